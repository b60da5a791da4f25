"""CalibrationResult: what calibrate_model returns, and its --json form."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from kvcal.calibrate import choice, format_advice, output, skip_layers
from kvcal.calibrate.decision import Decision


@dataclass
class CalibrationResult:
    """A finished run: `decision` is the one answer (calibrate/decision.py)
    that the summary, to_dict() (`--json`), the report and the checkpoint
    all render."""
    checkpoint: str                       # the patched checkpoint directory
    report: Optional[str]
    decision: Decision
    inspect: dict
    patch: output.PatchInfo
    session: str
    samples: dict
    platform: str
    timings: Dict[str, float] = field(default_factory=dict)
    warnings: List[str] = field(default_factory=list)
    reference_nll: float = math.nan
    resumed: Optional[dict] = None        # {"skipped_batches", "batches"} after --resume

    @property
    def chosen(self) -> choice.Candidate:
        return self.decision.chosen

    @property
    def candidates(self) -> List[choice.Candidate]:
        return self.decision.candidates

    @property
    def serve(self) -> dict:
        return self.decision.serve

    @property
    def why(self) -> str:
        return self.decision.why

    @property
    def skip(self) -> Optional[skip_layers.SkipAdvice]:
        return self.decision.skip

    @property
    def formats(self) -> Optional[format_advice.FormatAdvice]:
        return self.decision.formats

    @property
    def holdout_tokens(self) -> int:
        return self.decision.noise.tokens

    @property
    def scale_one(self) -> choice.Candidate:
        return next(c for c in self.candidates
                    if c.observer is None and c.kv_only == self.chosen.kv_only)

    def to_dict(self) -> dict:
        ones = self.scale_one
        out = {
            "ok": True, "checkpoint": self.checkpoint, "report": self.report,
            "session": self.session, "chosen": self.chosen.to_dict(),
            "why": self.why,
            "versus_scale_one": {"delta_nll": _num(self.chosen.delta - ones.delta),
                                 "attention_error": _num(self.chosen.attention_error),
                                 "attention_error_scale_one": _num(ones.attention_error)},
            "serve": self.serve, "platform": self.platform,
            "patch": vars(self.patch), "inspect": inspect_summary(self.inspect),
            "samples": self.samples, "timings": {k: round(v, 3) for k, v in self.timings.items()},
            "warnings": self.warnings, "resumed": self.resumed,
        }
        out.update(self.decision.view(self.reference_nll))
        return out


def _num(x):
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


def inspect_summary(report: dict) -> dict:
    v = report.get("vllm", report) if isinstance(report, dict) else {}
    return {k: v.get(k) for k in ("starts", "clean", "kv_cache_dtype", "per_head", "backends",
                                  "refusals", "silent", "notes") if k in v}
