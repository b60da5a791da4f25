"""The wheel that carries the worker (`./run wheel`), installed as a user
would: a fresh virtual environment outside the checkout, `pip install
--no-deps` of the wheel, run from another directory with a PATH that holds
no build directory.

Nothing is downloaded: the wheel is built with the tools environment
.venv-wheel (tests/python/run_python_tests.sh prepares it with `./run wheel
--tools-only`) from the existing build (ninja has nothing to do), and the
wheel's runtime dependencies (grpcio, protobuf, numpy; torch for the
[torch] extra) come from this test environment through a .pth file that
the fresh environment reads after its own site-packages, so the wheel's
kvcal is the one imported.

Checks: the wheel's name, tag and metadata (version from VERSION, extras,
console scripts); `kvcal --version` / `kvcal-worker --version` (the
VERSION file's), `kvcal-calibrate --help` and `kvcal demo` through the
console scripts,
with the demo's worker the wheel's own; the package imports from the fresh
environment with no checkout path on sys.path; the wheel's statistics
engine kvcal._engine (for this CPython) loads from the fresh environment and
kvcal.LocalStatistics accumulates and exports with it, and a Python it was
not built for gets load_engine()'s ImportError naming both versions; ldd of
the installed binaries and of the extension resolves every library other
than glibc's inside the installed wheel; as root, the binaries also start
in a chroot that holds glibc and nothing else, and `kvcal demo` runs
there."""
import glob
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GLIBC = ("linux-vdso.so.1", "libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0",
         "librt.so.1", "libutil.so.1", "libresolv.so.2", "libmvec.so.1",
         "ld-linux-x86-64.so.2", "/lib64/ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1")
TIMEOUT = 300


