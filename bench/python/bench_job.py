"""A calibration job of a Llama-3-70B geometry with P producer processes and
W kvcal-worker processes on loopback, in-band and with local statistics
side by side in one run (docs/scaling.md).

    python bench/python/bench_job.py                       # the ./run bench scale
    python bench/python/bench_job.py --tokens 256 --batches 4 --flush-batches 4   # docs/scaling.md

Geometry (--geometry, default llama3-70b): 80 layers, 64 q / 8 k / 8 v
heads, head_dim 128, bf16: 819,200 values per token. Activations
(synthetic, post-RoPE-like): Student-t values (df 3, heavy tails) times a
per-layer scale and a per-(layer, role) log-normal channel scale, one
outlier head (x16) and one outlier channel (x8) per (layer, role) and batch,
rounded to bf16, as [1, heads, tokens, head_dim] tensors (the layout
kvcal.torch.capture hands the producer). Each producer draws its tensors at
random offsets from a pool of --pool-values Student-t values of its own
(seeded by its index), so that generating them costs seconds, not minutes.
Every producer generates all its batches BEFORE anything is timed; the
generation time is printed apart and is in none of the figures.

Each producer is its own process (multiprocessing, spawn: no shared GIL),
with OMP_NUM_THREADS=1. The workers are real kvcal-worker processes (CPU
backend, 127.0.0.1, ephemeral ports, --worker-id w0, w1, ...), and the
producers' kvcal.Client holds all of them, so layers are sharded by the
same rule as in production (python/kvcal/sharding.py). Each mode gets FRESH
workers (so that each mode's peak worker RSS is its own) and a session of
its own on them; the same producer processes run both modes on the same
tensors, in-band first, then local statistics. Producer p numbers its
batches p * batches + b (the job's batches are all distinct).

Per mode it prints:
  wire bytes/token  the serialized bytes of every request the producers
                    sent (their stats()["wire_bytes"]: IngestRequests,
                    resends included, local-statistics flushes being
                    IngestRequests of partial statistics), over the tokens of all
                    producers; gRPC/HTTP/2 framing (a few bytes per
                    message) not counted; an in-band count below 2 bytes
                    per value stops the run (a lost count);
  CPU s/M values    user+sys CPU seconds of the producer processes (all
                    their threads, gRPC's included), measured with
                    getrusage around put()/close() only (close waits until
                    the worker applied everything: the last flush, the last
                    chunk), per million values put;
  values/s          all values of all producers over the wall time from the
                    first producer's first put() to the last producer's
                    close() returning (every value applied on a worker);
  worker CPU s      user+sys CPU seconds of all worker processes from their
                    start to the last producer's close (/proc/PID/stat),
                    Finalize not included;
  peak worker RSS   VmHWM of each worker process (/proc/PID/status) before
                    it is stopped: the largest, and the sum;
  finalize s        one Finalize of static min-max per head (every layer,
                    both workers; what a FP8 per-head checkpoint needs: the
                    first call, and the best of it and two more), then one
                    of percentile per head (which reads the histograms),
                    each timed by the caller;
and the ratio in-band/local of each. The finalized scales of both sessions
(static min-max and percentile, per head) must be bit-identical; it prints
"scales identical: yes" and otherwise exits 1. The session's value counter
must equal what the producers put.

Last, a projection to the full job (--project-tokens, default 1,048,576),
computed from the measured figures, not measured: in-band = the measured
wire bytes per token times the tokens; local = the number of flushes
times the measured mean flush (one producer's state over all workers), and
times the format's largest possible state (every histogram bin non-empty,
bench_local_statistics.state_bound), for a few producer and flush counts.

Needs: a build (kvcal-worker, the extension kvcal._engine; KVCAL_BUILD_DIR
picks one), torch (for bf16 tensors; numpy + ml_dtypes are not in the test
environment).
"""
import argparse
import multiprocessing
import os
import resource
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_worker  # noqa: E402
from bench_geometries import GEOMETRIES  # noqa: E402

BUILD = os.environ.get("KVCAL_BUILD_DIR", os.path.join(ROOT, "build"))
WORKER_BIN = os.path.join(BUILD, "service", "kvcal-worker")

MODES = ("in-band", "local")


