"""The scoring step: every candidate finalized and scored on the held-out
windows, the choice, the skip-layer advice and the cache formats, made one
Decision."""
from __future__ import annotations

import os
from types import SimpleNamespace
from typing import TYPE_CHECKING

from kvcal.calibrate import choice, data, format_advice, skip_layers
from kvcal.calibrate.decision import decide
from kvcal.calibrate.errors import CalibrateError, first_line
from kvcal.calibrate.ui import Ui

if TYPE_CHECKING:
    from kvcal.calibrate.state import Run


def score(run: "Run", client, geometry, ui: Ui) -> SimpleNamespace:
    """Every candidate finalized and scored on the held-out windows, the
    choice and the skip-layer advice for it."""
    import kvcal


    def finalize(obs, gran):
        try:
            return client.finalize(observer=obs, granularity=gran)
        except kvcal.KvcalError as e:
            raise CalibrateError(f"finalize {obs} per {gran}: {first_line(e)}") from None

    candidates = choice.build_candidates(finalize, geometry, run.observers, run.granularities, run.kv_modes)
    held = list(data.batches(run.sampled.holdout, run.opts.batch_size, run.pad, run.device))
    runs = 1 + sum(1 for c in candidates if c.same_as is None)
    with ui.bar(total=runs, desc="scoring on held-out", unit="run") as bar:
        scored = choice.score(run.lm, held, candidates, progress=lambda: bar.update(1))
    chosen = choice.choose(candidates, scored["blocks"])
    # Skip-layer advice for the chosen setting: one more held-out pass when
    # a layer's attention error is an outlier (kvcal/calibrate/skip_layers.py).
    skip = skip_layers.advise(run.lm, held, chosen, scored["reference"], scored["blocks"])
    others = [f for f in run.formats if f != "fp8"]
    with ui.bar(total=len(others), desc="scoring cache formats", unit="format") as bar:
        formats = format_advice.compare(run.lm, held, chosen, candidates, scored, skip,
                                        run.formats, run.opts.tolerance, progress=lambda: bar.update(1))
    if run.opts.scales_dir:
        _save_candidates(run.opts.scales_dir, candidates)
    decision = decide(
        chosen, candidates, scored["blocks"], choice.why(chosen, candidates, scored["blocks"]),
        skip, formats, checkpoint=run.out or run.directory, target=run.opts.target,
        model_dtype=run.model_dtype, windows=len(run.sampled.holdout), tokens=scored["tokens"],
        tolerance=run.opts.tolerance, dtype_argument=run.dtype_argument)
    return SimpleNamespace(candidates=candidates, scored=scored, chosen=chosen, skip=skip,
                           formats=formats, decision=decision)


def _save_candidates(directory: str, candidates) -> None:
    """Every distinct candidate's scales file into `directory`."""
    os.makedirs(directory, exist_ok=True)
    seen = set()
    for c in candidates:
        name = (f"{c.origin.replace(' ', '-')}-{c.observer or 'one'}-{c.granularity}"
                f".safetensors").replace("scale-1.0-one-one", "scale-1.0")
        if c.scales is None or name in seen:
            continue
        seen.add(name)
        c.scales.save(os.path.join(directory, name))
