"""Builds the kvcal Python package; generates the gRPC stubs from proto/.

The stubs (kvcal/v1/calibration_pb2*.py) are not committed: build_py runs
grpcio-tools on ../../proto/kvcal/v1/calibration.proto (the repository's wire
contract) and writes them into the package. The protobuf runtime is required
at >= the version grpcio-tools generated them with, because protobuf refuses
generated code newer than its runtime.
"""
import os

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


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


if __name__ == "__main__":
    import sys

    sys.path.insert(0, os.path.join(HERE, "kvcal"))
    import _stubgen as kvcal_stubgen  # noqa: E402

    sys.modules["kvcal_stubgen"] = kvcal_stubgen
    setup(
        cmdclass={"build_py": BuildPyWithStubs},
        install_requires=["grpcio>=1.60", _protobuf_requirement(), "numpy>=1.22"],
    )
