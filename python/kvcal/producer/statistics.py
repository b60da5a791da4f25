"""kvcal.LocalStatistics: the worker's statistics engine in the producer's
process, so that statistics, not activations, can travel.

    import kvcal

    client = kvcal.Client("127.0.0.1:50051")
    client.create_session(model.config)
    local = kvcal.LocalStatistics.for_session(client)   # the session's geometry and options
    for batch, (q, k, v) in enumerate(batches):         # [tokens, heads, head_dim]
        local.accumulate(layer, "q", q, batch=batch)
        ...
    client.import_state(local.export_state(), import_id="rank0-final")
    scales = client.finalize(observer="mse", granularity="head")

accumulate() runs the engine's C++ code (the extension kvcal._engine,
python/ext/; the same CPU backend and checks as a worker's ingest) on the
tensor's memory without copying it: numpy arrays and torch CPU tensors of
float32, float16 or bfloat16 (numpy: ml_dtypes.bfloat16), in layout
tokens_heads_dim [..., heads, head_dim] (the default) or heads_tokens_dim
[batch, heads, tokens, head_dim]. A heads_tokens_dim tensor that is a
transposed view of contiguous [batch, tokens, heads, head_dim] memory (what
transformers' attention hands out) is read in place as tokens_heads_dim;
any other non-contiguous tensor is copied once. CUDA tensors: see
docs/local-statistics.md (compiled in CUDA builds, not yet run on a GPU;
with the CPU backend they are copied to host memory).

export_state() returns a kvcal.v1.SessionState, the message a worker's
ExportState returns, which ImportState merges into a session exactly:
histograms, tails, min/max, counts and the per-batch min/max that the EMA
and memoryless observers read are the worker's for the same batches; only
the float64 sums (which no scale depends on) may differ in the last bits,
by summation order. It has no producer watermarks (nothing here is
sequenced): import it once per producer with an import_id, which the worker
applies at most once.

export_statistics() returns the statistics alone: what a local-statistics
producer (kvcal.Producer(..., local_statistics=True), kvcal push
--local-statistics) sends as IngestRequest.partial_statistics, numbered in
its own sequence (exactly once, durable and resumable like a chunk).
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import os
import sys
from typing import Any, Iterable, Optional, Tuple, Union

import numpy as np

from kvcal import _ranges, names
from kvcal.client import DEFAULT_HISTOGRAMS, Client, Geometry
from kvcal.producer.encoding import wire_dtype
from kvcal.v1 import pb

log = logging.getLogger("kvcal")

_ROLES = names.wire_numbers("Role")
_LAYOUTS = names.wire_numbers("Layout")
_ROLE_BITS = {pb.ROLE_Q: 1, pb.ROLE_K: 2, pb.ROLE_V: 4}

# kvcal/ (this file is kvcal/producer/statistics.py), where a wheel carries _engine.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_REPO_ROOT = os.path.dirname(os.path.dirname(_PACKAGE_DIR))
# Where a CMake build puts the module (relative to the build directory).
_BUILD_SUBDIR = os.path.join("python", "ext")

_engine_module = None


def _engine_dirs():
    """(description, directory) where a checkout's build may hold _engine."""
    out = []
    build_dir = os.environ.get("KVCAL_BUILD_DIR")
    if build_dir:
        out.append(("$KVCAL_BUILD_DIR", os.path.join(build_dir, _BUILD_SUBDIR)))
    out.append(("the checkout's build", os.path.join(_REPO_ROOT, "build", _BUILD_SUBDIR)))
    return out


def _cpython(suffix):
    """'.cpython-311-x86_64-linux-gnu.so' -> 'CPython 3.11' (else the suffix)."""
    import re

    found = re.match(r"\.cpython-(\d)(\d+)", suffix)
    return f"CPython {found.group(1)}.{found.group(2)}" if found else suffix


