"""Which KV cache format keeps the model within a stated tolerance, measured.

kvcal-calibrate scores its FP8 candidates on held-out windows; this module
scores the same held-out windows once more for each other cache format asked
for (vLLM 0.34's ``nvfp4`` and ``nvfp4_4over6``, emulated bit for bit by
kvcal.torch.evaluation), with the skip-layer advice of kvcal/calibrate/skip_layers.py for each,
and recommends a format.

The rule (recommend):

1. a format's loss is the held-out Δ nats/token of its best setting: with
   its advised skip layers unquantized when the skip advice holds, else every
   layer quantized;
2. a format is within the tolerance when that Δ is at most ``tolerance``
   nats/token (the point estimate; its standard error is shown beside it);
3. the recommended format is the one with the fewest cache bytes per token
   among those within the tolerance (ties: the lower Δ); when none is, the
   cache stays in the model's dtype (``--kv-cache-dtype auto``).

NVFP4's store kernel reads one global scale per layer, so NVFP4 is scored
with per-tensor K/V scales: the chosen FP8 candidate's when it is per tensor,
else the best-scoring per-tensor candidate, else scale 1.0 (for NVFP4 the
global scale hardly changes the error, docs/quality.md).

Cost is cache bytes per token relative to the model's dtype (2 bytes per
value): FP8 1 byte, NVFP4 9/16 (4-bit values plus one E4M3 scale per 16),
a skipped layer 2 bytes.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

from kvcal.calibrate import choice, skip_layers

FORMATS = ("fp8", "nvfp4", "nvfp4_4over6")
DEFAULT_TOLERANCE = 0.02  # nats/token: about 2% perplexity


@dataclass
class FormatFigure:
    """One cache format's held-out figures."""
    kv_format: str
    label: str                         # the scales it was scored with
    delta: float                       # Δ nats/token, every layer quantized
    se: float
    attention_error: float             # mean relative RMS error of attention
    skip: Optional[skip_layers.SkipAdvice] = None
    ones_delta: float = math.nan       # Δ with global scale 1.0 (NVFP4), for comparison
    evaluation: Optional[object] = None  # kvcal.torch.Evaluation (formats other than FP8)
    candidate: Optional[object] = None   # the choice.Candidate whose scales it used

    @property
    def best_delta(self) -> float:
        return self.skip.delta_skip if self.skip is not None and self.skip.advised else self.delta

    @property
    def best_se(self) -> float:
        return self.skip.delta_skip_se if self.skip is not None and self.skip.advised else self.se

    @property
    def skip_layers(self) -> List[int]:
        return list(self.skip.layers) if self.skip is not None else []

    @property
    def cache_ratio(self) -> float:
        """KV cache bytes per token over the model's dtype's."""
        b = skip_layers.VALUE_BYTES[self.kv_format]
        n = self.skip.total_layers if self.skip is not None else 0
        s = len(self.skip_layers)
        if not n:
            return b / skip_layers.SKIPPED_BYTES
        return ((n - s) * b + s * skip_layers.SKIPPED_BYTES) / (n * skip_layers.SKIPPED_BYTES)

    def to_dict(self, tolerance: float) -> dict:
        def num(x):
            return None if x is None or (isinstance(x, float) and math.isnan(x)) else x
        return {"kv_format": self.kv_format, "scales": self.label, "delta_nll": num(self.delta),
                "delta_nll_se": num(self.se), "attention_error_mean": num(self.attention_error),
                "skip_layers": self.skip_layers, "best_delta_nll": num(self.best_delta),
                "best_delta_nll_se": num(self.best_se), "cache_bytes_ratio": self.cache_ratio,
                "delta_nll_scale_one": num(self.ones_delta),
                "within_tolerance": within(self, tolerance)}


@dataclass
class FormatAdvice:
    tolerance: float
    figures: List[FormatFigure] = field(default_factory=list)
    recommended: Optional[FormatFigure] = None   # None: keep the model's dtype

    @property
    def kv_cache_dtype(self) -> str:
        return self.recommended.kv_format if self.recommended is not None else "auto"

    def describe(self, sixteen_bit: str = "auto") -> List[str]:
        """The summary's lines; `sixteen_bit`: the --kv-cache-dtype that keeps
        the cache unquantized (decision.py names the model's dtype:
        a patched checkpoint makes `auto` FP8)."""
        lines = [f"cache format (tolerance Δ ≤ {self.tolerance:g} nats/token on held-out):"]
        for f in self.figures:
            skip = f", skip {' '.join(map(str, f.skip_layers))}" if f.skip_layers else ""
            mark = "within" if within(f, self.tolerance) else "over"
            lines.append(f"  {f.kv_format:<13} Δ {f.best_delta:+.4f} ± {f.best_se:.4f}{skip}, "
                         f"attention error {100 * f.attention_error:.2f}%, cache x"
                         f"{f.cache_ratio:.3f} of 16-bit: {mark}")
        if self.recommended is None:
            lines.append(f"  recommended: none of them; keep the KV cache in 16 bits "
                         f"(--kv-cache-dtype {sixteen_bit})")
        else:
            r = self.recommended
            arg = f" {skip_layers.argument(r.skip_layers)}" if r.skip_layers else ""
            lines.append(f"  recommended: --kv-cache-dtype {r.kv_format}{arg}")
        return lines

    def to_dict(self, sixteen_bit: str = "auto") -> dict:
        return {"tolerance_nats_per_token": self.tolerance,
                "rule": "fewest cache bytes among the formats whose held-out Δ nats/token "
                        "(with their advised skip layers) is at most the tolerance, else the "
                        "model's 16-bit dtype",
                "formats": [f.to_dict(self.tolerance) for f in self.figures],
                "recommended": (self.kv_cache_dtype if self.recommended is not None
                                else sixteen_bit),
                "skip_layers": self.recommended.skip_layers if self.recommended else []}


