"""The capture step: the worker (embedded or --server) and the session, the
calibration windows through the model under kvcal.torch.capture, streamed
to the worker, and where a resumed run starts again."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kvcal.calibrate import data
from kvcal.calibrate.errors import CalibrateError, first_line, test_seam
from kvcal.calibrate.ui import Ui
from kvcal.calibrate.worker import EmbeddedWorker
from kvcal.calibrate.workdir import Journal

if TYPE_CHECKING:
    from kvcal.calibrate.state import Run

# The producer id of kvcal-calibrate's stream (its watermark says what a
# resumed run skips).
PRODUCER = "kvcal-calibrate"


def connect(run: "Run", ui: Ui):
    """The embedded worker (or --server's) and the session's status there,
    checked before the model loads (fail fast): (client, status or None)."""
    import kvcal

    if not run.opts.server:
        run.worker = EmbeddedWorker(run.work)
        run.worker.start()
        target_addr = run.worker.target
        ui.say(f"started a local kvcal-worker on {target_addr} (state in {run.worker.state_dir})")
    else:
        target_addr = list(run.opts.server)
    try:
        client = kvcal.Client(target_addr, token=run.token)
    except ValueError as e:
        raise CalibrateError(str(e)) from None
    existing = None
    try:
        existing = client.status(run.session_id)
    except kvcal.KvcalError as e:
        if "NOT_FOUND" not in str(e):
            raise CalibrateError(f"cannot reach the kvcal worker(s) {client.target}: "
                                 f"{first_line(e)}") from None
    except ValueError as e:
        raise CalibrateError(first_line(e)) from None
    if existing is None and run.previous and not run.opts.server:
        raise CalibrateError(f"--resume: the worker state in {run.work} has no session "
                             f"{run.session_id} (it was lost); delete {run.work} to start over")
    if existing is not None and not run.opts.resume:
        raise CalibrateError(f"session {run.session_id} already exists on {client.target}; "
                             f"add --resume to continue it, or pass another --session")
    return client, existing


def load_and_open_session(run: "Run", journal: "Journal", client, existing, ui: Ui):
    """Loads the model (run.lm) and creates or attaches the session;
    from then on the work directory is worth keeping. Returns the geometry."""
    import kvcal
    from kvcal.torch.capturing import _attention_modules

    geometry = kvcal.Geometry.from_config(run.text_config)
    t = time.monotonic()
    ui.say(f"loading {run.model} ({run.dtype} on {run.device})")
    run.lm = run.load_weights()
    if not _attention_modules(run.lm):
        raise CalibrateError(f"{run.model} ({type(run.lm).__name__}) has no attention layers "
                             f"that kvcal can capture")
    run.timings["load"] += time.monotonic() - t
    try:
        if existing is None:
            client.create_session(geometry=geometry, session_id=run.session_id)
        else:
            client.attach(run.session_id)
    except (kvcal.KvcalError, ValueError) as e:
        raise CalibrateError(f"session {run.session_id} on {client.target}: {first_line(e)}") from None
    journal.write_run({"fingerprint": run.fingerprint, "session": run.session_id,
                       "server": list(run.opts.server) if run.opts.server else None, "model": run.model,
                       "local_statistics": run.opts.local_statistics,
                       "flush_batches": run.flush_batches})
    run.uploaded = True
    run.stage = "upload"
    return geometry


def resume_point(journal: "Journal", client, existing, nbatches: int):
    """(batches already on the worker, the sequence to start at or None)."""
    if existing is None:
        return 0, None
    if client.workers is not None:
        return 0, 1  # several workers: resend all, the watermarks drop duplicates
    applied = _applied(existing)
    skip, start_sequence = 0, None
    done = journal.batches()
    for b in range(nbatches):
        if b in done and done[b] <= applied:
            skip, start_sequence = b + 1, done[b] + 1
        else:
            break
    return skip, start_sequence or 1


def local_resume_point(client, existing, nbatches: int, flush_batches: int):
    """resume_point of --local-statistics: (batches already on the worker,
    the sequence to start at or None). Flush n is the producer's message n
    and covers batches [(n-1) N, n N) (N = --flush-batches; the batches are
    numbered 0, 1, ... with data in each, nothing is held out, no flush()
    or time-based flush in between, the last flush at close), so a
    watermark of w means the first w N batches are on the worker."""
    if existing is None:
        return 0, None
    if client.workers is not None:
        return 0, 1  # several workers: resend all, each drops the flushes it has
    applied = _applied(existing)
    return min(nbatches, applied * flush_batches), applied + 1


def _applied(existing) -> int:
    """The watermark of kvcal-calibrate's producer in the session (0 when
    it has none)."""
    applied = 0
    for p in existing.producers:
        if p.producer_id == PRODUCER:
            applied = p.sequence
    return applied


def forwards(run: "Run", journal: "Journal", client, existing, ui: Ui) -> None:
    """The calibration windows through the model under capture, streamed to
    the worker; each batch's last chunk sequence journaled for --resume."""
    import torch

    import kvcal
    import kvcal.torch as kvtorch
    from kvcal.torch import UnsupportedModelError

    cal = run.sampled.calibration
    nbatches = -(-len(cal) // run.opts.batch_size)
    if run.opts.local_statistics:
        skip, start_sequence = local_resume_point(client, existing, nbatches, run.flush_batches)
    else:
        skip, start_sequence = resume_point(journal, client, existing, nbatches)
    if existing is not None:
        ui.say(f"resuming session {run.session_id}: {skip} of {nbatches} batches are on the worker")
    run.resumed = {"skipped_batches": skip, "batches": nbatches} if existing is not None else None
    kwargs = {"start_sequence": start_sequence} if start_sequence else {}
    if not run.opts.server:
        # Its chunks are safe once applied (the worker writes its state when
        # stopped), and it does not come back after a crash: fail fast.
        kwargs.update(keep_until_durable=False, reconnect_timeout=10.0,
                      shared_memory=not run.opts.local_statistics)
    if run.opts.local_statistics:
        # Batches are accumulated here and sent as statistics every
        # --flush-batches and at close (docs/local-statistics.md), each
        # flush one message of the producer's sequence; no held-out window
        # goes through this producer (scoring runs here). local_async: the
        # engine runs on the producer's thread beside the forwards
        # (bench_capture.py's "kvcal local async" row).
        kwargs.update(local_statistics=True, flush_batches=run.flush_batches, local_async=True)
    t = time.monotonic()
    producer = kvcal.Producer(client, producer_id=PRODUCER, **kwargs)
    for _ in range(skip):
        producer.new_batch()
    done_before = journal.batches() if skip else {}
    try:
        with open(journal.batches_path, "w") as jf:
            for b in range(0 if run.opts.local_statistics else skip):  # (local: none journaled)
                journal.add(jf, b, done_before[b])
            with ui.bar(total=len(cal), desc="forwards", unit="sample") as bar:
                bar.update(min(len(cal), skip * run.opts.batch_size))
                with kvtorch.capture(run.lm, producer), torch.no_grad():
                    for b, batch in enumerate(data.batches(cal, run.opts.batch_size, run.pad, run.device)):
                        if b < skip:
                            continue
                        run.lm(batch.input_ids, attention_mask=batch.attention_mask,
                                use_cache=False)
                        if client.workers is None and not run.opts.local_statistics:
                            # (local statistics: the watermark alone says
                            # which batches are flushed; none is journaled)
                            journal.add(jf, b, producer.last_sequence)
                        bar.update(batch.input_ids.shape[0])
                        test_seam(f"batch-{b}")
            run.timings["forwards"] = time.monotonic() - t
            t = time.monotonic()
            _close_with_bar(producer, ui)
            run.timings["upload"] = time.monotonic() - t
    except UnsupportedModelError as e:
        producer.__exit__(type(e), e, None)
        raise CalibrateError(first_line(e)) from None
    except kvcal.ProducerError as e:
        producer.__exit__(type(e), e, None)
        if run.worker is not None and not run.worker.running():
            raise CalibrateError(f"the embedded kvcal-worker died (exit {run.worker.proc.returncode}"
                                 f"; its log: {run.worker.log_path})") from None
        raise CalibrateError(f"streaming to {client.target} failed: {first_line(e)}") from None
    except BaseException as e:
        producer.__exit__(type(e), e, None)
        raise


def _close_with_bar(producer, ui: Ui) -> None:
    """producer.close(), with a bar of the chunks acknowledged meanwhile."""
    import threading

    error: list = []

    def close():
        try:
            producer.close()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            error.append(e)

    thread = threading.Thread(target=close, name="kvcal-calibrate-close", daemon=True)
    thread.start()
    stats = producer.stats()
    total = max(1, stats.get("last_sequence", 0))
    with ui.bar(total=total, desc="upload", unit="chunk") as bar:
        shown = stats.get("acknowledged", 0)
        bar.update(min(shown, total))
        while thread.is_alive():
            thread.join(0.2)
            now = producer.stats().get("acknowledged", shown)
            if now > shown:
                bar.update(min(now, total) - min(shown, total))
                shown = now
    if error:
        raise error[0]
