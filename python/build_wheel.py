"""Builds the kvcal wheel that carries the worker and the statistics
engine: `./run wheel` runs this with the tools environment .venv-wheel
(python/wheel-build-requirements.txt).

    python python/build_wheel.py --build-dir build --out dist

1. Stages a copy of python/ (never building inside the checkout), with the
   repository's VERSION, proto/kvcal/v1/calibration.proto and docs/calibrate.md (the guide the package carries) beside it, the
   build's client/kvcal and service/kvcal-worker in kvcal/bin/ (debug
   sections stripped: they are most of a RelWithDebInfo binary's size; RPATH
   $ORIGIN/../lib), the build's extension module kvcal._engine as
   kvcal/_engine<suffix> (python/ext/; stripped the same way; RPATH
   $ORIGIN/lib; the file BUILD/python/ext/engine.txt, which CMake writes
   at every configure, names it, or says why this build has none, which
   stops the wheel here) and, in kvcal/lib/, the libraries they load that
   auditwheel would leave to the system as part of the manylinux baseline
   (its policy's whitelist less glibc: libstdc++.so.6, libgcc_s.so.1,
   libz.so.1): carried here, the wheel needs nothing but glibc.
2. `pip wheel` on the staging copy (no index, no dependencies, no build
   isolation: the tools environment has setuptools and grpcio-tools): a
   py3-none-linux_<arch> wheel (setup.py). py3-none although it holds a
   CPython extension: the binaries and the console scripts work with any
   Python 3, and only kvcal._engine (kvcal.LocalStatistics, local
   statistics) is for the one CPython the build was made with; another
   Python installs the wheel and gets an ImportError from
   kvcal.producer.statistics.load_engine() naming both versions.
3. `auditwheel repair`: copies every other shared library the binaries and
   the extension need (gRPC, protobuf, Abseil, OpenSSL, c-ares, re2, ...)
   into kvcal.libs/, adds it to their RPATH (after $ORIGIN/../lib or
   $ORIGIN/lib, which it keeps since they point inside the wheel) and tags
   the wheel with the oldest manylinux_2_X that the symbol versions of
   every ELF file in it allow, kvcal/lib's included.
4. Writes OUT/kvcal-VERSION-py3-none-manylinux_2_X_<arch>.whl, replacing
   an older wheel of the same version there, and prints a JSON summary.

The CUDA runtime is linked statically (kernels/cuda/CMakeLists.txt) and
loads the driver (libcuda.so.1) with dlopen when a CUDA session starts: a
binary or extension with a DT_NEEDED on libcuda, libcudart, libcudnn or
libnvrtc is refused in step 1, since the wheel's CPU backend must start on
a machine without them.
"""
import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON_DIR = os.path.join(ROOT, "python")
BINARIES = {"kvcal": "client", "kvcal-worker": "service"}
# Never bundled, never needed at load time: the GPU driver stack.
GPU_LIBS = ("libcuda.so", "libcudart.so", "libcudnn", "libnvrtc", "libnvidia")
# glibc's own libraries: the one thing the wheel takes from the system.
GLIBC_LIBS = ("libc.so.6", "libm.so.6", "libmvec.so.1", "libdl.so.2", "libpthread.so.0",
              "librt.so.1", "libutil.so.1", "libresolv.so.2", "libanl.so.1", "libnsl.so.1",
              "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1", "linux-vdso.so.1")


def baseline_libraries():
    """The libraries auditwheel leaves to the system (the manylinux
    policies' whitelist), glibc's aside: libstdc++, libgcc_s, libz, ...
    These go into kvcal/lib by hand."""
    import auditwheel

    path = os.path.join(os.path.dirname(auditwheel.__file__), "policy",
                        "manylinux-policy.json")
    with open(path) as f:
        policies = json.load(f)
    names = set()
    for policy in policies:
        names.update(policy.get("lib_whitelist", []))
    return names - set(GLIBC_LIBS)


def log(msg):
    sys.stderr.write(f"[wheel] {msg}\n")
    sys.stderr.flush()


def die(msg):
    sys.stderr.write(f"[wheel] error: {msg}\n")
    sys.exit(1)


