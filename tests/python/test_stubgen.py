"""The generated gRPC stubs of a source checkout follow its contract: they
are generated on first import and again when calibration.proto changed
since (a pull that added RPCs used to leave stale stubs, and the client
then failed with "'CalibrationStub' object has no attribute ...")."""
import importlib.util
import os

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _source_stubgen():
    """kvcal/_stubgen.py of this checkout (the tests otherwise import the
    installed package, which has no proto next to it)."""
    path = os.path.join(ROOT, "python", "kvcal", "_stubgen.py")
    spec = importlib.util.spec_from_file_location("kvcal_source_stubgen", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_stubgen = _source_stubgen()


def test_stubs_are_regenerated_when_the_proto_changes(tmp_path):
    v1 = os.path.join(str(tmp_path), "kvcal", "v1")  # protoc writes kvcal/v1/...
    os.makedirs(v1)
    assert _stubgen.stale(v1)  # nothing generated yet
    _stubgen.generate(v1)
    assert not _stubgen.stale(v1)
    with open(os.path.join(v1, "calibration_pb2_grpc.py")) as f:
        assert "RegisterSharedMemory" in f.read()

    # Stubs from another proto (the digest they were made from differs).
    with open(os.path.join(v1, _stubgen.STAMP), "w") as f:
        f.write("0" * 64 + "\n")
    assert _stubgen.stale(v1)
    # Stubs from before the digest was kept.
    os.remove(os.path.join(v1, _stubgen.STAMP))
    assert _stubgen.stale(v1)
    _stubgen.generate(v1)
    assert not _stubgen.stale(v1)
    # A missing module.
    os.remove(os.path.join(v1, "calibration_pb2_grpc.py"))
    assert _stubgen.stale(v1)

