"""kvcal-calibrate's run lock (python/kvcal/calibrate/lock.py): one run per
output directory.

- the lock file is the work directory's path + ".lock" (next to --out DIR,
  or MODEL/.kvcal-calibrate.lock in place); taking and releasing it leaves
  nothing behind, not even the parents of --out it had to make;
- a second acquisition from another process is refused at once, naming
  the holder's pid, host, start time and command line, and saying to wait
  or use another --out, never to kill anything; the refused run leaves
  nothing behind;
- a lock file whose holder died (a record and no flock, or a holder
  SIGKILLed) is taken over without a word; a holder that has not written
  its record yet is waited for briefly, then named as such;
- a releasing holder's unlink between a contender's open and flock makes
  the contender start again (it never holds an unlinked file);
- end to end: two
  real kvcal-calibrate runs on one --out: the second exits 1 at once with
  one line naming the first's pid, no traceback; the first completes.
"""
import datetime
import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

import kvcal.calibrate.workdir
from kvcal.calibrate import lock as calibrate_lock
from kvcal.calibrate.lock import LockError, RunLocked, lock_path, run_lock

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# The directory that holds kvcal/ (lock.py is kvcal/calibrate/lock.py).
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(calibrate_lock.__file__))))
LICENSES = "/usr/share/common-licenses"

# A holder in a process of its own: takes the lock (or only flocks the file
# without a record, with "bare"), says "locked", holds it until stdin closes.
HOLDER = r"""
import fcntl, json, os, sys
from kvcal.calibrate import lock as calibrate_lock
directory, out, command, mode = sys.argv[1:5]
if mode == "bare":
    fd = os.open(calibrate_lock.lock_path(directory, out or None), os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    if len(sys.argv) > 5:
        os.write(fd, sys.argv[5].encode())
else:
    lock = calibrate_lock.run_lock(directory, out or None, command=command)
print("locked", flush=True)
sys.stdin.read()
if mode != "bare":
    lock.release()
"""


def child_env():
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([PACKAGE_ROOT] + [p for p in e.get("PYTHONPATH", "").split(
        os.pathsep) if p])
    return e


class Holder:
    def __init__(self, directory, out, command="kvcal-calibrate MODEL --out DIR", mode="lock",
                 content=None):
        args = [sys.executable, "-c", HOLDER, directory, out or "", command, mode]
        if content is not None:
            args.append(content)
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=child_env())
        line = self.proc.stdout.readline()
        assert line == "locked\n", (line, self.proc.communicate())

    @property
    def pid(self):
        return self.proc.pid

    def release(self):
        out, err = self.proc.communicate(timeout=60)
        assert self.proc.returncode == 0, err
        return self.proc.returncode

    def kill(self):
        self.proc.kill()
        self.proc.communicate(timeout=60)


@pytest.fixture
def holders():
    made = []

    def make(*args, **kwargs):
        made.append(Holder(*args, **kwargs))
        return made[-1]

    yield make
    for h in made:
        if h.proc.poll() is None:
            h.kill()


def listing(root):
    """Every path under `root` (what "leaves nothing" compares)."""
    out = set()
    for d, dirs, files in os.walk(root):
        out.update(os.path.join(d, n) for n in dirs + files)
    return out


def read_record(path):
    with open(path) as f:
        return json.loads(f.readline())


def iso(started):
    return datetime.datetime.fromtimestamp(started).astimezone().isoformat(timespec="seconds")


def dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return str(d)


# -- the path ---------------------------------------------------------------------

def test_lock_path_is_the_work_directory_and_lock(tmp_path):
    model = model_dir(tmp_path)
    for out in (str(tmp_path / "out"), str(tmp_path / "out") + "/", "relative/out"):
        assert lock_path(model, out) == kvcal.calibrate.workdir.work_dir(model, out) + ".lock"
        assert os.path.dirname(lock_path(model, out)) == os.path.dirname(
            os.path.abspath(out.rstrip("/")))
    assert lock_path(model, out=None) == os.path.join(model, ".kvcal-calibrate.lock")
    assert lock_path(model, None) == kvcal.calibrate.workdir.work_dir(model, None) + ".lock"
    assert issubclass(RunLocked, LockError) and issubclass(RunLocked, RuntimeError)


# -- acquire and release ------------------------------------------------------------

