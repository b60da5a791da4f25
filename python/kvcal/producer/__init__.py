"""kvcal.Producer: streams activation chunks to a session, exactly once.

    with kvcal.Producer(client) as producer:       # client has a session
        for batch in loader:
            producer.new_batch()                   # one forward = one batch
            q, k, v = ...                          # [batch, heads, tokens, head_dim]
            producer.put(layer, "q", q)
            producer.put(layer, "k", k)
            producer.put(layer, "v", v)
    # leaving the block flushes: every chunk is applied (and durable, when
    # the worker persists) or an error is raised

kvcal.Producer(client, ...) is a factory: for a client of one worker it
returns a WorkerProducer (one Ingest stream), for a client of several a
ShardedProducer, which holds one WorkerProducer per worker and puts each
layer's chunks on the worker that holds it. Both have the methods below.

Held-out batches (for Finalize's evaluate and the auto observer): set
`producer.holdout = True` (or pass holdout=True to put()); chunks put while
it is set are sent as held out, and the worker keeps them whole instead of
calibrating on them. Send q, k and v of the same sequences: heads_tokens_dim
[batch, heads, tokens, head_dim] (each batch entry one sequence) or
tokens_heads_dim [tokens, heads, head_dim] (one sequence). Held-out tensors
are split only into whole sequences and head ranges, never by tokens.

put() numbers the chunks (sequence 1, 2, ... per producer), splits tensors
larger than chunk_bytes along whole rows, and returns at once: a background
thread streams them over one Ingest stream. Its sender sleeps on one
condition until there is something to do: a chunk put, an acknowledgement
that opens the window, close(), an error. put() blocks only while the
producer holds max_pending_chunks / max_pending_bytes not yet released.

Exactly once across failures: when the stream breaks (worker restarted,
network), the thread reconnects, reads the producer's watermark with
GetSession and resends from there. A chunk is released once the worker
acknowledged it, or, when the worker persists its state (--state-dir), once it
is durable, so a worker that restarts from its last snapshot gets everything
it lost. keep_until_durable=None (default) learns that from the worker: chunks
are kept until durable when the session is persistent (the worker runs with
--state-dir) or a durable watermark has been seen, and otherwise only while
there is room. Set True when the worker runs with
--state-dir (keeps chunks until its first snapshot too), False to release on
acknowledgement.

Time limits: each outage (no stream working) may last reconnect_timeout
seconds; a wait for durability (in flush(), close(), or put() when the held
chunks are all acknowledged but not durable) durable_timeout seconds. Past
either, the producer fails with a ProducerError that says which.

Same-host shared memory (docs/shared_memory.md): shared_memory=True writes
each chunk into a ring of `window` slots of chunk_bytes in a POSIX
shared-memory object ("/kvcal-py-<pid>-<random>", 0600) that the worker maps
read-only, and sends a reference instead of the bytes; a slot is reused once
its chunk is acknowledged. When the worker cannot use it (another host,
--shared-memory=false, an older worker), one warning is logged and the chunks
go in-band; `producer.shared_memory` says which. A chunk larger than a slot
(a held-out sequence) goes in-band. After a reconnect the region is
registered again (a restarted worker has never heard of it).

Local statistics (local_statistics=True, flush_batches=N, flush_seconds=T;
kvcal/producer/local.py, docs/local-statistics.md): batches that are not
held out are accumulated in this process by a kvcal.LocalStatistics instead
of being sent; every N batches (or T seconds, at a batch boundary), at
flush() and at close() the state becomes one partial-statistics message in
the producer's sequence (exactly once, kept until durable and resumable like
a chunk) and starts afresh. Held-out chunks still go as chunks.

Tensors: numpy arrays (float32, float16, ml_dtypes.bfloat16) and torch
tensors (float32, float16, bfloat16; CPU or CUDA). bf16 goes on the wire as
bf16. A CUDA tensor is copied to pinned host memory with a non-blocking copy
on the current stream; the background thread waits for that copy, so put()
does not synchronize the device.

"""
from kvcal.producer.base import DEFAULT_WINDOW, ProducerError
from kvcal.producer.encoding import wire_dtype
from kvcal.producer.sharded import Producer, ShardedProducer
from kvcal.producer.streaming import WorkerProducer

__all__ = ["Producer", "ProducerError", "WorkerProducer", "ShardedProducer", "DEFAULT_WINDOW",
           "wire_dtype"]
