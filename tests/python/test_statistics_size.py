"""kvcal.producer.statistics.largest_statistics_bytes, the format's largest
state (what a local-statistics producer checks its message limit against
and the benchmarks' projections use as their upper end): exactly the
serialized size of a state whose heads have a value in every histogram bin
and a record per batch, for every layer or some, every role or some; any
other state is smaller."""
import numpy as np
import pytest

import kvcal
from kvcal.producer.statistics import largest_statistics_bytes


def every_bin(histograms):
    """One float32 value at the lower edge of each histogram bin
    (docs/formats.md "Histogram bins"): zero, the underflow bin, 48 octaves
    of `histograms` bins, the overflow bin."""
    b = histograms
    edges = [0.0, 2.0 ** -25] + [2.0 ** (o - 24) * (1 + s / b) for o in range(48)
                                 for s in range(b)] + [2.0 ** 25]
    values = np.array(edges, dtype=np.float32)
    assert len(np.unique(values)) == len(values) == 2 + 48 * b + 1
    return values


@pytest.mark.parametrize("histograms, layers, roles", [
    (16, None, ()),
    (32, None, ()),
    (32, [1], ()),
    (32, [0, 2], ("k", "v")),
    (0, None, ()),
    (0, [2], ("q",)),
])
def test_a_state_with_every_bin_filled_has_exactly_that_size(histograms, layers, roles):
    geometry = kvcal.Geometry(3, 4, 2, 8)
    values = every_bin(histograms or 16)
    full = kvcal.LocalStatistics(geometry, histograms=histograms, roles=roles, threads=1)
    fewer = kvcal.LocalStatistics(geometry, histograms=histograms, roles=roles, threads=1)
    filled = range(geometry.num_layers) if layers is None else layers
    for layer in filled:
        for role, heads in (("q", 4), ("k", 2), ("v", 2)):
            if roles and role not in roles:
                continue
            x = np.ascontiguousarray(np.broadcast_to(values[:, None, None], (len(values), heads, 8)))
            for batch in range(3):
                full.accumulate(layer, role, x, batch=batch, layout="tokens_heads_dim")
                fewer.accumulate(layer, role, x[::2], batch=batch if batch < 2 else 1,
                                 layout="tokens_heads_dim")
    bound = largest_statistics_bytes(geometry, histograms, 3, layers=layers,
                                     role_mask=full.role_mask)
    assert len(full.export_statistics()) == bound
    assert len(fewer.export_statistics()) < bound  # half the bins, two batches


def test_an_empty_state_is_the_bound_of_no_layers():
    geometry = kvcal.Geometry(2, 8, 2, 16)
    for histograms in (0, 32):
        empty = kvcal.LocalStatistics(geometry, histograms=histograms, threads=1)
        assert len(empty.export_statistics()) == largest_statistics_bytes(
            geometry, histograms, 5, layers=[])
