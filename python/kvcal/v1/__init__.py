"""Generated kvcal.v1 wire messages and the Calibration service stub.

The modules are generated from proto/kvcal/v1/calibration.proto when the
package is built; a source checkout generates them here on first import,
and again when its calibration.proto has changed since (the digest of the
proto they came from is kept next to them).
"""
import os

from kvcal import _stubgen

_HERE = os.path.dirname(os.path.abspath(__file__))
if _stubgen.stale(_HERE):
    try:
        _stubgen.generate(_HERE)
    except ImportError as e:  # no grpcio-tools
        raise ImportError(
            "kvcal: the gRPC stubs were not generated and grpcio-tools is not "
            "installed; install the package with `pip install python` "
            "or `pip install grpcio-tools`") from e

from kvcal.v1 import calibration_pb2 as pb  # noqa: E402
from kvcal.v1 import calibration_pb2_grpc as pb_grpc  # noqa: E402

__all__ = ["pb", "pb_grpc"]
