"""kvcal-calibrate's run: calibrate_model() and its steps in order (the
command line is kvcal/calibrate/cli.py, whose docstring describes the
whole): options checked (options.py), model and dataset found (model.py,
data.py), the work directory claimed (workdir.py, lock.py), the worker
connected and the windows captured (capture.py), the candidates scored and
one decision made (scoring.py, choice.py, decision.py), the checkpoint
patched and the report written (output.py), then cleanup. Run is the
record every step reads and fills in."""
from __future__ import annotations

import os
import shutil
import time
from kvcal.calibrate import data, lock, output
from kvcal.calibrate.backends import granularities_of
from kvcal.calibrate.capture import connect, forwards, load_and_open_session
from kvcal.calibrate.errors import CalibrateError, Interrupted, test_seam
from kvcal.calibrate.model import (GGUF_EXPORT_DTYPE, check_config, check_context,
                                   check_quant_method, config_dict, device_and_dtype, fetch_hub,
                                   load_model, resolve_model, served_dtype)
from kvcal.calibrate.options import Checked, Options, check
from kvcal.calibrate.result import CalibrationResult
from kvcal.calibrate.scoring import score
from kvcal.calibrate.state import Run
from kvcal.calibrate.ui import Ui
from kvcal.calibrate.workdir import (Journal, check_in_place, check_out, check_resume_mode, fingerprint, inside,
                                     makedirs, remove_created, session_of, work_dir)
from kvcal.calibrate.worker import WorkerError


def calibrate_model(model: str, dataset: str, **options) -> CalibrationResult:
    """Calibrates `model` on `dataset` and patches it; see the module docs.
    options: the fields of Options (kvcal-calibrate's flags). Raises
    CalibrateError (with a one-line message) or UsageError."""
    opts = Options.of(options)
    ui = Ui(opts.quiet)
    t_start = time.monotonic()
    checked = check(opts)
    # Model, config, dataset, output: checked before anything is written.
    run, documents = prepare(model, dataset, opts, checked, ui)
    run.t_start = t_start
    try:
        _resolve(run, documents, dataset, ui)
        del documents
        try:
            return _calibrate(run, Journal(run.work), ui)
        except BaseException as e:
            _raise_after_cleanup(run, e)
    finally:
        run.lock.release()  # after the cleanup: the lock covers the whole run


def _resolve(run: "Run", documents, dataset: str, ui: Ui) -> None:
    """Device, dtype, granularities, the tokenizer and the windows, the
    session id; then the work directory is made."""
    o = run.opts
    check_context(o.seq_len, run.text_config, run.model)

    import torch

    run.device, run.dtype = device_and_dtype(torch, o.device, o.dtype)
    run.granularities, run.platform = granularities_of(torch, o.target, o.granularity, o.kv_only,
                                                       o.assume_backend)
    # FlashAttention 3 alone (per head only) quantizes the query: no K/V-only setting.
    run.kv_modes = ([True] if o.kv_only else [False] if run.granularities == ["head"]
                    else [True, False])
    run.model_dtype = served_dtype(run.text_config, run.gguf)
    run.dtype_argument = GGUF_EXPORT_DTYPE if run.gguf else None

    t = time.monotonic()
    ui.say(f"loading the tokenizer of {run.model}")
    tokenizer, run.load_weights = load_model(run.directory, run.gguf, run.device,
                                             getattr(torch, run.dtype), ui)
    run.timings["load"] = time.monotonic() - t

    t = time.monotonic()
    run.sampled = _tokenize(run, documents, tokenizer, dataset, ui)
    run.pad = data.pad_id_of(tokenizer)
    run.timings["tokenize"] = time.monotonic() - t
    keyed = {"seq_len": o.seq_len, "batch_size": o.batch_size, "dtype": run.dtype,
             "device": run.device.split(":")[0], "packing": o.packing, "seed": o.seed}
    run.fingerprint = fingerprint(run.sampled, run.text_config, keyed)
    run.session_id = session_of(run, run.previous, o.session, run.fingerprint)
    check_resume_mode(run, run.previous, o.local_statistics, run.flush_batches)
    _make_work_dir(run)


def _make_work_dir(run: "Run") -> None:
    try:
        makedirs(run.work, run.created)
    except OSError as e:
        raise CalibrateError(f"cannot create {run.work}: {e.strerror}") from None


def _tokenize(run: "Run", documents, tokenizer, dataset: str, ui: Ui) -> data.Samples:
    """The windows (calibration and held out), with a progress bar and a
    warning when the data set is shorter than asked for."""
    o, warnings = run.opts, run.warnings
    samples, seq_len = o.samples, o.seq_len
    with ui.bar(total=samples * seq_len, desc="tokenizing", unit="token", estimate=True) as bar:
        sampled = data.make_samples(documents, tokenizer, path=dataset, samples=samples,
                                    seq_len=seq_len, holdout=run.checked.holdout, seed=o.seed,
                                    packing=o.packing, holdout_given=o.holdout_samples is not None, progress=bar.update)
    if sampled.short:
        warnings.append(
            f"{dataset} gives {sampled.count} samples of up to {seq_len} tokens ({sampled.tokens} "
            f"tokens from {sampled.documents} documents); asked for {samples}: calibrating on "
            f"{len(sampled.calibration)} and holding out {len(sampled.holdout)}")
        ui.warn(warnings[-1])
    return sampled


