"""kvcal.torch.evaluate and rescale_keys on tiny random Llamas: the
reference run is the model's own loss, FP8 errors are small and positive,
static scales never saturate, keys scaled past 448 saturate under scale 1.0
but not under calibrated scales, and the rescaled model computes the same
function."""
import numpy as np
import pytest
import torch

import kvcal
import kvcal.torch
from tiny_llama import tiny_llama


def batches(n=2, batch=2, seq=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (batch, seq), generator=g) for _ in range(n)]


def calibrate(worker, model, data, granularity="tensor", observer="static_minmax"):
    client = kvcal.Client(worker.target)
    client.create_session(model.config)
    with kvcal.Producer(client) as producer, kvcal.torch.capture(model, producer):
        with torch.no_grad():
            for ids in data:
                model(ids, use_cache=False)
    scales = client.finalize(observer=observer, granularity=granularity)
    client.delete()
    return scales


def test_fake_quantize_is_torch_e4m3fn():
    x = torch.linspace(-600, 600, 10001)
    s = torch.tensor(0.75)
    want = (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
    assert torch.equal(kvcal.torch.fake_quantize(x, s), want)


@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_evaluate_figures(worker, granularity):
    model = tiny_llama(num_kv_heads=2)
    data = batches()
    scales = calibrate(worker, model, data, granularity)
    result = kvcal.torch.evaluate(model, scales, data)
    # The reference run is the model's own next-token loss.
    with torch.no_grad():
        losses = [float(model(ids, labels=ids, use_cache=False).loss) for ids in data]
    assert result.runs["reference"].nll == pytest.approx(np.mean(losses), rel=1e-5)
    assert model.config._attn_implementation == "sdpa"  # switched back
    err = result.attention_error
    assert err.shape == (2, 4)
    assert np.all(err > 0) and np.all(err < 0.1), err
    for role in "qkv":
        # Static min-max: layer 0 sees the calibration inputs exactly, so it
        # never saturates; later layers see the FP8 error of earlier ones.
        assert np.all(result.saturation[role][0] == 0)
        assert np.all(result.saturation[role] < 0.01)
        assert result.saturation[role].shape == (2, 4 if role == "q" else 2)
    # K/V only leaves q alone: smaller error; FP8 probabilities add error.
    kv = kvcal.torch.evaluate(model, scales, data, kv_only=True, reference=result.runs["reference"])
    assert np.mean(kv.attention_error) < np.mean(err)
    probs = kvcal.torch.evaluate(model, scales, data, quantize_probs=True,
                                 reference=result.runs["reference"])
    assert np.mean(probs.attention_error) > np.mean(err)
    d = result.to_dict()
    assert d["runs"]["calibrated"]["tokens"] == 2 * 2 * 11
    assert "perplexity" in result.summary()


def test_padding_is_left_out(worker):
    model = tiny_llama()
    ids = batches(n=1, batch=1, seq=10)[0]
    scales = calibrate(worker, model, [ids])
    alone = kvcal.torch.evaluate(model, scales, [ids])
    padded = torch.cat([ids, torch.zeros(1, 4, dtype=torch.long)], dim=1)
    mask = torch.cat([torch.ones(1, 10), torch.zeros(1, 4)], dim=1).long()
    right = kvcal.torch.evaluate(model, scales, [{"input_ids": padded, "attention_mask": mask}])
    for run in ("reference", "calibrated", "ones"):
        assert right.runs[run].tokens == alone.runs[run].tokens == 9
        assert right.runs[run].nll == pytest.approx(alone.runs[run].nll, rel=1e-5)
    np.testing.assert_allclose(right.attention_error, alone.attention_error, rtol=1e-4)


def test_large_keys_saturate_scale_one_only(worker):
    model = tiny_llama()
    data = batches()
    with torch.no_grad():
        before = [model(ids, use_cache=False).logits for ids in data]
    kvcal.torch.rescale_keys(model, 4096.0)
    with torch.no_grad():
        after = [model(ids, use_cache=False).logits for ids in data]
    for a, b in zip(before, after):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)  # the same function
    scales = calibrate(worker, model, data)
    result = kvcal.torch.evaluate(model, scales, data)
    assert result.absmax["k"].max() > 448
    assert result.saturation_ones["k"].max() > 0
    assert result.saturation["k"][0].max() == 0
    assert result.saturation["k"].max() < result.saturation_ones["k"].max()
    # (a random model: its loss barely moves; the attention output does)
    assert np.mean(result.attention_error_ones) > 1.1 * np.mean(result.attention_error)
