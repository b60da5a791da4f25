"""Generates kvcal/v1/calibration_pb2*.py from the wire contract.

Used by setup.py at build time (into a temporary directory, whose files
build_py copies into the build: building never writes into the source
tree) and by kvcal.v1 on import when the package runs from a source
checkout (PYTHONPATH=python, an editable install, an unpacked sdist): there
the stubs are generated into a cache directory outside the tree
(checkout_stubs()), one per calibration.proto and grpcio-tools version, so
that environments with different grpcio-tools never share, or overwrite,
one another's stubs (an editable install, which may lack grpcio-tools at
run time, finds its build's stubs there: seed_cache()). Stdlib only (plus
grpcio-tools when it actually generates), so setup.py can import it.
"""
import os
import re

_HERE = os.path.dirname(os.path.abspath(__file__))
_PROTO_REL = os.path.join("kvcal", "v1", "calibration.proto")
MODULES = ("calibration_pb2.py", "calibration_pb2_grpc.py")


def _tree_proto_roots():
    """Where a source tree keeps the proto, relative to this package."""
    return [
        os.path.join(_HERE, "..", "..", "proto"),  # python/kvcal -> repository root/proto
        os.path.join(_HERE, "..", "proto"),  # an sdist carries a copy next to setup.py
    ]


def find_proto_root():
    """The directory that holds kvcal/v1/calibration.proto."""
    candidates = []
    if os.environ.get("KVCAL_PROTO_DIR"):
        candidates.append(os.environ["KVCAL_PROTO_DIR"])
    candidates.extend(_tree_proto_roots())
    for root in candidates:
        if os.path.isfile(os.path.join(root, _PROTO_REL)):
            return os.path.abspath(root)
    raise FileNotFoundError(
        "kvcal: cannot find proto/kvcal/v1/calibration.proto to generate the "
        "gRPC stubs (looked in: %s); set KVCAL_PROTO_DIR" % ", ".join(candidates))


def in_source_tree():
    """True when this package is a source tree's (a checkout's python/kvcal
    or an unpacked sdist's): the proto sits beside it. An installed package
    has no proto next to it and uses the stubs it was built with."""
    return any(os.path.isfile(os.path.join(root, _PROTO_REL)) for root in _tree_proto_roots())


STAMP = "calibration_pb2.proto-sha256"