def load_engine():
    """The extension module kvcal._engine: installed with the package (the
    wheel carries it, for the CPython the wheel was built with), or from a
    checkout's build ($KVCAL_BUILD_DIR/python/ext, then
    <repo>/build/python/ext). ImportError naming where it looked."""
    global _engine_module
    if _engine_module is not None:
        return _engine_module
    try:
        _engine_module = importlib.import_module("kvcal._engine")  # the wheel's
        return _engine_module
    except ModuleNotFoundError as e:
        if e.name != "kvcal._engine":
            raise
    # The package's own module, built for another Python (a py3-none wheel
    # installed into another Python than the one it was built with).
    carried = sorted(f for f in os.listdir(_PACKAGE_DIR) if f.startswith("_engine."))
    searched, others = [], []
    for what, directory in _engine_dirs():
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = os.path.join(directory, "_engine" + suffix)
            if os.path.isfile(path):
                spec = importlib.util.spec_from_file_location("kvcal._engine", path)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                sys.modules["kvcal._engine"] = module
                _engine_module = module
                return module
        searched.append(f"{directory} ({what})")
        if os.path.isdir(directory):
            others += [f for f in os.listdir(directory) if f.startswith("_engine.")]
    if carried:
        import platform

        raise ImportError(
            f"kvcal: this kvcal package carries the statistics engine kvcal._engine for "
            f"{', '.join(_cpython(f[len('_engine'):]) for f in carried)} ({', '.join(carried)} "
            f"in {_PACKAGE_DIR}), and this is {platform.python_implementation()} "
            f"{platform.python_version()}, which loads "
            f"_engine{importlib.machinery.EXTENSION_SUFFIXES[0]}. The kvcal and kvcal-worker "
            "programs work with any Python 3; kvcal.LocalStatistics (local statistics) needs "
            "the wheel installed into that Python, or the extension built for this one in a "
            f"checkout: cmake -S . -B build-ext -G Ninja -DPython3_EXECUTABLE={sys.executable} "
            "&& cmake --build build-ext --target kvcal_engine_module (needs this Python's "
            "headers and pybind11), then KVCAL_BUILD_DIR=$PWD/build-ext; also searched: "
            + "; ".join(searched) + ".")
    hint = (f"; found {', '.join(sorted(others))}, built for another Python than this one "
            f"({sys.version.split()[0]}, suffix {importlib.machinery.EXTENSION_SUFFIXES[0]})"
            if others else "")
    raise ImportError(
        "kvcal: the statistics engine extension kvcal._engine is not available; searched: "
        + "; ".join(searched) + hint + ". Build it with `./run build` (needs pybind11-dev and "
        "python3-dev, which ./run installs) and set KVCAL_BUILD_DIR to the build directory, "
        "or install the wheel of `./run wheel`, which carries it.")


def _role_number(role) -> int:
    key = role.lower() if isinstance(role, str) else role
    if isinstance(key, bool) or key not in _ROLES:
        raise ValueError(f"kvcal: role {role!r} is not q, k or v")
    return _ROLES[key]


def _layout_number(layout) -> int:
    key = layout.lower().replace("-", "_") if isinstance(layout, str) else layout
    if isinstance(key, bool) or key not in _LAYOUTS:
        raise ValueError(f"kvcal: layout {layout!r} is not tokens_heads_dim or heads_tokens_dim")
    return _LAYOUTS[key]


def _hf_as_vllm(shape: Tuple[int, ...], contiguous_after_swap: bool, layout: int):
    """For a heads_tokens_dim [b, h, t, d] view whose memory is contiguous
    [b, t, h, d]: that shape in tokens_heads_dim (same values per head)."""
    if layout == pb.LAYOUT_HEADS_TOKENS_DIM and len(shape) == 4 and contiguous_after_swap:
        b, h, t, d = shape
        return (b, t, h, d), pb.LAYOUT_TOKENS_HEADS_DIM
    return None


def largest_statistics_bytes(geometry: Union[Geometry, dict], histograms: int, batches: int, *,
                             layers: Optional[Iterable[int]] = None,
                             role_mask: int = 0b111) -> int:
    """The largest serialized statistics (docs/formats.md "The statistics
    state") a state of this geometry, histogram resolution and role set
    (bit 0 Q, 1 K, 2 V) can have: the heads of `layers` (default: every
    layer) each with a value in every histogram bin (so a full tail of 256)
    and a record for each of `batches` batches, the other layers' heads
    empty. Statistics of real activations are smaller; how much smaller
    depends on the tokens they cover."""
    if isinstance(geometry, dict):
        geometry = Geometry(**geometry)
    heads = ((geometry.num_attention_heads if role_mask & 1 else 0)
             + (geometry.num_key_value_heads if role_mask & 2 else 0)
             + (geometry.num_key_value_heads if role_mask & 4 else 0))
    # min, max, finite, nan, inf, sum, sum of squares; then the record count.
    empty_head = 48 + 4
    full_head = empty_head + 16 * batches
    if histograms:
        empty_head += 4 + 4  # the bin count and the tail's count
        full_head += 4 + 12 * (2 + 48 * histograms + 1) + 4 + 4 * 256
    num_layers = geometry.num_layers
    full_layers = num_layers if layers is None else len(set(layers))
    header, checksum = 8 * 4, 8
    return header + heads * (full_layers * full_head
                             + (num_layers - full_layers) * empty_head) + checksum


