"""kvcal-calibrate's run lock: one run per output.

Two kvcal-calibrate runs writing the same output would share one work
directory (its journal, its embedded worker's state dir, its staging
copy). So a run holds, for its whole length, an exclusive flock(2) on a
lock file that names the output:

- `--out DIR`:  DIR.kvcal-calibrate.lock, next to DIR (and to the work
  directory DIR.kvcal-calibrate), in DIR's parent;
- in place:     MODEL/.kvcal-calibrate.lock, next to MODEL/.kvcal-calibrate.

That is lock_path(directory, out): the work directory's path
(workdir.work_dir) + ".lock". Not inside the work directory, which is made only
after the tokenizing and removed at the end of a run, and not
MODEL/.kvcal-patch/kvcal.lock, the checkpoint lock that the run's own
`kvcal patch` takes (client/checkpoint/checkpoint_lock.h).

    lock = lock.run_lock(directory, out)   # RunLocked, LockError
    try:
        ...                                          # the whole run
    finally:
        lock.release()

or `with lock.run_lock(directory, out): ...`.

API:
- lock_path(directory, out) -> str: the lock file of a run on MODEL
  `directory` (in place when `out` is None) or into `out`.
- run_lock(directory, out, *, command=None, grace=GRACE) -> RunLock: the
  lock, taken without waiting. RunLocked (a LockError) when a live run
  holds it: its message is one line naming the holder (pid, host, start
  time, command line) and what to do (wait for it, or another --out);
  LockError when the lock file cannot be made (its message names it).
- RunLock: .path; .record (what this run wrote: pid, host, started,
  command); .taken_over (the record of a run that died holding the lock,
  or None); .held; .release() (idempotent) and the context manager.

The protocol (as checkpoint_lock.h's, for a writer):
1. make the lock file's parent directories that are missing (only
   --out's can be: _check_out allows a new parent); they are removed again
   on release when empty (a run that wrote DIR, or kept its work directory
   for --resume, leaves them), and at once when the lock is refused;
2. open the lock file with O_CREAT, no symbolic links, close-on-exec (the
   embedded worker must not inherit it);
3. flock(LOCK_EX | LOCK_NB): held by another: read its holder record and
   refuse (RunLocked). A holder that has just taken the lock and not yet
   written its record, or whose record names a process that is gone (a new
   holder about to write its own), is given `grace` seconds to write it; a
   file no longer at the path is a releasing holder's: start again;
4. once locked, the path must still name the locked file (a releasing
   holder unlinks it while it holds the lock): if not, close and start
   again;
5. truncate and write the holder record, one JSON line {"pid", "host",
   "started" (Unix time), "command"}; run; then unlink the lock file while
   still holding it, close, remove the parents made in 1.

The kernel drops the lock when its holder dies (SIGKILL, a crash), so the
file a dead run left is simply taken over: nothing waits, nothing tells the
user to stop a process; .taken_over says whose it was. A refused run leaves
nothing behind and never touches the holder's work directory.
"""
from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import shlex
import socket
import stat
import sys
import time
from typing import List, Optional

from kvcal._fs import pid_alive, same_file

IN_PLACE_NAME = ".kvcal-calibrate.lock"   # MODEL/.kvcal-calibrate.lock
OUT_SUFFIX = ".kvcal-calibrate.lock"      # DIR.kvcal-calibrate.lock
GRACE = 1.0        # seconds a new holder gets to write its record
_RECORD_BYTES = 8192
_COMMAND_CHARS = 400


class LockError(RuntimeError):
    """The run lock cannot be taken; the message is one line."""


class RunLocked(LockError):
    """Another run holds the lock: `holder` is its record (None when it
    wrote none that parses), `path` the lock file."""

    def __init__(self, message: str, path: str, holder: Optional[dict]):
        super().__init__(message)
        self.path = path
        self.holder = holder


def lock_path(directory: str, out: Optional[str]) -> str:
    """The lock file of a run on MODEL `directory` into `out` (None: in
    place); workdir.work_dir(directory, out) + ".lock"."""
    if out:
        return os.path.abspath(out).rstrip("/") + OUT_SUFFIX
    return os.path.join(directory, IN_PLACE_NAME)