def read_version():
    with open(os.path.join(ROOT, "VERSION")) as f:
        return f.read().strip()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    stamp = os.path.join(ROOT, ".venv-wheel", ".kvcal-requirements.sha256")
    if not os.path.exists(stamp):
        pytest.fail("the wheel tools are not installed: run `./run wheel --tools-only` "
                    "(tests/python/run_python_tests.sh does)")
    out = tmp_path_factory.mktemp("dist")
    # PIP_NO_INDEX: were anything missing, the build fails instead of downloading.
    env = dict(os.environ, PIP_NO_INDEX="1")
    proc = subprocess.run([os.path.join(ROOT, "run"), "wheel", "--out", str(out)],
                          capture_output=True, text=True, timeout=TIMEOUT, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    (path,) = glob.glob(str(out / "kvcal-*.whl"))
    assert summary["wheel"] == path
    return summary


@pytest.fixture(scope="module")
def fresh(wheel, tmp_path_factory):
    """A new venv outside the checkout with the wheel installed; returns
    (venv dir, its site-packages, an environment for running from it)."""
    base = tmp_path_factory.mktemp("fresh")
    venv = str(base / "venv")
    assert not venv.startswith(ROOT + os.sep)
    # Nothing of the checkout or the test environment: no PYTHONPATH (a
    # checkout's python/ there would make pip see kvcal as installed).
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "KVCAL_BUILD_DIR", "KVCAL_BIN_DIR", "KVCAL_CLI",
                        "VIRTUAL_ENV", "LD_LIBRARY_PATH", "PYTHONHOME")}
    env["PATH"] = os.pathsep.join([os.path.join(venv, "bin"), "/usr/bin", "/bin"])
    subprocess.run([sys.executable, "-m", "venv", venv], check=True, timeout=TIMEOUT, env=env)
    py = os.path.join(venv, "bin", "python")
    proc = subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                           "--disable-pip-version-check", wheel["wheel"]],
                          capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert proc.returncode == 0, proc.stderr
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True, env=env).stdout.strip()
    # The test environment's packages, after the fresh site-packages.
    with open(os.path.join(site, "zz-kvcal-test-dependencies.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    cwd = str(base / "elsewhere")
    os.makedirs(cwd)
    return {"venv": venv, "site": site, "env": env, "cwd": cwd, "python": py}


def run_in(fresh, *args, timeout=TIMEOUT):
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout,
                          env=fresh["env"], cwd=fresh["cwd"])


def test_wheel_name_tag_and_metadata(wheel):
    version = read_version()
    name = os.path.basename(wheel["wheel"])
    assert name.startswith(f"kvcal-{version}-py3-none-manylinux_"), name
    assert name.endswith(f"-py3-none-{wheel['platform_tag']}.whl")
    with zipfile.ZipFile(wheel["wheel"]) as z:
        names = z.namelist()
        info = f"kvcal-{version}.dist-info"
        metadata = z.read(f"{info}/METADATA").decode()
        entry_points = z.read(f"{info}/entry_points.txt").decode()
        wheel_file = z.read(f"{info}/WHEEL").decode()
        version_py = z.read("kvcal/_version.py").decode()
    assert f"Version: {version}\n" in metadata
    assert f"__version__ = {version!r}" in version_py
    assert "Root-Is-Purelib: false" in wheel_file
    assert f"Tag: py3-none-{wheel['platform_tag']}" in wheel_file
    for extra in ("torch", "gguf"):
        assert f"Provides-Extra: {extra}" in metadata
    for req in ("torch", "transformers", "safetensors", "tqdm"):
        assert any(line.startswith(f"Requires-Dist: {req}") and 'extra == "torch"' in line
                   for line in metadata.splitlines()), req
    assert any(line.startswith("Requires-Dist: gguf") and 'extra == "gguf"' in line
               for line in metadata.splitlines())
    for req in ("grpcio", "protobuf", "numpy"):
        assert any(line.startswith(f"Requires-Dist: {req}") and "extra" not in line
                   for line in metadata.splitlines()), req
    assert "kvcal = kvcal._binaries:main_kvcal" in entry_points
    assert "kvcal-worker = kvcal._binaries:main_worker" in entry_points
    assert "kvcal-calibrate = kvcal.calibrate:main" in entry_points
    for path in ("kvcal/bin/kvcal", "kvcal/bin/kvcal-worker", "kvcal/v1/calibration_pb2.py",
                 "kvcal/v1/calibration_pb2_grpc.py", "kvcal/lib/libstdc++.so.6",
                 wheel["engine"]["file"]):
        assert path in names, path
    assert any(n.startswith("kvcal.libs/libgrpc++") for n in names)
    assert not any(n.split("/")[-1].startswith(("libcuda.", "libcudart", "libcudnn", "libnvrtc"))
                   for n in names)


def test_console_scripts_from_elsewhere(fresh):
    for script in ("kvcal", "kvcal-worker", "kvcal-calibrate"):
        path = shutil.which(script, path=fresh["env"]["PATH"])
        assert path == os.path.join(fresh["venv"], "bin", script)
    help_text = run_in(fresh, "kvcal", "--help")
    assert help_text.returncode == 0, help_text.stderr
    assert "Usage: kvcal" in help_text.stdout
    help_text = run_in(fresh, "kvcal-calibrate", "--help")
    assert help_text.returncode == 0, help_text.stderr
    assert help_text.stdout.startswith("usage: kvcal-calibrate"), help_text.stdout
    version = read_version()
    for script in ("kvcal", "kvcal-worker"):
        proc = run_in(fresh, script, "--version")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith(f"{script} {version} "), proc.stdout


def test_demo_runs_the_wheels_worker(fresh, tmp_path):
    proc = run_in(fresh, "kvcal", "demo", "--json", "--backend", "cpu",
                  "--dir", str(tmp_path / "demo"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    assert result["worker"] == os.path.join(fresh["site"], "kvcal", "bin", "kvcal-worker")
    assert result["inspect"]["ok"] is True


def test_package_imports_from_the_fresh_environment(fresh):
    code = (
        "import json, os, sys, kvcal, kvcal.v1, kvcal.torch, kvcal._binaries as b\n"
        "from kvcal.v1 import calibration_pb2\n"
        "print(json.dumps({'file': kvcal.__file__, 'version': kvcal.__version__,\n"
        "  'worker': b.find('kvcal-worker'), 'cli': b.find('kvcal'), 'path': sys.path,\n"
        "  'pb2': calibration_pb2.__file__}))\n")
    proc = run_in(fresh, fresh["python"], "-c", code)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    site = fresh["site"]
    assert got["file"] == os.path.join(site, "kvcal", "__init__.py")
    assert got["pb2"].startswith(site + os.sep)
    assert got["version"] == read_version()
    assert got["worker"] == os.path.join(site, "kvcal", "bin", "kvcal-worker")
    assert got["cli"] == os.path.join(site, "kvcal", "bin", "kvcal")
    # No checkout path: the only entry under the checkout is the test
    # environment's site-packages (the .pth file), which comes after the
    # fresh one.
    deps = sysconfig.get_paths()["purelib"]
    path = [os.path.realpath(p) for p in got["path"] if p]
    inside = [p for p in path if p == ROOT or p.startswith(ROOT + os.sep)]
    assert inside in ([], [os.path.realpath(deps)]), inside
    assert os.path.join(ROOT, "python") not in path
    assert path.index(os.path.realpath(site)) < path.index(os.path.realpath(deps))


def test_local_statistics_from_the_fresh_environment(fresh, wheel):
    """kvcal.LocalStatistics with the wheel's own kvcal._engine: no
    checkout build, no KVCAL_BUILD_DIR (the fixture's environment has none)."""
    engine = "kvcal/_engine" + sysconfig.get_config_var("EXT_SUFFIX")
    assert wheel["engine"]["file"] == engine, (
        f"the wheel's extension is {wheel['engine']}, not one for this Python ({engine}): "
        "the build's CMake found another Python than the tests run")
    assert "KVCAL_BUILD_DIR" not in fresh["env"]
    code = (
        "import json, numpy as np, kvcal\n"
        "from kvcal.producer import statistics as local_statistics\n"
        "local = kvcal.LocalStatistics({'num_layers': 2, 'num_attention_heads': 4,\n"
        "  'num_key_value_heads': 2, 'head_dim': 8})\n"
        "rng = np.random.default_rng(0)\n"
        "local.accumulate(1, 'k', rng.standard_normal((16, 2, 8)).astype(np.float32), batch=0)\n"
        "local.accumulate(0, 'q', rng.standard_normal((16, 4, 8)).astype(np.float16), batch=0)\n"
        "state = local.export_state().SerializeToString()\n"
        "print(json.dumps({'file': kvcal.__file__, 'backend': local.backend,\n"
        "  'engine': local_statistics.load_engine().__file__,\n"
        "  'counters': local.counters, 'state_bytes': len(state)}))\n")
    proc = run_in(fresh, fresh["python"], "-c", code)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout)
    site = fresh["site"]
    assert got["file"] == os.path.join(site, "kvcal", "__init__.py")
    assert got["engine"] == os.path.join(site, engine)
    assert got["backend"] == "cpu"
    assert got["counters"]["chunks_applied"] == 2
    assert got["counters"]["values_ingested"] == 16 * 2 * 8 + 16 * 4 * 8
    assert got["state_bytes"] > 0


def test_engine_for_another_python_says_so(fresh, wheel, tmp_path):
    """The wheel is py3-none: installed into a Python it was not built for,
    the extension's file name does not match and load_engine() says which
    CPython the wheel's engine is for and how to get one. Simulated with a
    copy of the installed package whose module is renamed for CPython 3.99."""
    site = fresh["site"]
    copy = tmp_path / "other" / "kvcal"
    shutil.copytree(os.path.join(site, "kvcal"), copy,
                    ignore=shutil.ignore_patterns("bin", "lib", "_engine*"))
    os.symlink(os.path.join(site, wheel["engine"]["file"]),
               copy / "_engine.cpython-399-x86_64-linux-gnu.so")
    code = ("import kvcal\n"
            "from kvcal.producer import statistics as local_statistics\n"
            "assert kvcal.__file__.startswith(%r), kvcal.__file__\n"
            "try:\n"
            "    local_statistics.load_engine()\n"
            "except ImportError as e:\n"
            "    print(e)\n" % str(copy))
    env = dict(fresh["env"], PYTHONPATH=str(copy.parent))
    proc = subprocess.run([fresh["python"], "-c", code], capture_output=True, text=True,
                          timeout=TIMEOUT, env=env, cwd=fresh["cwd"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    message = proc.stdout
    assert "carries the statistics engine kvcal._engine for CPython 3.99" in message, message
    assert f"this is CPython {sys.version.split()[0]}" in message, message
    assert "kvcal and kvcal-worker programs work with any Python 3" in message, message
    assert f"-DPython3_EXECUTABLE={fresh['python']}" in message, message


def test_wheel_build_stops_without_the_engine(tmp_path):
    """A build without kvcal._engine (here: engine.txt as CMake writes it
    for KVCAL_PYTHON_EXT=OFF, beside the real binaries) makes no wheel and
    says why, instead of leaving the module out."""
    build = os.path.join(ROOT, "build")
    fake = tmp_path / "build"
    for name, subdir in (("kvcal", "client"), ("kvcal-worker", "service")):
        (fake / subdir).mkdir(parents=True)
        os.symlink(os.path.join(build, subdir, name), fake / subdir / name)
    (fake / "python" / "ext").mkdir(parents=True)
    (fake / "python" / "ext" / "engine.txt").write_text("not built\nKVCAL_PYTHON_EXT=OFF\n")
    tools = os.path.join(ROOT, ".venv-wheel", "bin", "python")
    proc = subprocess.run([tools, os.path.join(ROOT, "python", "build_wheel.py"),
                           "--build-dir", str(fake), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=TIMEOUT,
                          env=dict(os.environ, PIP_NO_INDEX="1"))
    assert proc.returncode == 1, proc.stderr
    assert (f"the build in {fake} has no Python extension kvcal._engine "
            "(KVCAL_PYTHON_EXT=OFF)") in proc.stderr, proc.stderr
    assert glob.glob(str(tmp_path / "out" / "*.whl")) == []


def ldd(path):
    out = subprocess.run(["ldd", path], capture_output=True, text=True, check=True).stdout
    libs = {}
    for line in out.splitlines():
        line = line.strip()
        if "=>" in line:
            name, rest = (s.strip() for s in line.split("=>", 1))
            libs[name] = rest.split(" (")[0].strip()
        elif line:
            libs[line.split(" (")[0]] = line.split(" (")[0]
    return libs


def test_every_library_but_glibc_comes_from_the_wheel(fresh, wheel):
    site = os.path.realpath(fresh["site"])
    for name in ("kvcal", "kvcal-worker"):
        libs = ldd(os.path.join(site, "kvcal", "bin", name))
        assert "not found" not in "".join(libs.values()), libs
        outside = {lib: where for lib, where in libs.items()
                   if lib not in GLIBC and not os.path.realpath(where).startswith(site + os.sep)}
        assert outside == {}, f"{name} loads from outside the wheel: {outside}"
        assert any("kvcal.libs" in where for where in libs.values())
        assert os.path.realpath(libs["libstdc++.so.6"]) == os.path.join(
            site, "kvcal", "lib", "libstdc++.so.6")
    # The extension: Abseil from kvcal.libs, the C++ runtime from kvcal/lib
    # (when no other libstdc++ is loaded in the process first).
    libs = ldd(os.path.join(site, wheel["engine"]["file"]))
    assert "not found" not in "".join(libs.values()), libs
    outside = {lib: where for lib, where in libs.items()
               if lib not in GLIBC and not os.path.realpath(where).startswith(site + os.sep)}
    assert outside == {}, f"kvcal._engine loads from outside the wheel: {outside}"
    assert os.path.realpath(libs["libstdc++.so.6"]) == os.path.join(
        site, "kvcal", "lib", "libstdc++.so.6")


def test_demo_runs_with_glibc_alone(fresh, tmp_path):
    """A root file system of glibc's loader, libc and libm, /proc (the
    loader finds $ORIGIN, the RPATH's base, through /proc/self/exe), /tmp
    and the installed package: `kvcal demo` runs there, worker included."""
    if os.geteuid() != 0:  # chroot needs root; the ldd test above still holds
        return
    tools = {t: shutil.which(t, path="/usr/sbin:/sbin:/usr/bin:/bin")
             for t in ("chroot", "unshare", "mount")}
    assert all(tools.values()), tools
    root = tmp_path / "root"
    site = os.path.realpath(fresh["site"])
    libs = ldd(os.path.join(site, "kvcal", "bin", "kvcal-worker"))
    for lib, where in libs.items():
        if lib in GLIBC and where.startswith("/"):
            target = root / where.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(os.path.realpath(where), target)
    shutil.copytree(os.path.join(site, "kvcal"), root / "pkg" / "kvcal")
    shutil.copytree(os.path.join(site, "kvcal.libs"), root / "pkg" / "kvcal.libs")
    (root / "proc").mkdir()
    (root / "tmp").mkdir(mode=0o1777)
    # A private mount namespace: /proc is unmounted when the command ends.
    script = (f'r="$1"; shift; {tools["mount"]} -t proc proc "$r/proc" && '
              f'exec {tools["chroot"]} "$r" "$@"')
    proc = subprocess.run(
        [tools["unshare"], "--mount", "sh", "-c", script, "sh", str(root),
         "/pkg/kvcal/bin/kvcal", "demo", "--json", "--backend", "cpu", "--dir", "/tmp/demo"],
        capture_output=True, text=True, timeout=TIMEOUT, env={})
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    assert result["worker"] == "/pkg/kvcal/bin/kvcal-worker"
    assert result["inspect"]["ok"] is True


def test_sdist_carries_version_and_contract(tmp_path):
    """An sdist (setup.py sdist) holds VERSION and proto/ beside setup.py,
    and builds a wheel of that version away from the checkout."""
    tools = os.path.join(ROOT, ".venv-wheel", "bin", "python")
    env = dict(os.environ, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    proc = subprocess.run([tools, "setup.py", "-q", "sdist", "-d", str(tmp_path / "sdist")],
                          cwd=os.path.join(ROOT, "python"), capture_output=True, text=True,
                          timeout=TIMEOUT, env=env)
    assert proc.returncode == 0, proc.stderr
    version = read_version()
    (sdist,) = glob.glob(str(tmp_path / "sdist" / f"kvcal-{version}.tar.gz"))
    import tarfile

    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    src = tmp_path / "unpacked" / f"kvcal-{version}"
    assert (src / "VERSION").read_text() == version + "\n"
    assert (src / "proto" / "kvcal" / "v1" / "calibration.proto").read_bytes() == open(
        os.path.join(ROOT, "proto", "kvcal", "v1", "calibration.proto"), "rb").read()
    for stale in glob.glob(str(src / "kvcal" / "v1" / "calibration_pb2*")):
        os.unlink(stale)  # generated again from the sdist's proto/
    proc = subprocess.run([tools, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "--no-index", "-w", str(tmp_path / "w"), str(src)],
                          capture_output=True, text=True, timeout=TIMEOUT, env=env,
                          cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    (built,) = glob.glob(str(tmp_path / "w" / f"kvcal-{version}-py3-none-any.whl"))
    with zipfile.ZipFile(built) as z:
        assert z.read("kvcal/_version.py").decode().endswith(f"__version__ = {version!r}\n")
        assert "kvcal/v1/calibration_pb2.py" in z.namelist()


def test_kvcal_calibrate_from_the_fresh_environment(fresh, tmp_path):
    """`kvcal-calibrate`, the wheel's console script, from the fresh
    environment (no checkout on PATH or sys.path, so its embedded worker and
    `kvcal patch` are the wheel's binaries): SmolLM2 on a few prompts gives
    a patched copy that the wheel's `kvcal inspect` accepts, a report and
    the `vllm serve` line."""
    import smollm2

    smollm2.require()
    model = smollm2.checkpoint_dir()
    data = tmp_path / "prompts.jsonl"
    with open(data, "w") as f:
        for paragraph in smollm2.text(smollm2.CALIBRATION_FILES).split(". ")[:80]:
            f.write(json.dumps({"text": paragraph + "."}) + "\n")
    out = tmp_path / "out"
    proc = run_in(fresh, os.path.join(fresh["venv"], "bin", "kvcal-calibrate"), model,
                  "--dataset", str(data), "--samples", "6", "--seq-len", "32", "--observer",
                  "static_minmax", "--out", str(out), "--json", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["checkpoint"] == str(out) and os.path.exists(result["report"])
    assert result["inspect"]["clean"] is True
    assert result["serve"]["command"].startswith(f"vllm serve {out} --kv-cache-dtype fp8")
    inspect = run_in(fresh, "kvcal", "inspect", str(out))
    assert inspect.returncode == 0, inspect.stderr
    # ... and vLLM 0.34's own loader reads every scale as written.
    from test_calibrate import assert_vllm_loads_every_scale_as_written

    assert_vllm_loads_every_scale_as_written(str(out))
