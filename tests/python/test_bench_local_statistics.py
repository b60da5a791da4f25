"""bench/python/bench_local_statistics.py: the size accounting its per-head
projection rests on, and a whole run with --head-tokens at the tiny
geometry. No timing is asserted."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("torch")
BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "python")
sys.path.insert(0, BENCH)
import bench_local_statistics  # noqa: E402

import kvcal  # noqa: E402


@pytest.mark.parametrize("geometry, histograms", [((3, 4, 2, 64), 32), ((2, 8, 8, 128), 16)])
def test_empty_state_is_header_plus_empty_heads(geometry, histograms):
    """The header and empty-head sizes add up to any empty state exactly."""
    layers, heads, kv_heads, dim = geometry
    header, empty_head = bench_local_statistics.empty_sizes(dim, histograms)
    state = kvcal.LocalStatistics(kvcal.Geometry(*geometry), histograms=histograms, threads=1)
    assert len(state.export_statistics()) == header + layers * (heads + 2 * kv_heads) * empty_head


def test_head_growth_run(tmp_path):
    r = subprocess.run(
        [sys.executable, os.path.join(BENCH, "bench_local_statistics.py"), "--tokens", "512",
         "--batches", "2", "--head-tokens", "4096", "--project-tokens", "8192",
         "--project-batch-tokens", "1024"],
        capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = re.findall(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+(\d+)$", r.stdout.split("one head's")[1],
                      re.M)
    growth = [tuple(map(int, row)) for row in rows[:3]]
    assert [t for t, *_ in growth] == [1024, 2048, 4096]
    assert [b for _, b, *_ in growth] == [1, 2, 4]  # one record per 1024-token batch
    # A head's statistics only grow with its tokens (histograms widen, records add up).
    for column in (2, 3):
        sizes = [row[column] for row in growth]
        assert sizes == sorted(sizes) and sizes[0] > 1000
    check = re.search(r"computed from these per-head sizes (\d+), measured (\d+)", r.stdout)
    assert check, r.stdout
    assert 0.7 < int(check.group(1)) / int(check.group(2)) < 1.05
    # 8192 tokens over 4 and 8 producers: flushes of 2048 and 1024 tokens.
    flushes = re.findall(r"^\s*(4|8)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)$",
                         r.stdout.split("flush per producer")[1], re.M)
    assert [(p, t) for p, t, *_ in flushes] == [("4", "2048"), ("8", "1024")]


@pytest.mark.parametrize("histograms", [16, 32])
def test_state_bound_is_the_size_of_a_state_with_every_bin_filled(histograms):
    """state_bound (the projections' upper end) is exactly the serialized
    size of a state whose every head has a value in every histogram bin (so
    a full tail) and a record in each of its batches; a state of fewer bins
    is smaller."""
    geometry = (2, 4, 2, 8)
    layers, heads, kv_heads, dim = geometry
    b = histograms
    # The lower edge of every bin (docs/formats.md "Histogram bins"): zero,
    # the underflow bin, 48 octaves of b bins, the overflow bin.
    edges = [0.0, 2.0 ** -25] + [2.0 ** (o - 24) * (1 + s / b) for o in range(48)
                                 for s in range(b)] + [2.0 ** 25]
    values = np.array(edges, dtype=np.float32)
    assert len(np.unique(values)) == len(values) == 2 + 48 * b + 1
    full = kvcal.LocalStatistics(kvcal.Geometry(*geometry), histograms=b, threads=1)
    half = kvcal.LocalStatistics(kvcal.Geometry(*geometry), histograms=b, threads=1)
    for layer in range(layers):
        for role, n in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
            x = np.ascontiguousarray(np.broadcast_to(values[:, None, None], (len(values), n, dim)))
            for batch in range(3):
                full.accumulate(layer, role, x, batch=batch, layout="tokens_heads_dim")
                half.accumulate(layer, role, x[::2], batch=batch, layout="tokens_heads_dim")
    bound = bench_local_statistics.state_bound(geometry, b, 3)
    assert len(full.export_statistics()) == bound
    assert len(half.export_statistics()) < bound