# -- activations ---------------------------------------------------------------
def make_batches(index, args):
    """Producer `index`'s batches: [[(layer, role, bf16 torch tensor
    [1, heads, tokens, head_dim])] per batch]. Deterministic in (seed, index)."""
    import numpy as np
    import torch

    layers, heads, kv_heads, dim = GEOMETRIES[args.geometry]
    rng = np.random.default_rng([args.seed, index])
    largest = heads * args.tokens * dim
    pool = rng.standard_t(3, max(args.pool_values, 2 * largest)).astype(np.float32)
    # Per (layer, role) channel scales: post-RoPE channels differ in size by
    # frequency pair; the same for every producer (seeded by the seed only).
    shape_rng = np.random.default_rng([args.seed, 1 << 20])
    channel = shape_rng.lognormal(0.0, 0.5, (layers, 3, dim)).astype(np.float32)
    batches = []
    for b in range(args.batches):
        tensors = []
        for layer in range(layers):
            for r, (role, n) in enumerate((("q", heads), ("k", kv_heads), ("v", kv_heads))):
                count = n * args.tokens * dim
                start = int(rng.integers(0, pool.size - count + 1))
                x = pool[start:start + count].reshape(1, n, args.tokens, dim)
                x = x * (channel[layer, r] * np.float32(0.5 + 0.05 * layer))
                x[:, (layer + b + index) % n] *= 16.0  # an outlier head
                x[..., (7 * layer + b + 3 * index) % dim] *= 8.0  # an outlier channel
                tensors.append((layer, role, torch.from_numpy(x).to(torch.bfloat16)))
        batches.append(tensors)
    return batches


# -- one producer process --------------------------------------------------------
def producer_main(index, args, conn):
    """Generates its batches, then for each (mode, targets, session) the
    parent sends: connects, waits for "go", puts every batch, closes, and
    sends back its figures. None ends it."""
    try:
        import kvcal

        started = time.monotonic()
        batches = make_batches(index, args)
        values = sum(t.numel() for tensors in batches for _, _, t in tensors)
        conn.send(("ready", time.monotonic() - started, values))
        while True:
            job = conn.recv()
            if job is None:
                return
            mode, targets, session_id = job
            client = kvcal.Client(targets, max_message_bytes=args.max_message_bytes)
            client.attach(session_id)
            options = {"local_statistics": True, "flush_batches": args.flush_batches} \
                if mode == "local" else {}
            producer = kvcal.Producer(client, producer_id=f"p{index}", **options)
            conn.send(("armed",))
            conn.recv()  # go
            usage0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.monotonic()
            for b, tensors in enumerate(batches):
                batch = index * args.batches + b
                for layer, role, tensor in tensors:
                    producer.put(layer, role, tensor, batch=batch)
            producer.close()
            t1 = time.monotonic()
            usage1 = resource.getrusage(resource.RUSAGE_SELF)
            stats = producer.stats()
            client.close()
            cpu = (usage1.ru_utime - usage0.ru_utime) + (usage1.ru_stime - usage0.ru_stime)
            conn.send(("done", {"t0": t0, "t1": t1, "cpu": cpu, "values": values,
                                # the producer's own count of serialized
                                # IngestRequests (resends and flushes included)
                                "wire": stats["wire_bytes"], "stats": stats}))
    except BaseException as e:  # the parent reports it and stops
        import traceback

        conn.send(("error", f"producer {index}: {e!r}\n{traceback.format_exc()}"))


# -- workers ------------------------------------------------------------------------
def Worker(worker_id, max_message_bytes):
    """One kvcal-worker on 127.0.0.1 (bench_worker.Worker) with this id."""
    return bench_worker.Worker(WORKER_BIN, "--worker-id", worker_id,
                               "--max-message-bytes", str(max_message_bytes))


# -- the run ----------------------------------------------------------------------
def receive(conn, want):
    message = conn.recv()
    if message[0] == "error":
        raise RuntimeError(message[1])
    if message[0] != want:
        raise RuntimeError(f"expected {want}, got {message[0]}")
    return message[1:]


def run_mode(mode, args, conns, values_expected):
    """Fresh workers, a session, every producer's batches; the figures."""
    import kvcal

    layers, heads, kv_heads, dim = GEOMETRIES[args.geometry]
    workers = []
    try:
        for w in range(args.workers):
            workers.append(Worker(f"w{w}", args.max_message_bytes))
        targets = [w.target for w in workers]
        client = kvcal.Client(targets, max_message_bytes=args.max_message_bytes)
        session = client.create_session(
            geometry=kvcal.Geometry(layers, heads, kv_heads, dim), histograms=args.histograms)
        for conn in conns:
            conn.send((mode, targets, session.session_id))
        for conn in conns:
            receive(conn, "armed")
        for conn in conns:
            conn.send("go")
        results = [receive(conn, "done")[0] for conn in conns]
        worker_cpu = sum(w.cpu_seconds() for w in workers)  # before Finalize
        status = client.status()
        if status.values_ingested != values_expected:
            raise RuntimeError(f"{mode}: the session counts {status.values_ingested} values, "
                               f"the producers put {values_expected}")
        finalize_minmax = []
        for _ in range(3):
            started = time.monotonic()
            minmax = client.finalize_response(observer="static_minmax", granularity="head")
            finalize_minmax.append(time.monotonic() - started)
        started = time.monotonic()
        percentile = client.finalize_response(observer="percentile", granularity="head")
        finalize_percentile = time.monotonic() - started
        rss = [w.peak_rss() for w in workers]
        client.close()
    finally:
        for w in workers:
            w.stop()
    wall = max(r["t1"] for r in results) - min(r["t0"] for r in results)
    values = sum(r["values"] for r in results)
    wire = sum(r["wire"] for r in results)
    if mode == "in-band" and wire < 2 * values:  # bf16: every value is 2 bytes on the wire
        raise RuntimeError(f"in-band: {wire} wire bytes counted for {values} bf16 values: "
                           f"the count lost requests")
    return {
        "wire": wire,
        "cpu": sum(r["cpu"] for r in results),
        "wall": wall, "values": values,
        "rss_max": max(rss), "rss_sum": sum(rss), "worker_cpu": worker_cpu,
        "finalize_minmax": finalize_minmax, "finalize_percentile": finalize_percentile,
        "scales": {"static_minmax": scale_bytes(minmax), "percentile": scale_bytes(percentile)},
        "local_flushes": sum(r["stats"].get("local_flushes", 0) for r in results),
    }


