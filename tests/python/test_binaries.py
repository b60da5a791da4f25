"""kvcal._binaries: where find() looks for the kvcal and kvcal-worker
executables, in which order, what it says when there are none, and that the
console-script entry points exec the binary with the caller's arguments."""
import os
import stat
import subprocess
import sys

import pytest

from kvcal import _binaries

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _exe(path, body="#!/bin/sh\nexit 0\n"):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(body)
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


@pytest.fixture
def places(tmp_path, monkeypatch):
    """Every place find() looks at, as empty directories under tmp_path."""
    d = {k: tmp_path / k for k in ("bindir", "package", "envbuild", "repo", "path")}
    for p in d.values():
        p.mkdir()
    monkeypatch.setattr(_binaries, "_PACKAGE_DIR", str(d["package"]))
    monkeypatch.setattr(_binaries, "_REPO_ROOT", str(d["repo"]))
    monkeypatch.setenv("KVCAL_BIN_DIR", str(d["bindir"]))
    monkeypatch.setenv("KVCAL_BUILD_DIR", str(d["envbuild"]))
    monkeypatch.setenv("PATH", str(d["path"]))
    return d


@pytest.mark.parametrize("name,subdir", [("kvcal", "client"), ("kvcal-worker", "service")])
def test_search_order(places, name, subdir):
    on_path = _exe(str(places["path"] / name))
    assert _binaries.find(name) == on_path
    repo_build = _exe(str(places["repo"] / "build" / subdir / name))
    assert _binaries.find(name) == repo_build
    env_build = _exe(str(places["envbuild"] / subdir / name))
    assert _binaries.find(name) == env_build
    wheel = _exe(str(places["package"] / "bin" / name))
    assert _binaries.find(name) == wheel
    bin_dir = _exe(str(places["bindir"] / name))
    assert _binaries.find(name) == bin_dir


def test_not_executable_is_skipped(places):
    path = places["bindir"] / "kvcal"
    path.write_text("#!/bin/sh\n")  # no x bit
    wheel = _exe(str(places["package"] / "bin" / "kvcal"))
    assert _binaries.find("kvcal") == wheel


def test_console_script_on_path_is_not_the_binary(places):
    # What pip writes for the entry point: finding it would exec itself forever.
    _exe(str(places["path"] / "kvcal"),
         "#!/usr/bin/python3\nimport sys\nfrom kvcal._binaries import main_kvcal\n"
         "sys.exit(main_kvcal())\n")
    with pytest.raises(FileNotFoundError):
        _binaries.find("kvcal")
    other = places["path"] / "more"
    real = _exe(str(other / "kvcal"))
    os.environ["PATH"] = os.pathsep.join([str(places["path"]), str(other)])
    assert _binaries.find("kvcal") == real


def test_missing_names_every_place_and_the_fixes(places):
    with pytest.raises(FileNotFoundError) as e:
        _binaries.find("kvcal-worker")
    msg = str(e.value)
    for p in (places["bindir"] / "kvcal-worker",
              places["package"] / "bin" / "kvcal-worker",
              places["envbuild"] / "service" / "kvcal-worker",
              places["repo"] / "build" / "service" / "kvcal-worker"):
        assert str(p) in msg
    assert "PATH=" + str(places["path"]) in msg
    assert "./run build" in msg and "KVCAL_BIN_DIR" in msg and "wheel" in msg


def test_unknown_name():
    with pytest.raises(ValueError):
        _binaries.find("sh")


def test_checkout_build_without_environment(monkeypatch):
    # The real layout: the module as it sits in a checkout (python/kvcal/)
    # finds <repo>/build/service/kvcal-worker with no variable set. Loaded
    # from the file, since the tests may import an installed copy of kvcal.
    import importlib.util

    worker = os.path.join(ROOT, "build", "service", "kvcal-worker")
    if not os.path.exists(worker):
        pytest.fail(f"{worker} is missing: build it first (./run build)")
    spec = importlib.util.spec_from_file_location(
        "kvcal_binaries_in_checkout", os.path.join(ROOT, "python", "kvcal", "_binaries.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for var in ("KVCAL_BIN_DIR", "KVCAL_BUILD_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert not os.path.exists(os.path.join(ROOT, "python", "kvcal", "bin", "kvcal-worker"))
    assert module.find("kvcal-worker") == worker
    assert module.find("kvcal") == os.path.join(ROOT, "build", "client", "kvcal")


@pytest.mark.parametrize("entry,name", [("main_kvcal", "kvcal"), ("main_worker", "kvcal-worker")])
def test_entry_point_execs_with_argv(tmp_path, entry, name):
    bindir = tmp_path / "bin"
    _exe(str(bindir / name),
         '#!/bin/sh\nprintf "%s|" "$0" "$@"\necho\necho on-stderr >&2\nexit 7\n')
    env = dict(os.environ, KVCAL_BIN_DIR=str(bindir))
    code = (f"import sys; from kvcal._binaries import {entry}; "
            f"sys.exit({entry}())")
    proc = subprocess.run([sys.executable, "-c", code, "--flag", "a b", ""],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 7, proc.stderr
    assert proc.stdout == f"{bindir / name}|--flag|a b||\n"
    assert proc.stderr == "on-stderr\n"


def test_entry_point_without_binary_exits_127(tmp_path):
    env = dict(os.environ, KVCAL_BIN_DIR=str(tmp_path), PATH=str(tmp_path),
               KVCAL_BUILD_DIR=str(tmp_path))
    code = ("import sys; from kvcal import _binaries; "
            f"_binaries._PACKAGE_DIR = {str(tmp_path)!r}; _binaries._REPO_ROOT = {str(tmp_path)!r}; "
            "sys.exit(_binaries.main_worker())")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 127
    assert proc.stderr.startswith("kvcal: cannot find the kvcal-worker executable")
    assert proc.stderr.count("\n") == 1
