"""Wire bytes per token of a producer in-band and in local-statistics mode,
for one synthetic geometry, both in the same run.

    python bench/python/bench_local_statistics.py                      # tiny geometry
    python bench/python/bench_local_statistics.py --geometry llama3-70b --tokens 16 --batches 4

Activations: Student-t (df 3) values, one outlier head and one outlier
channel per (layer, role), different per batch, in bf16 (or --dtype f32),
as [1, heads, tokens, head_dim] tensors (kvcal.torch.capture's layout).

In-band: the IngestRequests kvcal.Producer would send for them (its own
chunking, kvcal.producer.encoding._cut, at --chunk-bytes, and its own request
builder), and their serialized protobuf size summed.

Local statistics: the same tensors accumulated by kvcal.LocalStatistics
(the producer's engine), and at each flush the IngestRequest that
kvcal.Producer(..., local_statistics=True) sends (partial_statistics: the
engine's statistics and the counters), its serialized size summed, for each
--flush-batches value; and the size of one state holding the first 1, 2,
... batches (how a flush grows with the tokens it covers).

Last, a projection that is computed, not measured: the measured in-band
bytes per token times --project-tokens, against 1, 8 or one-per-batch
flushes each of the largest state the format allows (every histogram bin
non-empty, full tails, one record per batch and head) for batches of
--project-batch-tokens tokens.

With --head-tokens N, measured: how one head's statistics grow with the
tokens a flush covers, up to N tokens (1048576: a whole 1M-token job on one
head), from fresh values of the same distribution (an ordinary head and an
outlier head, batches of --project-batch-tokens tokens, so one record per
batch); and, computed from those measured per-head sizes, a flush of the
whole geometry per producer when P producers share --project-tokens and
flush once, against the in-band bytes.

Both counts are protobuf message sizes: gRPC's 5-byte message prefix and
HTTP/2 framing are not counted (they add the same few bytes per message in
both modes). Nothing is sent: no worker is needed. Needs torch (bf16) and
the extension kvcal._engine (a build with pybind11; KVCAL_BUILD_DIR).
"""
import argparse
import os
import sys
import time

import numpy as np

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kvcal  # noqa: E402
from kvcal.producer import encoding as producer_module  # noqa: E402
from kvcal.v1 import pb  # noqa: E402
from bench_geometries import GEOMETRIES  # noqa: E402
from kvcal.producer.statistics import largest_statistics_bytes  # noqa: E402


def make_tensors(rng, torch, geometry, batch, tokens, dtype):
    """[(layer, role, tensor [1, heads, tokens, head_dim])] of one batch."""
    layers, heads, kv_heads, dim = geometry
    out = []
    for layer in range(layers):
        for role, n in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
            x = rng.standard_t(3, (1, n, tokens, dim)).astype(np.float32)
            x *= 0.5 + 0.05 * layer
            x[:, (layer + batch) % n] *= 16.0  # an outlier head
            x[..., (7 * layer + batch) % dim] *= 8.0  # an outlier channel
            out.append((layer, role, torch.from_numpy(x).to(dtype)))
    return out


def in_band_bytes(tensors, batch, chunk_bytes, sequence):
    """Serialized IngestRequest bytes of the chunks kvcal.Producer cuts from
    `tensors`; (bytes, chunks, next sequence)."""
    total = chunks = 0
    roles = {"q": pb.ROLE_Q, "k": pb.ROLE_K, "v": pb.ROLE_V}
    for layer, role, tensor in tensors:
        payload, dtype, shape = producer_module._payload_of(tensor)
        itemsize = 4 if dtype == pb.DTYPE_F32 else 2
        for piece, head_delta, begin, end in producer_module._cut(
                shape, pb.LAYOUT_HEADS_TOKENS_DIM, itemsize, chunk_bytes):
            chunk = producer_module._Chunk(
                sequence=sequence, batch=batch, layer=layer, role=roles[role], dtype=dtype,
                layout=pb.LAYOUT_HEADS_TOKENS_DIM, shape=piece, head_offset=head_delta,
                payload=payload, begin=begin, end=end, holdout=False)
            total += chunk.request("bench-session", "producer-0").ByteSize()
            chunks += 1
            sequence += 1
    return total, chunks, sequence


def flush_bytes(local, n):
    """The IngestRequest a local-statistics producer sends as its n-th
    message for what `local` holds (kvcal/producer/local.py)."""
    counters = local.counters
    request = pb.IngestRequest(
        session_id="bench-session", producer_id="producer-0", sequence=n,
        partial_statistics=pb.PartialStatistics(
            statistics=local.export_statistics(), tensors=counters["chunks_applied"],
            values=counters["values_ingested"], bytes=counters["bytes_ingested"]))
    return request.ByteSize()