def scale_bytes(response):
    """Every layer's q/k/v scales and absmax as raw float32 bytes, and its
    value and non-finite counts, in order."""
    import numpy as np

    out = []
    for layer in sorted(response.layers, key=lambda l: l.layer):
        for role in (layer.q, layer.k, layer.v):
            out.append(np.asarray(role.scale, dtype=np.float32).tobytes())
            out.append(np.asarray(role.absmax, dtype=np.float32).tobytes())
            out.append(np.asarray([role.count, role.nonfinite], dtype=np.uint64).tobytes())
    return b"".join(out)


def table(args, tokens, figures):
    """The side-by-side rows: (label, in-band, local, in-band/local)."""
    inband, local = figures["in-band"], figures["local"]
    million = 1e6

    def per_token(f):
        return f["wire"] / tokens

    def cpu(f):
        return f["cpu"] / (f["values"] / million)

    def rate(f):
        return f["values"] / f["wall"]

    rows = [
        ("wire bytes/token", per_token, "{:.1f}"),
        ("producer CPU s/M values", cpu, "{:.4f}"),
        ("end-to-end values/s", rate, "{:.4g}"),
        ("wall s (first put..last close)", lambda f: f["wall"], "{:.2f}"),
        ("worker CPU s (sum, to last close)", lambda f: f["worker_cpu"], "{:.2f}"),
        ("peak worker RSS MiB (largest)", lambda f: f["rss_max"] / (1 << 20), "{:.1f}"),
        ("peak worker RSS MiB (sum)", lambda f: f["rss_sum"] / (1 << 20), "{:.1f}"),
        ("finalize s (static_minmax/head)", lambda f: f["finalize_minmax"][0], "{:.3f}"),
        ("  the same, best of 3 calls", lambda f: min(f["finalize_minmax"]), "{:.3f}"),
        ("finalize s (percentile/head)", lambda f: f["finalize_percentile"], "{:.3f}"),
    ]
    print(f"\n{'':32} {'in-band':>12} {'local':>12} {'in-band/local':>14}")
    for label, get, form in rows:
        a, b = get(inband), get(local)
        ratio = a / b if b else float("inf")
        print(f"{label:32} {form.format(a):>12} {form.format(b):>12} {ratio:>14.3f}")


