"""Generates kvcal/v1/calibration_pb2*.py from the wire contract.

Used by setup.py at build time and by kvcal.v1 on first import when the
package runs from a source checkout without having been built. Stdlib only
(plus grpcio-tools when it actually generates), so setup.py can import it.
"""
import os

_HERE = os.path.dirname(os.path.abspath(__file__))
_PROTO_REL = os.path.join("kvcal", "v1", "calibration.proto")


def find_proto_root():
    """The directory that holds kvcal/v1/calibration.proto."""
    candidates = []
    if os.environ.get("KVCAL_PROTO_DIR"):
        candidates.append(os.environ["KVCAL_PROTO_DIR"])
    # python/kvcal -> repository root/proto
    candidates.append(os.path.join(_HERE, "..", "..", "proto"))
    # an sdist may carry a copy next to setup.py
    candidates.append(os.path.join(_HERE, "..", "proto"))
    for root in candidates:
        if os.path.isfile(os.path.join(root, _PROTO_REL)):
            return os.path.abspath(root)
    raise FileNotFoundError(
        "kvcal: cannot find proto/kvcal/v1/calibration.proto to generate the "
        "gRPC stubs (looked in: %s); set KVCAL_PROTO_DIR" % ", ".join(candidates))


STAMP = "calibration_pb2.proto-sha256"


def proto_digest(proto_root):
    """sha256 of the calibration.proto the stubs are generated from."""
    import hashlib

    with open(os.path.join(proto_root, _PROTO_REL), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def stale(v1_dir=None):
    """True when the stubs in v1_dir are missing, or were generated from
    another calibration.proto than the one this checkout has (a pull that
    changed the contract). An installed package without the proto next to
    it keeps the stubs it was built with."""
    v1_dir = os.path.abspath(v1_dir or os.path.join(_HERE, "v1"))
    if not all(os.path.exists(os.path.join(v1_dir, name))
               for name in ("calibration_pb2.py", "calibration_pb2_grpc.py")):
        return True
    try:
        proto_root = find_proto_root()
    except FileNotFoundError:
        return False
    try:
        with open(os.path.join(v1_dir, STAMP)) as f:
            return f.read().strip() != proto_digest(proto_root)
    except OSError:
        return True


def generate(v1_dir=None):
    """Writes calibration_pb2.py, .pyi and calibration_pb2_grpc.py into v1_dir."""
    from grpc_tools import protoc  # grpcio-tools
    import importlib.resources

    v1_dir = os.path.abspath(v1_dir or os.path.join(_HERE, "v1"))
    out_root = os.path.dirname(os.path.dirname(v1_dir))  # .../<root>/kvcal/v1
    proto_root = find_proto_root()
    well_known = str(importlib.resources.files("grpc_tools") / "_proto")
    args = [
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        os.path.join(proto_root, _PROTO_REL),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("kvcal: grpc_tools.protoc failed on " + proto_root)
    with open(os.path.join(v1_dir, STAMP), "w") as f:
        f.write(proto_digest(proto_root) + "\n")