class RunLock:
    """A held run lock (run_lock() makes it)."""

    def __init__(self, path: str, fd: int, record: dict, taken_over: Optional[dict],
                 created: List[str]):
        self.path = path
        self.record = record
        self.taken_over = taken_over
        self._fd: Optional[int] = fd
        self._created = created
        self._owner = os.getpid()

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Unlinks the lock file (still holding the lock, so that no run can
        take the old file meanwhile), closes it, removes the parent
        directories that acquiring made when they are empty. Idempotent. In
        a forked child it only closes its copy of the descriptor."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if os.getpid() == self._owner and same_file(fd, self.path):
                os.unlink(self.path)
        except OSError:
            pass
        finally:
            os.close(fd)
        if os.getpid() == self._owner:
            _remove_dirs(self._created)

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"RunLock({self.path!r}, held={self.held})"


def run_lock(directory: str, out: Optional[str], *, command: Optional[str] = None,
             grace: float = GRACE) -> RunLock:
    """Takes the run lock of lock_path(directory, out) without waiting (see
    the module docs); `command` is the command line the holder record
    names (default: this process's)."""
    path = lock_path(directory, out)
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
              "command": _clean(command if command is not None else _command_line(),
                                _COMMAND_CHARS)}
    created: List[str] = []
    try:
        return _acquire(path, out, directory, record, created, grace)
    except BaseException:
        _remove_dirs(created)
        raise


def _acquire(path, out, directory, record, created, grace) -> RunLock:
    grace_end = time.monotonic() + max(0.0, grace)
    vanished = 0   # opens that found the file (or its directory) removed meanwhile
    while True:
        if vanished > 1000:
            raise LockError(f"cannot take the run lock {path}: it keeps being removed")
        _make_parents(os.path.dirname(path), created, path)
        fd = _open(path)
        if fd is None:
            vanished += 1
            continue  # removed meanwhile (a releasing holder): again
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not same_file(fd, path):
                    # Its holder is releasing it (unlinked, not yet closed): again.
                    os.close(fd)
                    fd = -1
                    vanished += 1
                    time.sleep(0.001)
                    continue
                holder = _read_record(fd)
                if (holder is not None and not _gone(holder)) or time.monotonic() >= grace_end:
                    raise RunLocked(_locked_message(path, out, directory, holder, fd),
                                    path, holder) from None
                os.close(fd)
                fd = -1
                time.sleep(0.02)
                continue
            except OSError as e:
                raise LockError(f"cannot lock {path}: {e.strerror}") from None
            if not same_file(fd, path):
                os.close(fd)  # a releasing holder unlinked it: start again
                fd = -1
                vanished += 1
                continue
            previous = _read_record(fd)
            _write_record(fd, path, record)
            lock = RunLock(path, fd, record, previous, created)
            fd = -1
            return lock
        finally:
            if fd >= 0:
                os.close(fd)


def _make_parents(parent: str, created: List[str], path: str) -> None:
    """mkdir of the missing directories down to `parent`, appended to
    `created` (a run racing to make the same directory is fine)."""
    missing = []
    p = os.path.abspath(parent)
    while not os.path.isdir(p):
        if os.path.lexists(p):
            raise LockError(f"cannot make the run lock {path}: {p} is not a directory")
        missing.append(p)
        up = os.path.dirname(p)
        if up == p:
            break
        p = up
    for d in reversed(missing):
        try:
            os.mkdir(d)
        except FileExistsError:
            continue
        except OSError as e:
            raise LockError(f"cannot make the run lock {path}: {e.strerror} ({d})") from None
        created.append(d)


def _remove_dirs(created: List[str]) -> None:
    """rmdir of `created`, deepest first; a directory that is not empty
    (the run's output, a kept work directory, another run's lock) stays."""
    for d in reversed(created):
        try:
            os.rmdir(d)
        except OSError:
            pass
    del created[:]


def _open(path: str) -> Optional[int]:
    """The lock file, opened (made when missing); None when it or its
    directory vanished meanwhile."""
    flags = os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, os.O_RDWR | flags, 0o644)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise LockError(f"cannot take the run lock {path}: it is a symbolic link (the run "
                            f"lock is a plain file: remove it)") from None
        if e.errno in (errno.EACCES, errno.EPERM) and os.path.exists(path):
            try:  # another user's lock file: readable, to name its holder
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            except OSError:
                raise LockError(f"cannot take the run lock {path}: {e.strerror}") from None
            return _check_regular(fd, path)
        raise LockError(f"cannot make the run lock {path}: {e.strerror}") from None
    return _check_regular(fd, path)


