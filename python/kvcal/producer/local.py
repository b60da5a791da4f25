"""The local-statistics side of a producer (kvcal.Producer(client,
local_statistics=True, flush_batches=N, flush_seconds=T)): the batches a
WorkerProducer is handed are accumulated in this process by a
kvcal.LocalStatistics instead of being sent as chunks. Every
`flush_batches` batches, when `flush_seconds` have passed since the last
flush at a batch boundary, and at flush() and close(), the accumulated
statistics become one numbered message of the producer's own sequence
(IngestRequest.partial_statistics, docs/local-statistics.md), queued after
the chunks put before it, and the local state starts afresh.

Because a flush is a message in the producer's sequence space, everything
the producer does for chunks holds for it: exactly once (a resend after a
broken stream is acknowledged as a duplicate), kept until durable when the
worker persists its state (a worker restarted from an older snapshot gets
it again), and resumable: a producer created with resume=True continues
after the session's watermark. With flush_batches only (no flush_seconds
and no flush() in the middle), flush n of a producer that numbers its
batches 0, 1, 2, ... covers batches [(n-1) N, n N), so a restarted
producer that finds watermark w skips the first w N batches.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Optional, Set

import numpy as np

from kvcal.client import Client
from kvcal.producer.statistics import LocalStatistics, largest_statistics_bytes
from kvcal.producer.base import ProducerError
from kvcal.v1 import pb

log = logging.getLogger("kvcal")

DEFAULT_FLUSH_BATCHES = 64
# Bytes of an IngestRequest around its partial statistics (ids, sequence,
# the counters, field tags), more than enough: for the message-size check.
_REQUEST_OVERHEAD = 1024


def _host_copy(tensor):
    """A copy of a host tensor (numpy array or torch CPU tensor) in the same
    memory layout (a transposed view stays one, so the engine still reads
    it in place); None for anything else (CUDA tensors are accumulated by
    the caller's thread)."""
    if isinstance(tensor, np.ndarray):
        return tensor.copy(order="K")
    try:
        import torch
    except ImportError:
        return None
    if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
        return tensor.detach().clone()  # preserve_format: same strides
    return None


class _Background:
    """local_async=True: copies of host tensors accumulated on a thread of
    its own, so that the engine's work runs beside the caller's (a forward
    pass) instead of inside it. At most `max_bytes` of copies wait; put()
    blocks beyond. A tensor the engine refuses fails the producer: the next
    put(), flush() or close() raises ProducerError naming it, as a chunk the
    worker refuses does in-band."""

    def __init__(self, local: LocalStatistics, producer_id: str, max_bytes: int):
        self._local = local
        self._producer_id = producer_id
        self._max_bytes = max_bytes
        self._cv = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._held = 0
        self._busy = False
        self._closed = False
        self.error: Optional[ProducerError] = None
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"kvcal-local-{producer_id}")
        self._thread.start()

    def put(self, copy, layer, role, batch, layout, head_offset) -> None:
        nbytes = int(copy.nbytes)  # numpy and torch alike
        with self._cv:
            self._cv.wait_for(lambda: self.error is not None or not self._queue
                              or self._held + nbytes <= self._max_bytes)
            if self.error is not None:
                raise self.error
            self._queue.append((copy, nbytes, layer, role, batch, layout, head_offset))
            self._held += nbytes
            self._cv.notify_all()

    def drain(self) -> None:
        """Waits until every tensor put is accumulated; raises the error."""
        with self._cv:
            self._cv.wait_for(lambda: self.error is not None or
                              (not self._queue and not self._busy))
            if self.error is not None:
                raise self.error

    def close(self, discard: bool = False) -> None:
        with self._cv:
            if discard:
                self._held -= sum(item[1] for item in self._queue)
                self._queue.clear()
            self._closed = True
            self._cv.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                item = self._queue.popleft()
                self._busy = True
            copy, nbytes, layer, role, batch, layout, head_offset = item
            try:
                if self.error is None:
                    self._local.accumulate(layer, role, copy, batch=batch, layout=layout,
                                           head_offset=head_offset)
            except Exception as e:  # the engine's refusal
                with self._cv:
                    self.error = ProducerError(
                        f"kvcal: producer {self._producer_id}: layer {layer} {role} batch "
                        f"{batch}: {e}")
            finally:
                del copy, item
                with self._cv:
                    self._busy = False
                    self._held -= nbytes
                    self._cv.notify_all()