def project(args, tokens, figures, flushes_per_producer):
    """Computed from the measured figures, not measured."""
    from bench_local_statistics import state_bound

    geometry = GEOMETRIES[args.geometry]
    n = args.project_tokens
    in_band_per_token = figures["in-band"]["wire"] / tokens
    flushes_measured = args.producers * flushes_per_producer
    mean_flush = figures["local"]["wire"] / flushes_measured
    tokens_per_flush = args.tokens * min(args.flush_batches, args.batches)
    in_band = in_band_per_token * n
    print(f"\nprojection to the full job: COMPUTED from the measured figures above, not measured")
    print(f"  {n} tokens of {args.geometry}; in-band: {in_band_per_token:.1f} bytes/token "
          f"(measured) x {n} = {in_band:.4g} bytes")
    print(f"  local: flushes x {mean_flush:.4g} bytes (measured: the mean flush, one producer's "
          f"state over its {args.workers} workers, covering <= {tokens_per_flush} tokens; "
          f"{flushes_measured} flushes), or x the format's largest state")
    print(f"  (every histogram bin non-empty, full tails: bench_local_statistics.state_bound, the "
          f"upper bound for flushes covering many more tokens)")
    print(f"{'producers':>9} {'flushes each':>12} {'tokens/flush':>12} "
          f"{'local (measured flush)':>22} {'in-band/local':>13} "
          f"{'local (largest state)':>21} {'in-band/local':>13}")
    for producers, each in ((args.producers, 1), (8, 1), (8, 8), (64, 1), (64, 8)):
        flushes = producers * each
        per_flush_tokens = n / flushes
        batches = max(1, int(per_flush_tokens // args.project_batch_tokens))
        bound = state_bound(geometry, args.histograms, batches) + 100 * args.workers
        print(f"{producers:>9} {each:>12} {per_flush_tokens:>12.0f} "
              f"{flushes * mean_flush:>22.4g} {in_band / (flushes * mean_flush):>13.0f} "
              f"{flushes * bound:>21.4g} {in_band / (flushes * bound):>13.0f}")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), default="llama3-70b")
    ap.add_argument("--producers", type=int, default=4, help="producer processes (default 4)")
    ap.add_argument("--workers", type=int, default=2, help="kvcal-worker processes (default 2)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per batch (default 128)")
    ap.add_argument("--batches", type=int, default=4, help="batches per producer (default 4)")
    ap.add_argument("--flush-batches", type=int, default=2,
                    help="local statistics: a flush every N batches, and at close (default 2)")
    ap.add_argument("--histograms", type=int, default=32,
                    help="histogram bins per octave of the sessions (default 32, the default)")
    ap.add_argument("--max-message-bytes", type=int, default=256 << 20,
                    help="the workers' --max-message-bytes and the clients' limit (default "
                         "256 MiB: a 70B flush to one worker can pass the 64 MiB default)")
    ap.add_argument("--pool-values", type=int, default=1 << 22,
                    help="Student-t values each producer draws its tensors from (default 2^22)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--project-tokens", type=int, default=1 << 20)
    ap.add_argument("--project-batch-tokens", type=int, default=16384,
                    help="tokens per batch in the projection's state bound (default 16384)")
    args = ap.parse_args(argv)
    for name in ("producers", "workers", "tokens", "batches", "flush_batches", "pool_values"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be 1 or more")
    return args


def main(argv=None):
    args = parse_args(argv)
    if not os.path.exists(WORKER_BIN):
        print(f"bench_job: skipped: {WORKER_BIN} is not built (./run build; KVCAL_BUILD_DIR "
              f"picks a build)")
        return 0
    from kvcal.producer.statistics import load_engine

    try:
        load_engine()
    except ImportError as e:  # a build without pybind11 (KVCAL_PYTHON_EXT)
        print(f"bench_job: skipped: local statistics need the extension kvcal._engine: {e}")
        return 0
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned producers
    layers, heads, kv_heads, dim = GEOMETRIES[args.geometry]
    values_per_token = layers * (heads + 2 * kv_heads) * dim
    tokens = args.producers * args.batches * args.tokens
    flushes_per_producer = -(-args.batches // args.flush_batches)
    print(f"job: {args.geometry} ({layers} layers, {heads}/{kv_heads}/{kv_heads} q/k/v heads, "
          f"head_dim {dim}, bf16, {values_per_token} values/token); {args.producers} producer "
          f"processes x {args.batches} batches x {args.tokens} tokens = {tokens} tokens, "
          f"{tokens * values_per_token / 1e6:.1f} M values; {args.workers} kvcal-workers (CPU "
          f"backend, loopback, fresh per mode); histograms {args.histograms} bins/octave; "
          f"local statistics: flush every {args.flush_batches} batches ({flushes_per_producer} "
          f"flush{'es' if flushes_per_producer != 1 else ''} per producer); "
          f"{os.cpu_count()} CPUs")

    ctx = multiprocessing.get_context("spawn")
    conns, processes = [], []
    try:
        for i in range(args.producers):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=producer_main, args=(i, args, child), daemon=True)
            p.start()
            conns.append(parent)
            processes.append(p)
        ready = [receive(conn, "ready") for conn in conns]
        values_expected = sum(v for _, v in ready)
        print(f"(activations generated before timing, not counted: "
              f"{max(g for g, _ in ready):.1f} s in the slowest producer)")
        figures = {}
        for mode in MODES:
            figures[mode] = run_mode(mode, args, conns, values_expected)
            f = figures[mode]
            print(f"{mode}: {f['wire']} wire bytes, producer CPU {f['cpu']:.2f} s, wall "
                  f"{f['wall']:.2f} s" + (f", {f['local_flushes']} flush messages (each flush: one "
                                           f"per worker owning layers)" if mode == "local"
                                         else ""))
        for conn in conns:
            conn.send(None)
    finally:
        for p in processes:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()

    table(args, tokens, figures)
    identical = all(figures["in-band"]["scales"][k] == figures["local"]["scales"][k]
                    for k in ("static_minmax", "percentile"))
    print(f"\nscales identical: {'yes' if identical else 'NO'} (static_minmax and percentile, "
          f"per head, every layer: float32 scales and absmax byte for byte)")
    project(args, tokens, figures, flushes_per_producer)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
