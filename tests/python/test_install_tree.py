"""Installing the package from a checkout leaves the checkout as it was, and
the stubs a build generates ask for no newer grpcio or protobuf than the
package declares (issue 31, "A source tree that installing does not
change").

`pip install ./python` used to regenerate python/kvcal/v1/*_pb2*.py inside
the source tree with whatever grpcio-tools pip's isolated build fetched
(1.85.4), and the checkout's .venv (grpcio 1.85.3) then failed on import
from the source tree: "the generated code ... depends on grpcio>=1.85.4".
Now setup.py generates into a temporary directory and copies into the
build, declares grpcio>= and protobuf>= the versions the generated code
checks, and pyproject.toml pins the isolated build's grpcio-tools to the
repository's; a source tree's own imports generate their stubs into a cache
outside the tree (kvcal._stubgen.checkout_stubs()).

- test_pip_install_leaves_the_tree_unchanged: a real isolated build from
  PyPI (`pip install --no-deps <checkout>/python` into a fresh venv, with
  bytecode writing on, as a user's shell has it): `git status --porcelain
  --ignored python/` is identical before and after, and so is every ignored
  file under python/ (listed one by one, with size, mtime and sha256);
  afterwards the checkout's .venv imports kvcal and
  kvcal.v1.calibration_pb2_grpc, installed and from the source tree, and the
  fresh install imports with the checkout environment's grpcio and protobuf
  (read through a .pth file); its metadata declares exactly the floors its
  stubs check. Skips when PyPI cannot be reached, unless CI=true (~20 s).
- the rest runs offline in a second or two: the grpcio-tools pins agree
  and the lock's grpcio and protobuf meet the floors of the stubs that
  grpcio-tools generates; a copy of the source tree imports stubs from the
  cache, not the (bogus) ones left in its kvcal/v1; without grpcio-tools
  (an editable install) the cached copy the environment's grpcio accepts is
  used, never a newer one.

The other engineers' edits to python/ while the install test runs would
show as a difference too (it compares the whole of python/'s status).
"""
import hashlib
import os
import re
import shutil
import subprocess
import sys
import urllib.request

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PYTHON_DIR = os.path.join(ROOT, "python")
TIMEOUT = 300
# The checkout's test environment (tests/python/run_python_tests.sh).
VENV_PY = os.path.join(ROOT, ".venv", "bin", "python")
CHECKOUT_PY = VENV_PY if os.path.exists(VENV_PY) else sys.executable


def _source_stubgen():
    """kvcal/_stubgen.py of this checkout (the tests otherwise import the
    installed package)."""
    import importlib.util

    path = os.path.join(PYTHON_DIR, "kvcal", "_stubgen.py")
    spec = importlib.util.spec_from_file_location("kvcal_source_stubgen_tree", path)
    module = importlib.util.module_from_spec(spec)
    write_bytecode, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:  # no python/kvcal/__pycache__ of this test in the tree
        spec.loader.exec_module(module)
    finally:
        sys.dont_write_bytecode = write_bytecode
    return module


def _clean_env(**extra):
    """No checkout path for Python, no virtual environment of the caller."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "KVCAL_STUB_CACHE",
                        "KVCAL_PROTO_DIR")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    env.update(extra)
    return env


def _pins(path):
    """{name: version} of the `name==version` lines of a requirements file."""
    pins = {}
    with open(path) as f:
        for line in f:
            found = re.match(r"^\s*([A-Za-z0-9_.-]+)==([^\s#;]+)", line)
            if found:
                pins[found.group(1).lower()] = found.group(2)
    return pins


def _version_tuple(text):
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def _build_requires():
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        tomllib = None
    path = os.path.join(PYTHON_DIR, "pyproject.toml")
    if tomllib:
        with open(path, "rb") as f:
            return tomllib.load(f)["build-system"]["requires"]
    with open(path) as f:
        block = re.search(r"^requires = \[(.*?)\]", f.read(), re.S | re.M).group(1)
    return re.findall(r'"([^"]+)"', block)


def test_grpcio_tools_pins_agree_and_the_lock_meets_the_floors(tmp_path):
    """The isolated build's grpcio-tools (pyproject.toml, for this Python)
    is the one of requirements.lock and wheel-build-requirements.txt, and the
    grpcio and protobuf pinned there satisfy what its stubs check: every
    build of the checkout imports in the checkout's own environments."""
    requires = _build_requires()
    tools = [r for r in requires if r.replace(" ", "").startswith("grpcio-tools==")]
    assert tools, f"pyproject.toml's build requirements pin no grpcio-tools: {requires}"
    current = [r for r in tools if "python_version >= '3.10'" in r]
    assert len(current) == 1, tools
    pinned = current[0].split("==", 1)[1].split(";")[0].strip()
    lock = _pins(os.path.join(ROOT, "tests", "python", "requirements.lock"))
    wheel_tools = _pins(os.path.join(PYTHON_DIR, "wheel-build-requirements.txt"))
    test_req = _pins(os.path.join(ROOT, "tests", "python", "requirements.txt"))
    assert lock["grpcio-tools"] == pinned, (lock["grpcio-tools"], pinned)
    assert wheel_tools["grpcio-tools"] == pinned, (wheel_tools["grpcio-tools"], pinned)
    assert test_req["grpcio-tools"] == pinned, (test_req["grpcio-tools"], pinned)

    # The floors of what that grpcio-tools generates (this environment's
    # grpcio-tools must be the pinned one for the comparison to hold).
    from importlib import metadata

    if metadata.version("grpcio-tools") != pinned:
        pytest.skip(f"this environment has grpcio-tools {metadata.version('grpcio-tools')}, "
                    f"not the pinned {pinned}")
    stubgen = _source_stubgen()
    v1 = tmp_path / "kvcal" / "v1"
    stubgen.generate(str(v1))
    grpc_req, pb_req = stubgen.generated_requirements(str(v1))
    assert grpc_req == f"grpcio>={pinned}", grpc_req
    code = (v1 / "calibration_pb2_grpc.py").read_text()
    assert f"GRPC_GENERATED_VERSION = '{pinned}'" in code
    pb_floor = re.match(r"protobuf>=([\d.]+),<(\d+)$", pb_req)
    assert pb_floor, pb_req
    for env in (lock, wheel_tools):
        assert _version_tuple(env["grpcio"]) >= _version_tuple(pinned), env["grpcio"]
        assert _version_tuple(pb_floor.group(1)) <= _version_tuple(env["protobuf"]) \
            < (int(pb_floor.group(2)),), (pb_req, env["protobuf"])