class LocalFlushes:
    """One producer's local state for one worker and its flushes (see the
    module docs). `send(partial)` queues one pb.PartialStatistics as the
    producer's next message (blocking while the producer holds too much).
    Thread-safe: accumulate(), batch_started() and flush() may be called
    from several threads (they take turns)."""

    def __init__(self, client: Client, session_id: str, producer_id: str,
                 send: Callable[[pb.PartialStatistics], None], *,
                 flush_batches: int = DEFAULT_FLUSH_BATCHES,
                 flush_seconds: Optional[float] = None, backend: str = "cpu",
                 device: int = 0, asynchronous: bool = False,
                 max_pending_bytes: int = 256 << 20):
        self.client = client
        self.session_id = session_id
        self.producer_id = producer_id
        self.flush_batches = int(flush_batches)
        self.flush_seconds = None if flush_seconds is None else float(flush_seconds)
        self._send = send
        # The client's max_message_bytes, which a flush must fit.
        self._message_limit = getattr(client, "_max_message_bytes", None)
        session = client.status(session_id)
        self.local = LocalStatistics.from_session(session, backend=backend, device=device)
        self._warn_if_a_flush_can_pass_the_limit(session)
        self.flushes = 0  # partial-statistics messages queued
        self.flush_bytes = 0  # bytes of their statistics
        self._batches: Set[int] = set()  # batch numbers in the local state
        self._last_flush = time.monotonic()
        self._lock = threading.Lock()
        self._error: Optional[ProducerError] = None  # raised from then on
        self._background = (_Background(self.local, producer_id, max_pending_bytes)
                            if asynchronous else None)

    def _warn_if_a_flush_can_pass_the_limit(self, session: pb.Session) -> None:
        """A warning now, before any forward pass, when this worker's share of
        the statistics can grow past the client's message limit: a flush over
        it is refused when it is made (docs/local-statistics.md)."""
        limit = self._message_limit
        if limit is None:
            return
        layers = range(session.num_layers)
        worker_ids = list(session.shard_map.worker_ids)
        if worker_ids and session.worker_id in worker_ids:
            mine = worker_ids.index(session.worker_id)
            layers = [layer for layer, owner in enumerate(session.shard_map.layer_owners)
                      if owner == mine]
        largest = largest_statistics_bytes(
            self.local.geometry, self.local.histograms, self.flush_batches, layers=layers,
            role_mask=self.local.role_mask) + _REQUEST_OVERHEAD
        if largest > limit:
            log.warning(
                "kvcal: producer %s: one flush of the local statistics of this worker's %d "
                "layers can reach %d bytes (the format's largest: every histogram bin filled), "
                "over the client's max_message_bytes %d. Real flushes are smaller and grow with "
                "the tokens they cover; one over the limit is refused when it is made. To be "
                "safe, raise max_message_bytes and the worker's --max-message-bytes to %d, or "
                "shard the session over more workers; flushing more often (flush_batches) keeps "
                "flushes smaller", self.producer_id, len(layers), largest, limit, largest)

    def accumulate(self, layer: int, role, tensor, *, batch: int, layout: int,
                   head_offset: int) -> None:
        """Adds one tensor to the local state; first flushes when `batch`
        starts a new batch and the flush policy says so."""
        with self._lock:
            self._raise_if_failed_locked()
            if batch not in self._batches and self._due_locked():
                self._flush_locked()
            copy = _host_copy(tensor) if self._background is not None else None
            if copy is not None:
                self._background.put(copy, layer, role, batch, layout, head_offset)
            else:
                self.local.accumulate(layer, role, tensor, batch=batch, layout=layout,
                                      head_offset=head_offset)
            self._batches.add(batch)

    def batch_started(self, batch: int) -> None:
        """new_batch(): flushes now when the policy says so (so a finished
        batch does not wait for the next one's first tensor)."""
        with self._lock:
            self._raise_if_failed_locked()
            if batch not in self._batches and self._due_locked():
                self._flush_locked()

    def flush(self) -> None:
        """Queues what is accumulated as the producer's next message
        (nothing when nothing was accumulated since the last flush)."""
        with self._lock:
            self._raise_if_failed_locked()
            self._flush_locked()

    def discard(self, why: str) -> None:
        """abandon(): forgets the local state; later calls raise `why`."""
        with self._lock:
            if self._error is None:
                self._error = ProducerError(why)
            if self._background is not None:
                self._background.close(discard=True)
                self._background = None
            self.local.reset()
            self._batches.clear()

    def close(self) -> None:
        """Stops the background accumulator (after flush())."""
        with self._lock:
            if self._background is not None:
                self._background.close()
                self._background = None

    def _due_locked(self) -> bool:
        if not self._batches:
            return False
        if len(self._batches) >= self.flush_batches:
            return True
        return (self.flush_seconds is not None
                and time.monotonic() - self._last_flush >= self.flush_seconds)

    def _raise_if_failed_locked(self) -> None:
        if self._error is None and self._background is not None:
            self._error = self._background.error
        if self._error is not None:
            raise ProducerError(str(self._error)) from self._error

    def _flush_locked(self) -> None:
        if self._background is not None:
            try:
                self._background.drain()
            except ProducerError as e:
                self._error = e
                raise
        self._last_flush = time.monotonic()
        counters = self.local.counters
        if counters["chunks_applied"] == 0:
            self._batches.clear()
            return
        statistics = self.local.export_statistics()
        partial = pb.PartialStatistics(statistics=statistics,
                                       tensors=counters["chunks_applied"],
                                       values=counters["values_ingested"],
                                       bytes=counters["bytes_ingested"])
        limit = self._message_limit
        size = partial.ByteSize() + _REQUEST_OVERHEAD
        if limit is not None and size > limit:
            self._error = ProducerError(
                f"kvcal: producer {self.producer_id}: the local statistics of flush "
                f"{self.flushes + 1} are {partial.ByteSize()} bytes, over the client's "
                f"max_message_bytes {limit}; raise it (kvcal.Client(..., max_message_bytes=) "
                f"and the worker's --max-message-bytes), flush more often (flush_batches) "
                f"or shard the session over more workers")
            raise self._error
        self._send(partial)  # raises ProducerError when the producer failed
        self.flushes += 1
        self.flush_bytes += len(statistics)
        self.local.reset()
        self._batches.clear()
