"""kvcal-calibrate's one answer: the Decision every output renders.

A run of kvcal-calibrate ends with one Decision: the FP8 scales chosen
(choice.choose), the KV cache format to serve with and its skip
layers (format_advice.recommend), the `vllm serve` line for exactly that
format, and the evidence: every candidate scored, why the choice, and how
much the held-out set can tell apart (Noise). The summary, `--json`, the
HTML report (`kvcal report --decision`, which renders it and applies no rule
of its own), the patched checkpoint (the chosen scales) and
CalibrationResult all read this one object, so they cannot disagree.

The cache format decides the serve line:
- a recommended format (fp8, nvfp4, ...): `--kv-cache-dtype FORMAT` with its
  advised skip layers;
- none within the tolerance ("keep 16-bit"): the KV cache in the model's
  16-bit dtype, named explicitly (`--kv-cache-dtype bfloat16`), because the
  patched checkpoint declares an FP8 KV cache and vLLM 0.34 resolves
  `--kv-cache-dtype auto` to what the checkpoint declares (fp8:
  Attention.__init__, "an explicit choice (e.g. bfloat16) must win"); vLLM
  accepts an explicit 16-bit cache dtype only equal to the model's dtype
  (VllmConfig._reject_mismatched_float_kv_cache), so a float32 checkpoint's
  line also passes `--dtype bfloat16`. The FP8 line, with what it costs,
  follows on its own line for users who accept it.

Noise: the held-out set resolves differences of Z standard errors of the
paired per-token difference (choice.mean_se over blocks of 32
tokens) between scale 1.0 and the best calibrated candidate. When that is
larger than the tolerance, or than the best candidate's gain over scale 1.0,
the summary says so with the held-out windows that would resolve it: the
paired standard error falls as 1/sqrt(windows) (its variance is a sum over
independent blocks), so n * (resolvable / target)^2 windows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional

from kvcal.calibrate import choice, format_advice, output, skip_layers

# The model dtypes vLLM names as a --kv-cache-dtype (vllm/config/cache.py
# CacheDType); a float32 model's 16-bit cache is bfloat16.
SIXTEEN_BIT = {"bfloat16": "bfloat16", "float16": "float16", "float32": "bfloat16"}


def _num(x):
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


@dataclass
class Noise:
    """How much the held-out set can tell apart (see the module docs)."""
    windows: int
    tokens: int
    window_tokens: int
    tolerance: float
    resolvable: float = math.nan      # Z paired standard errors, nats/token
    pair: str = ""                    # "scale 1.0, K, V against <label>"
    gain: float = math.nan            # scale 1.0's Δ minus the best calibrated Δ
    best_label: str = ""
    target: float = math.nan          # what should be resolved (tolerance or gain)
    windows_needed: int = 0           # 0: resolved

    @property
    def resolved(self) -> bool:
        return self.windows_needed == 0

    def lines(self) -> List[str]:
        out = [f"held-out: {self.windows} windows, {self.tokens} tokens; differences below "
               f"{self.resolvable:.4f} nats/token are within the noise ({choice.Z:g} standard "
               f"errors of the paired difference, {self.pair})"
               if not math.isnan(self.resolvable) else
               f"held-out: {self.windows} windows, {self.tokens} tokens; too few blocks to "
               f"estimate the noise"]
        if not self.resolved:
            what = (f"the tolerance ({self.tolerance:g} nats/token)"
                    if self.target == self.tolerance else
                    f"{self.best_label}'s gain over scale 1.0 ({self.gain:.4f} nats/token)")
            out.append(f"too few held-out tokens to decide: {self.resolvable:.4f} nats/token is "
                       f"more than {what}; about {self.windows_needed} held-out windows of "
                       f"{self.window_tokens} tokens would resolve it (--holdout-samples "
                       f"{self.windows_needed}); until then the simpler setting is kept")
        return out

    def to_dict(self) -> dict:
        return {"windows": self.windows, "tokens": self.tokens,
                "window_tokens": self.window_tokens,
                "resolvable_nats_per_token": _num(self.resolvable), "pair": self.pair,
                "gain_over_scale_one": _num(self.gain), "best_calibrated": self.best_label or None,
                "tolerance": self.tolerance, "target": _num(self.target),
                "resolved": self.resolved, "windows_needed": self.windows_needed or None,
                "lines": self.lines()}


def noise(candidates: List[choice.Candidate], blocks, windows: int, tokens: int,
          tolerance: float) -> Noise:
    """Noise of a scored candidate list (choice.score and choose
    ran)."""
    window_tokens = max(1, round(tokens / windows)) if windows else 0
    out = Noise(windows=windows, tokens=tokens, window_tokens=window_tokens, tolerance=tolerance)
    scored = [c for c in candidates if c.nll is not None and c.same_as is None]
    calibrated = [c for c in scored if c.observer is not None]
    if not calibrated:
        return out
    best = min(calibrated, key=lambda c: (c.delta, c.complexity()))
    ones = next((c for c in scored if c.observer is None and c.kv_only == best.kv_only), None)
    if ones is None:
        return out
    diff, se = choice.mean_se(ones.nll - best.nll, blocks)
    out.resolvable = choice.Z * se
    out.pair = f"{ones.label} against {best.label}"
    out.gain = diff
    out.best_label = best.label
    if math.isnan(se):
        return out
    targets = [tolerance] + ([diff] if diff > 0 else [])
    target = min(t for t in targets if t > 0) if any(t > 0 for t in targets) else tolerance
    out.target = target
    if out.resolvable > target and target > 0:
        out.windows_needed = int(math.ceil(windows * (out.resolvable / target) ** 2))
    return out


@dataclass
class Decision:
    """The one answer of a kvcal-calibrate run (see the module docs)."""
    chosen: choice.Candidate
    candidates: List[choice.Candidate]
    why: str
    noise: Noise
    skip: Optional[skip_layers.SkipAdvice]        # FP8's skip advice for the chosen scales
    formats: Optional[format_advice.FormatAdvice]
    model_dtype: str                              # the dtype vLLM serves the model in
    serve: dict = field(default_factory=dict)
    figure: Optional[format_advice.FormatFigure] = None  # the served format's figures

    @property
    def written(self) -> choice.Candidate:
        """The candidate whose scales the checkpoint holds: the chosen FP8
        scales, or the per-tensor scales a recommended NVFP4 cache was
        scored with (its store reads one global scale per layer)."""
        if self.figure is not None and self.figure.kv_format != "fp8" \
                and self.figure.candidate is not None:
            return self.figure.candidate
        return self.chosen

    @property
    def kv_cache_dtype(self) -> str:
        """What the serve line passes as --kv-cache-dtype."""
        return self.serve.get("kv_cache_dtype", "fp8")

    @property
    def inspect_dtype(self) -> str:
        """The --kv-cache-dtype `kvcal inspect` checks the checkpoint with:
        the served format, or FP8 (the alternative line) when the cache stays
        in 16 bits, where vLLM uses no scale at all."""
        return self.kv_cache_dtype if self.kv_cache_dtype in format_advice.FORMATS else "fp8"

    @property
    def sixteen_bit(self) -> str:
        """The --kv-cache-dtype that keeps this model's cache unquantized."""
        return SIXTEEN_BIT.get(self.model_dtype, "bfloat16")

    @property
    def skip_layers(self) -> List[int]:
        return list(self.serve.get("skip_layers", []))

    def view(self, reference_nll: float) -> dict:
        """Everything the outputs show, as JSON: `--json` (merged into
        CalibrationResult.to_dict) and `kvcal report --decision`."""
        return {"decision": self.to_dict(),
                "candidates": [c.to_dict() for c in self.candidates],
                "cache_formats": (self.formats.to_dict(self.sixteen_bit)
                                  if self.formats is not None else None),
                "skip_layers": self.skip.to_dict() if self.skip is not None else None,
                "reference_nll": _num(reference_nll), "holdout_tokens": self.noise.tokens}

    def to_dict(self) -> dict:
        w = self.written
        return {"chosen": self.chosen.label, "scales": w.label, "observer": w.observer,
                "granularity": w.granularity, "kv_only": w.kv_only, "why": self.why,
                "kv_cache_dtype": self.kv_cache_dtype, "skip_layers": self.skip_layers,
                "serve": self.serve, "noise": self.noise.to_dict(),
                "model_dtype": self.model_dtype}


