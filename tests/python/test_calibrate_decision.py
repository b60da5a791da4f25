"""kvcal-calibrate's one answer (python/kvcal/calibrate/decision.py).

Unit checks (no model): the noise of the held-out set (the resolvable
difference is 2 paired standard errors; the windows that would resolve a
target), the serve line for each kind of decision (a recommended FP8 or
NVFP4 cache with its skip layers; "keep 16-bit" naming the model's dtype,
since vLLM 0.34 turns `auto` into the checkpoint's FP8, with the FP8 line
beside it), which scales the checkpoint holds, and the default held-out
size.

End to end on SmolLM2 (tests/python/smollm2.py), in three situations: a
setting within the noise of scale 1.0 (the model as it is), a calibrated
setting that wins (the large-key variant: keys x64, queries /64, which
scale 1.0 clips), and FP8 over the tolerance (a tolerance below FP8's
measured cost). In each, the text summary, the `--json` object, the HTML
report (parsed) and the serve line name the same scales and the same KV
cache dtype, and the patched checkpoint holds those scales.
"""
import html.parser
import json
import math
import os
import re
import shlex
import shutil

import numpy as np
import pytest

from kvcal.calibrate import choice as select
from kvcal.calibrate import data as calibrate_data
from kvcal.calibrate import decision as decision_mod
from kvcal.calibrate import format_advice, skip_layers

LICENSES = "/usr/share/common-licenses"


# -- unit checks ---------------------------------------------------------------

def _cand(observer, granularity, kv_only, nll, scales=None):
    c = select.Candidate(observer, granularity, kv_only, scales=scales,
                         origin="scale 1.0" if observer is None else "kvcal")
    c.nll = np.asarray(nll, dtype=np.float64)
    return c


def _scored(seed, n_tokens, shift, noise_sd):
    """scale 1.0 and static min-max per tensor (K, V) with per-token losses
    differing by `shift` on average, and their block ids."""
    rng = np.random.default_rng(seed)
    base = rng.normal(0, 1, n_tokens)
    ones = _cand(None, "one", True, base + rng.normal(0, noise_sd, n_tokens))
    calibrated = _cand("static_minmax", "tensor", True,
                       base - shift + rng.normal(0, noise_sd, n_tokens))
    blocks = np.arange(n_tokens) // select.BLOCK
    for c in (ones, calibrated):
        c.delta, c.se = select.mean_se(c.nll - base, blocks)
    return [ones, calibrated], blocks


def test_noise_is_two_paired_standard_errors_and_says_what_would_resolve_it():
    candidates, blocks = _scored(0, 2048, 0.002, 0.3)
    n = decision_mod.noise(candidates, blocks, windows=8, tokens=2048, tolerance=0.02)
    diff, se = select.mean_se(candidates[0].nll - candidates[1].nll, blocks)
    assert n.resolvable == pytest.approx(2 * se)
    assert n.gain == pytest.approx(diff)
    assert n.pair == "scale 1.0, K, V against static min-max per tensor, K, V"
    # The target is the smaller of the tolerance and a positive gain.
    target = min(0.02, diff) if diff > 0 else 0.02
    if n.resolvable > target:
        assert n.windows_needed == math.ceil(8 * (n.resolvable / target) ** 2)
        text = "\n".join(n.lines())
        assert "too few held-out tokens to decide" in text
        assert f"--holdout-samples {n.windows_needed}" in text
    d = n.to_dict()
    assert d["tokens"] == 2048 and d["windows"] == 8 and d["lines"] == n.lines()


def test_noise_resolved_on_a_large_held_out_set_says_nothing_more():
    candidates, blocks = _scored(1, 65536, 0.05, 0.05)
    n = decision_mod.noise(candidates, blocks, windows=64, tokens=65536, tolerance=0.02)
    assert n.resolved and n.windows_needed == 0
    assert n.resolvable < 0.02 < n.gain
    assert len(n.lines()) == 1 and "within the noise" in n.lines()[0]


def test_windows_needed_shrink_the_standard_error_as_predicted():
    """The estimate n (R / target)^2: with that many windows of the same
    statistics, 2 standard errors come out near the target."""
    rng = np.random.default_rng(2)
    per_window, target = 256, 0.01

    def measured(windows):
        tokens = windows * per_window
        d = rng.normal(0.0, 0.4, tokens)
        blocks = np.arange(tokens) // select.BLOCK
        return 2 * select.mean_se(d, blocks)[1]

    small = measured(8)
    need = math.ceil(8 * (small / target) ** 2)
    assert 0.7 * target < measured(need) < 1.3 * target