def test_source_tree_imports_stubs_from_the_cache(tmp_path):
    """A copy of the source tree (python/ and proto/) on PYTHONPATH: kvcal.v1
    generates its stubs under KVCAL_STUB_CACHE and imports them from there,
    never the ones left in the tree's kvcal/v1 (bogus here: an older build's
    leftovers, possibly from another grpcio-tools), and writes nothing
    there."""
    tree = tmp_path / "tree"
    shutil.copytree(PYTHON_DIR, tree / "python",
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__",
                                                  "calibration_pb2*"))
    shutil.copytree(os.path.join(ROOT, "proto"), tree / "proto")
    v1 = tree / "python" / "kvcal" / "v1"
    for name in ("calibration_pb2.py", "calibration_pb2_grpc.py"):
        (v1 / name).write_text("raise RuntimeError('the stale stubs in the tree were imported')\n")
    before = sorted(os.listdir(v1))
    cache = tmp_path / "cache"
    code = ("import json, kvcal.v1, kvcal.client\n"
            "from kvcal.v1 import calibration_pb2, calibration_pb2_grpc\n"
            "print(json.dumps([calibration_pb2.__file__, calibration_pb2_grpc.__file__,\n"
            "  hasattr(calibration_pb2_grpc, 'CalibrationStub')]))\n")
    env = _clean_env(PYTHONPATH=str(tree / "python"), KVCAL_STUB_CACHE=str(cache),
                     PYTHONDONTWRITEBYTECODE="1")
    for _ in range(2):  # generated, then found
        proc = subprocess.run([CHECKOUT_PY, "-c", code], capture_output=True, text=True,
                              timeout=TIMEOUT, env=env, cwd=str(tmp_path))
        assert proc.returncode == 0, proc.stderr[-4000:]
        import json

        pb2, pb2_grpc, has_stub = json.loads(proc.stdout)
        assert pb2.startswith(str(cache) + os.sep) and pb2_grpc.startswith(str(cache) + os.sep)
        assert has_stub
    assert sorted(os.listdir(v1)) == before
    (entry,) = os.listdir(cache)
    assert "-grpcio-tools-" in entry


def test_without_grpcio_tools_a_compatible_cached_copy_is_used(tmp_path, monkeypatch):
    """An editable install has no grpcio-tools at run time: setup.py put its
    build's stubs in the cache (seed_cache) and checkout_stubs() takes the
    newest cached copy of this proto whose checks this environment's grpcio
    and protobuf pass, never one that asks for a newer grpcio."""
    stubgen = _source_stubgen()
    monkeypatch.setenv("KVCAL_STUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("KVCAL_PROTO_DIR", raising=False)
    built = tmp_path / "built" / "kvcal" / "v1"
    stubgen.generate(str(built))
    tools = stubgen.tools_version()
    seeded = stubgen.seed_cache(str(built), tools)
    assert seeded.startswith(str(tmp_path / "cache") + os.sep)
    newer = tmp_path / "newer" / "kvcal" / "v1"
    shutil.copytree(built, newer)
    code = (newer / "calibration_pb2_grpc.py").read_text()
    (newer / "calibration_pb2_grpc.py").write_text(
        code.replace(f"GRPC_GENERATED_VERSION = '{tools}'", "GRPC_GENERATED_VERSION = '99.0.0'"))
    stubgen.seed_cache(str(newer), "99.0.0")

    def no_tools():
        raise ImportError("grpcio-tools is not installed")

    monkeypatch.setattr(stubgen, "tools_version", no_tools)
    assert stubgen.checkout_stubs() == seeded
    shutil.rmtree(os.path.dirname(os.path.dirname(seeded)))
    with pytest.raises(ImportError):  # only the copy this grpcio refuses is left
        stubgen.checkout_stubs()


def _pypi_index():
    return os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")


def _require_pypi():
    url = f"{_pypi_index()}/grpcio-tools/"
    try:
        with urllib.request.urlopen(url, timeout=15) as response:
            response.read(1)
    except Exception as e:  # noqa: BLE001
        message = (f"PyPI is not reachable ({url}: {e}); this test runs pip's isolated "
                   "build, which fetches setuptools and grpcio-tools from it")
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)


