"""kvcal.ShardedProducer: one WorkerProducer per worker, each layer's chunks
on the worker that holds it; and kvcal.Producer, the factory that picks
between the two."""
from __future__ import annotations

import time
from typing import List, Optional, Tuple, Union

from kvcal import _ranges
from kvcal.client import Client
from kvcal.producer.base import ProducerError, _check_options, _ProducerBase
from kvcal.producer.streaming import WorkerProducer


class ShardedProducer(_ProducerBase):
    """Streams to one session over a client of several workers: one
    WorkerProducer per worker (`producers`, in the order of client.workers),
    each layer's chunks to the worker that holds it (numbered per worker, as
    the C++ client does). Batches and held-out flags are the
    ShardedProducer's; counters and errors are the sum of its producers'.
    With local_statistics=True each WorkerProducer keeps a local state of
    its worker's layers only and sends it to that worker alone."""

    def __init__(self, client: Client, session_id: Optional[str] = None, producer_id: str = "",
                 **options):
        """options: WorkerProducer's (chunk_bytes, window, ...), for each."""
        _check_options(**options)  # before any worker is asked
        if getattr(client, "workers", None) is None:
            raise ValueError("kvcal: a ShardedProducer needs a client of several workers; "
                             "kvcal.Producer(client) returns a WorkerProducer for one")
        self.client = client
        self.session_id = session_id or client._session(None)
        self.producer_id = producer_id or "default"
        client.check_session_workers(self.session_id)  # the clear error for another worker set
        self.producers: List[WorkerProducer] = []
        try:
            for worker in client.workers:
                self.producers.append(
                    WorkerProducer(worker, self.session_id, producer_id, **options))
        except BaseException:
            for p in self.producers:  # the streams already started
                p.abandon("kvcal: producer abandoned: another worker's producer failed to start")
            raise
        self.geometry = self.producers[0].geometry
        self.holdout = False  # chunks put while True are sent as held out
        self._batch = 0
        self._batches_started = False

    @property
    def last_sequence(self) -> int:
        return sum(p.last_sequence for p in self.producers)

    @property
    def reconnects(self) -> int:
        return sum(p.reconnects for p in self.producers)

    @property
    def resumes(self) -> List[Tuple[int, int]]:
        return [r for p in self.producers for r in p.resumes]

    @property
    def shared_memory(self) -> bool:
        return all(p.shared_memory for p in self.producers)

    @property
    def local_statistics(self) -> bool:
        return self.producers[0].local_statistics

    def _batch_started(self, batch: int) -> None:
        for p in self.producers:  # each worker's local state (its layers')
            p._batch_started(batch)

    @property
    def shared_memory_fallback(self) -> Optional[str]:
        """Why some worker's chunks go in-band (one line per such worker), or
        None."""
        why = [f"{p.client.target}: {p.shared_memory_fallback}" for p in self.producers
               if p.shared_memory_fallback is not None]
        return "; ".join(why) if why else None

    def put(self, layer: int, role, tensor, *, batch: Optional[int] = None,
            layout="heads_tokens_dim", head_offset: int = 0,
            holdout: Optional[bool] = None) -> None:
        """WorkerProducer.put on the producer of the worker that holds `layer`."""
        from kvcal.sharding import layer_owner

        layer = _ranges.check_int("put", "layer", layer, _ranges.IntRange(0, (1 << 32) - 1))
        producer = self.producers[layer_owner(self.session_id, int(layer), self.client.worker_ids)]
        if batch is None:
            self._batches_started = True
            batch = self._batch
        producer.put(layer, role, tensor, batch=batch, layout=layout, head_offset=head_offset,
                     holdout=self.holdout if holdout is None else bool(holdout))

    def flush(self, durable: Optional[bool] = None, timeout: Optional[float] = None) -> None:
        """flush() of every producer; `timeout` bounds them all together."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for p in self.producers:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            p.flush(durable=durable, timeout=remaining)

    def close(self) -> None:
        """Closes every producer (all of them, even after one failed); raises
        the ProducerError of the one that failed, or one naming each worker
        whose producer failed."""
        errors = []
        for p in self.producers:
            try:
                p.close()
            except BaseException as e:  # close every stream, then report
                errors.append((p, e))
        if len(errors) == 1:
            raise errors[0][1]
        if errors:
            raise ProducerError(
                f"kvcal: producer {self.producer_id} failed on {len(errors)} of "
                f"{len(self.producers)} workers: "
                + "; ".join(f"{p.client.target}: {e}" for p, e in errors)) from errors[0][1]

    def abandon(self, why: str = "kvcal: producer abandoned after an error") -> None:
        for p in self.producers:
            p.abandon(why)

    def stats(self) -> dict:
        total: dict = {}
        for p in self.producers:
            for k, v in p.stats().items():
                total[k] = total.get(k, 0) + v
        return total


def Producer(client: Client, session_id: Optional[str] = None, producer_id: str = "",
             **options) -> Union[WorkerProducer, ShardedProducer]:
    """The producer for `client`: a WorkerProducer when the client talks to
    one worker, a ShardedProducer (one WorkerProducer per worker) when it
    talks to several. session_id: the client's session by default;
    producer_id: "default" by default; options: WorkerProducer's keyword
    arguments (chunk_bytes, max_pending_chunks, max_pending_bytes, window,
    keep_until_durable, start_sequence, resume, reconnect_timeout,
    durable_timeout, shared_memory, local_statistics, flush_batches,
    flush_seconds, local_backend, local_device, local_async). Both
    types have the same methods: put, new_batch, flush, close, stats, and
    use as a context manager.

    local_statistics=True (docs/local-statistics.md): batches that are not
    held out are accumulated in this process (kvcal.LocalStatistics, the
    worker's engine) instead of being sent; every flush_batches batches
    (default 64), when flush_seconds have passed at a batch boundary, at
    flush() and at close() the state becomes the producer's next numbered
    message (partial statistics: exactly once, kept until durable, resumable
    as a chunk) and the local state starts afresh. Held-out chunks are sent
    as chunks as always. local_backend="cuda" (or "auto": CUDA when the
    extension has it and a device exists) keeps the statistics on GPU
    local_device and reads torch CUDA tensors there in place; "cpu" (the
    default) copies them to host memory first. local_async=True: put()
    copies a host tensor and a thread of the producer accumulates it, beside
    the caller's forward pass; a tensor the engine refuses then fails the
    producer (ProducerError from the next call, as in-band) instead of
    raising ValueError from put(). Needs the extension kvcal._engine."""
    if getattr(client, "workers", None) is not None:
        return ShardedProducer(client, session_id, producer_id, **options)
    return WorkerProducer(client, session_id, producer_id, **options)
