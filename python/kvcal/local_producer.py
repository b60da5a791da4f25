"""The local-statistics side of a producer (kvcal.Producer(client,
local_statistics=True, flush_batches=N)): the batches a WorkerProducer is
handed are accumulated in this process by a kvcal.LocalStatistics instead
of being sent as chunks, and every `flush_batches` batches (and at flush()
and close()) the accumulated state is exported and merged into the session
on the worker with ImportState, then the local state starts afresh.

Exactly once, as far as it goes: each flush has an import id
"kvcal-local/<producer id>/<instance>/<n>" (n = 1, 2, ... per producer
object; instance: random per producer object, so that a second producer
of the same name never collides with the first's ids). A flush whose
ImportState failed with a connection error is retried with the same id and
the same state, and the worker applies an id at most once, so a flush is
merged once however often it is retried. What that does not cover
(docs/local-statistics.md): batches accumulated since the last flush are
lost when the producer dies; a flush the worker acknowledged and then lost
in a restart from an older snapshot (--state-dir) is not sent again;
nothing is resumable from a durable watermark yet.
"""
from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Optional, Set

import grpc

from kvcal.client import Client, KvcalError
from kvcal.local_statistics import LocalStatistics
from kvcal.producer import ProducerError
from kvcal.v1 import pb

log = logging.getLogger("kvcal")

DEFAULT_FLUSH_BATCHES = 64
# ImportState codes after which the same flush (same import id) is sent
# again: the connection, a worker restart; anything else is an error in the
# state or the session.
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED,
              grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL,
              grpc.StatusCode.UNKNOWN}


class LocalFlushes:
    """One producer's local state for one worker and its flushes (see the
    module docs). Thread-safe: accumulate(), batch_started() and flush() may
    be called from several threads (they take turns)."""

    def __init__(self, client: Client, session_id: str, producer_id: str, *,
                 flush_batches: int = DEFAULT_FLUSH_BATCHES, retry_timeout: float = 120.0):
        self.client = client
        self.session_id = session_id
        self.producer_id = producer_id
        self.flush_batches = int(flush_batches)
        self.retry_timeout = float(retry_timeout)
        self.local = LocalStatistics.for_session(client, session_id)
        self.instance = secrets.token_hex(6)
        self.flushes = 0  # flushes applied by the worker
        self.flush_bytes = 0  # serialized ImportStateRequest bytes of those flushes
        self.import_retries = 0  # ImportState calls sent again after a retryable error
        self._batches: Set[int] = set()  # batch numbers in the local state
        self._lock = threading.Lock()
        self._error: Optional[ProducerError] = None  # a failed flush; raised from then on

    def import_id(self, n: int) -> str:
        """The import id of flush n (1, 2, ...)."""
        return f"kvcal-local/{self.producer_id}/{self.instance}/{n}"

    def accumulate(self, layer: int, role, tensor, *, batch: int, layout: int,
                   head_offset: int) -> None:
        """Adds one tensor to the local state; first flushes when the state
        holds flush_batches batches and `batch` is not one of them."""
        with self._lock:
            self._raise_if_failed_locked()
            if batch not in self._batches and len(self._batches) >= self.flush_batches:
                self._flush_locked()
            self.local.accumulate(layer, role, tensor, batch=batch, layout=layout,
                                  head_offset=head_offset)
            self._batches.add(batch)

    def batch_started(self, batch: int) -> None:
        """new_batch(): flushes now when the state already holds
        flush_batches batches (so a finished batch does not wait for the
        next one's first tensor)."""
        with self._lock:
            self._raise_if_failed_locked()
            if batch not in self._batches and len(self._batches) >= self.flush_batches:
                self._flush_locked()

    def flush(self) -> None:
        """Exports what is accumulated and merges it into the session
        (nothing when nothing was accumulated since the last flush)."""
        with self._lock:
            self._raise_if_failed_locked()
            self._flush_locked()

    def discard(self, why: str) -> None:
        """abandon(): forgets the local state; later calls raise `why`."""
        with self._lock:
            if self._error is None:
                self._error = ProducerError(why)
            self.local.reset()
            self._batches.clear()

    def _raise_if_failed_locked(self) -> None:
        if self._error is not None:
            raise ProducerError(str(self._error)) from self._error

    def _flush_locked(self) -> None:
        if self.local.counters["chunks_applied"] == 0:
            self._batches.clear()
            return
        n = self.flushes + 1
        request = pb.ImportStateRequest(session_id=self.session_id,
                                        state=self.local.export_state(self.session_id),
                                        import_id=self.import_id(n))
        limit = getattr(self.client, "_max_message_bytes", None)
        if limit is not None and request.ByteSize() > limit:
            self._error = ProducerError(
                f"kvcal: producer {self.producer_id}: the local state of flush "
                f"{request.import_id} is {request.ByteSize()} bytes, over the client's "
                f"max_message_bytes {limit}; raise it (kvcal.Client(..., max_message_bytes=) "
                f"and the worker's --max-message-bytes) or shard the session over more workers")
            raise self._error
        try:
            self._import(request)
        except ProducerError as e:
            self._error = e
            raise
        self.flushes = n
        self.flush_bytes += request.ByteSize()
        self.local.reset()
        self._batches.clear()

    def _import(self, request: pb.ImportStateRequest) -> None:
        """ImportState, retried with the same request (and import id) after
        a retryable error for up to retry_timeout seconds. Before each try
        the session must exist: ImportState would otherwise create one from
        this partial state (a worker restarted without --state-dir)."""
        deadline = time.monotonic() + self.retry_timeout
        backoff = 0.05
        while True:
            try:
                self.client.status(self.session_id)
                self.client._call(f"ImportState (flush {request.import_id})",
                                  self.client.stub.ImportState, request)
                return
            except KvcalError as e:
                if e.code == grpc.StatusCode.NOT_FOUND:
                    raise ProducerError(
                        f"kvcal: producer {self.producer_id}: session {self.session_id} is gone "
                        f"from the worker {self.client.target} (restarted without --state-dir?); "
                        f"the local statistics of flush {request.import_id} are not "
                        f"imported: {e}") from e
                if e.code not in _RETRYABLE or time.monotonic() > deadline:
                    raise ProducerError(
                        f"kvcal: producer {self.producer_id}: flush {request.import_id} to "
                        f"{self.client.target} failed: {e}") from e
                log.info("kvcal: flush %s failed (%s); retrying with the same import id",
                         request.import_id, e.code)
                self._relocate()
                time.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                self.import_retries += 1

    def _relocate(self) -> None:
        if self.client.relocate is not None:
            try:  # a sharding client: the worker may be back under a new address
                self.client.relocate()
            except Exception as e:  # looking is best effort
                log.info("kvcal: looking for a moved worker: %s", e)
