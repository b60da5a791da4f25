"""kvcal.WorkerProducer: one Ingest stream to one worker, exactly once (the
protocol of kvcal.producer's module docs, and of the C++ Uploader,
docs/producers.md)."""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Deque, List, Optional, Tuple

import grpc

from kvcal.client import Client, KvcalError
from kvcal.producer.base import DEFAULT_WINDOW, ProducerError, _check_options, _ProducerBase
from kvcal import _ranges
from kvcal.producer.encoding import _LAYOUTS, _ROLES, _Chunk, _cut, _payload_of
from kvcal.producer.local import DEFAULT_FLUSH_BATCHES, LocalFlushes
from kvcal.producer.ring import _SHM_FALLBACK, _SharedMemoryFull, _SharedMemoryRing
from kvcal.v1 import pb

log = logging.getLogger("kvcal")

# How often a producer that waits only for durability asks the worker for
# its durable watermark (GetSession): the worker snapshots on its own clock
# and sends no response for it while nothing is being sent.
_DURABLE_POLL_S = 0.2
# The codes after which the stream is re-established and resent from the
# watermark; anything else is an error in the data or the session.
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED,
              grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL,
              grpc.StatusCode.UNKNOWN}


class WorkerProducer(_ProducerBase):
    """Streams chunks to one session on one worker as one producer; see the
    module docs. kvcal.Producer(client) returns one for a client of one
    worker; a ShardedProducer holds one per worker."""

    def __init__(self, client: Client, session_id: Optional[str] = None, producer_id: str = "",
                 *, chunk_bytes: int = 4 << 20, max_pending_chunks: int = 1024,
                 max_pending_bytes: int = 512 << 20, window: int = DEFAULT_WINDOW,
                 keep_until_durable: Optional[bool] = None, start_sequence: Optional[int] = None,
                 resume: bool = False,
                 reconnect_timeout: float = 120.0, durable_timeout: float = 120.0,
                 shared_memory: bool = False, local_statistics: bool = False,
                 flush_batches: Optional[int] = None, flush_seconds: Optional[float] = None,
                 local_backend: Optional[str] = None, local_device: Optional[int] = None,
                 local_async: Optional[bool] = None):
        _check_options(chunk_bytes=chunk_bytes, max_pending_chunks=max_pending_chunks,
                       max_pending_bytes=max_pending_bytes, window=window,
                       start_sequence=start_sequence, reconnect_timeout=reconnect_timeout,
                       durable_timeout=durable_timeout, local_statistics=local_statistics,
                       flush_batches=flush_batches, flush_seconds=flush_seconds,
                       local_backend=local_backend, local_device=local_device,
                       local_async=local_async)
        workers = getattr(client, "workers", None)
        if workers is not None:
            raise ValueError(f"kvcal: a WorkerProducer streams to one worker and this client has "
                             f"{len(workers)}; use kvcal.Producer(client), which returns a "
                             f"ShardedProducer for it")
        self.client = client
        self.session_id = session_id or client._session(None)
        self.producer_id = producer_id or "default"
        self.chunk_bytes = int(chunk_bytes)
        self.max_pending_chunks = int(max_pending_chunks)
        self.max_pending_bytes = int(max_pending_bytes)
        self.window = int(window)
        self.keep_until_durable = keep_until_durable
        self.reconnect_timeout = reconnect_timeout
        self.durable_timeout = durable_timeout
        self.reconnects = 0  # streams re-established after a failure
        # (worker watermark, acknowledged before) at each reconnect: a worker
        # watermark below the acknowledged one means the worker restarted from
        # a snapshot and the chunks after it were sent again.
        self.resumes: List[Tuple[int, int]] = []
        # shared_memory=True: the ring, until the worker turns out unable to
        # use it (then None and the reason in shared_memory_fallback).
        self._ring: Optional[_SharedMemoryRing] = None
        self._retired_ring: Optional[_SharedMemoryRing] = None  # see _shm_fall_back
        self._shm_requested = bool(shared_memory)
        self.shared_memory_fallback: Optional[str] = None
        if shared_memory:
            try:
                self._ring = _SharedMemoryRing(self.window, self.chunk_bytes)
            except OSError as e:
                self._shm_fall_back(f"cannot create shared memory: {e}")

        self._init_stream_state()
        self._next_sequence = self._first_sequence(start_sequence, resume)
        self._acked = self._durable = self._next_sequence - 1
        self._wire_bytes = 0  # serialized IngestRequests sent (resends included)
        self._local = self._make_local(local_statistics, flush_batches, flush_seconds,
                                       local_backend, local_device, bool(local_async))
        self._thread = threading.Thread(target=self._run, name=f"kvcal-producer-{self.producer_id}",
                                        daemon=True)
        self._thread.start()

    def _init_stream_state(self) -> None:
        """The state the streaming thread and put() share."""
        # One condition for all of the state below: notified on every change
        # a waiter may wait for (a chunk put, an acknowledgement or durable
        # watermark that releases chunks, close, an error, a stream's end).
        self._cv = threading.Condition()
        self._chunks: Deque[_Chunk] = collections.deque()  # unreleased, in order
        self._held_bytes = 0
        self._acked = 0
        self._durable = 0
        self._seen_durable = False
        self._error: Optional[BaseException] = None
        self._closing = False
        self._progress = False  # the current stream has had a response
        self._batch = 0
        self._batches_started = False
        # Chunks put while True are sent as held out (see the module docs).
        self.holdout = False
        self.geometry = None  # the session's, read from the worker by _first_sequence

    def _first_sequence(self, start_sequence: Optional[int], resume: bool) -> int:
        """The sequence of the first chunk: `start_sequence`, else one past
        the worker's watermark of this producer (which must be 0 unless
        `resume`). Reads the session's geometry too."""
        watermark = self._server_watermark()  # also reads the geometry
        applied = watermark[0] if watermark else 0
        if start_sequence is None:
            # docs/producers.md: a producer name that already has chunks is
            # refused unless the caller says it resumes (as the C++ Uploader).
            if applied > 0 and not resume:
                raise ValueError(
                    f"kvcal: session {self.session_id}, producer {self.producer_id} already has "
                    f"{applied} chunks applied; use a new producer_id, or resume=True to "
                    f"continue after chunk {applied}")
            start_sequence = applied + 1
        return int(start_sequence)

    def _make_local(self, local_statistics: bool, flush_batches: Optional[int],
                    flush_seconds: Optional[float], backend: Optional[str],
                    device: Optional[int], asynchronous: bool):
        """local_statistics=True: the LocalFlushes that put() hands the batches
        that are not held out to, instead of sending them; else None."""
        if not local_statistics:
            return None
        return LocalFlushes(
            self.client, self.session_id, self.producer_id, self._put_partial,
            flush_batches=DEFAULT_FLUSH_BATCHES if flush_batches is None else flush_batches,
            flush_seconds=flush_seconds, backend=backend or "cpu", device=device or 0,
            asynchronous=asynchronous, max_pending_bytes=self.max_pending_bytes)

    # -- producer side ---------------------------------------------------------
    @property
    def last_sequence(self) -> int:
        return self._next_sequence - 1

    @property
    def local_statistics(self) -> bool:
        """Batches are accumulated here and shipped as statistics
        (local_statistics=True)."""
        return self._local is not None

    @property
    def shared_memory(self) -> bool:
        """Chunks go by shared-memory reference (shared_memory=True and the
        worker accepted the region)."""
        return self._shm_requested and self.shared_memory_fallback is None

    def put(self, layer: int, role, tensor, *, batch: Optional[int] = None,
            layout="heads_tokens_dim", head_offset: int = 0,
            holdout: Optional[bool] = None) -> None:
        """Queues one tensor of (layer, role) for the current batch.

        layout heads_tokens_dim (alias hf): [batch, heads, tokens, head_dim];
        tokens_heads_dim (alias vllm): [..., heads, head_dim]. The tensor
        carries heads [head_offset, head_offset + heads) of the role.
        holdout (default: self.holdout) sends it as held out.
        """
        if isinstance(role, str):
            role = role.lower()
        holdout = self.holdout if holdout is None else bool(holdout)
        if role not in _ROLES:
            raise ValueError(f"kvcal: role {role!r} is not q, k or v")
        if isinstance(layout, str):
            layout = layout.lower().replace("-", "_")
        if layout not in _LAYOUTS:
            raise ValueError(f"kvcal: layout {layout!r} is not heads_tokens_dim or tokens_heads_dim")
        layout = _LAYOUTS[layout]
        layer = _ranges.check_int("put", "layer", layer, _ranges.IntRange(0, (1 << 32) - 1))
        head_offset = _ranges.check_int("put", "head_offset", head_offset,
                                      _ranges.IntRange(0, (1 << 32) - 1))
        if batch is None:
            self._batches_started = True
            batch = self._batch
        batch = _ranges.check_int("put", "batch", batch, _ranges.IntRange(0, (1 << 64) - 1))
        if self._local is not None and not holdout:
            self._put_local(layer, layout, role, tensor, batch, head_offset)
            return
        payload, dtype, shape = _payload_of(tensor)
        if layout == pb.LAYOUT_HEADS_TOKENS_DIM and len(shape) != 4:
            raise ValueError(f"kvcal: layout heads_tokens_dim needs [batch, heads, tokens, head_dim], "
                             f"got shape {list(shape)}")
        if layout == pb.LAYOUT_TOKENS_HEADS_DIM and len(shape) < 2:
            raise ValueError(f"kvcal: layout tokens_heads_dim needs [..., heads, head_dim], got {list(shape)}")
        itemsize = 4 if dtype == pb.DTYPE_F32 else 2
        pieces = list(_cut(shape, layout, itemsize, self.chunk_bytes, whole_sequences=holdout))
        with self._cv:
            for piece_shape, head_delta, begin, end in pieces:
                self._enqueue_locked(batch=int(batch), layer=int(layer), role=_ROLES[role],
                                     dtype=dtype, layout=layout, shape=piece_shape,
                                     head_offset=int(head_offset) + head_delta, payload=payload,
                                     begin=begin, end=end, holdout=holdout)

    def _put_local(self, layer, layout, role, tensor, batch, head_offset) -> None:
        """put() in local-statistics mode: into the local state (flushed
        first when it holds flush_batches other batches)."""
        with self._cv:
            self._raise_if_failed_locked()
            if self._closing:
                raise ProducerError("kvcal: put() after close()")
        self._local.accumulate(layer, role, tensor, batch=batch, layout=layout,
                               head_offset=head_offset)

    def _put_partial(self, partial: pb.PartialStatistics) -> None:
        """A local-statistics flush: `partial` becomes the next message of the
        producer's sequence, after every chunk put before it."""
        with self._cv:
            self._enqueue_locked(partial=partial, begin=0, end=len(partial.statistics),
                                 holdout=False)

    def _enqueue_locked(self, **fields) -> None:
        """Numbers the next message (a _Chunk of `fields`) and queues it for
        the sender, once it has room for its bytes."""
        self._wait_for_room_locked(fields["end"] - fields["begin"])
        chunk = _Chunk(sequence=self._next_sequence, **fields)
        self._next_sequence += 1
        self._chunks.append(chunk)
        self._held_bytes += chunk.nbytes
        self._cv.notify_all()  # the sender: new data

    def _batch_started(self, batch: int) -> None:
        if self._local is not None:
            self._local.batch_started(batch)

    def _flush_local(self) -> None:
        if self._local is not None:
            self._local.flush()

    def flush(self, durable: Optional[bool] = None, timeout: Optional[float] = None) -> None:
        """Waits until every chunk put so far is applied; with durable=True
        (default: when chunks are kept until durable) until it is on disk.
        In local-statistics mode the local state is first queued as the
        producer's next message, and waited for like a chunk."""
        self._flush_local()
        last = self.last_sequence
        deadline = None if timeout is None else time.monotonic() + timeout
        durable_deadline = None  # set once everything is acknowledged
        while True:
            with self._cv:
                self._raise_if_failed_locked()
                want_durable = self._want_durable() if durable is None else durable
                if self._acked >= last and (not want_durable or self._durable >= last):
                    return
                now = time.monotonic()
                only_durability = self._acked >= last
                if only_durability:
                    durable_deadline = durable_deadline or now + self.durable_timeout
                    if now > durable_deadline:
                        raise ProducerError(self._not_durable_message_locked(last))
                else:
                    durable_deadline = None
                if deadline is not None and now >= deadline:
                    raise TimeoutError(f"kvcal: flush: acknowledged {self._acked}, durable "
                                       f"{self._durable} of {last} chunks")
                # Acknowledgements and errors notify; durability is asked for.
                wait = _DURABLE_POLL_S if only_durability else None
                if deadline is not None:
                    wait = deadline - now if wait is None else min(wait, deadline - now)
                self._cv.wait(wait)
            if only_durability:
                self._poll_durable()

    def _poll_durable(self) -> None:
        """Reads the durable watermark with GetSession (no response arrives
        for it while nothing is being sent)."""
        try:
            watermark = self._server_watermark()
        except KvcalError as e:
            if e.code in _RETRYABLE:
                return  # the stream thread deals with connection trouble
            self._fail(ProducerError(f"kvcal: producer {self.producer_id}: reading the durable "
                                     f"watermark of session {self.session_id}: {e}"))
            return
        if watermark is None:
            return
        with self._cv:
            if watermark[1] > 0:
                self._seen_durable = True
            self._durable = max(self._durable, min(watermark[1], self._acked))
            self._release_locked(self._release_point_locked())

    def close(self) -> None:
        """Flushes, then ends the stream and the thread. Raises ProducerError
        if the producer failed."""
        try:
            if self._thread.is_alive():
                self.flush(timeout=None)  # the local state first, then the chunks
        finally:
            if self._local is not None:
                self._local.close()
            with self._cv:
                self._closing = True
                self._cv.notify_all()  # the sender half-closes the stream
            self._thread.join()
            self._close_ring()
        with self._cv:
            self._raise_if_failed_locked()

    def abandon(self, why: str = "kvcal: producer abandoned after an error") -> None:
        """Stops without flushing: what is not applied yet is dropped, and
        put(), flush() and close() raise ProducerError(why) from now on."""
        with self._cv:
            self._closing = True
            if self._error is None:
                self._error = ProducerError(why)
            self._cv.notify_all()
        if self._local is not None:
            self._local.discard(why)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._close_ring()

    def stats(self) -> dict:
        """Counters: wire_bytes (serialized IngestRequests sent, resends
        included; gRPC framing not counted), and in local-statistics mode
        local_flushes (partial-statistics messages queued) and
        local_flush_bytes (their statistics' bytes)."""
        with self._cv:
            out = {"last_sequence": self.last_sequence, "acknowledged": self._acked,
                   "durable": self._durable, "pending_chunks": len(self._chunks),
                   "pending_bytes": self._held_bytes, "reconnects": self.reconnects,
                   "wire_bytes": self._wire_bytes}
        if self._local is not None:
            out.update(local_flushes=self._local.flushes,
                       local_flush_bytes=self._local.flush_bytes)
        return out

    # -- internals (self._cv held where the name says _locked) ---------------------
    def _want_durable(self) -> bool:
        if self.keep_until_durable is None:
            return self._seen_durable
        return self.keep_until_durable

    def _raise_if_failed_locked(self) -> None:
        if self._error is not None:
            raise ProducerError(str(self._error)) from self._error

    def _wait_for_room_locked(self, nbytes: int) -> None:
        durable_deadline = None  # set once every held chunk is acknowledged
        while True:
            self._raise_if_failed_locked()
            if self._closing:
                raise ProducerError("kvcal: put() after close()")
            if self._has_room_locked(nbytes):
                return
            if self.keep_until_durable is None and not self._seen_durable:
                # Full, and no sign that the worker persists: acknowledged
                # chunks make room.
                self._release_locked(self._acked)
                if self._has_room_locked(nbytes):
                    return
            if not (self._chunks and self._acked >= self._chunks[-1].sequence):
                # Chunks in flight: their acknowledgements (and the durable
                # watermark they carry) release chunks and notify.
                durable_deadline = None
                self._cv.wait()
                continue
            # Full of acknowledged chunks waiting to become durable.
            now = time.monotonic()
            durable_deadline = durable_deadline or now + self.durable_timeout
            if now > durable_deadline:
                raise ProducerError(self._not_durable_message_locked(self._chunks[-1].sequence))
            self._cv.wait(_DURABLE_POLL_S)
            if self._want_durable():
                self._cv.release()
                try:
                    self._poll_durable()
                finally:
                    self._cv.acquire()

    def _not_durable_message_locked(self, last: int) -> str:
        return (f"kvcal: producer {self.producer_id}: chunks up to {last} acknowledged but only "
                f"{self._durable} durable after {self.durable_timeout:.0f} s; is the worker running "
                f"with --state-dir and able to write it? (keep_until_durable=False does not wait)")

    def _has_room_locked(self, nbytes: int) -> bool:
        return len(self._chunks) < self.max_pending_chunks and (
            self._held_bytes + nbytes <= self.max_pending_bytes or not self._chunks)

    def _release_locked(self, upto: int) -> None:
        while self._chunks and self._chunks[0].sequence <= upto:
            self._held_bytes -= self._chunks.popleft().nbytes
        self._cv.notify_all()  # put() waiting for room; the sender: a new window

    def _release_point_locked(self) -> int:
        # None and no durable watermark seen yet: kept while there is room
        # (_wait_for_room_locked releases acknowledged ones when full), so a
        # worker that restarts before its first snapshot still gets them.
        return self._acked if self.keep_until_durable is False else self._durable

    def _shm_fall_back(self, why: str, in_flight: bool = False) -> None:
        """In-band from now on. in_flight: chunks sent by reference may still
        be on their way to the worker, so the ring stays registered (and its
        bytes in place) until close."""
        if self._ring is not None:
            if in_flight:
                self._retired_ring = self._ring
            else:
                self._ring.close()
            self._ring = None
        self.shared_memory_fallback = why
        log.warning("kvcal: producer %s: shared memory not used, sending chunks in-band (%s)",
                    self.producer_id, why)

    def _close_ring(self) -> None:
        for ring in (self._ring, self._retired_ring):
            if ring is not None:
                ring.close()
        self._ring = self._retired_ring = None

    def _register_ring(self) -> None:
        """(Re)registers the ring with the worker before a stream; falls back
        to in-band on the codes that mean it cannot be used."""
        if self._ring is None:
            return
        try:
            self._ring.register(self.client)
        except KvcalError as e:
            if e.code in _SHM_FALLBACK:
                self._shm_fall_back(str(e))
                return
            raise

    def _fail(self, error: BaseException) -> None:
        with self._cv:
            if self._error is None:
                self._error = error
            self._cv.notify_all()

    def _server_watermark(self) -> Optional[Tuple[int, int]]:
        session = self.client.status(self.session_id)
        if session.persistent:  # the worker has a state dir
            self._seen_durable = True
        if self.geometry is None:
            from kvcal.client import Geometry

            self.geometry = Geometry(session.num_layers, session.num_attention_heads,
                                     session.num_key_value_heads, session.head_dim)
        for p in session.producers:
            if p.producer_id == self.producer_id:
                return p.sequence, p.durable_sequence
        return None

    def _resync(self) -> int:
        """Reads the watermark after (re)connecting; returns the next sequence
        to send."""
        try:
            watermark = self._server_watermark()
        except KvcalError as e:
            if e.code == grpc.StatusCode.NOT_FOUND:
                raise ProducerError(
                    f"kvcal: session {self.session_id} is gone from the worker (restarted without "
                    f"--state-dir?); chunks {self._acked + 1}.. cannot be resumed") from e
            raise
        applied, durable = watermark if watermark else (0, 0)
        with self._cv:
            if durable > 0:
                self._seen_durable = True
            if self.reconnects:
                self.resumes.append((applied, self._acked))
            self._acked = applied
            self._durable = durable
            self._release_locked(self._release_point_locked())
            first_kept = self._chunks[0].sequence if self._chunks else self._next_sequence
            if applied + 1 < first_kept:
                raise ProducerError(
                    f"kvcal: producer {self.producer_id}: the worker resumed at sequence {applied} "
                    f"but chunks {applied + 1}..{first_kept - 1} were already released (acknowledged, "
                    f"not durable); use keep_until_durable=True with a worker that has --state-dir")
            return applied + 1

    def _run(self) -> None:
        """The stream thread: one Ingest stream after another until closed
        or failed; reconnects after a retryable error."""
        failing_since: Optional[float] = None
        backoff = 0.05
        while True:
            with self._cv:
                if self._error is not None:
                    return
                if self._closing and self._acked >= self.last_sequence:
                    return
            self._progress = False
            try:
                start = self._resync()
                self._register_ring()
                self._stream(start)
                failing_since, backoff = None, 0.05
            except ProducerError as e:
                self._fail(e)
                return
            except (grpc.RpcError, KvcalError) as e:
                code = e.code() if isinstance(e, grpc.RpcError) else e.code
                detail = e.details() if isinstance(e, grpc.RpcError) else str(e)
                # A worker restarted since the registration does not know the
                # region: register again (in _register_ring) and resend.
                region_lost = (self._ring is not None and code == grpc.StatusCode.NOT_FOUND
                               and "shared memory region" in (detail or ""))
                if code not in _RETRYABLE and not region_lost:
                    self._fail(ProducerError(f"kvcal: producer {self.producer_id}: "
                                             f"{code.name if code else 'ERROR'}: {detail}"))
                    return
                now = time.monotonic()
                if self._progress:  # the broken stream had worked: a new outage
                    failing_since, backoff = None, 0.05
                failing_since = failing_since or now
                if now - failing_since > self.reconnect_timeout:
                    self._fail(ProducerError(
                        f"kvcal: producer {self.producer_id}: no connection to {self.client.target} "
                        f"for {self.reconnect_timeout:.0f} s: {e}"))
                    return
                log.info("kvcal: stream broke (%s); reconnecting", code)
                if self.client.relocate is not None:
                    try:  # a sharding client: the worker may be back under a new address
                        self.client.relocate()
                    except Exception as relocate_error:  # looking is best effort
                        log.info("kvcal: looking for a moved worker: %s", relocate_error)
                with self._cv:  # the backoff, cut short by abandon()
                    self._cv.wait_for(lambda: self._error is not None, backoff)
                backoff = min(backoff * 2, 2.0)
                self.reconnects += 1
            except BaseException as e:  # a bug or an unusable tensor: stop loudly
                self._fail(e)
                return

    def _stream(self, start: int) -> None:
        """One Ingest stream: sends from `start`, applies responses. Returns
        when closing and everything sent is acknowledged (and durable if
        wanted); raises grpc.RpcError when the stream breaks."""
        sender = _Sender(self, start)
        call = self.client.stub.Ingest(iter(sender), metadata=self.client.metadata)
        try:
            for response in call:
                self._progress = True
                self._apply_response(response)
        finally:
            sender.end()
        # The stream ended cleanly: the sender half-closed it (closing, or failed).
        self._await_durable_after_stream()

    def _apply_response(self, response: pb.IngestResponse) -> None:
        with self._cv:
            self._acked = max(self._acked, response.watermark)
            if response.durable_watermark > 0:
                self._seen_durable = True
                self._durable = max(self._durable, response.durable_watermark)
            self._release_locked(self._release_point_locked())

    def _request(self, chunk: _Chunk) -> Optional[pb.IngestRequest]:
        """The IngestRequest of `chunk` (by shared-memory reference when the
        ring takes it); None after recording the error when it cannot be
        made."""
        try:
            try:
                request = chunk.request(self.session_id, self.producer_id, self._ring)
            except _SharedMemoryFull as e:
                # This chunk and the rest in-band.
                self._shm_fall_back(str(e), in_flight=True)
                request = chunk.request(self.session_id, self.producer_id, None)
            if self.client.shard_worker_ids:
                request.shard_worker_ids.extend(self.client.shard_worker_ids)
            return request
        except BaseException as e:  # e.g. a failed device copy
            self._fail(ProducerError(f"kvcal: chunk {chunk.sequence}: {e}"))
            return None

    def _await_durable_after_stream(self) -> None:
        """After a clean end of the stream: waits (asking the worker every
        _DURABLE_POLL_S) until the chunks are durable when that is wanted;
        ProducerError after durable_timeout. Returns at once when more is to
        be sent (put() raced close) or the producer failed."""
        deadline = time.monotonic() + self.durable_timeout
        while True:
            with self._cv:
                last = self.last_sequence
                if self._error is not None or self._acked < last:
                    return  # failed, or more to send: the run loop decides
                if not self._want_durable() or self._durable >= last:
                    return
                remaining = deadline - time.monotonic()
                if remaining < 0:
                    raise ProducerError(
                        f"kvcal: producer {self.producer_id}: chunks up to {last} acknowledged "
                        f"but not durable after {self.durable_timeout:.0f} s")
                if self._cv.wait_for(lambda: self._error is not None,
                                     min(_DURABLE_POLL_S, remaining)):
                    return
            applied, durable = self._server_watermark() or (0, 0)
            with self._cv:
                if applied < self._acked:
                    # The worker restarted from an older snapshot: the run
                    # loop resyncs and sends the kept chunks again.
                    self._acked = applied
                    return
                if durable > 0:
                    self._seen_durable = True
                self._durable = max(self._durable, durable)
                self._release_locked(self._release_point_locked())


