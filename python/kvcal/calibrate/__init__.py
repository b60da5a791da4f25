"""kvcal.calibrate: the kvcal-calibrate command (cli.main) and
kvcal.calibrate_model, its function form; cli.py's docstring describes the
run, docs/calibrate.md is the user's guide.

The rooms, in the order a run goes through them:
- options.py: Options (one typed field per flag) and their checks;
- model.py, data.py: the model and tokenizer, the dataset and its windows;
- workdir.py, lock.py: the work directory, the resume journal, one run per
  output;
- worker.py, capture.py: the embedded worker, the session, the forwards
  under kvcal.torch.capture;
- scoring.py with choice.py (candidates and the rule that picks one),
  skip_layers.py, format_advice.py and decision.py (the one answer);
- output.py, result.py: the patched checkpoint, the report, the result;
- run.py: calibrate_model, the steps in order; backends.py, errors.py and
  ui.py serve them all.
"""
from kvcal.calibrate.cli import main
from kvcal.calibrate.errors import CalibrateError, Interrupted, UsageError
from kvcal.calibrate.options import Options
from kvcal.calibrate.result import CalibrationResult
from kvcal.calibrate.run import calibrate_model

__all__ = ["main", "calibrate_model", "CalibrationResult", "CalibrateError", "UsageError",
           "Interrupted", "Options"]