def _figure(fmt, delta, layers=(), candidate=None, total=4):
    advice = skip_layers.SkipAdvice(fmt, list(layers), list(layers), [0.0] * total, 0.0,
                                    total_layers=total, reason="measured")
    if layers:
        advice.gain, advice.gain_se = 1.0, 0.1
        advice.delta_skip, advice.delta_skip_se = delta, 0.001
    return format_advice.FormatFigure(fmt, "x", delta, 0.001, 0.05, advice,
                                      candidate=candidate)


def _formats(figures, tolerance=0.02):
    advice = format_advice.FormatAdvice(tolerance=tolerance, figures=figures)
    advice.recommended = format_advice.recommend(figures, tolerance)
    return advice


def test_serve_line_names_the_recommended_format_and_its_skip_layers():
    chosen = _cand("static_minmax", "tensor", False, [0.0])
    fp8 = _figure("fp8", 0.001, candidate=chosen)
    nv = _figure("nvfp4", 0.015, layers=[3], candidate=chosen)
    serve = decision_mod.serve_line("/m", chosen, "compressed-tensors", _formats([fp8, nv]),
                                    fp8.skip, "bfloat16")
    words = shlex.split(serve["command"])
    assert words[words.index("--kv-cache-dtype") + 1] == "nvfp4"
    assert words[-2:] == ["--kv-cache-dtype-skip-layers", "3"]
    assert serve["kv_cache_dtype"] == "nvfp4" and serve["skip_layers"] == [3]
    assert serve["fp8_alternative"] is None
    serve = decision_mod.serve_line("/m", chosen, "compressed-tensors",
                                    _formats([fp8, _figure("nvfp4", 0.5, candidate=chosen)]),
                                    fp8.skip, "bfloat16")
    assert "--kv-cache-dtype fp8" in serve["command"] and serve["kv_cache_dtype"] == "fp8"


def test_keep_16_bit_names_the_models_dtype_and_gives_the_fp8_line_beside_it():
    chosen = _cand(None, "one", True, [0.0])
    fp8 = _figure("fp8", 0.05, candidate=chosen)
    formats = _formats([fp8])
    for model_dtype, want, pinned in (("bfloat16", "bfloat16", False),
                                      ("float16", "float16", False),
                                      ("float32", "bfloat16", True)):
        serve = decision_mod.serve_line("/m", chosen, "compressed-tensors", formats, fp8.skip,
                                        model_dtype)
        words = shlex.split(serve["command"])
        assert words[words.index("--kv-cache-dtype") + 1] == want
        assert ("--dtype" in words) == pinned
        if pinned:
            assert words[words.index("--dtype") + 1] == want
        assert "auto" not in words and "fp8" not in words
        alt = serve["fp8_alternative"]
        assert "--kv-cache-dtype fp8" in alt["command"] and "+0.0500" in alt["cost"]
        assert "over the tolerance of 0.02" in alt["cost"]
    # The summary line of the format advice names the same dtype.
    assert "(--kv-cache-dtype bfloat16)" in "\n".join(formats.describe("bfloat16"))
    # A GGUF conversion's serve line carries its --dtype once.
    serve = decision_mod.serve_line("/m", chosen, "compressed-tensors", formats, fp8.skip,
                                    "bfloat16", dtype_argument="bfloat16")
    assert shlex.split(serve["command"]).count("--dtype") == 1


def test_nvfp4_checkpoint_holds_the_per_tensor_scales_it_was_scored_with():
    head = _cand("static_minmax", "head", False, [0.0], scales="head-scales")
    tensor = _cand("static_minmax", "tensor", False, [0.0], scales="tensor-scales")
    formats = _formats([_figure("fp8", 0.05, candidate=head),
                        _figure("nvfp4", 0.01, candidate=tensor)])
    d = decision_mod.Decision(chosen=head, candidates=[head, tensor], why="w",
                              noise=decision_mod.Noise(2, 100, 50, 0.02), skip=None,
                              formats=formats, model_dtype="bfloat16",
                              figure=decision_mod.served_format(formats, None, "bfloat16")[2])
    assert d.written is tensor
    d.serve = decision_mod.serve_line("/m", d.written, "compressed-tensors", formats, None,
                                      "bfloat16")
    assert d.to_dict()["scales"] == tensor.label and d.kv_cache_dtype == "nvfp4"


