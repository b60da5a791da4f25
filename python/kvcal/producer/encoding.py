"""Tensors as the wire carries them: the wire dtype of a tensor, its bytes
(a CUDA tensor through pinned host memory), and the cut of a tensor into
chunks of whole rows. A leaf of kvcal.producer: the local statistics and
the streaming producer both build on it."""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Optional, Tuple

import numpy as np

from kvcal import names
from kvcal.v1 import pb

if TYPE_CHECKING:  # an annotation only: the ring imports nothing of this module
    from kvcal.producer.ring import _SharedMemoryRing

# Every spelling of a role or layout (the proto's names table) and the wire
# numbers themselves -> wire number.
_ROLES = names.wire_numbers("Role")
_LAYOUTS = names.wire_numbers("Layout")


class _Payload:
    """The bytes of one put() tensor, shared by the chunks cut from it. For a
    CUDA tensor: a pinned host copy and the event that completes it, turned
    into bytes by the first chunk that is sent."""

    __slots__ = ("_data", "_pinned", "_event", "_lock")

    def __init__(self, data: Optional[bytes] = None, pinned=None, event=None):
        self._data = data
        self._pinned = pinned
        self._event = event
        self._lock = threading.Lock()

    def whole(self) -> bytes:
        with self._lock:
            if self._data is None:
                if self._event is not None:
                    self._event.synchronize()
                self._data = _torch_bytes(self._pinned)
                self._pinned = self._event = None
            return self._data


class _Chunk:
    """One numbered message: a piece of a tensor, or (partial set; a
    local-statistics flush) partial statistics."""
    __slots__ = ("sequence", "batch", "layer", "role", "dtype", "layout", "shape",
                 "head_offset", "payload", "begin", "end", "holdout", "partial")

    def __init__(self, **kw):
        self.partial = None
        for k, v in kw.items():
            setattr(self, k, v)

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    def request(self, session_id: str, producer_id: str,
                ring: Optional[_SharedMemoryRing] = None) -> pb.IngestRequest:
        if self.partial is not None:
            return pb.IngestRequest(session_id=session_id, producer_id=producer_id,
                                    sequence=self.sequence, partial_statistics=self.partial)
        request = pb.IngestRequest(
            session_id=session_id, producer_id=producer_id, sequence=self.sequence,
            batch=self.batch, layer=self.layer, role=self.role, dtype=self.dtype,
            layout=self.layout, shape=self.shape, head_offset=self.head_offset,
            holdout=self.holdout)
        whole = self.payload.whole()
        data = memoryview(whole)[self.begin:self.end]
        if ring is not None and len(data) <= ring.slot_bytes:
            # The window keeps the slot's previous chunk (sequence - slots)
            # acknowledged before this one is sent.
            request.shared_memory.CopyFrom(ring.put(self.sequence, data))
        elif self.begin == 0 and self.end == len(whole):
            request.data = whole  # a chunk of the whole tensor: no copy here
        else:
            request.data = bytes(data)
        return request


def _torch_bytes(tensor) -> bytes:
    import torch

    # numpy's tobytes gathers a strided view in its one copy (transformers'
    # q, k and v are transposed views): no contiguous() copy before it.
    if tensor.dtype in (torch.bfloat16, torch.float16):
        tensor = tensor.view(torch.int16)
    return tensor.numpy().tobytes()


def wire_dtype(dtype: np.dtype) -> int:
    """The wire DType of a numpy dtype: float32, float16 (native byte order)
    or ml_dtypes' bfloat16; TypeError for any other. The producers and
    kvcal.LocalStatistics take the same arrays."""
    if dtype == np.float32:
        return pb.DTYPE_F32
    if dtype == np.float16:
        return pb.DTYPE_F16
    if dtype.name == "bfloat16":  # ml_dtypes
        return pb.DTYPE_BF16
    raise TypeError(f"kvcal: dtype {dtype} is not supported (float32, float16, bfloat16)")


def _payload_of(tensor: Any) -> Tuple[_Payload, int, Tuple[int, ...]]:
    """(payload, wire dtype, shape). Copies: the caller may reuse its buffer."""
    if isinstance(tensor, np.ndarray):
        dtype = wire_dtype(tensor.dtype)
        array = np.ascontiguousarray(tensor)
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        return _Payload(array.tobytes()), dtype, tuple(array.shape)
    import torch  # only when handed something that is not numpy

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"kvcal: cannot send a {type(tensor).__name__}; pass a numpy array or torch tensor")
    dtypes = {torch.float32: pb.DTYPE_F32, torch.float16: pb.DTYPE_F16, torch.bfloat16: pb.DTYPE_BF16}
    if tensor.dtype not in dtypes:
        raise TypeError(f"kvcal: dtype {tensor.dtype} is not supported (float32, float16, bfloat16)")
    tensor = tensor.detach()
    shape = tuple(tensor.shape)
    if tensor.device.type == "cpu":
        return _Payload(_torch_bytes(tensor)), dtypes[tensor.dtype], shape
    if tensor.device.type == "cuda":
        pinned = torch.empty(shape, dtype=tensor.dtype, pin_memory=True)
        pinned.copy_(tensor, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(tensor.device))
        return _Payload(pinned=pinned, event=event), dtypes[tensor.dtype], shape
    return _Payload(_torch_bytes(tensor.cpu())), dtypes[tensor.dtype], shape


def _cut(shape: Tuple[int, ...], layout: int, itemsize: int, chunk_bytes: int,
         whole_sequences: bool = False):
    """Splits a tensor into contiguous byte ranges of at most chunk_bytes
    (when a single row allows it). Yields (shape, head_offset_delta, begin, end).
    whole_sequences (held-out tensors): never cut a sequence; a
    tokens_heads_dim tensor goes whole, one head of one sequence may pass
    chunk_bytes."""
    total = itemsize
    for d in shape:
        total *= d
    if total <= chunk_bytes or total == 0 or (whole_sequences
                                              and layout == pb.LAYOUT_TOKENS_HEADS_DIM):
        yield list(shape), 0, 0, total
        return
    if layout == pb.LAYOUT_TOKENS_HEADS_DIM:
        heads, dim = shape[-2], shape[-1]
        tokens = total // (heads * dim * itemsize)
        row = heads * dim * itemsize
        step = max(1, chunk_bytes // row)
        for t in range(0, tokens, step):
            n = min(step, tokens - t)
            yield [n, heads, dim], 0, t * row, (t + n) * row
        return
    batch, heads, tokens, dim = shape
    per_head = tokens * dim * itemsize
    per_batch = heads * per_head
    if per_batch <= chunk_bytes:
        step = chunk_bytes // per_batch
        for b in range(0, batch, step):
            n = min(step, batch - b)
            yield [n, heads, tokens, dim], 0, b * per_batch, (b + n) * per_batch
        return
    for b in range(batch):
        base = b * per_batch
        if per_head <= chunk_bytes or whole_sequences:
            step = max(1, chunk_bytes // per_head)
            for h in range(0, heads, step):
                n = min(step, heads - h)
                yield [1, n, tokens, dim], h, base + h * per_head, base + (h + n) * per_head
        else:
            row = dim * itemsize
            step = max(1, chunk_bytes // row)
            for h in range(heads):
                for t in range(0, tokens, step):
                    n = min(step, tokens - t)
                    begin = base + h * per_head + t * row
                    yield [1, 1, n, dim], h, begin, begin + n * row
