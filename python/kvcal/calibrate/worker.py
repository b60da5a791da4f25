"""kvcal-calibrate's embedded worker: a kvcal-worker process on a free
loopback port, owned by this process.

- Found by kvcal._binaries.find("kvcal-worker"): the binary the wheel
  carries, or a checkout's build (find_binary("kvcal") finds the CLI).
- Started with --listen 127.0.0.1:0 --port-file, its own session (setsid:
  a Ctrl-C in the terminal reaches kvcal-calibrate, which stops the worker
  itself) and a durable --state-dir, so a run that was killed can be resumed.
  On Linux the worker gets SIGTERM when kvcal-calibrate dies, even by
  SIGKILL (PR_SET_PDEATHSIG): it then writes its state and exits.
- stop(): SIGTERM (the worker writes its state dir and exits 0), SIGKILL
  after a grace period. Its pid is kept in STATE_DIR/../worker.pid while it
  runs; a resumed run waits for a previous worker that is still writing
  its state.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from typing import Optional

from kvcal._fs import pid_alive


class WorkerError(RuntimeError):
    pass


def find_binary(name: str) -> str:
    """The path of kvcal's `name` binary ("kvcal-worker" or "kvcal"), as
    kvcal._binaries.find looks for it (KVCAL_BIN_DIR, the wheel, a
    checkout's build, PATH); WorkerError saying where it looked."""
    from kvcal import _binaries

    try:
        return _binaries.find(name)
    except FileNotFoundError as e:
        raise WorkerError(" ".join(str(e).split())) from None


def _parent_death_signal():
    """preexec_fn: SIGTERM this child when its parent dies (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: the worker outlives a killed parent
        pass


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class EmbeddedWorker:
    def __init__(self, work_dir: str, backend: str = "auto"):
        self.work_dir = work_dir
        self.state_dir = os.path.join(work_dir, "worker-state")
        self.pid_file = os.path.join(work_dir, "worker.pid")
        self.log_path = os.path.join(work_dir, "worker.log")
        self.backend = backend
        self.binary = find_binary("kvcal-worker")
        self.proc: Optional[subprocess.Popen] = None
        self.port = 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait_for_previous(self, timeout: float = 60.0) -> None:
        """A worker of an earlier run on this state dir (its parent was
        killed) may still be writing its state: wait for it to exit."""
        try:
            with open(self.pid_file) as f:
                pid = int(f.read().strip() or 0)
        except (OSError, ValueError):
            return
        if pid <= 0 or not pid_alive(pid) or self.state_dir not in _cmdline(pid):
            return
        deadline = time.monotonic() + timeout
        while pid_alive(pid):
            if time.monotonic() > deadline:
                raise WorkerError(f"the worker of an earlier run (pid {pid}) still holds "
                                  f"{self.state_dir}; stop it (kill {pid}) and rerun")
            time.sleep(0.1)

    def start(self, timeout: float = 60.0) -> "EmbeddedWorker":
        os.makedirs(self.state_dir, exist_ok=True)
        self.wait_for_previous()
        port_file = os.path.join(self.work_dir, "worker.port")
        if os.path.exists(port_file):
            os.unlink(port_file)
        args = [self.binary, "--listen", "127.0.0.1:0", "--port-file", port_file,
                "--backend", self.backend, "--worker-id", "kvcal-calibrate",
                "--state-dir", self.state_dir, "--snapshot-interval-ms", "2000",
                "--shutdown-grace-ms", "5000"]
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         preexec_fn=_parent_death_signal if sys.platform.startswith("linux") else None)
        except OSError as e:
            raise WorkerError(f"cannot start {self.binary}: {e}") from None
        finally:
            log.close()
        with open(self.pid_file + ".tmp", "w") as f:
            f.write(str(self.proc.pid))
        os.replace(self.pid_file + ".tmp", self.pid_file)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise WorkerError(f"kvcal-worker exited with {self.proc.returncode} at start: "
                                  f"{self.log_tail(1)} (log: {self.log_path})")
            try:
                with open(port_file) as f:
                    text = f.read().strip()
                if text:
                    self.port = int(text)
                    return self
            except (FileNotFoundError, ValueError):
                pass
            time.sleep(0.02)
        self.stop()
        raise WorkerError(f"kvcal-worker did not report its port in {timeout:.0f} s "
                          f"(log: {self.log_path})")

    def log_tail(self, lines: int = 5) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return " | ".join(f.read().strip().splitlines()[-lines:])
        except OSError:
            return ""

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace: float = 30.0) -> Optional[int]:
        """SIGTERM (the worker writes its state dir), SIGKILL after `grace`
        seconds. Safe to call twice; returns the exit code."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            try:
                proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            except KeyboardInterrupt:  # a second Ctrl-C: do not leave it behind
                proc.kill()
                proc.wait()
                raise
        try:
            os.unlink(self.pid_file)
        except OSError:
            pass
        return proc.returncode