class LocalStatistics:
    """The statistics of one session's geometry and options, accumulated in
    this process (see the module docs).

    geometry: a kvcal.Geometry or a dict with num_layers,
    num_attention_heads, num_key_value_heads, head_dim. histograms, roles and
    reject_non_finite as in Client.create_session: they must be the
    session's (ImportState refuses another geometry, histogram resolution or
    role set), so for_session() reads them from the session.
    backend: "cpu" (default), "cuda" or "auto"; device: the CUDA device;
    threads: CPU threads for large tensors (0: all cores, 1: the calling
    thread only).
    """

    def __init__(self, geometry: Union[Geometry, dict], *, histograms: int = DEFAULT_HISTOGRAMS,
                 roles: Iterable[str] = (), reject_non_finite: bool = False,
                 holdout_budget_bytes: int = 0, backend: str = "cpu", device: int = 0,
                 threads: int = 0):
        if isinstance(geometry, dict):
            geometry = Geometry(**geometry)
        if not isinstance(geometry, Geometry):
            raise TypeError(f"kvcal: geometry must be a kvcal.Geometry or a dict, not "
                            f"{type(geometry).__name__}")
        histograms = _ranges.check_histograms(histograms)
        self.holdout_budget_bytes = _ranges.check_int("LocalStatistics", "holdout_budget_bytes",
                                                    holdout_budget_bytes, _ranges.UINT64)
        device = _ranges.check_int("LocalStatistics", "device", device, _ranges.IntRange(0, 1 << 16))
        threads = _ranges.check_int("LocalStatistics", "threads", threads, _ranges.IntRange(0, 4096))
        role_mask = 0
        for r in roles:
            role_mask |= _ROLE_BITS[_role_number(r)]
        self.geometry = geometry
        self.histograms = histograms
        self.role_mask = role_mask or 0b111
        self.reject_non_finite = bool(reject_non_finite)
        self._host_copy_logged = False
        engine = load_engine()
        self._engine = engine.Engine(
            geometry.num_layers, geometry.num_attention_heads, geometry.num_key_value_heads,
            geometry.head_dim, histograms, self.role_mask, self.reject_non_finite,
            str(backend), device, threads)

    @classmethod
    def from_session(cls, session: pb.Session, **kwargs) -> "LocalStatistics":
        """For a session as GetSession describes it (Client.status())."""
        geometry = Geometry(session.num_layers, session.num_attention_heads,
                            session.num_key_value_heads, session.head_dim)
        roles = [{pb.ROLE_Q: "q", pb.ROLE_K: "k", pb.ROLE_V: "v"}[r] for r in session.roles]
        return cls(geometry, histograms=session.histogram_bins_per_octave, roles=roles,
                   reject_non_finite=session.reject_non_finite,
                   holdout_budget_bytes=session.holdout_budget_bytes, **kwargs)

    @classmethod
    def for_session(cls, client: Client, session_id: Optional[str] = None,
                    **kwargs) -> "LocalStatistics":
        """For the client's session (or session_id): its geometry, histogram
        resolution, roles and non-finite rule, read with GetSession."""
        return cls.from_session(client.status(session_id), **kwargs)

    @property
    def backend(self) -> str:
        """"cpu" or "cuda": where the statistics are kept."""
        return self._engine.backend

    @property
    def counters(self) -> dict:
        """What the worker's session counters would say for the same tensors
        (one chunk per accumulate() call)."""
        chunks, values, nbytes = self._engine.counters()
        return {"chunks_applied": chunks, "values_ingested": values, "bytes_ingested": nbytes}

    def accumulate(self, layer: int, role, tensor: Any, *, batch: int,
                   layout="tokens_heads_dim", head_offset: int = 0) -> None:
        """Adds one tensor of (layer, role) to calibration batch `batch`.

        The tensor carries heads [head_offset, head_offset + heads) of the
        role. Refused (ValueError naming what was wrong; nothing of the tensor
        is counted) as a worker refuses the chunk: layer out of range, role
        not collected, wrong rank, head_dim or head count, and with
        reject_non_finite any NaN or Inf. TypeError for an unsupported type
        or dtype.
        """
        role_number = _role_number(role)
        layout_number = _layout_number(layout)
        layer = _ranges.check_int("accumulate", "layer", layer, _ranges.IntRange(0, (1 << 32) - 1))
        head_offset = _ranges.check_int("accumulate", "head_offset", head_offset,
                                      _ranges.IntRange(0, (1 << 32) - 1))
        batch = _ranges.check_int("accumulate", "batch", batch, _ranges.UINT64)
        if isinstance(tensor, np.ndarray):
            self._accumulate_numpy(layer, role_number, tensor, batch, layout_number, head_offset)
            return
        try:
            import torch
        except ImportError:
            torch = None
        if torch is None or not isinstance(tensor, torch.Tensor):
            raise TypeError(f"kvcal: cannot accumulate a {type(tensor).__name__}; pass a numpy "
                            f"array or a torch tensor")
        self._accumulate_torch(torch, layer, role_number, tensor, batch, layout_number,
                               head_offset)

    def _accumulate_numpy(self, layer, role, array, batch, layout, head_offset):
        dtype = wire_dtype(array.dtype)
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        shape = tuple(array.shape)
        if not array.flags.c_contiguous:
            swapped = (array.ndim == 4 and np.swapaxes(array, 1, 2).flags.c_contiguous)
            as_vllm = _hf_as_vllm(shape, swapped, layout)
            if as_vllm is not None:
                shape, layout = as_vllm
                array = np.swapaxes(array, 1, 2)
            else:
                array = np.ascontiguousarray(array)
        # Bytes in place (a custom dtype such as bfloat16 need not export
        # a buffer format).
        data = array.reshape(-1).view(np.uint8)
        self._engine.accumulate(layer, role, dtype, layout, list(shape), head_offset, batch, data)

    def _accumulate_torch(self, torch, layer, role, tensor, batch, layout, head_offset):
        dtypes = {torch.float32: pb.DTYPE_F32, torch.float16: pb.DTYPE_F16,
                  torch.bfloat16: pb.DTYPE_BF16}
        if tensor.dtype not in dtypes:
            raise TypeError(f"kvcal: dtype {tensor.dtype} is not supported "
                            f"(float32, float16, bfloat16)")
        dtype = dtypes[tensor.dtype]
        tensor = tensor.detach()
        shape = tuple(tensor.shape)
        if not tensor.is_contiguous():
            swapped = tensor.dim() == 4 and tensor.transpose(1, 2).is_contiguous()
            as_vllm = _hf_as_vllm(shape, swapped, layout)
            if as_vllm is not None:
                shape, layout = as_vllm
                tensor = tensor.transpose(1, 2)
            else:
                tensor = tensor.contiguous()
        if tensor.device.type == "cuda" and self._engine.accepts_device_data:
            # Read in place on the device after the work queued so far on
            # the current stream (the event); finished when this returns.
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(tensor.device))
            self._engine.accumulate_device(
                layer, role, dtype, layout, list(shape), head_offset, batch, tensor.data_ptr(),
                tensor.numel() * tensor.element_size(), event.cuda_event)
            return
        if tensor.device.type != "cpu":
            if not self._host_copy_logged:
                log.warning("kvcal: LocalStatistics on the %s backend copies %s tensors to host "
                            "memory (backend='cuda' reads them in place)", self.backend,
                            tensor.device.type)
                self._host_copy_logged = True
            tensor = tensor.cpu()
        data = tensor.reshape(-1).view(torch.uint8).numpy()
        self._engine.accumulate(layer, role, dtype, layout, list(shape), head_offset, batch, data)

    def export_state(self, session_id: str = "") -> pb.SessionState:
        """Everything accumulated, as a kvcal.v1.SessionState (what a worker's
        ExportState returns): Client.import_state() merges it into a session
        of the same geometry and options. No producer watermarks."""
        statistics, nonfinite = self._engine.export()
        counters = self.counters
        g = self.geometry
        return pb.SessionState(
            format_version=1, session_id=session_id, num_layers=g.num_layers,
            num_attention_heads=g.num_attention_heads, num_key_value_heads=g.num_key_value_heads,
            head_dim=g.head_dim, histogram_bins_per_octave=self.histograms,
            roles=[r for r in (pb.ROLE_Q, pb.ROLE_K, pb.ROLE_V) if self.role_mask & _ROLE_BITS[r]],
            statistics=statistics, chunks_applied=counters["chunks_applied"],
            values_ingested=counters["values_ingested"],
            bytes_ingested=counters["bytes_ingested"], nonfinite_values=nonfinite,
            holdout_budget_bytes=self.holdout_budget_bytes,
            reject_non_finite=self.reject_non_finite)

    def export_statistics(self) -> bytes:
        """The statistics alone, in the engine's serialized format (what
        export_state() carries as SessionState.statistics, and a
        local-statistics producer sends as PartialStatistics.statistics)."""
        return self._engine.export()[0]

    def reset(self) -> None:
        """Forgets everything accumulated (and the counters)."""
        self._engine.reset()
