"""bench/python/bench_job.py (issue 27's job benchmark) at a tiny geometry:
its whole run (two spawned producer processes, two kvcal-workers, in-band
then local statistics) completes, finds both sessions' scales identical and
counts plausible wire bytes; and its activations. No timing is asserted."""
import os
import re
import sys

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench", "python"))
import bench_job  # noqa: E402


TINY = ["--geometry", "tiny", "--producers", "2", "--workers", "2", "--tokens", "8",
        "--batches", "3", "--flush-batches", "2", "--pool-values", "4096",
        "--project-tokens", "65536", "--project-batch-tokens", "1024"]


def test_activations_are_deterministic_heavy_tailed_bf16():
    args = bench_job.parse_args(TINY)
    first = bench_job.make_batches(1, args)
    again = bench_job.make_batches(1, args)
    other = bench_job.make_batches(0, args)
    layers, heads, kv_heads, dim = bench_job.GEOMETRIES["tiny"]
    assert len(first) == 3 and len(first[0]) == layers * 3
    for (layer, role, x), (_, _, y), (_, _, z) in zip(first[0], again[0], other[0]):
        n = heads if role == "q" else kv_heads
        assert x.dtype == torch.bfloat16 and tuple(x.shape) == (1, n, 8, dim)
        assert torch.equal(x, y)  # the same producer regenerates the same batch
        assert not torch.equal(x, z)  # another producer gets other values
    # The outlier head is 16 times the others (before the channel outlier).
    x = first[0][0][2].float()
    per_head = x.abs().amax(dim=(0, 2, 3))
    assert per_head.max() > 8 * per_head.median()


def test_tiny_job_runs_both_modes_with_identical_scales(worker_bin, capsys):
    assert bench_job.main(TINY) == 0
    out = capsys.readouterr().out
    assert "scales identical: yes" in out, out
    values = 2 * 3 * 8 * 4 * (8 + 2 + 2) * 64  # producers x batches x tokens x values/token
    in_band = int(re.search(r"^in-band: (\d+) wire bytes", out, re.M).group(1))
    local = int(re.search(r"^local: (\d+) wire bytes", out, re.M).group(1))
    flushes = int(re.search(r"(\d+) flush messages", out).group(1))
    assert in_band > 2 * values  # every bf16 value once, plus the request headers
    assert in_band < 2 * values * 1.2
    assert local > 0
    # producers x flushes each (3 batches, every 2) x the workers that own layers:
    # the tiny geometry's 4 layers can all hash to one of the two workers.
    assert flushes in (2 * 2 * 1, 2 * 2 * 2), flushes
    assert "COMPUTED from the measured figures" in out
