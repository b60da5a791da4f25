"""kvcal.Producer(..., local_statistics=True): batches accumulated in the
producer's process and sent as numbered partial-statistics messages in the
producer's sequence every flush_batches batches, against the same batches
sent as chunks.

- Two producers interleaving their batches (one numbering them with
  new_batch(), one passing batch= out of order; heavy tails, outlier heads
  and channels, NaN/Inf, bf16 and f32, both layouts, a held-out batch) into
  one session in-band and into another with local_statistics=True,
  flush_batches=2 (three flushes each): every finalized scale and absmax is
  bit-identical for static_minmax, minmax, memoryless_minmax, mse and
  percentile, per tensor and per head; the counters the observers do not
  read (values, bytes, non-finite) are equal too; the held-out batch arrived
  as chunks in both; each flush took one sequence number.
- A worker SIGKILLed mid-calibration and restarted from its state dir: the
  producer sends the flushes the snapshot did not hold again; same scales.
- A producer SIGKILLed after some flushes, and a new process resuming after
  the session's watermark: same scales as one uninterrupted producer.
- Two workers: each worker's partials hold only its own layers; the scales
  equal one in-band worker's.
- kvcal.torch.capture on a tiny Llama gives the same scales through a
  local-statistics producer as through an in-band one.
- Partial statistics of another histogram resolution are refused with
  FAILED_PRECONDITION and change nothing.
"""
import logging
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

import kvcal
from kvcal.client import KvcalError  # noqa: F401
from kvcal.producer.statistics import largest_statistics_bytes
from kvcal.v1 import pb

torch = pytest.importorskip("torch")

from test_local_statistics import exact_bits, parse_statistics  # noqa: E402

GEOMETRY = dict(num_layers=3, num_attention_heads=8, num_key_value_heads=2, head_dim=16)
HEADS = {"q": 8, "k": 2, "v": 2}
OBSERVERS = ["static_minmax", "minmax", "memoryless_minmax", "mse", "percentile"]


def make_batch(rng, batch, tokens):
    """[(layer, role, tensor, layout)] of one batch: Student-t values, an
    outlier head and channel per layer, NaN/Inf in k of even batches; odd
    batches bf16 in heads_tokens_dim [1, heads, tokens, dim], even ones f32
    in tokens_heads_dim [tokens, heads, dim]."""
    out = []
    for layer in range(GEOMETRY["num_layers"]):
        for role, heads in HEADS.items():
            x = rng.standard_t(2, (tokens, heads, GEOMETRY["head_dim"])).astype(np.float32)
            x *= 0.5 + layer + 0.3 * batch
            x[:, (layer + batch) % heads, :] *= 20.0
            x[:, :, (3 * layer) % GEOMETRY["head_dim"]] *= 8.0
            if role == "k" and batch % 2 == 0:
                x[0, 0, 0] = np.nan
                x[1, heads - 1, 2] = np.inf
            t = torch.from_numpy(x)
            if batch % 2:
                out.append((layer, role, t.to(torch.bfloat16).transpose(0, 1).unsqueeze(0),
                            "heads_tokens_dim"))
            else:
                out.append((layer, role, t, "tokens_heads_dim"))
    return out


def batches(seed, n):
    rng = np.random.default_rng(seed)
    return [make_batch(rng, b, 23 + 4 * b) for b in range(n)]


def holdout_batch(seed):
    rng = np.random.default_rng(seed)
    return [(layer, role, torch.from_numpy(
        rng.standard_normal((1, heads, 9, GEOMETRY["head_dim"])).astype(np.float32)))
        for layer in range(GEOMETRY["num_layers"]) for role, heads in HEADS.items()]


