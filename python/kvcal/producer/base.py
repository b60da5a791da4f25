"""What every producer shares: its options' checks, ProducerError, and the
batch bookkeeping of _ProducerBase (kvcal.producer's WorkerProducer and
ShardedProducer)."""
from __future__ import annotations

from kvcal import _ranges

# The protocol the C++ Uploader follows too (docs/producers.md): chunks in
# flight without an acknowledgement.
DEFAULT_WINDOW = 16


def _check_options(chunk_bytes=4 << 20, max_pending_chunks=1024, max_pending_bytes=512 << 20,
                   window=DEFAULT_WINDOW, start_sequence=None, reconnect_timeout=120.0,
                   durable_timeout=120.0, local_statistics=False, flush_batches=None,
                   flush_seconds=None, local_backend=None, local_device=None,
                   local_async=None, **_):
    """The numeric arguments of Producer, checked before it connects, with
    the CLI's ranges for chunk_bytes and window (push --chunk-bytes,
    --window): a ValueError naming the argument and what is valid."""
    if flush_batches is not None and not local_statistics:
        raise ValueError("kvcal: Producer: flush_batches is for local_statistics=True")
    for name, value in (("flush_seconds", flush_seconds), ("local_backend", local_backend),
                        ("local_device", local_device), ("local_async", local_async)):
        if value is not None and not local_statistics:
            raise ValueError(f"kvcal: Producer: {name} is for local_statistics=True")
    if local_backend is not None and local_backend not in ("cpu", "cuda", "auto"):
        raise ValueError(f"kvcal: Producer local_backend={local_backend!r}: want 'cpu', 'cuda' "
                         f"or 'auto'")
    if local_device is not None:
        _ranges.check_int("Producer", "local_device", local_device, _ranges.IntRange(0, 1 << 16))
    if flush_batches is not None:
        _ranges.check_int("Producer", "flush_batches", flush_batches, _ranges.IntRange(1, None))
    _ranges.check_timeout("Producer", "flush_seconds", flush_seconds)
    _ranges.check_int("Producer", "chunk_bytes", chunk_bytes, _ranges.CHUNK_BYTES)
    _ranges.check_int("Producer", "window", window, _ranges.WINDOW)
    _ranges.check_int("Producer", "max_pending_chunks", max_pending_chunks, _ranges.IntRange(1, None))
    _ranges.check_int("Producer", "max_pending_bytes", max_pending_bytes, _ranges.IntRange(1, None))
    if start_sequence is not None:
        _ranges.check_int("Producer", "start_sequence", start_sequence,
                        _ranges.IntRange(1, (1 << 64) - 1))
    _ranges.check_timeout("Producer", "reconnect_timeout", reconnect_timeout, allow_none=False)
    _ranges.check_timeout("Producer", "durable_timeout", durable_timeout, allow_none=False)


class ProducerError(RuntimeError):
    """The producer stopped; raised by put(), flush() and close()."""


class _ProducerBase:
    """What both producers share: the calibration batch number they stamp
    on their chunks (0 until new_batch() is called after the first chunk,
    then one more per call: the EMA and memoryless observers' batches), and
    use as a context manager (close() on a clean exit, abandon() on an
    error, so that a flush does not hide the original error)."""
    _batch = 0
    _batches_started = False

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abandon()

    @property
    def batch(self) -> int:
        return self._batch

    def new_batch(self) -> int:
        """Starts the next calibration batch (0, 1, 2, ...) and returns it.
        In local-statistics mode a local state that holds flush_batches
        batches is flushed here."""
        if self._batches_started:
            self._batch += 1
        self._batches_started = True
        self._batch_started(self._batch)
        return self._batch

    def _batch_started(self, batch: int) -> None:
        """new_batch() hook of local-statistics mode."""
