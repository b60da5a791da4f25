"""kvcal-calibrate's output: the patched checkpoint, its `kvcal inspect`
check, the HTML report and the `vllm serve` line.

Patching (patch_checkpoint) always runs the `kvcal patch` binary:
- in place: `kvcal patch --checkpoint MODEL` (crash-safe: new files are
  staged and verified, a journal is the commit point, then renames);
- `--out DIR` on the checkpoint's file system: a copy of the checkpoint is
  made of reflinks (copy-on-write clones, where the file system has them)
  or else hard links, in a staging directory next to DIR, and patched in
  place there: the patch writes every file it changes as a new file and
  renames it over the link, so the source's files are never written (this
  is checked: every linked source file's inode, size and mtime are
  compared before and after). Then the staging directory is renamed to DIR.
  While it links, it holds a shared lock on MODEL (the protocol of
  client/checkpoint/checkpoint_lock.h: flock on MODEL/.kvcal-patch/kvcal.lock), so that
  a `kvcal patch` in place cannot change MODEL under it;
  A hard-linked DIR shares its unchanged shards with MODEL: a tool that
  later rewrites one of them in place changes both;
- `--out DIR` on another file system (links fail with EXDEV): `kvcal
  patch --out DIR`, which copies and verifies every file; the bytes copied
  are reported.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, List, Optional

from kvcal._fs import same_file
from kvcal.calibrate.model import gguf_exporter
from kvcal.calibrate.worker import find_binary

if TYPE_CHECKING:
    from kvcal.calibrate.state import Run

SKIP_NAMES = (".kvcal-calibrate", ".kvcal-patch")
# A run's lock file in a checkout being calibrated in place (calibrate/lock.py).
SKIP_FILES = (".kvcal-calibrate.lock",)
FICLONE = 0x40049409  # linux/fs.h _IOW(0x94, 9, int)


class OutputError(RuntimeError):
    pass


@dataclass
class PatchInfo:
    output_dir: str
    mode: str                      # in place | reflink | hard link | copy | gguf export
    linked_files: int = 0
    linked_bytes: int = 0
    copied_bytes: int = 0
    written_bytes: int = 0
    files_written: List[str] = field(default_factory=list)
    scale_tensors: int = 0

    def describe(self) -> str:
        wrote = ", ".join(self.files_written)
        if self.mode == "in place":
            return f"patched {self.output_dir} in place (rewrote {wrote})"
        if self.mode in ("reflink", "hard link"):
            how = "reflinked (copy-on-write)" if self.mode == "reflink" else "hard-linked"
            return (f"wrote {self.output_dir}: {self.linked_files} unchanged file(s) "
                    f"({_size(self.linked_bytes)}) {how} from the source, not copied; "
                    f"the patch rewrote {wrote}")
        if self.mode == "copy":
            return (f"wrote {self.output_dir}: another file system, so {_size(self.copied_bytes)} "
                    f"copied (and verified); the patch rewrote {wrote}")
        return (f"wrote {self.output_dir}: the GGUF model saved as safetensors "
                f"({_size(self.written_bytes)}); the patch rewrote {wrote}")


def _size(n: int) -> str:
    """'315622 bytes (308.2 KiB)'."""
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024.0
        if value < 1024 or unit == "TiB":
            return f"{n} bytes ({value:.1f} {unit})" if n >= 1024 else f"{n} bytes"
    return f"{n} bytes"


def run_tool(args: List[str], what: str, timeout: Optional[float] = None,
             defer: Optional[list] = None) -> subprocess.CompletedProcess:
    """Runs a kvcal binary to completion. A Ctrl-C while it runs waits for
    it (a patch that committed must finish its renames); then it is raised,
    or, with `defer` (a list), appended to it for the caller to raise."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    interrupted = None
    while True:
        try:
            out, err = proc.communicate(timeout=timeout)
            break
        except KeyboardInterrupt as e:
            interrupted = e
            continue
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate()
            raise OutputError(f"{what} did not finish in {timeout:.0f} s") from None
    result = subprocess.CompletedProcess(args, proc.returncode, out, err)
    if interrupted is not None:
        if defer is None:
            raise interrupted
        defer.append(interrupted)
    return result


def _tool_error(result: subprocess.CompletedProcess) -> str:
    lines = [l for l in (result.stderr or "").strip().splitlines() if l.strip()]
    return lines[-1] if lines else f"exit {result.returncode}"