@pytest.mark.parametrize("windows, seq_len, want", [
    (512, 2048, 51),     # a tenth
    (16, 64, 8),         # HOLDOUT_TOKENS wants 128 windows; at most half
    (40, 256, 20),       # 32 windows wanted, at most half
    (400, 256, 40),      # a tenth (40) over HOLDOUT_TOKENS' 32
    (3, 64, 2),          # at least 2
])
def test_default_holdout(windows, seq_len, want):
    assert calibrate_data.HOLDOUT_TOKENS == 8192
    assert calibrate_data.default_holdout(windows, seq_len) == want


# -- end to end on SmolLM2: one answer in every output ---------------------------------

class _Page(html.parser.HTMLParser):
    """The report's decision: the recommendation's bold values, the serve
    command, and the candidates table's chosen row."""

    def __init__(self):
        super().__init__()
        self.stack, self.bold, self.codes, self.rows = [], [], {}, []
        self._code, self._row, self._in_rec, self._in_candidates = None, None, False, False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "section":
            self._in_rec = a.get("id") == "recommendation"
            self._in_candidates = a.get("id") == "candidates"
        if tag == "code" and a.get("id"):
            self._code = a["id"]
            self.codes[self._code] = ""
        if tag == "tr" and self._in_candidates:
            self._row = {"chosen": a.get("class") == "chosen", "cells": []}
        if tag == "td" and self._row is not None:
            self._row["cells"].append("")
        self.stack.append(tag)

    def handle_endtag(self, tag):
        if tag == "code":
            self._code = None
        if tag == "tr" and self._row is not None:
            if self._row["cells"]:
                self.rows.append(self._row)
            self._row = None
        if self.stack:
            self.stack.pop()

    def handle_data(self, data):
        if self._code:
            self.codes[self._code] += data
        if self.stack and self.stack[-1] == "b" and self._in_rec:
            self.bold.append(data)
        if self._row is not None and self._row["cells"] and self.stack[-1] == "td":
            self._row["cells"][-1] += data


def parse_report(path):
    page = _Page()
    with open(path, encoding="utf-8") as f:
        page.feed(f.read())
    return page


from test_calibrate import dataset, smollm2_dir  # noqa: E402,F401 (fixtures)


@pytest.fixture(scope="module")
def large_keys_dir(smollm2_dir, tmp_path_factory):
    """SmolLM2 with keys x64 and queries /64 (kvcal.torch.rescale_keys): the
    same model, whose keys pass 448 so that scale 1.0 clips them."""
    import transformers

    import kvcal.torch

    out = str(tmp_path_factory.mktemp("large-keys") / "model")
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir)
    kvcal.torch.rescale_keys(model, 64.0)
    model.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(out)
    return out


def calibrate_three_ways(model_dir, dataset, out, samples=16, seq_len=64, **options):
    """One run (as the command runs it, in this process); its summary,
    --json object, report and checkpoint."""
    from kvcal import calibrate

    result = calibrate.calibrate_model(
        model_dir, dataset, samples=samples, seq_len=seq_len, observer="static_minmax", out=out,
        quiet=True, kv_cache_formats="fp8", **options)
    return result, calibrate.cli.summary(result), json.loads(json.dumps(result.to_dict()))


