"""Where the kvcal executables are: ``find("kvcal")``, ``find("kvcal-worker")``.

The two C++ programs (the ``kvcal`` CLI and the ``kvcal-worker`` service)
come either inside the wheel (``kvcal/bin/``) or from a checkout's build.
``find`` looks, in this order, at:

1. ``$KVCAL_BIN_DIR/NAME``;
2. the package's own ``kvcal/bin/NAME`` (an installed wheel);
3. a checkout's build: ``$KVCAL_BUILD_DIR/{service,client}/NAME``, then
   ``<repo>/build/{service,client}/NAME`` with ``<repo>`` found relative to
   ``python/kvcal/`` (this file);
4. ``PATH`` (skipping the console scripts below, which would call themselves).

The console scripts ``kvcal`` and ``kvcal-worker`` (``main_kvcal``,
``main_worker``) replace the Python process with the binary (``os.execv``),
so the exit status, signals and stdin/stdout are the binary's own.
"""
import os
import shutil
import sys

NAMES = ("kvcal", "kvcal-worker")
# Where a CMake build puts each program (relative to the build directory).
_BUILD_SUBDIR = {"kvcal": "client", "kvcal-worker": "service"}

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# python/kvcal -> the repository root of a checkout
_REPO_ROOT = os.path.dirname(os.path.dirname(_PACKAGE_DIR))

# Text that marks one of this module's console scripts (pip writes a small
# Python file naming the entry point): found on PATH, it is not the binary.
_SCRIPT_MARK = b"kvcal._binaries"


def _is_executable(path):
    return os.path.isfile(path) and os.access(path, os.X_OK)


def _is_console_script(path):
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return not head.startswith(b"\x7fELF") and _SCRIPT_MARK in head


def _candidates(name):
    """(description, path) in the order find() tries them; PATH last, as None."""
    out = []
    bin_dir = os.environ.get("KVCAL_BIN_DIR")
    if bin_dir:
        out.append(("$KVCAL_BIN_DIR", os.path.join(bin_dir, name)))
    out.append(("the kvcal package (wheel)", os.path.join(_PACKAGE_DIR, "bin", name)))
    build_dir = os.environ.get("KVCAL_BUILD_DIR")
    if build_dir:
        out.append(("$KVCAL_BUILD_DIR", os.path.join(build_dir, _BUILD_SUBDIR[name], name)))
    out.append(("the checkout's build",
                os.path.join(_REPO_ROOT, "build", _BUILD_SUBDIR[name], name)))
    return out


def find(name):
    """The path of the executable ``name`` ("kvcal" or "kvcal-worker").

    Raises FileNotFoundError naming every place searched and how to fix it.
    """
    if name not in NAMES:
        raise ValueError(f"kvcal: unknown executable {name!r} (one of: {', '.join(NAMES)})")
    searched = []
    for what, path in _candidates(name):
        if _is_executable(path):
            return os.path.abspath(path)
        searched.append(f"{path} ({what})")
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        if not directory:
            continue
        path = os.path.join(directory, name)
        if _is_executable(path) and not _is_console_script(path):
            return os.path.abspath(path)
    searched.append("PATH=" + os.environ.get("PATH", ""))
    raise FileNotFoundError(
        f"kvcal: cannot find the {name} executable; searched: " + "; ".join(searched)
        + ". Fix: install the kvcal wheel (pip install kvcal-*.whl, built by "
        "`./run wheel`), or build a checkout with `./run build`, or set "
        f"KVCAL_BIN_DIR to a directory that holds {name}.")


def _exec(name, argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        path = find(name)
    except FileNotFoundError as e:
        sys.stderr.write(f"{e}\n")
        return 127
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(path, [name] + argv)
    except OSError as e:  # not reached on success
        sys.stderr.write(f"kvcal: cannot run {path}: {e}\n")
        return 126


def main_kvcal():
    """Console script ``kvcal``: runs the kvcal CLI binary with the same arguments."""
    return _exec("kvcal")


def main_worker():
    """Console script ``kvcal-worker``: runs the worker binary with the same arguments."""
    return _exec("kvcal-worker")
