"""docs/scaling.md's full-job table, COMPUTED (nothing here is measured)
from figures measured by bench/python/bench_job.py (copied below with the
command that printed each) and from the assumptions named below.

    python bench/python/scaling_table.py [--producers 8] [--workers 2]
                                         [--worker-cores 2] [--tokens 1048576]

For each model (Llama-3 8B, 70B, 405B), link (10, 100, 400 GbE at line
rate) and producer kind (CPU-only; GPU), in-band and local statistics: the
seconds each resource needs for the whole job, and the one that bounds it
(the largest). Resources:

  link      wire bytes / line rate (one link between producers and workers;
            TCP/gRPC overheads would add a few percent);
  producer  producer CPU core-seconds / producers (one core each for
            kvcal's work): in-band the copy, serialization and send of every
            value (also with GPU producers: the bytes leave the GPU and are
            sent by the CPU; the device-to-host copy is not counted);
            local statistics on CPU the engine's accumulate;
  GPU       local statistics on GPU producers: the accumulate kernel over
            every value, split over the producers' GPUs (ASSUMED rate,
            below);
  worker    in-band: worker CPU core-seconds / (workers x cores); local: the
            worker CPU per imported byte times each worker's share of the
            flushes' bytes (its flushes one after another).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_local_statistics import state_bound  # noqa: E402

TOKENS = 1 << 20
# name: (geometry, measured in-band wire bytes/token, measured mean flush bytes
#        (one producer's whole state over 2 workers), tokens that flush covered)
MODELS = {
    # python bench/python/bench_job.py --geometry llama3-8b
    "Llama-3-8B": ((32, 32, 8, 128), 393258.1, 1.101e7, 256),
    # python bench/python/bench_job.py --tokens 256 --batches 4 --flush-batches 4
    "Llama-3-70B": ((80, 64, 8, 128), 1638453.4, 5.323e7, 1024),
    # python bench/python/bench_job.py --geometry llama3-405b --tokens 64 --batches 2 --flush-batches 2
    "Llama-3-405B": ((126, 128, 8, 128), 4645195.1, 1.187e8, 128),
}
# Measured, llama3-70b, --tokens 256 --batches 4 --flush-batches 4 (the
# largest batches measured; smaller batches cost more per value, most of all
# in local mode: see docs/scaling.md):
PRODUCER_CPU_S_PER_M = {"in-band": 0.0040, "local": 0.0022}
WORKER_CPU_S_PER_M_IN_BAND = 6.11 / 3355.4  # worker CPU s / M values, same run
# local: the workers' CPU s (1.75, from their start to the last close) per byte
# of the 8 flush messages they took (212931136 bytes), same run
WORKER_S_PER_IMPORTED_BYTE = 1.75 / 212931136
# ASSUMED, not measured here: the CUDA accumulate's rate for bf16 with 16
# bins per octave + tail, 972 GB/s = 486 G values/s, recorded on an H200 in
# bench/README.md ("Measured on an NVIDIA H200 (2026-12-04)"); the sessions
# here use 32 bins per octave, and an H100 has less memory bandwidth.
GPU_VALUES_PER_S = 972e9 / 2
LINKS = {"10 GbE": 1.25e9, "100 GbE": 12.5e9, "400 GbE": 50e9}  # bytes/s, line rate


def rows(args):
    """(model, producer kind, mode, wire bytes low, high, {resource: seconds})
    with the link's seconds per link name under "link <name>"."""
    out = []
    for model, (geometry, in_band_per_token, flush, flush_tokens) in MODELS.items():
        layers, heads, kv_heads, dim = geometry
        values = layers * (heads + 2 * kv_heads) * dim * args.tokens
        in_band_bytes = in_band_per_token * args.tokens
        flushes = args.producers  # one flush per producer, at close
        batches = max(1, args.tokens // args.producers // 16384)
        bound = state_bound(geometry, 32, batches)
        local_low, local_high = flushes * flush, flushes * bound
        for kind in ("CPU", "GPU"):
            t = {f"link {link}": in_band_bytes / rate for link, rate in LINKS.items()}
            t["producer"] = values / 1e6 * PRODUCER_CPU_S_PER_M["in-band"] / args.producers
            t["worker"] = (values / 1e6 * WORKER_CPU_S_PER_M_IN_BAND
                           / (args.workers * args.worker_cores))
            out.append((model, kind, "in-band", in_band_bytes, None, t))
            # local: the link time of the larger byte count (the format's bound)
            t = {f"link {link}": local_high / rate for link, rate in LINKS.items()}
            if kind == "CPU":
                t["producer"] = values / 1e6 * PRODUCER_CPU_S_PER_M["local"] / args.producers
            else:
                t["GPU (assumed)"] = values / GPU_VALUES_PER_S / args.producers
            t["worker"] = local_high / args.workers * WORKER_S_PER_IMPORTED_BYTE
            out.append((model, kind, "local", local_low, local_high, t))
    return out


def fmt_s(s):
    return f"{s:.2g} s" if s < 10 else f"{s:,.0f} s"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--producers", type=int, default=8)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--worker-cores", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=TOKENS)
    args = ap.parse_args()
    print(f"COMPUTED for {args.tokens} tokens, {args.producers} producers (one core each for "
          f"kvcal), {args.workers} workers x {args.worker_cores} cores; one flush per producer\n")
    links = list(LINKS)
    print("| model | producers | mode | wire bytes | " + " | ".join(f"link {l}" for l in links)
          + " | producer CPU | GPU (assumed) | worker | bound at " + " / ".join(links) + " |")
    print("|" + "---|" * (8 + len(links)))
    for model, kind, mode, low, high, t in rows(args):
        wire = f"{low:.3g}" if high is None else f"{low:.3g} to {high:.3g}"
        cells = [fmt_s(t[f"link {l}"]) for l in links]
        cells += [fmt_s(t[k]) if k in t else "-" for k in ("producer", "GPU (assumed)", "worker")]
        bounds = []
        for l in links:
            mine = {k: v for k, v in t.items() if not k.startswith("link ") or k == f"link {l}"}
            name = max(mine, key=mine.get)
            bounds.append(f"{name.split(' (')[0].replace('link ' + l, 'link')} {fmt_s(mine[name])}")
        print(f"| {model} | {kind} | {mode} | {wire} | " + " | ".join(cells) + " | "
              + " / ".join(bounds) + " |")


if __name__ == "__main__":
    main()