def test_acquire_and_release_leave_nothing(tmp_path):
    model = model_dir(tmp_path)
    before = listing(tmp_path)
    # --out under parents that do not exist yet: made for the lock, removed with it.
    out = str(tmp_path / "new" / "deeper" / "out")
    t = time.time()
    lock = run_lock(model, out, command="kvcal-calibrate MODEL --out OUT")
    assert lock.held and lock.path == out + ".kvcal-calibrate.lock"
    assert lock.taken_over is None
    record = read_record(lock.path)
    assert record == lock.record
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    assert record["command"] == "kvcal-calibrate MODEL --out OUT"
    assert t - 1 <= record["started"] <= time.time() + 1
    with open(lock.path) as f:
        assert len(f.read().splitlines()) == 1
    # Close-on-exec: the embedded worker must not inherit the lock.
    assert fcntl.fcntl(lock._fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
    lock.release()
    assert not lock.held
    lock.release()  # idempotent
    assert listing(tmp_path) == before

    # In place, as a context manager: MODEL/.kvcal-calibrate.lock, then nothing.
    with run_lock(model, None) as lock:
        assert lock.path == os.path.join(model, ".kvcal-calibrate.lock")
        assert os.path.isfile(lock.path)
        assert read_record(lock.path)["pid"] == os.getpid()
    assert listing(tmp_path) == before


def test_parents_stay_when_the_run_wrote_into_them(tmp_path):
    out = str(tmp_path / "new" / "out")
    lock = run_lock(str(tmp_path), out)
    os.makedirs(out)                      # the run's output (or a kept work directory)
    lock.release()
    assert os.path.isdir(out) and not os.path.exists(lock.path)


def test_default_command_is_this_process(tmp_path):
    with run_lock(str(tmp_path), str(tmp_path / "out")) as lock:
        assert lock.record["command"]
        assert "\n" not in lock.record["command"] and len(lock.record["command"]) <= 403


# -- contention ----------------------------------------------------------------------

def test_a_second_process_is_refused_naming_the_holder(tmp_path, holders):
    model = model_dir(tmp_path)
    out = str(tmp_path / "sub" / "out")    # its parent made by the holder
    holder = holders(model, out, command="kvcal-calibrate MODEL --dataset d.jsonl --out OUT")
    path = lock_path(model, out)
    record = read_record(path)
    assert record["pid"] == holder.pid
    before = listing(tmp_path)

    # Refused here (another process than the holder) ...
    t = time.monotonic()
    with pytest.raises(RunLocked) as refused:
        run_lock(model, out)
    assert time.monotonic() - t < 0.5      # at once: a live, named holder is not waited for
    message = str(refused.value)
    assert refused.value.holder == record and refused.value.path == path
    assert f"pid {holder.pid} on {socket.gethostname()}" in message
    assert f"started {iso(record['started'])}" in message
    assert "`kvcal-calibrate MODEL --dataset d.jsonl --out OUT`" in message
    assert f"--out {out} is being written by another kvcal-calibrate run" in message
    assert "wait for it to finish, or use another --out" in message
    assert "kill" not in message.lower()
    assert "\n" not in message
    # ... and in a third process, the way a second kvcal-calibrate meets it.
    probe = subprocess.run(
        [sys.executable, "-c", "import sys\nfrom kvcal.calibrate import lock as L\n"
         "try:\n    L.run_lock(sys.argv[1], sys.argv[2])\nexcept L.RunLocked as e:\n"
         "    print(e)\n    sys.exit(3)\n", model, out],
        capture_output=True, text=True, env=child_env(), timeout=60)
    assert probe.returncode == 3, probe.stderr
    assert f"pid {holder.pid} on" in probe.stdout and "kill" not in probe.stdout.lower()
    # The refused runs left nothing and changed nothing, the record included.
    assert listing(tmp_path) == before
    assert read_record(path) == record

    # Released: gone, and the next run gets it.
    holder.release()
    assert not os.path.exists(path)
    with run_lock(model, out) as lock:
        assert lock.taken_over is None
        assert read_record(path)["pid"] == os.getpid()


def test_in_place_refusal_says_what_to_do(tmp_path, holders):
    model = model_dir(tmp_path)
    holder = holders(model, None, command="kvcal-calibrate MODEL --dataset d.jsonl")
    with pytest.raises(RunLocked) as refused:
        run_lock(model, None)
    message = str(refused.value)
    assert f"{model} is being calibrated in place by another kvcal-calibrate run: " \
           f"pid {holder.pid}" in message
    assert "wait for it to finish" in message and "--out DIR" in message
    assert "kill" not in message.lower()
    # An --out run of the same model is another output: not refused.
    with run_lock(model, str(tmp_path / "out")):
        pass


# -- stale locks -------------------------------------------------------------------------

def test_a_dead_runs_lock_file_is_taken_over(tmp_path):
    out = str(tmp_path / "out")
    path = lock_path(str(tmp_path), out)
    stale = {"pid": dead_pid(), "host": socket.gethostname(), "started": time.time() - 3600,
             "command": "kvcal-calibrate MODEL --out OUT"}
    with open(path, "w") as f:              # a record, no flock held
        f.write(json.dumps(stale) + "\n" + "leftover " * 50)
    t = time.monotonic()
    lock = run_lock(str(tmp_path), out)
    assert time.monotonic() - t < 0.5
    assert lock.taken_over == stale
    with open(path) as f:                   # rewritten: only the new record
        text = f.read()
    assert text.count("\n") == 1 and json.loads(text) == lock.record
    lock.release()
    assert os.listdir(tmp_path) == []


def test_a_killed_holders_lock_is_taken_over(tmp_path, holders):
    model = model_dir(tmp_path)
    holder = holders(model, None)
    holder.kill()                           # SIGKILL: no release, the file stays
    path = lock_path(model, None)
    assert os.path.exists(path)
    with run_lock(model, None) as lock:
        assert lock.taken_over["pid"] == holder.pid
    assert not os.path.exists(path)


def test_a_holder_without_a_record_is_waited_for_then_named(tmp_path, holders):
    out = str(tmp_path / "out")
    holders(str(tmp_path), out, mode="bare")   # flock held, nothing written
    t = time.monotonic()
    with pytest.raises(RunLocked) as refused:
        run_lock(str(tmp_path), out, grace=0.3)
    assert time.monotonic() - t >= 0.3
    message = str(refused.value)
    assert refused.value.holder is None
    assert "another process that has not written its name into the lock file" in message
    assert "wait for it to finish, or use another --out" in message
    assert "kill" not in message.lower()


def test_a_lock_outliving_its_run_is_named(tmp_path, holders):
    """The flock held, its record naming a process that is gone (a child
    the dead run started kept the descriptor)."""
    out = str(tmp_path / "out")
    gone = {"pid": dead_pid(), "host": socket.gethostname(), "started": time.time(),
            "command": "kvcal-calibrate MODEL --out OUT"}
    holders(str(tmp_path), out, mode="bare", content=json.dumps(gone) + "\n")
    with pytest.raises(RunLocked) as refused:
        run_lock(str(tmp_path), out, grace=0.2)
    message = str(refused.value)
    assert f"a process started by the kvcal-calibrate run pid {gone['pid']}" in message
    assert "which has exited" in message and "kill" not in message.lower()


def test_a_file_unlinked_between_open_and_flock_is_not_held(tmp_path, monkeypatch):
    """A releasing holder unlinks its file while a contender has it open:
    the contender's flock then succeeds on a file nobody else can find, so
    it must start again on a new file at the path."""
    out = str(tmp_path / "out")
    path = lock_path(str(tmp_path), out)
    real_open = calibrate_lock._open
    calls = []

    def open_then_unlinked(p):
        fd = real_open(p)
        calls.append(os.fstat(fd).st_ino)
        if len(calls) == 1:
            os.unlink(p)                     # the releasing holder's unlink
        return fd

    monkeypatch.setattr(calibrate_lock, "_open", open_then_unlinked)
    with run_lock(str(tmp_path), out) as lock:
        assert len(calls) == 2
        assert os.stat(path).st_ino == os.fstat(lock._fd).st_ino == calls[1]
        assert read_record(path)["pid"] == os.getpid()
    assert os.listdir(tmp_path) == []


def test_a_releasing_holder_is_not_reported(tmp_path, monkeypatch):
    """A holder that has unlinked its file and not yet closed it still
    holds the flock: a contender that opened the old file is refused by
    flock, and must start again on a new file instead of naming it."""
    out = str(tmp_path / "out")
    path = lock_path(str(tmp_path), out)
    releasing = run_lock(str(tmp_path), out, command="first")  # another open file description
    real_open = calibrate_lock._open
    calls = []

    def open_then_released(p):
        fd = real_open(p)
        calls.append(os.fstat(fd).st_ino)
        if len(calls) == 1:
            os.unlink(p)                     # the release's unlink; its close comes later
        return fd

    monkeypatch.setattr(calibrate_lock, "_open", open_then_released)
    with run_lock(str(tmp_path), out, command="second") as lock:
        assert len(calls) == 2 and calls[0] != calls[1]
        assert read_record(path)["command"] == "second"
        releasing.release()                  # its file is gone: closes, unlinks nothing
        assert read_record(path)["command"] == "second"
    assert os.listdir(tmp_path) == []


def test_no_symbolic_link_or_other_file_is_taken(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("precious")
    out = str(tmp_path / "out")
    os.symlink(target, lock_path(str(tmp_path), out))
    with pytest.raises(LockError, match="symbolic link"):
        run_lock(str(tmp_path), out)
    assert target.read_text() == "precious"
    os.unlink(lock_path(str(tmp_path), out))
    os.mkdir(lock_path(str(tmp_path), out))
    with pytest.raises(LockError):
        run_lock(str(tmp_path), out)


def test_a_parent_that_is_a_file_is_refused_and_nothing_left(tmp_path):
    (tmp_path / "file").write_text("")
    before = listing(tmp_path)
    with pytest.raises(LockError, match="not a directory"):
        run_lock(str(tmp_path), str(tmp_path / "file" / "sub" / "out"))
    assert listing(tmp_path) == before


# -- two real kvcal-calibrate runs on one --out ------------------------------------------

# The helpers and fixtures of test_calibrate.py (SmolLM2, GPL-3 as .jsonl).
from test_calibrate import command as calibrate_command  # noqa: E402
from test_calibrate import dataset, smollm2_dir, workers_for  # noqa: E402,F401
from test_calibrate import env as calibrate_env  # noqa: E402


def test_two_runs_on_one_out(smollm2_dir, dataset, tmp_path):
    out = str(tmp_path / "out")
    work = out + ".kvcal-calibrate"
    lock = lock_path(smollm2_dir, out)
    # (--tolerance 1: FP8 is recommended whatever 14 windows measure, so the
    # first run's end does not depend on the choice.)
    args = (smollm2_dir, "--dataset", dataset, "--samples", "16", "--seq-len", "64",
            "--observer", "static_minmax", "--kv-cache-formats", "fp8", "--tolerance", "1",
            "--out", out)
    first_log = tmp_path / "first.stderr"
    with open(first_log, "w") as err, open(tmp_path / "first.stdout", "w") as so:
        first = subprocess.Popen(calibrate_command(*args), stdout=so, stderr=err,
                                 env=calibrate_env(), start_new_session=True)
    try:
        # The first run has its work directory and its worker: where two
        # runs used to collide.
        deadline = time.monotonic() + 600
        while "started a local kvcal-worker" not in first_log.read_text():
            assert first.poll() is None, first_log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the first run did not start its worker"
            time.sleep(0.1)
        assert read_record(lock)["pid"] == first.pid
        assert workers_for(work)

        t = time.monotonic()
        second = subprocess.run(calibrate_command(*args, "--json"), capture_output=True,
                                text=True, env=calibrate_env(), timeout=300)
        took = time.monotonic() - t
        assert second.returncode == 1, second.stderr[-3000:]
        lines = [line for line in second.stderr.strip().splitlines() if line.strip()]
        assert len(lines) == 1, second.stderr
        line = lines[0]
        assert line.startswith("kvcal-calibrate: ")
        # Naming the first run proves it was refused while the first held the lock.
        assert f"pid {first.pid} on {socket.gethostname()}" in line, line
        assert "wait for it to finish, or use another --out" in line, line
        assert "kill" not in line.lower() and "Traceback" not in second.stderr
        assert json.loads(second.stdout)["ok"] is False
        assert took < 120, took            # refused at once, not after waiting

        assert first.wait(timeout=900) == 0, first_log.read_text()[-3000:]
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    # The first run completed normally: the patched copy, no work directory,
    # no worker, no lock file left.
    assert os.path.isfile(os.path.join(out, "config.json"))
    assert not os.path.exists(work) and not os.path.exists(lock)
    assert workers_for(work) == []
