"""Builds the kvcal Python package; generates the gRPC stubs from proto/.

The stubs (kvcal/v1/calibration_pb2*.py) are not committed: build_py runs
grpcio-tools on the repository's proto/kvcal/v1/calibration.proto (the wire
contract; an sdist carries a copy in proto/) and writes them into the
package. The protobuf runtime is required at >= the version grpcio-tools
generated them with, because protobuf refuses generated code newer than its
runtime.

The version comes from the repository's top-level VERSION file (the one
CMake reads for `kvcal --version`); an sdist carries a copy next to this
file. build_py writes it into kvcal/_version.py.

With kvcal/bin/kvcal and kvcal/bin/kvcal-worker present (`./run wheel` puts
them, the extension module kvcal/_engine<suffix> and the C++ runtime in
kvcal/lib/ into a staging copy of this directory, never into the checkout),
they go into the wheel as package data, installed as platform files, and
the wheel is tagged py3-none-<platform>: executables for one platform, which
any Python 3 runs, and the statistics engine kvcal._engine for the one
CPython it was built with (kvcal.local_statistics.load_engine() tells
another Python so; see build_wheel.py). Without them the wheel is pure
Python (py3-none-any).
"""
import os
import shutil

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = os.path.dirname(os.path.abspath(__file__))
BINARIES = ("kvcal", "kvcal-worker")


def _find_up(name):
    """HERE/name (an sdist's copy) or HERE/../name (the checkout's)."""
    for candidate in (os.path.join(HERE, name), os.path.join(HERE, "..", name)):
        if os.path.exists(candidate):
            return os.path.abspath(candidate)
    raise FileNotFoundError(
        f"kvcal setup.py: no {name} next to setup.py nor in the repository root "
        f"({os.path.dirname(HERE)})")


def read_version():
    with open(_find_up("VERSION")) as f:
        version = f.read().strip()
    if not version:
        raise ValueError("kvcal setup.py: the VERSION file is empty")
    return version


def _has_binaries():
    return all(os.path.isfile(os.path.join(HERE, "kvcal", "bin", b)) for b in BINARIES)


def _protobuf_requirement():
    try:
        from google.protobuf import __version__ as version
    except ImportError:  # metadata-only builds before grpcio-tools is there
        return "protobuf"
    major_minor = ".".join(version.split(".")[:2])
    return f"protobuf>={major_minor},<{int(version.split('.')[0]) + 1}"


class BuildPyWithStubs(build_py):
    def run(self):
        from kvcal_stubgen import generate  # noqa: local helper, see below

        generate(os.path.join(HERE, "kvcal", "v1"))
        super().run()
        target = os.path.join(self.build_lib, "kvcal", "_version.py")
        with open(target, "w") as f:
            f.write("# Written by setup.py from the repository's VERSION file.\n"
                    f"__version__ = {read_version()!r}\n")
        if _has_binaries():  # package data loses the x bit on some setuptools
            for name in BINARIES:
                path = os.path.join(self.build_lib, "kvcal", "bin", name)
                os.chmod(path, 0o755)


class SdistWithContract(sdist):
    """The sdist carries VERSION and proto/ next to setup.py."""

    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        shutil.copyfile(_find_up("VERSION"), os.path.join(base_dir, "VERSION"))
        proto = os.path.join(base_dir, "proto", "kvcal", "v1")
        os.makedirs(proto, exist_ok=True)
        shutil.copyfile(
            os.path.join(_find_up("proto"), "kvcal", "v1", "calibration.proto"),
            os.path.join(proto, "calibration.proto"))


class BinaryDistribution(Distribution):
    """Platform files in the package: installed as platlib (the wheel's root
    is not purelib), as auditwheel requires of a wheel it repairs."""

    def has_ext_modules(self):
        return True


def _cmdclass():
    commands = {"build_py": BuildPyWithStubs, "sdist": SdistWithContract}
    if _has_binaries():
        try:
            from setuptools.command.bdist_wheel import bdist_wheel
        except ImportError:  # setuptools < 70.1
            from wheel.bdist_wheel import bdist_wheel

        class PlatformWheel(bdist_wheel):
            """Executables (and kvcal._engine, needed by kvcal.LocalStatistics
            alone): py3-none-<platform>."""

            def get_tag(self):
                _, _, plat = super().get_tag()
                return "py3", "none", plat

        commands["bdist_wheel"] = PlatformWheel
    return commands


if __name__ == "__main__":
    import sys

    sys.path.insert(0, os.path.join(HERE, "kvcal"))
    import _stubgen as kvcal_stubgen  # noqa: E402

    sys.modules["kvcal_stubgen"] = kvcal_stubgen
    setup(
        version=read_version(),
        cmdclass=_cmdclass(),
        distclass=BinaryDistribution if _has_binaries() else Distribution,
        package_data={"kvcal": ["bin/*", "lib/*", "_engine*"]} if _has_binaries() else {},
        install_requires=["grpcio>=1.60", _protobuf_requirement(), "numpy>=1.22"],
    )