def proto_digest(proto_root):
    """sha256 of the calibration.proto the stubs are generated from."""
    import hashlib

    with open(os.path.join(proto_root, _PROTO_REL), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def stale(v1_dir=None):
    """True when the stubs in v1_dir are missing, or were generated from
    another calibration.proto than the one this checkout has (a pull that
    changed the contract). Without a proto to compare with, the stubs there
    are kept."""
    v1_dir = os.path.abspath(v1_dir or os.path.join(_HERE, "v1"))
    if not all(os.path.exists(os.path.join(v1_dir, name)) for name in MODULES):
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


def generate(v1_dir):
    """Writes calibration_pb2.py, .pyi and calibration_pb2_grpc.py into
    v1_dir, which must end in kvcal/v1 (protoc writes <root>/kvcal/v1/...),
    with the digest of the proto they came from (STAMP)."""
    from grpc_tools import protoc  # grpcio-tools
    import importlib.resources

    v1_dir = os.path.abspath(v1_dir)
    if v1_dir.split(os.sep)[-2:] != ["kvcal", "v1"]:
        raise ValueError(f"kvcal: stubs go into a directory .../kvcal/v1, not {v1_dir}")
    out_root = os.path.dirname(os.path.dirname(v1_dir))
    os.makedirs(v1_dir, exist_ok=True)
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


def generated_requirements(v1_dir):
    """The grpcio and protobuf requirements that the stubs in v1_dir check
    when they are imported, read from the generated code itself:

    - calibration_pb2_grpc.py raises RuntimeError ("the generated code ...
      depends on grpcio>=X") when grpc.__version__ is lower than its
      GRPC_GENERATED_VERSION, which is the grpcio-tools version that
      generated it: the floor is exactly that version.
    - calibration_pb2.py calls ValidateProtobufRuntimeVersion(PUBLIC, M, m,
      p, ...), which refuses a protobuf runtime older than M.m.p (the
      gencode's version); below the next major, as the gencode is only
      guaranteed to run within its major version.

    setup.py declares these as the package's grpcio and protobuf
    dependencies, so that pip installs what the shipped stubs accept."""
    with open(os.path.join(v1_dir, "calibration_pb2_grpc.py")) as f:
        grpc_code = f.read()
    with open(os.path.join(v1_dir, "calibration_pb2.py")) as f:
        pb_code = f.read()
    found = re.search(r"^GRPC_GENERATED_VERSION = '([0-9][0-9A-Za-z.]*)'$", grpc_code, re.M)
    if not found:
        raise RuntimeError(f"kvcal: no GRPC_GENERATED_VERSION in {v1_dir}/calibration_pb2_grpc.py "
                           "(grpcio-tools too old: kvcal needs one that writes the check)")
    grpc_floor = found.group(1)
    found = re.search(r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,"
                      r"\s*(\d+),\s*(\d+),\s*(\d+),\s*'([^']*)'", pb_code)
    if not found:
        raise RuntimeError(f"kvcal: no ValidateProtobufRuntimeVersion call in "
                           f"{v1_dir}/calibration_pb2.py (grpcio-tools too old)")
    major, minor, patch, suffix = found.groups()
    return [f"grpcio>={grpc_floor}",
            f"protobuf>={major}.{minor}.{patch}{suffix},<{int(major) + 1}"]


def tools_version():
    """The installed grpcio-tools' version; ImportError without it."""
    try:
        from grpc_tools.grpc_version import VERSION  # no protoc loaded yet
        return VERSION
    except ImportError:
        from importlib import metadata

        try:
            return metadata.version("grpcio-tools")
        except metadata.PackageNotFoundError:
            raise ImportError("grpcio-tools is not installed") from None


def cache_root():
    """Where a source tree's stubs are generated: $KVCAL_STUB_CACHE, else
    $XDG_CACHE_HOME/kvcal/stubs (~/.cache/kvcal/stubs); never the tree."""
    if os.environ.get("KVCAL_STUB_CACHE"):
        return os.path.abspath(os.environ["KVCAL_STUB_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvcal", "stubs")


def _cache_roots():
    roots = [cache_root()]
    if not os.environ.get("KVCAL_STUB_CACHE"):  # an unwritable home: the temporary directory
        import tempfile

        user = os.getuid() if hasattr(os, "getuid") else "user"
        roots.append(os.path.join(tempfile.gettempdir(), f"kvcal-stubs-{user}"))
    return roots


def _version_tuple(text):
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def _compatible(v1_dir):
    """True when the stubs in v1_dir pass their own checks with this
    environment's grpcio and protobuf (generated_requirements())."""
    try:
        from importlib import metadata

        grpc_req, pb_req = generated_requirements(v1_dir)
        grpc_version = metadata.version("grpcio")
        pb_version = metadata.version("protobuf")
    except Exception:  # noqa: BLE001 (unreadable stubs, or no grpcio/protobuf)
        return False
    pb_floor, pb_major_limit = re.match(r"protobuf>=([^,]+),<(\d+)$", pb_req).groups()
    return (_version_tuple(grpc_version) >= _version_tuple(grpc_req.split(">=", 1)[1])
            and _version_tuple(pb_floor) <= _version_tuple(pb_version)
            and _version_tuple(pb_version)[0] < int(pb_major_limit))


def _place(key, fill):
    """<a cache root>/<key>/kvcal/v1, made by fill(v1_dir) unless it is
    there already: in a scratch directory renamed into place, so that
    processes starting at once never see half a directory."""
    import shutil
    import tempfile

    error = None
    roots = _cache_roots()
    for root in roots:
        entry = os.path.join(root, key)
        v1_dir = os.path.join(entry, "kvcal", "v1")
        if not stale(v1_dir):
            return v1_dir
        try:
            os.makedirs(root, exist_ok=True)
            scratch = tempfile.mkdtemp(prefix=f".{key}.", dir=root)
        except OSError as e:
            error = e
            continue
        try:
            fill(os.path.join(scratch, "kvcal", "v1"))
            os.chmod(scratch, 0o755)  # mkdtemp's 0700: readable like what it holds
            if os.path.isdir(entry) and stale(v1_dir):  # damaged: replace it
                shutil.rmtree(entry, ignore_errors=True)
            try:
                os.rename(scratch, entry)
            except OSError:
                if stale(v1_dir):  # not another process's complete copy
                    raise
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return v1_dir
    raise OSError(f"kvcal: cannot write the generated gRPC stubs under {' or '.join(roots)}: "
                  f"{error}; set KVCAL_STUB_CACHE to a writable directory")


def _key(tools_version):
    return f"{proto_digest(find_proto_root())[:16]}-grpcio-tools-{tools_version}"


def checkout_stubs():
    """The kvcal/v1 directory holding stubs of the source tree's proto
    generated by this environment's grpcio-tools, generated on first use:
    <cache_root()>/<proto digest>-grpcio-tools-<version>/kvcal/v1. Without
    grpcio-tools (an editable install: setup.py put its build's stubs in the
    cache, seed_cache()), the newest cached stubs of this proto that pass
    their own checks with this environment's grpcio and protobuf; else
    ImportError."""
    try:
        tools = tools_version()
    except ImportError:
        import glob

        prefix = _key("")
        for root in _cache_roots():
            entries = glob.glob(os.path.join(root, glob.escape(prefix) + "*"))
            for entry in sorted(entries, reverse=True,
                                key=lambda e: _version_tuple(e.rsplit("-grpcio-tools-", 1)[1])):
                v1_dir = os.path.join(entry, "kvcal", "v1")
                if not stale(v1_dir) and _compatible(v1_dir):
                    return v1_dir
        raise
    return _place(_key(tools), generate)


def seed_cache(v1_dir, tools_version):
    """Puts stubs generated by grpcio-tools `tools_version` (setup.py's, for
    an editable install) where checkout_stubs() looks for them."""
    import shutil

    def fill(target):
        shutil.copytree(v1_dir, target)

    return _place(_key(tools_version), fill)