def _check_regular(fd: int, path: str) -> int:
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise LockError(f"cannot take the run lock {path}: it is not a regular file (the run "
                        f"lock is a plain file: remove it)")
    return fd


def _write_record(fd: int, path: str, record: dict) -> None:
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
        # Another user's file (opened read-only to name its holder); no run holds it.
        raise LockError(f"cannot take over the run lock {path}: a run of another user left it "
                        f"and no run holds it now; remove it")
    line = (json.dumps(record) + "\n").encode()
    try:
        os.ftruncate(fd, 0)
        if os.pwrite(fd, line, 0) != len(line):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except OSError as e:
        raise LockError(f"cannot write the run lock {path}: {e.strerror}") from None


def _read_record(fd: int) -> Optional[dict]:
    """The holder record the file holds, or None (empty, torn, not ours)."""
    try:
        text = os.pread(fd, _RECORD_BYTES, 0).decode(errors="replace")
        record = json.loads(text.splitlines()[0]) if text.strip() else None
    except (OSError, ValueError, IndexError):
        return None
    if not isinstance(record, dict) or type(record.get("pid")) is not int:
        return None
    return record


def _raw(fd: int) -> str:
    try:
        return _clean(os.pread(fd, 200, 0).decode(errors="replace"), 80)
    except OSError:
        return ""


def _gone(record: dict) -> bool:
    """True when the record names a process of this host that has exited."""
    if record.get("host") != socket.gethostname() or record["pid"] <= 0:
        return False
    return not pid_alive(record["pid"])


def describe(record: dict) -> str:
    """'pid 123 on HOST, started 2026-05-01T10:11:12+02:00 (`COMMAND`)'."""
    started = record.get("started")
    try:
        when = datetime.datetime.fromtimestamp(float(started)).astimezone() \
            .isoformat(timespec="seconds")
    except (TypeError, ValueError, OverflowError, OSError):
        when = "at an unknown time"
    else:
        when = f"started {when}"
    host = _clean(str(record.get("host") or "?"), 100)
    command = _clean(str(record.get("command") or "?"), _COMMAND_CHARS)
    return f"pid {record['pid']} on {host}, {when} (`{command}`)"


def _locked_message(path: str, out: Optional[str], directory: str, holder: Optional[dict],
                    fd: int) -> str:
    if out:
        what = f"--out {os.path.abspath(out)} is being written by"
        todo = "wait for it to finish, or use another --out"
    else:
        what = f"{directory} is being calibrated in place by"
        todo = "wait for it to finish, or pass --out DIR to write a patched copy instead"
    if holder is None:
        raw = _raw(fd)
        who = ("another process that has not written its name into the lock file"
               if not raw else f"a process unknown to kvcal-calibrate (the lock file holds "
                               f"\"{raw}\")")
    elif _gone(holder):
        # The lock outlived its run: a process that run started inherited it.
        who = (f"a process started by the kvcal-calibrate run {describe(holder)}, which has "
               f"exited")
    else:
        who = f"another kvcal-calibrate run: {describe(holder)}"
    return f"{what} {who}; {todo} (lock file {path})"


def _command_line() -> str:
    argv = list(sys.argv) if sys.argv and sys.argv[0] not in ("", "-c", "-m") else []
    if argv:
        if argv[0].endswith(os.path.join("kvcal", "calibrate", "__main__.py")):
            argv[:1] = ["python", "-m", "kvcal.calibrate"]  # how it was started
        return shlex.join(argv)
    try:
        with open("/proc/self/cmdline", "rb") as f:
            parts = [p.decode(errors="replace") for p in f.read().split(b"\0") if p]
        return shlex.join(parts) if parts else sys.executable
    except OSError:
        return sys.executable or "?"


def _clean(text: str, limit: int) -> str:
    """One printable line of at most `limit` characters."""
    text = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    return text if len(text) <= limit else text[:limit] + "..."
