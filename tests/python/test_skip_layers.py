"""kvcal.calibrate.skip_layers: which layers to keep out of the quantized KV cache
(vLLM 0.34's --kv-cache-dtype-skip-layers), on tiny random Llamas.

The model: 4 layers, its lm_head x30 and every o_proj x10 (a random model's
next-token distribution is nearly uniform and its attention adds little to
the residual stream, so its loss would not respond to attention errors at
all; scaled, it does, as a trained model's does). The outlier: one layer's
keys get a large constant component (a k_proj bias of 3000 in the last
dimension of each half of every KV head, the slowest RoPE pair, which turns
by ~0.02 rad over 64 positions): nearly the same for every key, so it hardly
changes the model, but it sets the per-tensor FP8 scale, and FP8's rounding
of those elements (~|bias| / 16) is noise on every logit of that layer. The
same model without the bias has no outlier. (NVFP4 is not tested on it: with
16-value heads each block holds a bias element and NVFP4's error is large in
every layer, 9-17%, so no layer is 3x the median.)

Checked: the advised layers are exactly the one the held-out evaluation
shows worst, re-scoring with it unquantized lowers both the held-out loss
(by more than 2 standard errors) and the attention error, the argument is
vLLM's spelling, the cache-bytes ratio is 2 bytes instead of 1 (FP8) for
the skipped layer (9/16 for NVFP4, checked on the formula); without the outlier nothing is advised.
(tests/python/test_vllm_own_code.py runs the printed argument through vLLM's
own parser and attention layers.) A few seconds on two cores."""
import math
import shlex
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import kvcal
import kvcal.torch
from kvcal.calibrate import choice as select
from kvcal.calibrate import skip_layers
from kvcal.calibrate.data import Batch
from tiny_llama import tiny_llama

LAYERS = 4
OUTLIER = 2
BIAS = 3000.0


def model_with(outlier=None):
    model = tiny_llama(layers=LAYERS, heads=4, num_kv_heads=2, head_dim=16)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(10)
    if outlier is not None:
        kv, hd = model.config.num_key_value_heads, model.config.head_dim
        bias = torch.zeros(kv * hd)
        for h in range(kv):
            bias[h * hd + hd // 2 - 1] = BIAS
            bias[h * hd + hd - 1] = BIAS
        model.model.layers[outlier].self_attn.k_proj.bias = torch.nn.Parameter(bias)
    return model


def windows(n, seed, batch=2, seq=64):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 128, (batch, seq), generator=g)
        out.append(Batch(ids, torch.ones_like(ids), int(ids.numel())))
    return out


def static_scales(model, data):
    """Static min-max per tensor (max |x| / 448 per layer and role) of `data`,
    measured by the evaluation's own absmax at scale 1.0."""
    ones = select.Candidate(None, "one", False, select.ones_scales(SimpleNamespace(num_layers=LAYERS)),
                            origin="scale 1.0")
    select.score(model, data, [ones])
    amax = ones.evaluation.absmax
    tensors = {f"model.layers.{l}.self_attn.{r}_scale": np.float32([amax[r][l].max() / 448])
               for l in range(LAYERS) for r in "qkv"}
    return kvcal.Scales(tensors, granularity="tensor", observer="static_minmax")


def scored(model, kv_format="fp8", kv_only=False):
    scales = static_scales(model, windows(2, seed=1))
    held = windows(8, seed=2)
    one = select.Candidate(None, "one", kv_only,
                           select.ones_scales(SimpleNamespace(num_layers=LAYERS)), origin="scale 1.0")
    cand = select.Candidate("static_minmax", "tensor", kv_only, scales)
    out = select.score(model, held, [one, cand], kv_format=kv_format)
    return cand, held, out, scales