def state_bound(geometry, bins_per_octave, batches):
    """The largest serialized statistics (formats.md "The statistics
    state") a state of `batches` batches can have: every histogram bin
    non-empty, a full tail of 256 values, one record per batch and head
    (kvcal.producer.statistics.largest_statistics_bytes)."""
    return largest_statistics_bytes(kvcal.Geometry(*geometry), bins_per_octave, batches)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), default="tiny")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per batch (default 256)")
    ap.add_argument("--batches", type=int, default=8, help="batches (default 8)")
    ap.add_argument("--flush-batches", default="",
                    help="comma-separated flush_batches values (default: 1, 2 and --batches)")
    ap.add_argument("--dtype", choices=("bf16", "f32"), default="bf16")
    ap.add_argument("--histograms", type=int, default=32, help="bins per octave (default 32)")
    ap.add_argument("--chunk-bytes", type=int, default=4 << 20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--project-tokens", type=int, default=1 << 20,
                    help="tokens of the projection (default 1048576)")
    ap.add_argument("--project-batch-tokens", type=int, default=16384,
                    help="tokens per batch in the projection (default 16384: 8 x 2048)")
    ap.add_argument("--head-tokens", type=int, default=0,
                    help="also measure one head's state growth up to this many tokens "
                         "(default 0: not run; 1048576 for a 1M-token job)")
    args = ap.parse_args()
    if args.tokens < 1 or args.batches < 1:
        ap.error("--tokens and --batches must be 1 or more")
    flushes = args.flush_batches or f"1,2,{args.batches}"
    args.flush_list = sorted({int(f) for f in flushes.split(",") if f.strip()})
    if any(f < 1 for f in args.flush_list):
        ap.error("--flush-batches values must be 1 or more")
    return args


def main():
    import torch

    args = parse_args()
    geometry = GEOMETRIES[args.geometry]
    layers, heads, kv_heads, dim = geometry
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    values_per_token = layers * (heads + 2 * kv_heads) * dim
    tokens_total = args.tokens * args.batches
    print(f"geometry {args.geometry}: {layers} layers, {heads}/{kv_heads}/{kv_heads} q/k/v heads, "
          f"head_dim {dim}, {args.dtype}; {args.batches} batches x {args.tokens} tokens = "
          f"{tokens_total} tokens; histograms {args.histograms} bins/octave; "
          f"{values_per_token} values per token")
    g = kvcal.Geometry(layers, heads, kv_heads, dim)
    rng = np.random.default_rng(args.seed)
    started = time.monotonic()
    batches = [make_tensors(rng, torch, geometry, b, args.tokens, dtype)
               for b in range(args.batches)]
    print(f"(activations generated in {time.monotonic() - started:.1f} s)")

    wire, chunks, sequence = 0, 0, 1
    for b, tensors in enumerate(batches):
        nbytes, n, sequence = in_band_bytes(tensors, b, args.chunk_bytes, sequence)
        wire += nbytes
        chunks += n
    print(f"\nin-band: {chunks} chunks, {wire} bytes = {wire / tokens_total:.0f} bytes/token")

    local = kvcal.LocalStatistics(g, histograms=args.histograms, threads=1)
    print("\nlocal: one state holding the first k batches (one flush of k batches)")
    print(f"{'k':>4} {'tokens':>8} {'state bytes':>12} {'bytes/token':>12}")
    for b, tensors in enumerate(batches):
        for layer, role, tensor in tensors:
            local.accumulate(layer, role, tensor, batch=b, layout="heads_tokens_dim")
        size = flush_bytes(local, 1)
        tokens = (b + 1) * args.tokens
        whole_state = len(local.export_statistics())
        print(f"{b + 1:>4} {tokens:>8} {size:>12} {size / tokens:>12.1f}")

    print("\nlocal: every flush_batches batches a flush (and the rest at close)")
    print(f"{'flush_batches':>13} {'flushes':>7} {'bytes':>12} {'bytes/token':>12} "
          f"{'in-band/local':>14}")
    for every in args.flush_list:
        local.reset()
        total = flushes = 0
        for b, tensors in enumerate(batches):
            for layer, role, tensor in tensors:
                local.accumulate(layer, role, tensor, batch=b, layout="heads_tokens_dim")
            if (b + 1) % every == 0 or b + 1 == len(batches):
                flushes += 1
                total += flush_bytes(local, flushes)
                local.reset()
        print(f"{every:>13} {flushes:>7} {total:>12} {total / tokens_total:>12.1f} "
              f"{wire / total:>14.1f}")
    overhead = flush_bytes(local, 1) - len(local.export_statistics())
    project(args, geometry, wire / tokens_total, overhead)
    if args.head_tokens > 0:
        head_growth(args, torch, dtype, geometry, wire / tokens_total, overhead, whole_state)