def _git_status(*extra):
    proc = subprocess.run(["git", "--no-optional-locks", "status", "--porcelain", "--ignored",
                           *extra, "--", "python"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _tree_state():
    """python/'s status, and every ignored or untracked file under it (one by
    one) with its size, mtime and sha256."""
    files = {}
    for line in _git_status("--untracked-files=all").splitlines():
        if line[:2] not in ("!!", "??"):
            continue
        path = os.path.join(ROOT, line[3:].strip('"'))
        if os.path.isfile(path):
            st = os.stat(path)
            with open(path, "rb") as f:
                files[line[3:]] = (st.st_size, st.st_mtime_ns, hashlib.sha256(f.read()).hexdigest())
        else:
            files[line[3:]] = None
    return _git_status(), files


def test_pip_install_leaves_the_tree_unchanged(tmp_path):
    _require_pypi()
    if shutil.which("git") is None or not os.path.isdir(os.path.join(ROOT, ".git")):
        pytest.skip("not a git checkout")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=TIMEOUT)
    py = str(venv / "bin" / "python")
    # As a user's shell has it: Python writes bytecode (a build importing
    # from the tree would leave kvcal/__pycache__ there), no pip cache
    # switch of ours.
    env = _clean_env()
    env.pop("PYTHONDONTWRITEBYTECODE", None)

    status_before, files_before = _tree_state()
    proc = subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", PYTHON_DIR],
                          capture_output=True, text=True, timeout=TIMEOUT, env=env,
                          cwd=str(tmp_path))
    status_after, files_after = _tree_state()
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert status_after == status_before
    assert files_after == files_before

    # What the isolated build made: stubs whose checks equal the declared
    # floors.
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True, env=env).stdout.strip()
    v1 = os.path.join(site, "kvcal", "v1")
    for name in ("calibration_pb2.py", "calibration_pb2_grpc.py", "calibration_pb2.pyi"):
        assert os.path.isfile(os.path.join(v1, name)), name
    (info,) = [d for d in os.listdir(site) if d.startswith("kvcal-") and d.endswith(".dist-info")]
    with open(os.path.join(site, info, "METADATA")) as f:
        requires = [line.split(":", 1)[1].strip() for line in f
                    if line.startswith("Requires-Dist:") and "extra ==" not in line]
    floors = _source_stubgen().generated_requirements(v1)
    grpc_declared = [r for r in requires if r.startswith("grpcio")]
    pb_declared = [r for r in requires if r.startswith("protobuf")]
    assert grpc_declared == [floors[0]], (grpc_declared, floors)
    assert len(pb_declared) == 1 and sorted(pb_declared[0][len("protobuf"):].split(",")) == \
        sorted(floors[1][len("protobuf"):].split(",")), (pb_declared, floors)

    # The checkout's environment still imports kvcal: installed, and from
    # the source tree (as tests and bench scripts do with PYTHONPATH=python).
    code = "import kvcal, kvcal.v1.calibration_pb2_grpc as g; print(g.__file__)"
    checks = {"installed": _clean_env(PYTHONDONTWRITEBYTECODE="1"),
              "source tree": _clean_env(PYTHONPATH=PYTHON_DIR, PYTHONDONTWRITEBYTECODE="1",
                                        KVCAL_STUB_CACHE=str(tmp_path / "stub-cache"))}
    for what, check_env in checks.items():
        proc = subprocess.run([CHECKOUT_PY, "-c", code], capture_output=True, text=True,
                              timeout=TIMEOUT, env=check_env, cwd=str(tmp_path))
        assert proc.returncode == 0, f"{what}: {proc.stderr[-4000:]}"
        if what == "source tree":
            assert proc.stdout.startswith(str(tmp_path / "stub-cache")), proc.stdout

    # ... and the isolated build's stubs import with the checkout
    # environment's grpcio and protobuf (after the fresh site-packages).
    deps = subprocess.run([CHECKOUT_PY, "-c",
                           "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(site, "zz-checkout-dependencies.pth"), "w") as f:
        f.write(deps + "\n")
    proc = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=TIMEOUT,
                          env=_clean_env(PYTHONDONTWRITEBYTECODE="1"), cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip() == os.path.join(v1, "calibration_pb2_grpc.py")
    assert _tree_state() == (status_before, files_before)
