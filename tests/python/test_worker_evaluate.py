"""Finalize `evaluate` and the `auto` observer on held-out batches, through a
real worker, against the Python-side definitions (kvcal.torch.evaluation's
fake_quantize and eager attention) on the same held-out data.

The generated model: 2 layers, 4 query heads, 2 KV heads, head_dim 16,
N(0, 1) activations; layer 1's K head 0 carries an attention-sink-like
outlier (40.0 in dimension 3 of every sequence's first token), 1 in 4096
values of the K tensor. Percentile 99.9 clips it; min-max keeps it."""
import json
from types import SimpleNamespace
import subprocess

import numpy as np
import pytest
import torch

import kvcal
from kvcal.v1 import pb
from kvcal.client import OBSERVERS, KvcalError
from kvcal.torch.evaluation import MIN_NORMAL, SATURATED, _attention, fake_quantize

H, KV, D, TOKENS, SEQS = 4, 2, 16, 128, 2
GEOMETRY = dict(num_layers=2, num_attention_heads=H, num_key_value_heads=KV, head_dim=D)


def batch(seed):
    """{layer: (q, k, v)} of one batch, [SEQS, heads, TOKENS, D] float32."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(2):
        q = torch.randn(SEQS, H, TOKENS, D, generator=g)
        k = torch.randn(SEQS, KV, TOKENS, D, generator=g)
        v = torch.randn(SEQS, KV, TOKENS, D, generator=g)
        if layer == 1:
            k[:, 0, 0, 3] = 40.0
        out[layer] = (q, k, v)
    return out


CALIBRATION = [batch(s) for s in range(4)]
HELD_OUT = [batch(100 + s) for s in range(2)]


@pytest.fixture(scope="module")
def session(worker):
    client = kvcal.Client(worker.target)
    client.create_session(geometry=GEOMETRY, session_id="evaluate")
    with kvcal.Producer(client) as producer:
        for b in CALIBRATION:
            producer.new_batch()
            for layer, tensors in b.items():
                for role, t in zip("qkv", tensors):
                    producer.put(layer, role, t)
        producer.holdout = True
        for b in HELD_OUT:
            producer.new_batch()
            for layer, tensors in b.items():
                for role, t in zip("qkv", tensors):
                    producer.put(layer, role, t)
    return client


def expand(scales, heads, q):
    s = torch.tensor(list(scales), dtype=torch.float32)
    if s.numel() == 1:
        s = s.expand(heads)
    elif q and s.numel() == H:  # per query head: vLLM reduces per KV group
        s = s.view(KV, -1).amax(dim=1).repeat_interleave(H // KV)
    return s.view(1, heads, 1, 1)


def python_evaluation(layer_scales, layer, kv_only):
    """kvcal.torch.evaluation's definitions over the held-out sequences of a layer."""
    qs = expand(layer_scales.q.scale, H, True)
    ks = expand(layer_scales.k.scale, KV, False)
    vs = expand(layer_scales.v.scale, KV, False)
    mask = torch.ones(1, 1, TOKENS, TOKENS, dtype=torch.bool).tril()
    err = np.zeros(H)
    ref = np.zeros(H)
    sat_k = 0
    for b in HELD_OUT:
        q, k, v = b[layer]
        o = _attention(None, q, k, v, mask, D ** -0.5, False)
        oq = _attention(None, q if kv_only else fake_quantize(q, qs), fake_quantize(k, ks),
                        fake_quantize(v, vs), mask, D ** -0.5, False)
        err += (oq - o).double().pow(2).sum(dim=(0, 1, 3)).numpy()
        ref += o.double().pow(2).sum(dim=(0, 1, 3)).numpy()
        sat_k += int(((k / ks).abs() > SATURATED).sum())
    return np.sqrt(err.sum() / ref.sum()), np.sqrt(err / ref), sat_k


@pytest.mark.parametrize("granularity,kv_only", [("tensor", False), ("head", False),
                                                 ("tensor", True)])
def test_evaluate_matches_the_python_side(session, granularity, kv_only):
    r = session.finalize_response(observer="static_minmax", granularity=granularity,
                                  evaluate=True, evaluate_kv_only=kv_only)
    e = r.evaluation
    assert e.sequences == 2 * SEQS and e.tokens == 2 * SEQS * TOKENS
    assert e.kv_only == kv_only and len(e.layers) == 2
    for layer_scales, row in zip(r.layers, e.layers):
        want, want_heads, sat_k = python_evaluation(layer_scales, row.layer, kv_only)
        # float32 attention in a different summation order: 1e-3 relative.
        assert row.error == pytest.approx(want, rel=1e-3)
        np.testing.assert_allclose(row.head_error, want_heads, rtol=1e-3)
        assert 0.001 < row.error < 0.2
        # Held-out values beyond the calibration absmax saturate; the same
        # ones on both sides.
        k_values = len(HELD_OUT) * SEQS * KV * TOKENS * D
        assert round(row.k.saturated_all * k_values) == sat_k
        if kv_only:
            assert list(row.q.saturated) == [0.0] * H and row.q.subnormal_all == 0
    # The scale-1.0 baseline, the same way (N(0, 1) data: about 1.2% of the
    # values fall into e4m3's subnormals, |x| < 2^-6).
    ones = SimpleNamespace(**{r: SimpleNamespace(scale=[1.0]) for r in "qkv"})
    for row in e.layers:
        want_ones, _, _ = python_evaluation(ones, row.layer, kv_only)
        assert row.error_ones == pytest.approx(want_ones, rel=1e-3)
        assert 0.005 < row.k_ones.subnormal_all < 0.02


