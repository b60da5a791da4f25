"""The run's work directory (MODEL/.kvcal-calibrate or OUT.kvcal-calibrate):
creating and removing what a run made, the checks on --out, the samples'
fingerprint, and the resume journal."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import TYPE_CHECKING, Dict, List, Optional

from kvcal.calibrate import data
from kvcal.calibrate.errors import CalibrateError

if TYPE_CHECKING:
    from kvcal.calibrate.state import Run


def work_dir(directory: str, out: Optional[str]) -> str:
    if out:
        return os.path.abspath(out).rstrip("/") + ".kvcal-calibrate"
    return os.path.join(directory, ".kvcal-calibrate")


def makedirs(path: str, created: List[str]) -> None:
    missing = []
    p = os.path.abspath(path)
    while not os.path.exists(p):
        missing.append(p)
        p = os.path.dirname(p)
    for d in reversed(missing):
        os.mkdir(d)
        created.append(d)


def remove_created(created: List[str]) -> None:
    for d in reversed(created):
        shutil.rmtree(d, ignore_errors=True)
    del created[:]


def check_out(out: str) -> None:
    """--out must be new (or an empty directory) and creatable; probed by
    creating and removing a directory, nothing is left."""
    out = os.path.abspath(out)
    if os.path.exists(out):
        if not os.path.isdir(out):
            raise CalibrateError(f"--out {out} exists and is not a directory")
        if os.listdir(out):
            raise CalibrateError(f"--out {out} exists and is not empty; name a new directory")
    created: List[str] = []
    probe = out.rstrip("/") + f".kvcal-probe-{os.getpid()}"
    try:
        makedirs(probe, created)
    except OSError as e:
        raise CalibrateError(f"cannot write --out {out}: {e.strerror} "
                             f"({e.filename or os.path.dirname(out)}); choose a writable "
                             f"directory") from None
    finally:
        remove_created(created)


def inside(path: str, directory: str) -> bool:
    path, directory = os.path.realpath(path), os.path.realpath(directory)
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def check_in_place(directory: str) -> None:
    probe = os.path.join(directory, f".kvcal-probe-{os.getpid()}")
    try:
        os.mkdir(probe)
        os.rmdir(probe)
    except OSError as e:
        raise CalibrateError(f"cannot write into {directory} to patch it in place ({e.strerror}); "
                             f"pass --out DIR for a patched copy") from None


def fingerprint(samples: data.Samples, config: dict, options: dict) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({k: config.get(k) for k in sorted(config) if k != "quantization_config"},
                        sort_keys=True, default=str).encode())
    h.update(json.dumps(options, sort_keys=True).encode())
    for part in (samples.holdout, samples.calibration):
        h.update(b"|")
        for w in part:
            h.update(len(w).to_bytes(4, "little"))
            h.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in w))
    return h.hexdigest()


class Journal:
    """RUN.json (what the run is) and batches.jsonl (after each forward:
    the batch and the producer's last chunk sequence)."""

    def __init__(self, work: str):
        self.run_path = os.path.join(work, "run.json")
        self.batches_path = os.path.join(work, "batches.jsonl")

    def read_run(self) -> Optional[dict]:
        try:
            with open(self.run_path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def write_run(self, run: dict) -> None:
        tmp = self.run_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(run, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.run_path)

    def batches(self) -> Dict[int, int]:
        out: Dict[int, int] = {}
        try:
            with open(self.batches_path) as f:
                for line in f:
                    try:
                        entry = json.loads(line)
                        out[int(entry["batch"])] = int(entry["sequence"])
                    except (ValueError, KeyError, TypeError):
                        break  # a torn last line
        except OSError:
            pass
        return out

    def add(self, f, batch: int, sequence: int) -> None:
        f.write(json.dumps({"batch": batch, "sequence": sequence}) + "\n")
        f.flush()


def check_resume_mode(run: "Run", previous: Optional[dict], local_statistics: bool,
                       flush_batches: Optional[int]) -> None:
    """--resume continues in the mode the interrupted run streamed in: its
    watermark counts chunks in-band and flushes of --flush-batches batches
    with --local-statistics, so another mode or another N would skip the
    wrong batches."""
    if not previous:
        return
    before = bool(previous.get("local_statistics", False))
    if before != bool(local_statistics):
        raise CalibrateError(
            f"--resume: the interrupted run in {run.work} ran "
            f"{'with' if before else 'without'} --local-statistics; rerun it the same way, or "
            f"delete that directory to start over")
    if before and previous.get("flush_batches") != flush_batches:
        raise CalibrateError(
            f"--resume: the interrupted run in {run.work} flushed every "
            f"{previous.get('flush_batches')} batches, not {flush_batches}; rerun it with "
            f"--flush-batches {previous.get('flush_batches')}, or delete that directory to start "
            f"over")


def session_of(run, previous, session, fingerprint) -> str:
    """The session id: the interrupted run's (which must have the same
    samples), --session, or one named after the samples' fingerprint."""
    if previous and previous.get("fingerprint") != fingerprint:
        raise CalibrateError(f"--resume: the samples differ from the interrupted run's in "
                             f"{run.work} (another dataset, --samples, --seq-len, --seed, "
                             f"--batch-size, --dtype or device); rerun it the same way, or delete "
                             f"that directory to start over")
    if previous and session and previous.get("session") != session:
        raise CalibrateError(f"--session {session}: the interrupted run in {run.work} used "
                             f"session {previous.get('session')}")
    if previous:
        return previous["session"]
    return session or f"kvcal-calibrate-{fingerprint[:16]}"