def within(figure: FormatFigure, tolerance: float) -> bool:
    d = figure.best_delta
    return not math.isnan(d) and d <= tolerance


def recommend(figures: Sequence[FormatFigure], tolerance: float) -> Optional[FormatFigure]:
    """The cheapest format within `tolerance` (ties: the lower Δ); None when
    none is."""
    ok = [f for f in figures if within(f, tolerance)]
    if not ok:
        return None
    return min(ok, key=lambda f: (f.cache_ratio, f.best_delta))


def parse_formats(spec: str) -> List[str]:
    """'fp8,nvfp4' -> ['fp8', 'nvfp4']; ValueError naming an unknown one."""
    out: List[str] = []
    for word in (w.strip() for w in spec.split(",")):
        if not word:
            continue
        if word not in FORMATS:
            raise ValueError(f"unknown KV cache format {word!r}: choose from {', '.join(FORMATS)}")
        if word not in out:
            out.append(word)
    if not out:
        raise ValueError("no KV cache format given: choose from " + ", ".join(FORMATS))
    return out


def _per_tensor(chosen: choice.Candidate, candidates: Sequence[choice.Candidate]):
    """The candidate NVFP4 is scored with (see the module's docstring)."""
    if chosen.granularity in ("tensor", "one"):
        return chosen
    scored = [c for c in candidates if c.granularity in ("tensor", "one") and c.same_as is None
              and c.kv_only == chosen.kv_only and not math.isnan(c.delta)]
    kvcal_made = [c for c in scored if c.observer is not None and c.origin == "kvcal"]
    pool = kvcal_made or scored
    return min(pool, key=lambda c: c.delta) if pool else None


def compare(model, batches: list, chosen: choice.Candidate,
            candidates: Sequence[choice.Candidate], scored: dict,
            fp8_skip: Optional[skip_layers.SkipAdvice], formats: Sequence[str],
            tolerance: float = DEFAULT_TOLERANCE, progress=None) -> FormatAdvice:
    """Every format in `formats` scored on the held-out `batches` (FP8 from
    the scoring kvcal-calibrate already ran: `chosen`, `scored`, `fp8_skip`)
    and the recommendation."""
    advice = FormatAdvice(tolerance=tolerance)
    for fmt in formats:
        if fmt == "fp8":
            advice.figures.append(FormatFigure("fp8", chosen.label, chosen.delta, chosen.se,
                                               _mean_error(chosen), fp8_skip, candidate=chosen))
            continue
        base = _per_tensor(chosen, candidates)
        if base is None:
            continue
        c = _fresh(base)
        ones = next((_fresh(o) for o in candidates if o.observer is None
                     and o.kv_only == c.kv_only and o.same_as is None), None)
        if c.observer is None or ones is None:
            ones = None
        run = [c] if ones is None else [ones, c]
        choice.score(model, batches, run, kv_format=fmt, reference=scored)
        skip = skip_layers.advise(model, batches, c, scored["reference"], scored["blocks"],
                                  kv_format=fmt)
        if progress:
            progress()
        advice.figures.append(FormatFigure(fmt, c.label, c.delta, c.se, _mean_error(c), skip,
                                           ones_delta=ones.delta if ones else math.nan,
                                           evaluation=c.evaluation, candidate=base))
    advice.recommended = recommend(advice.figures, tolerance)
    return advice


def _fresh(c: choice.Candidate) -> choice.Candidate:
    """A copy of `c` with nothing scored (score() fills the copy)."""
    return dataclasses.replace(c, same_as=None, evaluation=None, nll=None, delta=math.nan,
                               se=math.nan, chosen=False, best=False)


def _mean_error(c: choice.Candidate) -> float:
    import numpy as np

    if c.evaluation is None:
        return math.nan
    return float(np.asarray(c.evaluation.attention_error, dtype=np.float64).mean())