@pytest.mark.parametrize("kv_format,kv_only", [("fp8", False), ("fp8", True)])
def test_outlier_layer_is_advised_and_skipping_it_helps(kv_format, kv_only):
    model = model_with(OUTLIER)
    cand, held, out, scales = scored(model, kv_format, kv_only)
    advice = skip_layers.advise(model, held, cand, out["reference"], out["blocks"], kv_format)
    per_layer = cand.evaluation.attention_error.mean(axis=1)
    # The evaluation shows the biased layer worst, far above the median.
    assert int(np.argmax(per_layer)) == OUTLIER
    assert per_layer[OUTLIER] > skip_layers.K_MEDIAN * np.median(per_layer)
    assert [l for l in range(LAYERS) if l != OUTLIER
            and per_layer[l] > skip_layers.K_MEDIAN * np.median(per_layer)] == []
    assert advice.layers == [OUTLIER] and advice.tried == [OUTLIER], advice.describe()
    assert advice.argument == f"--kv-cache-dtype-skip-layers {OUTLIER}"
    # Re-scored with the layer unquantized: its own error is gone, the loss
    # and the mean attention error are lower, measurably.
    assert advice.per_layer_skip[OUTLIER] == 0.0
    assert advice.delta == pytest.approx(cand.delta)
    assert advice.delta_skip < advice.delta
    assert advice.gain == pytest.approx(advice.delta - advice.delta_skip)
    assert advice.gain > select.Z * advice.gain_se > 0
    assert advice.attention_error_skip < advice.attention_error
    assert advice.worst_layer_error_skip < per_layer[OUTLIER]
    # What it costs: one layer of four at 2 bytes per value instead of 1.
    assert advice.cache_ratio == pytest.approx(5 / 4)
    d = advice.to_dict()
    assert d["advised"] and d["layers"] == [OUTLIER] and d["argument"] == advice.argument
    text = "\n".join(advice.describe())
    assert advice.argument in text and "exceeds 3 x the median" in text
    # kvcal-calibrate's `vllm serve` line ends with it (the option takes
    # every following word), and its note gives the cost.
    from kvcal.calibrate import decision as calibrate_decision

    serve = calibrate_decision.serve_line("/m", cand, "compressed-tensors", None, advice,
                                          "bfloat16")
    assert shlex.split(serve["command"])[-2:] == ["--kv-cache-dtype-skip-layers", str(OUTLIER)]
    assert any("x1.250 the bytes per token" in n for n in serve["notes"]), serve["notes"]
    plain = calibrate_decision.serve_line("/m", cand, "compressed-tensors", None, None,
                                          "bfloat16")
    assert serve["command"] == plain["command"] + " " + advice.argument
    # kvcal-calibrate's summary prints the advice and the serve line.
    from kvcal import calibrate

    decision = calibrate_decision.Decision(
        chosen=cand, candidates=[cand], why="test",
        noise=calibrate_decision.Noise(8, out["tokens"], out["tokens"] // 8, 0.02), skip=advice,
        formats=None, model_dtype="bfloat16", serve=serve)
    result = SimpleNamespace(
        chosen=cand, scale_one=cand, candidates=[cand], samples={"holdout": 8},
        holdout_tokens=out["tokens"], reference_nll=out["reference_nll"], why="test",
        skip=advice, formats=None, platform="per tensor", decision=decision,
        patch=SimpleNamespace(describe=lambda: "patched"),
        inspect={}, report=None, serve=serve, timings={}, warnings=[])
    text = calibrate.cli.summary(result)
    assert advice.describe()[0] in text and advice.describe()[1] in text
    assert serve["command"] in text
    # The candidate's own figures are untouched by the extra pass.
    assert cand.evaluation.attention_error.mean(axis=1)[OUTLIER] == per_layer[OUTLIER]


def test_no_outlier_no_advice():
    model = model_with(None)
    cand, held, out, _ = scored(model)
    advice = skip_layers.advise(model, held, cand, out["reference"], out["blocks"])
    assert advice.layers == [] and advice.argument == ""
    assert not advice.to_dict()["advised"]
    assert "none advised" in advice.describe()[0]
    # Either no layer is an outlier, or re-scoring showed skipping it does
    # not lower the loss by more than the noise.
    if advice.tried:
        assert not advice.gain > select.Z * advice.gain_se
    per_layer = cand.evaluation.attention_error.mean(axis=1)
    assert advice.layer_error == pytest.approx(per_layer.tolist())
    from kvcal.calibrate import decision as calibrate_decision

    serve = calibrate_decision.serve_line("/m", cand, "compressed-tensors", None, advice,
                                          "bfloat16")
    assert "skip-layers" not in serve["command"] and not any("dtype (" in n for n in serve["notes"])


def test_outliers_rule_and_argument():
    e = [0.01, 0.011, 0.05, 0.012, 0.04, 0.0105, 0.01, 0.012]
    # median 0.0115: above 3x are 0.05 (layer 2) and 0.04 (layer 4), worst first.
    assert skip_layers.outliers(e) == [2, 4]
    assert skip_layers.outliers(e, max_share=0.125) == [2]  # at most 1 of 8
    assert skip_layers.outliers(e, k=5) == []
    assert skip_layers.outliers([0.0] * 4) == []
    assert skip_layers.argument([]) == ""
    assert skip_layers.argument([17, 3]) == "--kv-cache-dtype-skip-layers 3 17"
    scales = {f"model.layers.{l}.self_attn.{r}_scale": np.ones(1) for l in range(3) for r in "qkv"}
    kept = skip_layers.without_layers(scales, [1])
    assert sorted(kept) == sorted(n for n in scales if ".layers.1." not in n)
    assert len(scales) == 9  # the input is left alone


def test_unscored_candidate_is_refused():
    c = select.Candidate("static_minmax", "tensor", False, {})
    with pytest.raises(ValueError, match="not been scored"):
        skip_layers.advise(None, [], c, np.zeros(0), np.zeros(0, np.int64))
    assert math.isnan(skip_layers.SkipAdvice("fp8", [], [], [], 0.0).cache_ratio)
    # NVFP4 stores 9/16 bytes per value (4-bit values, an e4m3 scale per 16).
    nvfp4 = skip_layers.SkipAdvice("nvfp4", [2], [2], [0.0] * 4, 0.0, total_layers=4)
    assert nvfp4.cache_ratio == pytest.approx((3 * 9 / 16 + 2) / (4 * 9 / 16))