def served_format(formats: Optional[format_advice.FormatAdvice],
                  fp8_skip: Optional[skip_layers.SkipAdvice], model_dtype: str):
    """(--kv-cache-dtype, skip layers, the FormatFigure or None) to serve
    with: the recommended format, or the model's 16-bit dtype when none is
    within the tolerance. Without format advice (none asked for), FP8."""
    if formats is None:
        layers = list(fp8_skip.layers) if fp8_skip is not None and fp8_skip.advised else []
        return "fp8", layers, None
    if formats.recommended is None:
        return SIXTEEN_BIT.get(model_dtype, "bfloat16"), [], None
    r = formats.recommended
    return r.kv_format, list(r.skip_layers), r


def serve_line(checkpoint: str, chosen: choice.Candidate, target: str,
               formats: Optional[format_advice.FormatAdvice],
               fp8_skip: Optional[skip_layers.SkipAdvice], model_dtype: str,
               dtype_argument: Optional[str] = None) -> dict:
    """The `vllm serve` command for the decision, and why. `dtype_argument`:
    the --dtype vLLM needs (a GGUF conversion), else None."""
    kv_dtype, layers, figure = served_format(formats, fp8_skip, model_dtype)
    base = ["vllm", "serve", checkpoint] + (["--dtype", dtype_argument] if dtype_argument else [])
    notes: List[str] = []
    if kv_dtype in format_advice.FORMATS:
        args, backends, more = output.serve_arguments(chosen, kv_dtype, target)
        notes.extend(more)
        advice = figure.skip if figure is not None else fp8_skip
        if layers and advice is not None:
            notes.append(f"layers {', '.join(map(str, layers))} keep their KV cache in the "
                         f"model's dtype ({advice.reason}); the KV cache takes "
                         f"x{advice.cache_ratio:.3f} the bytes per token of an all-{kv_dtype} one")
        command = base + args + (skip_layers.argument(layers).split() if layers else [])
        alternative = None
    else:
        # vLLM 0.34 refuses an explicit 16-bit cache dtype other than the
        # model's (VllmConfig._reject_mismatched_float_kv_cache): a float32
        # checkpoint is served in kv_dtype, said with --dtype.
        pin = [] if dtype_argument or model_dtype == kv_dtype else ["--dtype", kv_dtype]
        command = base + pin + ["--kv-cache-dtype", kv_dtype]
        backends = "every attention backend (the KV cache is not quantized)"
        fp8 = next((f for f in (formats.figures if formats else []) if f.kv_format == "fp8"),
                   None)
        cost = (f"held-out Δ {fp8.best_delta:+.4f} ± {fp8.best_se:.4f} nats/token, over the "
                f"tolerance of {formats.tolerance:g}" if fp8 is not None else
                "not scored (fp8 was not in --kv-cache-formats)")
        notes.append(f"no cache format is within the tolerance: the KV cache stays in "
                     f"{kv_dtype}; the checkpoint declares an FP8 KV cache, which "
                     f"--kv-cache-dtype auto would select, so the 16-bit dtype is named")
        fp8_args, _, _ = output.serve_arguments(chosen, "fp8", target)
        fp8_layers = list(fp8.skip_layers) if fp8 is not None else []
        alternative = {
            "command": " ".join(output.quote(a) for a in base + fp8_args + (
                skip_layers.argument(fp8_layers).split() if fp8_layers else [])),
            "kv_cache_dtype": "fp8", "cost": cost}
    return {"command": " ".join(output.quote(a) for a in command), "kv_cache_dtype": kv_dtype,
            "skip_layers": layers, "backends": backends, "notes": notes,
            "fp8_alternative": alternative}


def decide(chosen: choice.Candidate, candidates: List[choice.Candidate], blocks, why: str,
           skip, formats, *, checkpoint: str, target: str, model_dtype: str, windows: int,
           tokens: int, tolerance: float, dtype_argument: Optional[str] = None) -> Decision:
    """The Decision of a scored run."""
    d = Decision(chosen=chosen, candidates=candidates, why=why,
                 noise=noise(candidates, blocks, windows, tokens, tolerance), skip=skip,
                 formats=formats, model_dtype=model_dtype,
                 figure=served_format(formats, skip, model_dtype)[2])
    d.serve = serve_line(checkpoint, d.written, target, formats, skip, model_dtype,
                         dtype_argument)
    return d