def feed(client, on_batch=None, **options):
    """Producer a numbers its 6 batches with new_batch(); producer b passes
    batch= for its 6 in the order 1, 3, 5, 0, 2, 4; their puts interleave.
    Then one held-out batch from a. on_batch(i, producer a) is called before
    batch i. Returns both producers' stats()."""
    a_data, b_data = batches(1, 6), batches(2, 6)
    b_order = [1, 3, 5, 0, 2, 4]
    with kvcal.Producer(client, producer_id="a", **options) as pa, \
            kvcal.Producer(client, producer_id="b", chunk_bytes=2048, **options) as pb_:
        for i in range(6):
            if on_batch is not None:
                on_batch(i, pa)
            pa.new_batch()
            for (la, ra, ta, ya), (lb, rb, tb, yb) in zip(a_data[i], b_data[b_order[i]]):
                pa.put(la, ra, ta, layout=ya)
                pb_.put(lb, rb, tb, batch=b_order[i], layout=yb)
        pa.holdout = True
        for layer, role, t in holdout_batch(3):
            pa.put(layer, role, t)
    return pa.stats(), pb_.stats()


def all_scales(client, session_id=None):
    return {(observer, granularity): exact_bits(client.finalize_response(
        session_id, observer=observer, granularity=granularity))
        for observer in OBSERVERS for granularity in ("tensor", "head")}


@pytest.fixture
def two_sessions(worker):
    wired, local = kvcal.Client(worker.target), kvcal.Client(worker.target)
    for c in (wired, local):
        c.create_session(geometry=GEOMETRY, holdout_budget_bytes=1 << 20)
    yield wired, local
    wired.delete()
    local.delete()


def test_local_statistics_producer_equals_in_band(two_sessions):
    wired, local = two_sessions
    in_band = feed(wired)
    assert all("local_flushes" not in s for s in in_band)  # off by default
    stats = feed(local, local_statistics=True, flush_batches=2)
    # 6 batches, 2 per flush: 3 flushes each, nothing left for close().
    assert [s["local_flushes"] for s in stats] == [3, 3]
    assert all(s["local_flush_bytes"] > 0 for s in stats)
    # Each flush took one sequence number, the held-out batch 9 more (9
    # tensors, 9 chunks) between a's second and third flush.
    assert [s["last_sequence"] for s in stats] == [3 + 9, 3]
    assert [p.sequence for p in local.status().producers] == [12, 3]
    # On the wire: the flushes' statistics plus the held-out chunks (at
    # this test's few tokens the statistics outweigh the activations;
    # bench/python/bench_job.py measures real sizes).
    assert all(s["wire_bytes"] > s["local_flush_bytes"] for s in stats)
    assert all(s["wire_bytes"] > 0 for s in in_band)

    got, want = local.status(), wired.status()
    assert got.values_ingested == want.values_ingested > 0
    assert got.bytes_ingested == want.bytes_ingested
    assert got.nonfinite_values == want.nonfinite_values > 0
    assert got.holdout_chunks == want.holdout_chunks == 9
    assert got.holdout_bytes == want.holdout_bytes > 0

    mine, theirs = all_scales(local), all_scales(wired)
    assert len(mine) == 10
    for key in theirs:
        assert mine[key] == theirs[key], key
    # Every (layer, role) of every observer and granularity compared.
    assert sum(len(v[0]) for s in theirs.values() for v in s.values()) == \
        5 * (3 * 3 + 3 * (8 + 2 + 2))
    # The batches the EMA and memoryless observers read: one per batch.
    heads = parse_statistics(local.export_state().statistics)
    assert all(len(h[9]) == 6 * 3 for h in heads)


