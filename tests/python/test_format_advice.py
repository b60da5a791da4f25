"""kvcal.calibrate.format_advice: which KV cache format keeps a model within a stated
tolerance, on the tiny scaled Llama of test_skip_layers.py (no outlier).

Checked: FP8's figures are the ones the FP8 scoring already measured; NVFP4
is scored with per-tensor scales on the same held-out windows (its Δ equals
an independent kvcal.torch.evaluation-based score of the same scales) and with scale
1.0 beside it; NVFP4's error is larger than FP8's on this model; the
recommendation follows the rule (cheapest within the tolerance, none when
none is) at tolerances chosen from the measured figures; the cache-bytes
ratios are 1/2 (FP8) and 9/32 (NVFP4) of 16-bit; bad --kv-cache-formats and
--tolerance values are refused naming them."""
import math

import numpy as np
import pytest

from kvcal.calibrate import errors as calibrate_errors
from kvcal.calibrate import options as calibrate_options
from kvcal.calibrate import choice as select
from kvcal.calibrate import format_advice
from kvcal.calibrate import skip_layers
from test_skip_layers import model_with, static_scales, windows


@pytest.fixture(scope="module")
def measured():
    model = model_with()
    held = windows(3, seed=11)
    scales = static_scales(model, windows(3, seed=5))
    ones = select.Candidate(None, "one", False, select.ones_scales(_geometry()),
                            origin="scale 1.0")
    chosen = select.Candidate("static_minmax", "tensor", False, scales)
    candidates = [ones, chosen]
    scored = select.score(model, held, candidates)
    skip = skip_layers.advise(model, held, chosen, scored["reference"], scored["blocks"])
    advice = format_advice.compare(model, held, chosen, candidates, scored, skip,
                                   ["fp8", "nvfp4"], tolerance=1.0)
    return model, held, chosen, candidates, scored, advice


def _geometry():
    from types import SimpleNamespace

    return SimpleNamespace(num_layers=4)


def test_fp8_figures_are_the_scoring_runs(measured):
    _, _, chosen, _, _, advice = measured
    fp8 = advice.figures[0]
    assert fp8.kv_format == "fp8"
    assert fp8.delta == chosen.delta and fp8.se == chosen.se
    assert fp8.cache_ratio == pytest.approx(0.5)


def test_nvfp4_scored_independently_on_the_same_windows(measured):
    model, held, chosen, _, scored, advice = measured
    nv = advice.figures[1]
    assert nv.kv_format == "nvfp4"
    # The same scales scored again from scratch (own reference pass).
    again = select.Candidate("static_minmax", "tensor", False, chosen.scales)
    ones = select.Candidate(None, "one", False, select.ones_scales(_geometry()),
                            origin="scale 1.0")
    fresh = select.score(model, held, [ones, again], kv_format="nvfp4")
    np.testing.assert_allclose(fresh["reference"], scored["reference"])
    assert nv.delta == pytest.approx(again.delta, abs=1e-9)
    assert nv.ones_delta == pytest.approx(ones.delta, abs=1e-9)
    # NVFP4 costs more than FP8 here, and its cache is 9/16 byte per value.
    assert nv.attention_error > advice.figures[0].attention_error
    assert nv.cache_ratio == pytest.approx(9 / 32)


def _figure(fmt, delta, skip=None):
    return format_advice.FormatFigure(fmt, "x", delta, 0.01, 0.05, skip)


def test_recommendation_follows_the_rule():
    fp8, nv, nv46 = _figure("fp8", 0.004), _figure("nvfp4", 0.030), _figure("nvfp4_4over6", 0.025)
    figures = [fp8, nv, nv46]
    # Loose: all within; the cheaper NVFP4 formats win, the lower Δ among them.
    assert format_advice.recommend(figures, 0.05) is nv46
    # Between: only FP8 is within.
    assert format_advice.recommend(figures, 0.01) is fp8
    # Below all: none; the cache stays 16-bit.
    assert format_advice.recommend(figures, 0.001) is None
    none = format_advice.FormatAdvice(tolerance=0.001, figures=figures)
    assert none.kv_cache_dtype == "auto"
    # kvcal-calibrate names the 16-bit dtype (a patched checkpoint turns
    # `auto` into FP8): kvcal.calibrate.decision passes it in.
    assert "keep the KV cache in 16 bits (--kv-cache-dtype bfloat16)" in "\n".join(
        none.describe("bfloat16"))
    assert none.to_dict("bfloat16")["recommended"] == "bfloat16"
    # A format over the tolerance with every layer quantized but within it
    # with its advised skip layers counts with them, and pays their bytes.
    skip = skip_layers.SkipAdvice(kv_format="nvfp4", layers=[2], tried=[2],
                                  layer_error=[0.1, 0.1, 0.9, 0.1], median=0.1, delta=0.03,
                                  delta_skip=0.008, delta_skip_se=0.01, total_layers=4)
    nv_skip = _figure("nvfp4", 0.03, skip)
    advice = format_advice.FormatAdvice(0.01, [fp8, nv_skip])
    advice.recommended = format_advice.recommend(advice.figures, 0.01)
    assert advice.recommended is nv_skip
    assert nv_skip.cache_ratio == pytest.approx((3 * 0.5625 + 2) / 8)
    assert advice.describe()[-1].endswith(
        "--kv-cache-dtype nvfp4 --kv-cache-dtype-skip-layers 2")
    d = advice.to_dict()
    assert d["recommended"] == "nvfp4" and d["skip_layers"] == [2]
    assert [f["within_tolerance"] for f in d["formats"]] == [True, True]


def test_measured_advice_serializes(measured):
    *_, advice = measured
    d = advice.to_dict()
    assert [f["kv_format"] for f in d["formats"]] == ["fp8", "nvfp4"]
    assert d["recommended"] == advice.kv_cache_dtype


def test_per_head_choice_scores_nvfp4_with_a_per_tensor_candidate(measured):
    _, _, chosen, candidates, _, _ = measured
    per_head = select.Candidate("static_minmax", "head", False, chosen.scales)
    assert format_advice._per_tensor(per_head, candidates) is chosen
    assert format_advice._per_tensor(chosen, candidates) is chosen


@pytest.mark.parametrize("spec,tolerance,needle", [
    ("fp8,int4", 0.02, "unknown KV cache format 'int4'"),
    (",", 0.02, "no KV cache format"),
    ("fp8", -1.0, "--tolerance"),
    ("fp8", math.nan, "--tolerance"),
])
def test_bad_arguments_are_refused(spec, tolerance, needle):
    with pytest.raises(calibrate_errors.UsageError, match=needle.replace("'", ".")):
        calibrate_options.check_formats(spec, tolerance)


def test_parse_keeps_order_and_drops_repeats():
    assert format_advice.parse_formats("nvfp4, fp8,nvfp4") == ["nvfp4", "fp8"]
