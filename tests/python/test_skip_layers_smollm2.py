"""Skip-layer advice on SmolLM2-135M-Instruct with one large-key layer.

SmolLM2 as it is, and its everywhere-x64 large-key variant, have no layer
whose attention error stands out (docs/quality.md, "Which layers to leave
unquantized"): scaling every key by a power of two changes nothing under
calibrated scales. What makes a layer one that no scale can save is a key
component much larger than the rest: here layer LAYER's k_proj gets a bias
of BIAS in the last dimension of each half of every KV head (the slowest
RoPE pair, which turns by well under a degree over the window), nearly the
same for every key, so the model's output hardly moves (the unquantized
loss is checked), but it sets that layer's per-tensor FP8 scale and FP8's
rounding of it is noise on every logit of the layer.

Checked, with static min-max per tensor (max |x| / 448 from the calibration
text, as kvcal finalizes it) and FP8 Q, K and V, on held-out text:
- the advised layers are exactly the one the evaluation shows worst;
- re-scoring with it unquantized lowers the held-out loss by more than 2
  standard errors and the mean attention error;
- the same model without the bias gets no advice.
Measured (4 held-out windows of 2 x 128 tokens): layer 7 at 45.7% against a
median of 8.4%; unquantized, Δ +0.078 -> +0.015 nats/token (gain 0.063 ±
0.022), attention error 9.3% -> 7.9%. About 50 s on two cores."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import smollm2

smollm2.require()

import kvcal  # noqa: E402
from kvcal.calibrate import choice as select  # noqa: E402
from kvcal.calibrate import skip_layers  # noqa: E402
from kvcal.calibrate.data import Batch  # noqa: E402

LAYER = 7
BIAS = 3000.0


@pytest.fixture(scope="module")
def inputs():
    torch.manual_seed(0)
    model, tokenizer = smollm2.load()
    cal = smollm2.token_batches(tokenizer, smollm2.CALIBRATION_FILES, 2, 2, 128)
    ev = smollm2.token_batches(tokenizer, smollm2.EVALUATION_FILES, 4, 2, 128)
    held = [Batch(ids, torch.ones_like(ids), int(ids.numel())) for ids in ev]
    cal = [Batch(ids, torch.ones_like(ids), int(ids.numel())) for ids in cal]
    return model, cal, held


def _bias(model):
    attn = model.model.layers[LAYER].self_attn
    kv, hd = model.config.num_key_value_heads, model.config.head_dim
    bias = torch.zeros(kv * hd)
    for h in range(kv):
        bias[h * hd + hd // 2 - 1] = BIAS
        bias[h * hd + hd - 1] = BIAS
    attn.k_proj.bias = torch.nn.Parameter(bias)


def _unbias(model):
    model.model.layers[LAYER].self_attn.k_proj.bias = None


def _static(model, cal):
    layers = model.config.num_hidden_layers
    ones = select.Candidate(None, "one", False,
                            select.ones_scales(SimpleNamespace(num_layers=layers)),
                            origin="scale 1.0")
    select.score(model, cal, [ones])
    amax = ones.evaluation.absmax
    return kvcal.Scales({f"model.layers.{l}.self_attn.{r}_scale": np.float32([amax[r][l].max() / 448])
                         for l in range(layers) for r in "qkv"},
                        granularity="tensor", observer="static_minmax")


def _advice(model, cal, held):
    cand = select.Candidate("static_minmax", "tensor", False, _static(model, cal))
    ones = select.Candidate(None, "one", False, select.ones_scales(
        SimpleNamespace(num_layers=model.config.num_hidden_layers)), origin="scale 1.0")
    out = select.score(model, held, [ones, cand])
    return cand, out, skip_layers.advise(model, held, cand, out["reference"], out["blocks"])


def test_the_large_key_layer_is_advised_and_skipping_it_helps(inputs):
    model, cal, held = inputs
    try:
        _, plain_out, plain = _advice(model, cal, held)
        _bias(model)
        cand, out, advice = _advice(model, cal, held)
    finally:
        _unbias(model)
    # The bias hardly changes the unquantized model.
    assert abs(out["reference_nll"] - plain_out["reference_nll"]) < 0.02
    # Without it, no advice; with it, exactly the biased layer, the worst.
    assert plain.layers == [], plain.describe()
    assert advice.layers == [LAYER], advice.describe()
    assert int(np.argmax(advice.layer_error)) == LAYER
    assert advice.layer_error[LAYER] > skip_layers.K_MEDIAN * advice.median
    # Skipping it lowers the loss measurably and the attention error.
    assert advice.gain > 2 * advice.gain_se > 0
    assert advice.delta_skip < advice.delta
    assert advice.attention_error_skip < advice.attention_error
    assert advice.argument == f"--kv-cache-dtype-skip-layers {LAYER}"