def assert_one_answer(result, text, js, out):
    from test_calibrate import scale_tensors

    d = result.decision
    scales_label, kv_dtype = d.written.label, d.kv_cache_dtype
    command = d.serve["command"]
    # --json
    assert js["decision"]["scales"] == scales_label
    assert js["decision"]["kv_cache_dtype"] == kv_dtype == js["serve"]["kv_cache_dtype"]
    assert js["serve"]["command"] == command
    assert [c["label"] for c in js["candidates"] if c["chosen"]] == [d.chosen.label]
    if js["cache_formats"] is not None:
        assert js["cache_formats"]["recommended"] == kv_dtype
    # the serve line
    words = shlex.split(command)
    assert words[words.index("--kv-cache-dtype") + 1] == kv_dtype
    # the summary
    assert f"chosen: {d.chosen.label}," in text
    assert f"  {command}\n" in text + "\n"
    if kv_dtype in format_advice.FORMATS:
        assert f"recommended: --kv-cache-dtype {kv_dtype}" in text
    else:
        assert f"recommended: none of them; keep the KV cache in 16 bits " \
               f"(--kv-cache-dtype {kv_dtype})" in text
    assert f"held-out: {len(result.decision.candidates) and js['decision']['noise']['windows']} windows" in text
    assert re.search(r"serve it with:\n  vllm serve .* --kv-cache-dtype " + re.escape(kv_dtype),
                     text)
    # the report, parsed
    page = parse_report(result.report)
    assert page.bold[:2] == [scales_label, kv_dtype], page.bold
    assert page.codes["serve-command"] == command
    chosen_rows = [r["cells"][0] for r in page.rows if r["chosen"]]
    assert chosen_rows == [d.chosen.label]
    every = [r["cells"][0] for r in page.rows]
    assert every == [c.label for c in result.candidates]
    with open(result.report, encoding="utf-8") as f:
        assert "eval-" not in f.read()  # no name of a file that is gone
    # the checkpoint
    held = scale_tensors(out)
    assert held, out
    if d.written.observer is None:
        want = {k: np.ones(1, np.float32) for k in held}
    else:
        want = {k: np.asarray(v) for k, v in d.written.scales.items()}
    for key, value in held.items():
        assert np.array_equal(value.reshape(-1), want[key].reshape(-1)), key
    return d


def test_within_the_noise_of_scale_one(smollm2_dir, dataset, tmp_path):
    out = str(tmp_path / "out")
    result, text, js = calibrate_three_ways(smollm2_dir, dataset, out)
    d = assert_one_answer(result, text, js, out)
    # The held-out set says how much it can resolve, in tokens and nats.
    n = js["decision"]["noise"]
    assert n["windows"] == 8 and n["tokens"] == 8 * 63
    assert n["resolvable_nats_per_token"] > 0
    if d.chosen.observer is None:  # scale 1.0 kept: the calibrated one is within the noise
        best = next(c for c in result.candidates if c.best)
        assert best.observer is None or "within the noise" in result.why


def test_a_calibrated_setting_that_wins(large_keys_dir, dataset, tmp_path):
    # 16 held-out windows of 255 tokens (4080 tokens): enough to resolve
    # scale 1.0's clipping on this variant (on 8 x 63 tokens it is not);
    # K and V only (--kv-only), which halves the held-out passes.
    out = str(tmp_path / "out")
    result, text, js = calibrate_three_ways(large_keys_dir, dataset, out, samples=24,
                                            seq_len=256, holdout_samples=16, kv_only=True)
    d = assert_one_answer(result, text, js, out)
    assert d.chosen.observer == "static_minmax", text
    assert d.kv_cache_dtype == "fp8"
    ones = result.scale_one
    assert ones.delta - d.chosen.delta > 0.05, text


def test_fp8_over_the_tolerance_keeps_16_bit(smollm2_dir, dataset, tmp_path):
    out = str(tmp_path / "out")
    result, text, js = calibrate_three_ways(smollm2_dir, dataset, out, tolerance=1e-6)
    d = assert_one_answer(result, text, js, out)
    assert d.kv_cache_dtype == "bfloat16"
    # float32 checkpoint: vLLM takes an explicit 16-bit cache only equal to
    # the model's dtype, so the line pins --dtype too.
    words = shlex.split(d.serve["command"])
    assert words[words.index("--dtype") + 1] == "bfloat16"
    alt = js["serve"]["fp8_alternative"]
    assert "--kv-cache-dtype fp8" in alt["command"] and "over the tolerance" in alt["cost"]
    assert f"or, accepting FP8's cost ({alt['cost']}):\n  {alt['command']}" in text
    page = parse_report(result.report)
    assert page.codes["fp8-command"] == alt["command"]
    # kvcal inspect checks the scales for the FP8 line (a 16-bit cache uses none).
    assert js["inspect"]["kv_cache_dtype"] == "fp8", js["inspect"]
    assert "kvcal inspect (--kv-cache-dtype fp8, the FP8 line below)" in text