class _Sender:
    """The request side of one Ingest stream (gRPC reads it on a thread of
    its own): the producer's kept chunks from `start` on, at most `window`
    past the acknowledged one. It sleeps on the producer's condition until
    there is something to do: a chunk put, an acknowledgement that opens the
    window, close() (the stream is half-closed once everything put is sent),
    an error, or end() when the stream is over. It never wakes on a timer."""

    def __init__(self, producer: WorkerProducer, start: int):
        self._producer = producer
        self._sequence = start  # the next chunk to send
        self._ended = False
        self._next: Optional[_Chunk] = None  # what _ready_locked found

    def end(self) -> None:
        """The stream is over: the sender stops (a waiting one wakes up)."""
        with self._producer._cv:
            self._ended = True
            self._producer._cv.notify_all()

    def __iter__(self):
        p = self._producer
        while True:
            with p._cv:
                p._cv.wait_for(self._ready_locked)
                chunk, self._next = self._next, None
            if chunk is None:
                return  # half-closes the stream
            request = p._request(chunk)
            if request is None:
                return
            p._wire_bytes += request.ByteSize()  # only this thread writes it
            yield request
            self._sequence += 1

    def _ready_locked(self) -> bool:
        """True when there is a chunk to send (then in self._next) or the
        stream is to be half-closed (self._next None); False to wait."""
        p = self._producer
        self._next = None
        if self._ended or p._error is not None:
            return True
        # Acknowledged meanwhile (e.g. an earlier stream's chunks applied
        # after this one resumed): skip them.
        self._sequence = max(self._sequence, p._acked + 1)
        if self._sequence < p._next_sequence and self._sequence - p._acked <= p.window:
            first = p._chunks[0].sequence if p._chunks else p._next_sequence
            if self._sequence < first:
                p._error = p._error or ProducerError(
                    f"kvcal: producer {p.producer_id}: chunk {self._sequence} must be sent but "
                    f"was already released (kept from {first})")
                p._cv.notify_all()
                return True
            self._next = p._chunks[self._sequence - first]
            return True
        return p._closing and self._sequence >= p._next_sequence