def test_local_async_equals_in_band(two_sessions):
    """local_async=True: the tensors are copied by put() and accumulated on
    the producer's own thread; same scales as in-band, and the caller may
    overwrite its tensor right after put(). A tensor the engine refuses
    fails the producer at the next call, naming it; nothing of it counted."""
    wired, local = two_sessions
    feed(wired)
    feed(local, local_statistics=True, flush_batches=2, local_async=True)
    assert all_scales(local) == all_scales(wired)
    assert local.status().values_ingested == wired.status().values_ingested

    # The buffer reused at once: the copy was taken in put().
    buffer = np.ones((5, 2, 16), np.float32)
    before = local.status().values_ingested
    with kvcal.Producer(local, producer_id="reuse", local_statistics=True,
                        local_async=True) as producer:
        producer.put(0, "k", buffer, layout="tokens_heads_dim")
        buffer[:] = 1e6
    assert local.status().values_ingested == before + buffer.size
    assert max(local.finalize_response(observer="static_minmax").layers[0].k.absmax) < 1e6

    producer = kvcal.Producer(local, producer_id="bad", local_statistics=True, local_async=True)
    producer.put(0, "k", np.zeros((4, 2, 8), np.float32), layout="tokens_heads_dim")
    with pytest.raises(kvcal.ProducerError, match="layer 0 k batch 0: .*head_dim"):
        producer.flush()
    with pytest.raises(kvcal.ProducerError, match="head_dim"):
        producer.put(0, "k", buffer, layout="tokens_heads_dim")
    producer.abandon()
    assert local.status().values_ingested == before + buffer.size


def test_flush_batches_needs_local_statistics(worker):
    client = kvcal.Client(worker.target)
    client.create_session(geometry=GEOMETRY)
    with pytest.raises(ValueError, match="flush_batches is for local_statistics=True"):
        kvcal.Producer(client, flush_batches=2)
    with pytest.raises(ValueError, match="flush_batches"):
        kvcal.Producer(client, local_statistics=True, flush_batches=0)
    for name, value in (("flush_seconds", 1.0), ("local_backend", "cpu"), ("local_device", 0),
                        ("local_async", True)):
        with pytest.raises(ValueError, match=f"{name} is for local_statistics=True"):
            kvcal.Producer(client, **{name: value})
    with pytest.raises(ValueError, match="flush_seconds"):
        kvcal.Producer(client, local_statistics=True, flush_seconds=0)
    with pytest.raises(ValueError, match="local_backend='gpu': want 'cpu', 'cuda' or 'auto'"):
        kvcal.Producer(client, local_statistics=True, local_backend="gpu")
    with kvcal.Producer(client, producer_id="off") as off:
        assert off.local_statistics is False
    # Bad input is refused at put() with the worker's words; nothing counted.
    with kvcal.Producer(client, local_statistics=True) as producer:
        with pytest.raises(ValueError, match="head_dim"):
            producer.put(0, "k", np.zeros((4, 2, 8), np.float32), layout="tokens_heads_dim")
    assert producer.stats()["local_flushes"] == 0
    assert client.status().values_ingested == 0
    client.delete()


def test_a_killed_worker_restarts_and_gets_the_lost_flushes(make_worker):
    """A worker with --state-dir is SIGKILLed after producer a's third flush
    and restarted on the same port: flushes its last snapshot did not hold
    are sent again from the producer's queue (kept until durable), the ones
    it held are acknowledged as duplicates; the scales equal an in-band
    session's on another worker."""
    ref = kvcal.Client(make_worker().target)
    ref.create_session(geometry=GEOMETRY, holdout_budget_bytes=1 << 20)
    feed(ref)
    w = make_worker(state_dir=True, snapshot_ms=400)
    client = kvcal.Client(w.target)
    client.create_session(geometry=GEOMETRY, holdout_budget_bytes=1 << 20)

    def kill_after(i, producer):
        if i == 4:  # a has queued flushes 1 and 2 (batches 0-3); kill now
            producer.flush(durable=False)
            w.stop(signal.SIGKILL)
            w.start()

    stats = feed(client, local_statistics=True, flush_batches=2, on_batch=kill_after)
    assert stats[0]["reconnects"] >= 1
    assert all_scales(client) == all_scales(ref)
    assert client.status().values_ingested == ref.status().values_ingested