def _raise_after_cleanup(run: "Run", e: BaseException) -> None:
    """Stops the embedded worker; removes what the run created when nothing
    worth resuming was sent; re-raises `e`, saying where the state is kept."""
    if run.worker is not None:
        run.worker.stop()
    kept = run.uploaded or bool(run.previous)
    if not kept:
        remove_created(run.created)  # nothing worth resuming: leave no trace
    if isinstance(e, KeyboardInterrupt):
        if run.stage == "done":
            raise Interrupted("interrupted after the patch committed: the checkpoint is "
                              "patched; the summary and cleanup were skipped") from None
        where = (f"; its state is kept in {run.work}: rerun with --resume to continue"
                 if kept else "")
        raise Interrupted(f"interrupted; the checkpoint is unchanged{where}") from None
    if kept and isinstance(e, (CalibrateError, data.DataError, WorkerError,
                               output.OutputError)) and run.stage != "done":
        raise type(e)(f"{e} (the run's state is kept in {run.work}: rerun with --resume "
                      f"after fixing this)") from None
    raise e


def prepare(model: str, dataset: str, opts: Options, checked: Checked, ui: Ui):
    """The model directory, its config and the dataset's documents, checked,
    and the run's work directory with what an interrupted run left there
    (run.previous): (run, documents)."""
    out, resume, server = opts.out, opts.resume, opts.server
    directory, is_hub, gguf = resolve_model(model, opts.gguf_file)
    if (is_hub or gguf) and not out:
        raise CalibrateError(f"{model}: {'a hub model' if is_hub else 'a GGUF model'} is not "
                             f"patched in place; pass --out DIR for the patched checkpoint")
    data.check_dataset(dataset)
    documents = data.read_documents(dataset)
    if not documents:
        raise data.DataError(f"{dataset} has no usable text (no non-empty documents)")
    if out:
        check_out(out)
        if not is_hub and inside(out, directory):
            raise CalibrateError(f"--out {out} is inside the model directory {directory}; "
                                 f"name a directory outside it")
    if is_hub:
        ui.say(f"fetching {model} from the Hugging Face hub")
        directory = fetch_hub(model)
    config = config_dict(directory, gguf)
    text_config = check_config(config, model)
    check_quant_method(config, opts.target, model)
    if not out:
        check_in_place(directory)
    run = Run(opts, checked, model, directory, gguf, os.path.abspath(out) if out else None,
              work_dir(directory, out), text_config=text_config)
    # One run per output, until calibrate_model returns or raises: the work
    # directory (journal, worker state, staging) is this run's alone.
    try:
        run.lock = lock.run_lock(directory, out)
    except lock.LockError as e:
        raise CalibrateError(str(e)) from None
    try:
        if out:
            check_out(out)  # again under the lock: its last holder may just have written OUT
        run.previous = previous = Journal(run.work).read_run()
        if previous and not resume:
            raise CalibrateError(f"an interrupted run left its state in {run.work} (session "
                                 f"{previous.get('session')}); add --resume to continue it, or "
                                 f"delete that directory to start over")
        if resume and not previous and not server:
            raise CalibrateError(f"nothing to resume: {run.work} holds no interrupted run of "
                                 f"{model}{' into ' + out if out else ''}")
    except BaseException:
        run.lock.release()
        raise
    return run, documents


def _calibrate(run: "Run", journal: "Journal", ui: Ui) -> CalibrationResult:
    """The run after its checks: worker and session, forwards, scoring,
    patch and report, then cleanup."""
    client, existing = connect(run, ui)
    geometry = load_and_open_session(run, journal, client, existing, ui)
    forwards(run, journal, client, existing, ui)

    run.stage = "score"
    test_seam("score")
    t = time.monotonic()
    scoring = score(run, client, geometry, ui)
    run.timings["finalize_evaluate"] = time.monotonic() - t

    t = time.monotonic()
    written = output.patch_and_report(run, scoring)
    run.timings["patch"] = time.monotonic() - t

    if not run.opts.keep_session:
        import kvcal

        try:
            client.delete(run.session_id)
        except kvcal.KvcalError:
            pass
    client.close()
    if run.worker is not None:
        run.worker.stop()
        run.worker = None
    shutil.rmtree(run.work, ignore_errors=True)
    run.timings["total"] = time.monotonic() - run.t_start
    return CalibrationResult(
        checkpoint=written.checkpoint, report=written.report, decision=scoring.decision,
        inspect=written.inspected, patch=written.patch, session=run.session_id,
        samples={"calibration": len(run.sampled.calibration), "holdout": len(run.sampled.holdout),
                 "tokens": run.sampled.tokens, "seq_len": run.opts.seq_len, "batch_size": run.opts.batch_size,
                 "documents": run.sampled.documents, "requested": run.sampled.requested},
        platform=run.platform, timings=run.timings, warnings=run.warnings,
        reference_nll=scoring.scored["reference_nll"], resumed=run.resumed)