def run(args, **kw):
    proc = subprocess.run(args, capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        die(f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return proc.stdout


def needed(path):
    """The DT_NEEDED entries of an ELF file (readelf -d)."""
    libs = []
    for line in run(["readelf", "-d", path]).splitlines():
        if "(NEEDED)" in line:
            libs.append(line.split("[", 1)[1].rstrip("]").strip())
    return libs


def resolved_libraries(binary):
    """{soname: the file the dynamic loader picks} for a binary (ldd)."""
    out = {}
    for line in run(["ldd", binary]).splitlines():
        if "=>" in line:
            name, rest = line.split("=>", 1)
            path = rest.strip().split(" (")[0].strip()
            if path.startswith("/"):
                out[name.strip()] = os.path.realpath(path)
    return out


def check_no_gpu_libs(path):
    for lib in needed(path):
        if lib.startswith(GPU_LIBS):
            die(f"{path} needs {lib} at load time (DT_NEEDED); the wheel's CPU "
                "backend must start without the GPU stack: link the CUDA runtime "
                "statically and load such libraries with dlopen")


def place_elf(src, dst, rpath, patchelf):
    """Copies a binary or the extension into the staging tree, debug
    sections stripped and its RPATH set to `rpath` (inside the wheel), after
    checking it loads no GPU library; returns the libraries it loads
    (resolved_libraries)."""
    check_no_gpu_libs(src)
    runtime = resolved_libraries(src)
    run(["objcopy", "--strip-debug", src, dst])
    run([patchelf, "--set-rpath", rpath, dst])
    os.chmod(dst, 0o755)
    return runtime


def engine_module(build_dir):
    """The extension module this build made (BUILD/python/ext/engine.txt,
    written by CMake at every configure): (path, python). Stops the wheel,
    saying why, when the build has none."""
    info = os.path.join(build_dir, "python", "ext", "engine.txt")
    if not os.path.isfile(info):
        die(f"{info} is missing: configure {build_dir} again (./run build); the wheel "
            "carries the extension kvcal._engine, and that file names it")
    with open(info) as f:
        lines = f.read().splitlines()
    if lines[:1] != ["built"]:
        why = lines[1] if len(lines) > 1 else "no reason given"
        die(f"the build in {build_dir} has no Python extension kvcal._engine ({why}), "
            "and the wheel carries it (kvcal.LocalStatistics): build it with "
            "-DKVCAL_PYTHON_EXT=AUTO or ON, pybind11-dev and python3-dev (./run installs "
            "both), in a build without KVCAL_STATIC_RUNTIME, sanitizers or fuzzing")
    path, python = lines[1], f"Python {lines[2]}" if len(lines) > 2 else "its Python"
    if not os.path.isfile(path):
        die(f"{path} (kvcal._engine, named by {info}) is missing: build it first "
            "(./run build)")
    return path, python


def stage(build_dir, staging, patchelf):
    ignore = shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "*.pyc",
                                    "bin", "lib", "_version.py", "calibration_pb2*",
                                    "_engine*")  # only the build's own module goes in
    shutil.copytree(PYTHON_DIR, staging, ignore=ignore)
    shutil.copyfile(os.path.join(ROOT, "VERSION"), os.path.join(staging, "VERSION"))
    proto = os.path.join(staging, "proto", "kvcal", "v1")
    os.makedirs(proto)
    shutil.copyfile(os.path.join(ROOT, "proto", "kvcal", "v1", "calibration.proto"),
                    os.path.join(proto, "calibration.proto"))
    # The user's guide, which the package carries (kvcal-calibrate --help-guide).
    os.makedirs(os.path.join(staging, "docs"))
    shutil.copyfile(os.path.join(ROOT, "docs", "calibrate.md"),
                    os.path.join(staging, "docs", "calibrate.md"))
    bin_dir = os.path.join(staging, "kvcal", "bin")
    lib_dir = os.path.join(staging, "kvcal", "lib")
    os.makedirs(bin_dir)
    os.makedirs(lib_dir)
    engine, python = engine_module(build_dir)  # first: a build without it stops here
    runtime = {}
    for name, subdir in BINARIES.items():
        src = os.path.join(build_dir, subdir, name)
        if not os.access(src, os.X_OK):
            die(f"{src} is missing: build it first (./run build)")
        runtime.update(place_elf(src, os.path.join(bin_dir, name), "$ORIGIN/../lib",
                                 patchelf))
    name = os.path.basename(engine)  # _engine<the build's Python's extension suffix>
    runtime.update(place_elf(engine, os.path.join(staging, "kvcal", name), "$ORIGIN/lib",
                             patchelf))
    log(f"carrying kvcal/{name} (for {python})")
    carried = sorted(set(runtime) & baseline_libraries())
    if "libstdc++.so.6" not in carried:
        die(f"ldd of the binaries shows no libstdc++.so.6: {sorted(runtime)}")
    for lib in carried:
        shutil.copyfile(runtime[lib], os.path.join(lib_dir, lib))
        os.chmod(os.path.join(lib_dir, lib), 0o755)
    log(f"carrying {', '.join(carried)} in kvcal/lib")
    return {"file": f"kvcal/{name}", "python": python}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build"))
    ap.add_argument("--out", default=os.path.join(ROOT, "dist"))
    args = ap.parse_args()
    with open(os.path.join(ROOT, "VERSION")) as f:
        version = f.read().strip()
    tools = os.path.dirname(sys.executable)  # the tools environment's bin/
    # No index: nothing is downloaded; patchelf from the tools first on PATH.
    env = dict(os.environ, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1",
               PATH=os.pathsep.join([tools, os.environ.get("PATH", "")]))
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvcal-wheel-") as tmp:
        staging = os.path.join(tmp, "python")
        engine = stage(os.path.abspath(args.build_dir), staging,
                       os.path.join(tools, "patchelf"))
        plain = os.path.join(tmp, "plain")
        log(f"pip wheel (kvcal {version}, binaries from {args.build_dir})")
        run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
             "--no-index", "-w", plain, staging], env=env)
        built = glob.glob(os.path.join(plain, "kvcal-*.whl"))
        if len(built) != 1 or f"kvcal-{version}-py3-none-linux_" not in built[0]:
            die(f"expected one kvcal-{version}-py3-none-linux_*.whl, got {built}")
        repaired = os.path.join(tmp, "repaired")
        log("auditwheel repair (bundles the shared libraries, computes the platform tag)")
        run([sys.executable, "-m", "auditwheel", "repair", "-w", repaired, built[0]], env=env)
        (wheel,) = glob.glob(os.path.join(repaired, "kvcal-*.whl"))
        found = re.search(r"-py3-none-(manylinux_\d+_\d+_[a-z0-9_]+)\.whl$", wheel)
        if not found:
            die(f"auditwheel repair wrote {os.path.basename(wheel)}: not a manylinux wheel")
        tag = found.group(1)
        for old in glob.glob(os.path.join(args.out, f"kvcal-{version}-*.whl")):
            os.unlink(old)
        dest = os.path.join(args.out, os.path.basename(wheel))
        shutil.copyfile(wheel, dest)
    with zipfile.ZipFile(dest) as z:
        libs = sorted(n for n in z.namelist()
                      if re.search(r"(\.libs|kvcal/lib)/[^/]+\.so", n))
        lib_bytes = sum(z.getinfo(n).file_size for n in libs)
        if engine["file"] not in z.namelist():
            die(f"{dest} lacks {engine['file']}")
        engine["bytes"] = z.getinfo(engine["file"]).file_size
    glibc = ".".join(tag.split("_")[1:3])
    summary = {"wheel": dest, "bytes": os.path.getsize(dest), "platform_tag": tag,
               "glibc": glibc, "bundled_libraries": [os.path.basename(n) for n in libs],
               "bundled_bytes": lib_bytes, "engine": engine}
    log(f"wrote {dest} ({os.path.getsize(dest) / 1e6:.1f} MB; {tag}: glibc >= {glibc}; "
        f"{len(libs)} bundled libraries, {lib_bytes / 1e6:.1f} MB unpacked; "
        f"{engine['file']} for {engine['python']}, {engine['bytes'] / 1e6:.1f} MB)")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
