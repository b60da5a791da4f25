"""Generated kvcal.v1 wire messages and the Calibration service stub.

An installed package carries the modules setup.py generated from
proto/kvcal/v1/calibration.proto when it was built. A source tree (a
checkout's python/ on PYTHONPATH, an editable install, an unpacked sdist)
never holds them: on import they come from a cache directory outside the
tree, generated there by this environment's grpcio-tools on first use and
again when calibration.proto changes (kvcal._stubgen.checkout_stubs()), and
that directory goes first on this package's __path__. Stubs another
environment left in the tree (older kvcal builds wrote them there) are not
used.
"""
import os

from kvcal import _stubgen

_HERE = os.path.dirname(os.path.abspath(__file__))
if _stubgen.in_source_tree():
    try:
        __path__.insert(0, _stubgen.checkout_stubs())  # noqa: F821 (the package's own)
    except ImportError as e:  # no grpcio-tools
        raise ImportError(
            "kvcal: running from a source tree, whose gRPC stubs are generated on "
            "import, and grpcio-tools is not installed: `pip install grpcio-tools`, "
            "or install the package (`pip install ./python`)") from e
elif not all(os.path.isfile(os.path.join(_HERE, name)) for name in _stubgen.MODULES):
    raise ImportError(
        f"kvcal: {_HERE} lacks the generated gRPC stubs ({', '.join(_stubgen.MODULES)}), "
        "which an installed kvcal carries: install it again")

from kvcal.v1 import calibration_pb2 as pb  # noqa: E402
from kvcal.v1 import calibration_pb2_grpc as pb_grpc  # noqa: E402

__all__ = ["pb", "pb_grpc"]