def test_auto_avoids_the_observer_that_clips_the_outlier(session):
    r = session.finalize_response(observer="auto", percentile=99.9)
    names = [(c.observer, c.granularity) for c in r.candidates]
    assert len(names) == 5  # every observer, per tensor
    by = {c.observer: c for c in r.candidates}
    pct = by[pb.OBSERVER_PERCENTILE]
    static = by[pb.OBSERVER_STATIC_MINMAX]
    # Percentile 99.9 clips layer 1's K outlier: it saturates and costs.
    assert pct.layers[1].k.saturated_all > 0
    assert pct.layers[1].error > 3 * static.layers[1].error
    chosen = r.evaluation.layers[1]
    assert chosen.observer != pb.OBSERVER_PERCENTILE
    for layer in range(2):
        best = min(c.layers[layer].error for c in r.candidates)
        assert r.evaluation.layers[layer].error == best
        # The scales returned are the chosen candidate's.
        name = {v: k for k, v in OBSERVERS.items()}[r.evaluation.layers[layer].observer]
        mine = session.finalize_response(observer=name, percentile=99.9)
        assert list(mine.layers[layer].k.scale) == list(r.layers[layer].k.scale)

    # One observer for the session: the candidate with the lowest total error.
    s = session.finalize_response(observer="auto", percentile=99.9, auto_per_session=True)
    best = min(r.candidates, key=lambda c: c.error)
    assert s.evaluation.observer == best.observer
    assert {row.observer for row in s.evaluation.layers} == {best.observer}
    assert best.observer != pb.OBSERVER_PERCENTILE

    # Per head too, when allowed: both granularities are tried.
    h = session.finalize_response(observer="auto", percentile=99.9,
                                  auto_granularities=["tensor", "head"])
    assert len(h.candidates) == 10


def test_auto_and_evaluate_need_held_out_batches(worker):
    client = kvcal.Client(worker.target)
    client.create_session(geometry=GEOMETRY, session_id="no-holdout")
    with kvcal.Producer(client) as producer:
        producer.new_batch()
        for role, t in zip("qkv", CALIBRATION[0][0]):
            producer.put(0, role, t)
            producer.put(1, role, t)
    with pytest.raises(KvcalError) as e:
        client.finalize_response(observer="auto")
    assert e.value.code.name == "FAILED_PRECONDITION"
    assert "held-out batches" in str(e.value) and "--holdout-batches" in str(e.value)
    with pytest.raises(KvcalError) as e:
        client.finalize_response(evaluate=True)
    assert e.value.code.name == "FAILED_PRECONDITION"


def test_evaluate_is_fp8_e4m3fn_only(session):
    with pytest.raises(KvcalError) as e:
        session.finalize_response(evaluate=True, fmt="int8")
    assert e.value.code.name == "INVALID_ARGUMENT" and "float8_e4m3fn" in str(e.value)


def test_cli_finalize_evaluate_prints_the_table_and_json(session, worker, kvcal_cli, tmp_path):
    out = tmp_path / "scales.safetensors"
    text = subprocess.run([kvcal_cli, "finalize", "--server", worker.target, "--session",
                           "evaluate", "--observer", "auto", "--percentile", "99.9",
                           "-o", str(out)], check=True, capture_output=True, text=True).stdout
    assert "FP8 attention error on 4 held-out sequences" in text, text
    assert "auto candidates" in text and "percentile" in text
    j = json.loads(subprocess.run([kvcal_cli, "finalize", "--server", worker.target, "--session",
                                   "evaluate", "--evaluate", "--json", "-o", str(out)],
                                  check=True, capture_output=True, text=True).stdout)
    want = session.finalize_response(evaluate=True).evaluation
    assert [row["error"] for row in j["evaluation"]["layers"]] == pytest.approx(
        [row.error for row in want.layers], rel=1e-12)
    assert j["evaluation"]["sequences"] == 4
    # Skip-layer candidates: kvcal-calibrate's outlier rule on the layers'
    # errors (python/kvcal/calibrate/skip_layers.py outliers), in the JSON and a line.
    from kvcal.calibrate.skip_layers import argument, outliers

    errors = [row.error for row in want.layers]
    assert j["evaluation"]["skip_layer_candidates"] == sorted(outliers(errors))
    line = next(l for l in text.splitlines() if l.startswith("skip layers:"))
    if outliers(errors):
        assert argument(outliers(errors)) in line, line
    else:
        assert line.startswith("skip layers: none: no layer's error exceeds 3x"), line