_RESUMING_PRODUCER = """
import os, signal, sys
import kvcal
from test_local_producer import batches

target, kill_at = sys.argv[1], int(sys.argv[2])
client = kvcal.Client(target)
producer = kvcal.Producer(client, session_id="resume", producer_id="r", local_statistics=True,
                          flush_batches=2, resume=True)
# Flush n covers batches 2n-2 and 2n-1: resume after the watermark's flushes.
start = 2 * producer.last_sequence
print("resuming at batch", start, flush=True)
data = batches(5, 8)
for b in range(start, 8):
    for layer, role, t, layout in data[b]:
        producer.put(layer, role, t, batch=b, layout=layout)
    if b == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)  # batch b is in local memory only
    if b % 2 == 1:
        producer.flush(durable=False)  # applied: the next run starts after it
producer.close()
"""


def test_a_killed_producer_resumes_after_the_watermark(worker, tmp_path):
    """A producer process SIGKILLs itself with batches 0-3 flushed (two
    partials applied) and batch 4 accumulated but not sent; a new process
    with resume=True finds watermark 2 and sends batches 4-7. The scales
    equal one in-band producer's of batches 0-7."""
    ref = kvcal.Client(worker.target)
    ref.create_session(geometry=GEOMETRY, session_id="resume-ref")
    with kvcal.Producer(ref) as producer:
        for b, data in enumerate(batches(5, 8)):
            for layer, role, t, layout in data:
                producer.put(layer, role, t, batch=b, layout=layout)
    client = kvcal.Client(worker.target)
    client.create_session(geometry=GEOMETRY, session_id="resume")
    script = tmp_path / "producer.py"
    script.write_text(_RESUMING_PRODUCER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(__file__)] + sys.path))
    run = [sys.executable, str(script), worker.target]
    killed = subprocess.run(run + ["4"], env=env, capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert "resuming at batch 0" in killed.stdout
    assert [p.sequence for p in client.status().producers] == [2]
    resumed = subprocess.run(run + ["-1"], env=env, capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming at batch 4" in resumed.stdout
    assert [p.sequence for p in client.status().producers] == [4]
    assert client.status().values_ingested == ref.status().values_ingested
    assert all_scales(client) == all_scales(ref)
    client.delete()
    ref.delete()


def test_other_options_are_refused_with_failed_precondition(worker):
    """Partial statistics computed with 32 histogram bins per octave sent to
    a session of 16: FAILED_PRECONDITION naming both geometries; nothing
    applied, the producer not even registered."""
    import grpc

    client = kvcal.Client(worker.target)
    client.create_session(geometry=GEOMETRY, histograms=16, session_id="options")
    other = kvcal.LocalStatistics(GEOMETRY, histograms=32)
    other.accumulate(0, "k", np.ones((3, 2, 16), np.float32), batch=0)
    request = pb.IngestRequest(
        session_id="options", producer_id="x", sequence=1,
        partial_statistics=pb.PartialStatistics(statistics=other.export_statistics()))
    with pytest.raises(grpc.RpcError) as refused:
        for _ in client.stub.Ingest(iter([request])):
            pass
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "partial statistics 1 from producer 'x': computed with geometry" in \
        refused.value.details()
    status = client.status()
    assert status.values_ingested == 0 and list(status.producers) == []
    # A message that also carries chunk fields: INVALID_ARGUMENT.
    request.partial_statistics.statistics = kvcal.LocalStatistics.for_session(
        client).export_statistics()
    request.layer, request.data = 1, b"\0\0"
    with pytest.raises(grpc.RpcError) as both:
        for _ in client.stub.Ingest(iter([request])):
            pass
    assert both.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "also sets data, layer" in both.value.details()
    client.delete()


def test_sharded_local_statistics(make_worker, caplog):
    """Two workers: each producer's local state holds its worker's layers
    only (the others' heads are empty in what it imports); the scales equal
    one worker's fed in-band."""
    one = kvcal.Client(make_worker().target)
    one.create_session(geometry=GEOMETRY, session_id="ref")
    feed_plain(one)
    ws = [make_worker(extra_args=["--worker-id", n]) for n in ("a", "b")]
    client = kvcal.Client([w.target for w in ws])
    session = client.create_session(geometry=GEOMETRY, session_id="sharded")
    owners = list(session.shard_map.layer_owners)
    assert sorted(set(owners)) == [0, 1], owners  # both workers own a layer
    stats = feed_plain(client, local_statistics=True, flush_batches=2)
    assert stats["local_flushes"] == 2 * 2  # 4 batches: 2 flushes per worker
    # Each worker's producer measures its message limit against its own
    # layers' largest flush.
    small = kvcal.Client([w.target for w in ws], max_message_bytes=64 << 10)
    with caplog.at_level(logging.WARNING, logger="kvcal"):
        kvcal.Producer(small, session_id="sharded", producer_id="q",
                       local_statistics=True).close()
    said = sorted(int(m.group(1)) for m in (
        re.search(r"of this worker's (\d+) layers", r.getMessage()) for r in caplog.records) if m)
    assert said == sorted(owners.count(i) for i in (0, 1)), caplog.text
    per_head = 8 + 2 + 2
    for i, w in enumerate(client.workers):
        heads = parse_statistics(w.export_state("sharded").statistics)
        for layer in range(GEOMETRY["num_layers"]):
            finite = sum(h[2] for h in heads[layer * per_head:(layer + 1) * per_head])
            assert (finite > 0) == (owners[layer] == i), (i, layer, finite)
    for observer in OBSERVERS:
        for granularity in ("tensor", "head"):
            want = exact_bits(one.finalize_response("ref", observer=observer,
                                                    granularity=granularity))
            got = exact_bits(client.finalize_response("sharded", observer=observer,
                                                      granularity=granularity))
            assert got == want, (observer, granularity)


def feed_plain(client, **options):
    with kvcal.Producer(client, producer_id="p", **options) as producer:
        for batch in batches(5, 4):
            producer.new_batch()
            for layer, role, t, layout in batch:
                producer.put(layer, role, t, layout=layout)
    return producer.stats()


def test_flush_seconds_flushes_at_batch_boundaries(worker):
    """flush_seconds: a flush at the first batch boundary after T seconds
    (here T is tiny, so every boundary), whatever flush_batches says; the
    scales equal in-band's."""
    wired, local = kvcal.Client(worker.target), kvcal.Client(worker.target)
    for c in (wired, local):
        c.create_session(geometry=GEOMETRY)
    feed_plain(wired)
    stats = feed_plain(local, local_statistics=True, flush_batches=1000, flush_seconds=1e-6,
                       local_backend="auto")
    assert stats["local_flushes"] == 4 and stats["last_sequence"] == 4  # one per batch
    assert all_scales(local) == all_scales(wired)
    wired.delete()
    local.delete()


def test_cuda_tensors_on_a_cuda_local_backend(worker):
    """local_backend="cuda": torch CUDA tensors accumulated in place on the
    GPU give the scales of the same tensors sent in-band from host memory.
    Needs a CUDA device and a CUDA build of kvcal._engine."""
    from kvcal.producer.statistics import load_engine

    if not torch.cuda.is_available() or load_engine().cuda_device_count() == 0:
        pytest.skip("no CUDA device (or kvcal._engine built without CUDA)")
    wired, local = kvcal.Client(worker.target), kvcal.Client(worker.target)
    for c in (wired, local):
        c.create_session(geometry=GEOMETRY)
    feed_plain(wired)
    with kvcal.Producer(local, producer_id="p", local_statistics=True, flush_batches=2,
                        local_backend="cuda", local_device=torch.cuda.current_device()) as p:
        assert p._local.local.backend == "cuda"
        for batch in batches(5, 4):
            p.new_batch()
            for layer, role, t, layout in batch:
                p.put(layer, role, t.cuda(), layout=layout)
    assert all_scales(local) == all_scales(wired)
    wired.delete()
    local.delete()


def test_capture_through_a_local_statistics_producer(worker):
    import kvcal.torch
    from tiny_llama import tiny_llama

    model = tiny_llama(num_kv_heads=2)
    g = torch.Generator().manual_seed(7)
    inputs = [torch.randint(0, 128, (2, 9), generator=g) for _ in range(5)]
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0  # left padding in one forward: the masked tokens are dropped
    results = []
    for options in ({}, {"local_statistics": True, "flush_batches": 2}):
        client = kvcal.Client(worker.target)
        client.create_session(model.config)
        with kvcal.Producer(client, **options) as producer, kvcal.torch.capture(model, producer):
            with torch.no_grad():
                for i, ids in enumerate(inputs):
                    model(ids, attention_mask=mask if i == 2 else None, use_cache=False)
        results.append((all_scales(client), client.status().values_ingested, producer.stats()))
        client.delete()
    (wired, wired_values, _), (local, local_values, stats) = results
    # One sequence number per flush, nothing else sent.
    assert stats["local_flushes"] == 3 and stats["last_sequence"] == 3
    assert local_values == wired_values > 0
    assert local == wired


def test_a_flush_is_refused_when_it_cannot_be_applied(make_worker, caplog):
    """A state over the client's message limit, and a session that is gone
    (a worker restarted without --state-dir: ImportState would create a new
    session from one partial state): one ProducerError naming why, nothing
    imported, and the producer stays failed."""
    w = make_worker()
    small = kvcal.Client(w.target, max_message_bytes=64 << 10)
    small.create_session(geometry=GEOMETRY, session_id="limit")
    with caplog.at_level(logging.WARNING, logger="kvcal"):
        producer = kvcal.Producer(small, local_statistics=True)
    # Said when the producer starts, before anything was put: the format's
    # largest flush of 3 layers of 12 heads and 64 batch records, at the
    # session's histogram resolution, and the request around it.
    bins = small.status("limit").histogram_bins_per_octave
    largest = largest_statistics_bytes(kvcal.Geometry(**GEOMETRY), bins, 64) + 1024
    assert [r.getMessage() for r in caplog.records] == [
        f"kvcal: producer default: one flush of the local statistics of this worker's 3 layers "
        f"can reach {largest} bytes (the format's largest: every histogram bin filled), over the "
        f"client's max_message_bytes 65536. Real flushes are smaller and grow with the tokens "
        f"they cover; one over the limit is refused when it is made. To be safe, raise "
        f"max_message_bytes and the worker's --max-message-bytes to {largest}, or shard the "
        f"session over more workers; flushing more often (flush_batches) keeps flushes smaller"]
    for layer, role, t, layout in batches(4, 1)[0]:
        producer.put(layer, role, t, layout=layout)
    with pytest.raises(kvcal.ProducerError, match="over the client's max_message_bytes 65536"):
        producer.flush()
    with pytest.raises(kvcal.ProducerError, match="max_message_bytes"):
        producer.put(0, "k", np.ones((3, 2, 16), np.float32), layout="tokens_heads_dim")
    producer.abandon()
    assert small.status("limit").values_ingested == 0

    client = kvcal.Client(w.target)
    client.create_session(geometry=GEOMETRY, session_id="gone")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvcal"):
        producer = kvcal.Producer(client, local_statistics=True)
    assert caplog.records == []  # within the default 64 MiB
    producer.put(0, "k", np.ones((3, 2, 16), np.float32), layout="tokens_heads_dim")
    w.restart()
    with pytest.raises(kvcal.ProducerError, match="session gone is gone from the worker"):
        producer.flush()
    producer.abandon()
    assert [s.session_id for s in client.list_sessions()] == []