def project(args, geometry, in_band_per_token, overhead):
    """Not measured: the in-band bytes/token measured above times
    --project-tokens, against flushes of the largest state the format allows
    (state_bound), for a few flush counts."""
    n = args.project_tokens
    print(f"\nprojection (computed, not measured) to {n} tokens in batches of "
          f"{args.project_batch_tokens}: "
          f"in-band {in_band_per_token:.0f} bytes/token x {n} = {in_band_per_token * n:.4g} bytes;"
          f" local <= flushes x the format's largest state of n/flushes batches "
          f"(every bin non-empty) + {overhead} bytes of IngestRequest")
    print(f"{'flushes':>8} {'largest flush':>14} {'local total <=':>15} {'in-band/local >=':>17}")
    total_batches = max(1, -(-n // args.project_batch_tokens))
    for flushes in sorted({1, min(8, total_batches), total_batches}):
        per_flush = state_bound(geometry, args.histograms, -(-total_batches // flushes)) + overhead
        total = flushes * per_flush
        over = " (over the default 64 MiB gRPC message limit)" if per_flush > 64 << 20 else ""
        print(f"{flushes:>8} {per_flush:>14} {total:>15} {in_band_per_token * n / total:>17.0f}"
              f"{over}")


def empty_sizes(dim, histograms):
    """(bytes of a serialized state besides its heads, bytes of a head that
    saw nothing), from the format's empty states of 1 and 2 layers of one
    head per role (largest_statistics_bytes with no layer filled)."""
    def empty_state(num_layers):
        return largest_statistics_bytes(kvcal.Geometry(num_layers, 1, 1, dim), histograms, 0,
                                        layers=[])

    one = empty_state(1)
    empty_head = (empty_state(2) - one) // 3
    return one - 3 * empty_head, empty_head


def head_growth(args, torch, dtype, geometry, in_band_per_token, overhead, whole_state):
    """Measured: one head's serialized statistics after 1024, 2048, ...
    --head-tokens tokens of fresh values (make_tensors' distribution: an
    ordinary head and an outlier head, each with the outlier channel), in
    batches of --project-batch-tokens tokens. Then computed from them: one
    flush of the whole geometry (one outlier head per layer and role) per
    producer when P producers share --project-tokens tokens."""
    layers, heads, kv_heads, dim = geometry
    g = kvcal.Geometry(1, 1, 1, dim)
    header, empty_head = empty_sizes(dim, args.histograms)
    empty = header + 3 * empty_head  # the one-head geometry's q, k and v
    batch_tokens = args.project_batch_tokens
    print(f"\none head's statistics (measured): fresh {args.dtype} values of one head "
          f"(head_dim {dim}), batches of {batch_tokens} tokens; serialized bytes of that head")
    step = 4096
    sizes = {}  # tokens -> (ordinary, outlier)
    rng = np.random.default_rng(args.seed + 1)
    started = time.monotonic()
    for column, head_scale in enumerate((1.0, 16.0)):
        local = kvcal.LocalStatistics(g, histograms=args.histograms, threads=1)
        tokens, report = 0, 1024
        while tokens < args.head_tokens:
            n = min(step, args.head_tokens - tokens, report - tokens)
            x = rng.standard_t(3, (1, 1, n, dim)).astype(np.float32) * head_scale
            x[..., 7] *= 8.0  # the outlier channel
            local.accumulate(0, "q", torch.from_numpy(x).to(dtype), batch=tokens // batch_tokens,
                             layout="heads_tokens_dim")
            tokens += n
            if tokens == report or tokens == args.head_tokens:
                sizes.setdefault(tokens, [0, 0])[column] = len(local.export_statistics()) - empty
                report *= 2
    print(f"(generated and accumulated in {time.monotonic() - started:.1f} s)")
    # A head's own bytes: what the one-head state grew by, plus the bytes it
    # has when empty.
    sizes = {t: [b + empty_head for b in both] for t, both in sizes.items()}
    print(f"{'tokens':>8} {'batches':>7} {'ordinary head':>14} {'outlier head':>13}")
    for tokens, (ordinary, outlier) in sorted(sizes.items()):
        print(f"{tokens:>8} {-(-tokens // batch_tokens):>7} {ordinary:>14} {outlier:>13}")

    outliers = 3 * layers  # one per (layer, role)
    ordinary_heads = layers * (heads + 2 * kv_heads) - outliers
    tokens_total = args.tokens * args.batches

    def whole(tokens, records):
        """The whole geometry's statistics from the per-head sizes, with
        `records` batch records per head instead of the measured ones."""
        ordinary, outlier = sizes[tokens]
        extra = 16 * (records - -(-tokens // batch_tokens))
        return header + ordinary_heads * (ordinary + extra) + outliers * (outlier + extra)

    if tokens_total in sizes:
        computed = whole(tokens_total, args.batches)
        print(f"check: the whole geometry's state after the first table's {tokens_total} tokens, "
              f"computed from these per-head sizes {computed}, measured {whole_state} "
              f"({computed / whole_state:.3f}x)")

    n = args.project_tokens
    print(f"\nflush per producer, COMPUTED from the per-head sizes above (not measured): "
          f"{ordinary_heads} ordinary + {outliers} outlier heads + the geometry's header; "
          f"{n} tokens over P producers flushing once; in-band {in_band_per_token:.0f} "
          f"bytes/token (measured)")
    print(f"{'P':>4} {'tokens/flush':>12} {'flush bytes':>12} {'local total':>12} "
          f"{'in-band/local':>14}")
    for producers in (4, 8, 64):
        per = n // producers
        if per not in sizes:
            continue
        flush = whole(per, -(-per // batch_tokens)) + overhead
        total = producers * flush
        print(f"{producers:>4} {per:>12} {flush:>12} {total:>12} "
              f"{in_band_per_token * n / total:>14.0f}")


if __name__ == "__main__":
    main()
