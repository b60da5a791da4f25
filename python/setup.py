"""Builds the kvcal Python package; generates the gRPC stubs from proto/.

The stubs (kvcal/v1/calibration_pb2*.py) are not committed, and building
never writes into the source tree: setup.py runs grpcio-tools on the
repository's proto/kvcal/v1/calibration.proto (the wire contract; an sdist
carries a copy in proto/) into a temporary directory, and build_py copies
them into the build (self.build_lib); setuptools' build/ and kvcal.egg-info
go into that temporary directory too, which is removed when setup.py ends.
So `pip install ./python` leaves the checkout as it was, and never replaces
stubs that another environment generated (a source tree's own imports
generate theirs outside it: kvcal/_stubgen.py checkout_stubs()).

The package's grpcio and protobuf requirements are read from the generated
code (kvcal/_stubgen.py generated_requirements()): calibration_pb2_grpc.py
refuses a grpcio older than the grpcio-tools that generated it, and
calibration_pb2.py a protobuf runtime older than its gencode, so those
versions are the declared floors; a pip that honours them installs nothing
the stubs refuse at import. pyproject.toml pins the grpcio-tools of an
isolated build to the one the repository's environments use
(tests/python/requirements.lock, python/wheel-build-requirements.txt), so
that every build of a version declares the same floors.

The version comes from the repository's top-level VERSION file (the one
CMake reads for `kvcal --version`); an sdist carries a copy next to this
file. build_py writes it into kvcal/_version.py.

With kvcal/bin/kvcal and kvcal/bin/kvcal-worker present (`./run wheel` puts
them, the extension module kvcal/_engine<suffix> and the C++ runtime in
kvcal/lib/ into a staging copy of this directory, never into the checkout),
they go into the wheel as package data, installed as platform files, and
the wheel is tagged py3-none-<platform>: executables for one platform, which
any Python 3 runs, and the statistics engine kvcal._engine for the one
CPython it was built with (kvcal.producer.statistics.load_engine() tells
another Python so; see build_wheel.py). Without them the wheel is pure
Python (py3-none-any).
"""
import atexit
import os
import shutil
import tempfile

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = os.path.dirname(os.path.abspath(__file__))
BINARIES = ("kvcal", "kvcal-worker")
_SCRATCH = []


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


def scratch():
    """This run's temporary directory (outside the source tree), removed at
    exit: the generated stubs, setuptools' build/ and kvcal.egg-info."""
    if not _SCRATCH:
        path = tempfile.mkdtemp(prefix="kvcal-setup-")
        atexit.register(shutil.rmtree, path, True)
        _SCRATCH.append(path)
    return _SCRATCH[0]


def generate_stubs(stubgen):
    """(the kvcal/v1 directory of freshly generated stubs, the grpcio and
    protobuf requirements they check at import); (None, unversioned
    requirements) without grpcio-tools, for metadata only: build_py then
    stops, saying why."""
    try:
        import grpc_tools  # noqa: F401
    except ImportError:
        return None, ["grpcio", "protobuf"]
    v1_dir = os.path.join(scratch(), "stubs", "kvcal", "v1")
    stubgen.generate(v1_dir)
    return v1_dir, stubgen.generated_requirements(v1_dir)


class BuildPyWithStubs(build_py):
    stubs = None  # generate_stubs()'s directory, set below
    stubgen = None  # kvcal/_stubgen.py

    def find_package_modules(self, package, package_dir):
        # Stubs that an older kvcal build or import left in the source tree
        # are never packaged (nor put in an sdist): the build's own go in.
        modules = super().find_package_modules(package, package_dir)
        if package == "kvcal.v1":
            modules = [m for m in modules if not m[1].startswith("calibration_pb2")]
        return modules

    def run(self):
        if self.stubs is None:
            raise RuntimeError("kvcal setup.py: building needs grpcio-tools (pyproject.toml's "
                               "build requirements; with --no-build-isolation, install it first)")
        super().run()
        if getattr(self, "editable_mode", False):
            # An editable install imports kvcal from the source tree, whose
            # stubs come from the cache outside it (kvcal/_stubgen.py
            # checkout_stubs()): put this build's there, for an environment
            # without grpcio-tools to find.
            self.stubgen.seed_cache(self.stubs, self.stubgen.tools_version())
        v1_dir = os.path.join(self.build_lib, "kvcal", "v1")
        os.makedirs(v1_dir, exist_ok=True)  # editable mode built nothing there
        for name in sorted(os.listdir(self.stubs)):
            shutil.copyfile(os.path.join(self.stubs, name), os.path.join(v1_dir, name))
        # The user's guide, which `kvcal-calibrate --help-guide` prints.
        guide = os.path.join(self.build_lib, "kvcal", "guide")
        os.makedirs(guide, exist_ok=True)
        shutil.copyfile(_find_up(os.path.join("docs", "calibrate.md")),
                        os.path.join(guide, "calibrate.md"))
        target = os.path.join(self.build_lib, "kvcal", "_version.py")
        with open(target, "w") as f:
            f.write("# Written by setup.py from the repository's VERSION file.\n"
                    f"__version__ = {read_version()!r}\n")
        if _has_binaries():  # package data loses the x bit on some setuptools
            for name in BINARIES:
                path = os.path.join(self.build_lib, "kvcal", "bin", name)
                os.chmod(path, 0o755)


class SdistWithContract(sdist):
    """The sdist carries VERSION, proto/ and docs/calibrate.md next to
    setup.py."""

    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        shutil.copyfile(_find_up("VERSION"), os.path.join(base_dir, "VERSION"))
        os.makedirs(os.path.join(base_dir, "docs"), exist_ok=True)
        shutil.copyfile(_find_up(os.path.join("docs", "calibrate.md")),
                        os.path.join(base_dir, "docs", "calibrate.md"))
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

    # kvcal/_stubgen.py alone (stdlib only; kvcal/ is not importable before
    # it is built), writing no kvcal/__pycache__ into the source tree.
    sys.path.insert(0, os.path.join(HERE, "kvcal"))
    write_bytecode, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    import _stubgen as kvcal_stubgen  # noqa: E402

    sys.dont_write_bytecode = write_bytecode
    sys.path.pop(0)

    BuildPyWithStubs.stubgen = kvcal_stubgen
    BuildPyWithStubs.stubs, stub_requirements = generate_stubs(kvcal_stubgen)
    setup(
        version=read_version(),
        cmdclass=_cmdclass(),
        distclass=BinaryDistribution if _has_binaries() else Distribution,
        package_data={"kvcal": ["bin/*", "lib/*", "_engine*"]} if _has_binaries() else {},
        install_requires=stub_requirements + ["numpy>=1.22"],
        # Out of the source tree: setuptools' build/ and kvcal.egg-info.
        options={"build": {"build_base": os.path.join(scratch(), "build")},
                 "egg_info": {"egg_base": scratch()}},
    )
