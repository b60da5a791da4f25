"""bench/python/bench_local_statistics.py: the size accounting its per-head
projection rests on, and a whole run with --head-tokens at the tiny
geometry. No timing is asserted."""
import os
import re
import subprocess
import sys

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