def _entries(src: str):
    """(relative path, absolute source file) of every file to carry over."""
    for root, dirs, files in os.walk(src, followlinks=False):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_NAMES and not d.endswith(".kvcal-partial"))
        for name in sorted(f for f in files if f not in SKIP_FILES):
            path = os.path.join(root, name)
            yield os.path.relpath(path, src), os.path.realpath(path)


def _reflink(src: str, dst: str) -> bool:
    try:
        with open(src, "rb") as s, open(dst, "wb") as d:
            fcntl.ioctl(d.fileno(), FICLONE, s.fileno())
        return True
    except OSError:
        try:
            os.unlink(dst)
        except OSError:
            pass
        return False


@contextlib.contextmanager
def shared_lock(checkpoint: str, timeout: Optional[float]):
    """LOCK_SH on CHECKPOINT/.kvcal-patch/kvcal.lock, as a reader in
    client/checkpoint/checkpoint_lock.h's protocol: several readers share it, a writer
    (an in-place `kvcal patch`) waits for them. A read-only checkpoint
    without a lock file has no writer to fear: no lock. The last reader
    removes the lock file (and .kvcal-patch when empty)."""
    staging = os.path.join(checkpoint, ".kvcal-patch")
    path = os.path.join(staging, "kvcal.lock")
    try:
        os.mkdir(staging)
    except FileExistsError:
        pass
    except OSError as e:
        if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM) and not os.path.exists(path):
            yield None
            return
        raise OutputError(f"cannot lock {checkpoint}: {e.strerror} ({staging})") from None
    deadline = time.monotonic() + (timeout or 0.0)
    while True:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            else:
                raise OutputError(f"cannot lock {checkpoint}: {e.strerror} ({path})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if time.monotonic() >= deadline:
                raise OutputError(f"{checkpoint} is being patched by {_holder(path)}; wait for it, "
                                  f"or pass --lock-timeout SECONDS to wait") from None
            time.sleep(0.2)
            continue
        if same_file(fd, path):
            break
        os.close(fd)  # a releasing writer unlinked it: start again
    try:
        yield fd
    finally:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the last reader cleans up
            if same_file(fd, path):
                os.unlink(path)
                try:
                    os.rmdir(staging)
                except OSError:
                    pass
        except OSError:
            pass
        os.close(fd)


def _holder(path: str) -> str:
    try:
        with open(path) as f:
            line = json.loads(f.readline() or "{}")
        return f"pid {line.get('pid')} on {line.get('host')} (`{line.get('command')}`)"
    except (OSError, ValueError, AttributeError):
        return "another process"


def link_tree(src: str, dst: str):
    """Makes dst (new) a copy of src made of reflinks or hard links.
    Returns (mode, files, bytes, stats of the sources), or None when src and
    dst are on different file systems (nothing left behind)."""
    os.makedirs(dst)
    mode, files, total = None, 0, 0
    stats = {}
    try:
        for rel, real in _entries(src):
            target = os.path.join(dst, rel)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            st = os.stat(real)
            if mode in (None, "reflink") and _reflink(real, target):
                mode = "reflink"
            else:
                try:
                    os.link(real, target)
                except OSError as e:
                    if e.errno in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                        shutil.rmtree(dst, ignore_errors=True)
                        return None
                    raise
                mode = "hard link" if mode is None else mode
                if mode == "reflink":
                    mode = "reflink+hard link"
            stats[real] = (st.st_ino, st.st_size, st.st_mtime_ns)
            files += 1
            total += st.st_size
    except BaseException:
        shutil.rmtree(dst, ignore_errors=True)
        raise
    return mode or "hard link", files, total, stats


def _check_sources(stats) -> None:
    for path, (ino, size, mtime) in stats.items():
        st = os.stat(path)
        if (st.st_ino, st.st_size, st.st_mtime_ns) != (ino, size, mtime):
            raise OutputError(f"{path} changed while its link was patched; compare it with a "
                              f"backup before using it")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def patch_checkpoint(checkpoint: str, scales_path: str, *, out: Optional[str], staging: str,
                     target: str, lock_timeout: Optional[float] = None,
                     export=None, committed=None) -> PatchInfo:
    """Patches `checkpoint` in place, or writes the patched copy to `out`
    (staged in `staging`, a new path on out's file system). `export(dir)`,
    when given (a GGUF model), writes the safetensors checkpoint to start
    from instead of linking `checkpoint`. `committed()` is called once the
    output is patched; a Ctrl-C during the patch is raised after that."""
    deferred: list = []
    info = _patch(checkpoint, scales_path, out, staging, target, lock_timeout, export, deferred)
    if committed is not None:
        committed()
    if deferred:
        raise deferred[0]
    return info


def _patch(checkpoint, scales_path, out, staging, target, lock_timeout, export, deferred):
    cli = find_binary("kvcal")
    extra = ["--target", target, "--json"]
    if lock_timeout is not None:
        extra += ["--lock-timeout", f"{lock_timeout:g}"]
    if out is None:
        info = PatchInfo(checkpoint, "in place")
        result = run_tool([cli, "patch", "--checkpoint", checkpoint, "--scales", scales_path] + extra,
                          "kvcal patch", defer=deferred)
    else:
        if export is not None:
            os.makedirs(staging)
            info = PatchInfo(out, "gguf export", written_bytes=export(staging))
            stats = {}
        else:
            with shared_lock(checkpoint, lock_timeout):
                linked = link_tree(checkpoint, staging)
            if linked is None:
                copied = sum(os.path.getsize(real) for _, real in _entries(checkpoint))
                info = PatchInfo(out, "copy", copied_bytes=copied)
                result = run_tool([cli, "patch", "--checkpoint", checkpoint, "--scales", scales_path,
                                   "--out", out] + extra, "kvcal patch", defer=deferred)
                return _finish(info, result)
            mode, files, nbytes, stats = linked
            info = PatchInfo(out, mode, linked_files=files, linked_bytes=nbytes)
        result = run_tool([cli, "patch", "--checkpoint", staging, "--scales", scales_path] + extra,
                          "kvcal patch", defer=deferred)
        _check_sources(stats)
        if result.returncode == 0:
            if os.path.isdir(out):
                os.rmdir(out)  # empty (checked before the run)
            os.rename(staging, out)
            _fsync_dir(os.path.dirname(os.path.abspath(out)))
            info.output_dir = out
    info = _finish(info, result)
    if info.mode == "hard link" or info.mode.startswith("reflink"):
        # What the patch replaced was linked first, then rewritten.
        for name in info.files_written:
            source = os.path.join(checkpoint, name)
            if os.path.isfile(source):
                info.linked_files -= 1
                info.linked_bytes -= os.path.getsize(source)
    return info


def _finish(info: PatchInfo, result: subprocess.CompletedProcess) -> PatchInfo:
    if result.returncode != 0:
        raise OutputError(f"kvcal patch failed: {_tool_error(result)}")
    try:
        report = json.loads(result.stdout)
    except ValueError:
        report = {}
    report = report.get("patch", report)
    info.files_written = list(report.get("files_written", []))
    info.scale_tensors = int(report.get("scale_tensors", 0))
    return info


def inspect(checkpoint: str, target: str, kv_cache_dtype: str = "fp8") -> dict:
    """`kvcal inspect --json` of the patched checkpoint with the cache dtype
    the serve line names; OutputError when vLLM 0.34 would refuse it, drop a
    scale or use 1.0 silently."""
    cli = find_binary("kvcal")
    args = [cli, "inspect", checkpoint, "--json", "--kv-cache-dtype", kv_cache_dtype]
    result = run_tool(args, "kvcal inspect")
    try:
        report = json.loads(result.stdout)
    except ValueError:
        report = None
    if result.returncode != 0 or report is None:
        raise OutputError(f"the patched checkpoint fails `kvcal inspect {checkpoint}`: "
                          f"{_tool_error(result)}")
    return report


def write_report(path: str, target: str, session: str, evaluations: List[str],
                 token_file: Optional[str] = None, scales: Optional[str] = None,
                 decision: Optional[str] = None) -> dict:
    """`kvcal report`; `decision`: kvcal-calibrate's decision JSON, which the
    page renders as its recommendation (the report applies no rule of its
    own then)."""
    cli = find_binary("kvcal")
    args = [cli, "report", "--json", "-o", path]
    if decision:
        args += ["--decision", decision]
    if target:
        args += ["--server", target, "--session", session]
    if scales:
        args += ["--scales", scales]
    if token_file:
        args += ["--auth-token-file", token_file]
    for e in evaluations:
        args += ["--eval", e]
    result = run_tool(args, "kvcal report")
    if result.returncode != 0:
        raise OutputError(f"kvcal report failed: {_tool_error(result)}")
    try:
        return json.loads(result.stdout)
    except ValueError:
        return {}


# What vLLM 0.34 does with the query under an FP8 KV cache (read from its
# source): Attention.__init__ (model_executor/layers/attention/attention.py)
# quantizes the query with q_scale when the backend's
# supports_quant_query_input is set: FlashAttention (v1/attention/backends/
# flash_attn.py, every CUDA GPU; FA3 on Hopper), Triton (triton_attn.py, on
# CUDA) and FlashInfer only on Blackwell (flashinfer.py, SM100, unless
# attention_config.disable_flashinfer_q_quantization); FlashInfer before
# Blackwell keeps the query in 16 bits.
Q_BACKENDS = ("FLASH_ATTN (FlashAttention 2/3), TRITON_ATTN and, on Blackwell, FLASHINFER "
              "quantize the query to FP8 with q_scale; FLASHINFER before Blackwell keeps it in "
              "16 bits")


def serve_arguments(chosen, kv_format: str, target: str):
    """(the `vllm serve` arguments after the checkpoint for a quantized KV
    cache `kv_format` with the `chosen` scales, the attention backends that
    run it, notes). kvcal/calibrate/decision.py puts the line together."""
    args = ["--kv-cache-dtype", kv_format]
    notes = []
    if kv_format != "fp8":
        backends = ("FLASHINFER only (vLLM 0.34 has an NVFP4 cache there alone: trtllm-gen on "
                    "compute capability 10.x, its FA2 path on 8.x, 9.x and 12.x for nvfp4)")
        args += ["--attention-backend", "FLASHINFER"]
        notes.append(f"{kv_format} takes the per-tensor k/v scales as the layers' global scales")
    elif chosen.granularity == "head":
        args += ["--attention-backend", "FLASH_ATTN"]
        backends = "FLASH_ATTN with FlashAttention 3 (Hopper or newer) only"
        notes.append("per-head scales start only on FlashAttention 3; elsewhere vLLM stops with "
                     "\"No valid attention backend found\"")
    elif chosen.kv_only:
        args += ["--attention-backend", "FLASHINFER"]
        backends = ("FLASHINFER, which keeps the query in 16 bits before Blackwell; on Blackwell "
                    "also pass --attention-config '{\"disable_flashinfer_q_quantization\": true}'")
        notes.append("the choice is K and V in FP8 with the query unquantized: " + Q_BACKENDS)
    else:
        backends = "every FP8-capable attention backend"
        notes.append("the choice quantizes Q, K and V: " + Q_BACKENDS)
    if target == "quark":
        notes.append("Quark checkpoints need --kv-cache-dtype fp8 (vLLM does not switch by itself)")
    return args, backends, notes


def quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


def patch_and_report(run: "Run", scoring) -> SimpleNamespace:
    """The decision's scales patched into the checkpoint (in place or
    --out), inspected for the cache dtype the serve line names, and the HTML
    report written from the same decision (kvcal report --decision)."""
    decision = scoring.decision
    written = decision.written
    scales_path = os.path.join(run.work, "scales.safetensors")
    written.scales.metadata["kvcal_calibrate_choice"] = written.label
    written.scales.save(scales_path)
    export = gguf_exporter(run.lm, run) if run.gguf else None
    run.stage = "patch"
    patch = patch_checkpoint(run.directory, scales_path, out=run.out,
                                    staging=os.path.join(run.work, "checkpoint"), target=run.opts.target,
                                    lock_timeout=run.opts.lock_timeout, export=export,
                                    committed=lambda: setattr(run, "stage", "done"))
    checkpoint = patch.output_dir
    inspected = inspect(checkpoint, run.opts.target, decision.inspect_dtype)
    report_path = os.path.abspath(run.opts.report) if run.opts.report else os.path.join(checkpoint, "kvcal-report.html")
    evals = []
    for c in scoring.candidates:
        if c.same_as is not None or c.evaluation is None:
            continue
        path = os.path.join(run.work, f"eval-{len(evals)}.json")
        c.evaluation.to_json(path)
        evals.append(path)
    # The other cache formats' runs: the report's "Cache format" section.
    for f in scoring.formats.figures if scoring.formats is not None else []:
        if f.evaluation is not None:
            path = os.path.join(run.work, f"eval-{len(evals)}-{f.kv_format}.json")
            f.evaluation.to_json(path)
            evals.append(path)
    decision_path = os.path.join(run.work, "decision.json")
    with open(decision_path, "w") as f:
        json.dump(decision.view(scoring.scored["reference_nll"]), f)
    rep_target = ",".join(run.opts.server) if run.opts.server else run.worker.target
    try:
        write_report(report_path, rep_target, run.session_id, evals, run.opts.auth_token_file,
                            scales=scales_path, decision=decision_path)
    except OutputError as e:
        run.warnings.append(f"no report: {e}")
        report_path = None
    return SimpleNamespace(patch=patch, checkpoint=checkpoint, inspected=inspected,
                           report=report_path)
