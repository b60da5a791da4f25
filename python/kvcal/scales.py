"""Scales: finalized scales keyed by checkpoint tensor name, and the scales
file that `kvcal finalize` writes and `kvcal patch` reads.

    scales = client.finalize(granularity="head")
    scales.save("scales.safetensors")
    back = kvcal.Scales.load("scales.safetensors")

The file is safetensors: one F32 tensor per (layer, role) named
`model.layers.{L}.self_attn.{q,k,v}_scale`, shape [1] per tensor or
[heads, 1, 1] per head, and `__metadata__` with kvcal_scales_version,
granularity (tensor|head), observer (llm-compressor's name), format and
whatever else the producer recorded (client/checkpoint/scales_file.h).
"""
from __future__ import annotations

import json
import re
import struct
from typing import Any, Dict, Mapping, Optional

import numpy as np

from ._output import write_output_file

_NAME = re.compile(r"model\.layers\.(\d+)\.self_attn\.([qkv])_scale")


class Scales(dict):
    """dict name -> scale array, plus how the scales were made."""

    def __init__(self, tensors: Mapping[str, Any], *, granularity: str, observer: str,
                 fmt: str = "float8_e4m3fn", metadata: Optional[Mapping[str, str]] = None):
        super().__init__(tensors)
        self.granularity = granularity
        self.observer = observer
        self.format = fmt
        self.metadata = dict(metadata or {})

    def _like(self, tensors: Mapping[str, Any]) -> "Scales":
        return Scales(tensors, granularity=self.granularity, observer=self.observer,
                      fmt=self.format, metadata=self.metadata)

    def to_torch(self, device=None) -> "Scales":
        import torch

        return self._like({k: torch.as_tensor(np.asarray(v, dtype=np.float32), device=device)
                           for k, v in self.items()})

    def to_numpy(self) -> "Scales":
        return self._like({k: _as_numpy(v) for k, v in self.items()})

    def layers(self) -> Dict[int, Dict[str, np.ndarray]]:
        """{layer: {"q": array, "k": array, "v": array}} (flattened)."""
        out: Dict[int, Dict[str, np.ndarray]] = {}
        for name, value in self.items():
            m = _NAME.fullmatch(name)
            if m:
                out.setdefault(int(m.group(1)), {})[m.group(2)] = _as_numpy(value).reshape(-1)
        return dict(sorted(out.items()))

    def save(self, path: str) -> None:
        """Writes the scales file (atomically: a temporary file, then rename)."""
        metadata = dict(self.metadata)
        metadata.update({"kvcal_scales_version": "1", "granularity": self.granularity,
                         "observer": self.observer, "format": self.format})
        tensors = {}
        for name, value in self.items():
            if not _NAME.fullmatch(name):
                raise ValueError(f"kvcal: {name!r} is not model.layers.{{L}}.self_attn.{{q,k,v}}_scale")
            array = _as_numpy(value).astype(np.float32)
            shape = (array.size, 1, 1) if self.granularity == "head" else (1,)
            if self.granularity != "head" and array.size != 1:
                raise ValueError(f"kvcal: {name}: per-tensor scale has {array.size} values")
            tensors[name] = array.reshape(shape)
        write_safetensors(path, tensors, metadata)

    @classmethod
    def load(cls, path: str) -> "Scales":
        tensors, metadata = read_safetensors(path)
        granularity = metadata.get("granularity")
        if granularity not in ("tensor", "head"):
            raise ValueError(f"kvcal: {path}: __metadata__ has no granularity; not a kvcal scales file")
        return cls(tensors, granularity=granularity,
                   observer=metadata.get("observer", "static_minmax"),
                   fmt=metadata.get("format", "float8_e4m3fn"),
                   metadata={k: v for k, v in metadata.items()
                             if k not in ("granularity", "observer", "format", "kvcal_scales_version")})

    def __repr__(self) -> str:
        return (f"Scales({len(self)} tensors, granularity={self.granularity!r}, "
                f"observer={self.observer!r}, format={self.format!r})")


def _as_numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # torch.Tensor
        value = value.detach().to("cpu").float().numpy()
    return np.asarray(value, dtype=np.float32)


_DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.float64): "F64",
           np.dtype(np.int64): "I64", np.dtype(np.int32): "I32", np.dtype(np.uint8): "U8"}
_NP_DTYPES = {v: k for k, v in _DTYPES.items()}


def write_safetensors(path: str, tensors: Mapping[str, np.ndarray],
                      metadata: Optional[Mapping[str, str]] = None) -> None:
    """A minimal safetensors writer (numpy dtypes F32/F16/F64/I64/I32/U8)."""
    header: Dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    blobs = []
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        dtype = _DTYPES.get(array.dtype)
        if dtype is None:
            raise ValueError(f"kvcal: {name}: dtype {array.dtype} not supported")
        data = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)

    def write(f):
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)

    # A temporary file beside it, then rename (kvcal/_output.py).
    write_output_file(path, write)


def read_safetensors(path: str):
    """(tensors, metadata) of a small safetensors file, numpy arrays."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    metadata = header.pop("__metadata__", {}) or {}
    tensors = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        dtype = _NP_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"kvcal: {path}: {name}: dtype {info['dtype']} not supported here")
        tensors[name] = np.frombuffer(data[begin:end], dtype=dtype.newbyteorder("<")).reshape(
            info["shape"]).astype(dtype)
    return tensors, metadata
