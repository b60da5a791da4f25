"""Producer(shared_memory=True): chunks by same-host shared-memory reference
against a real worker on this host; the same statistics as in-band, exactly
once through a worker restart, and in-band when the worker cannot use it."""
import glob
import logging
import mmap
import os
import signal
import threading
import time

import numpy as np

import kvcal
from kvcal.v1 import pb
from test_resume import GEOMETRY, activations, reference_scales, stream


def regions(client):
    return list(client.stub.ListSharedMemory(pb.ListSharedMemoryRequest(),
                                             metadata=client.metadata).regions)


def exported_statistics(client, session_id):
    return client.export_state(session_id).statistics


def test_shared_memory_equals_in_band(worker):
    client = kvcal.Client(worker.target)
    client.create_session(geometry=GEOMETRY, session_id="py-inband")
    client.create_session(geometry=GEOMETRY, session_id="py-shm")
    with kvcal.Producer(client, "py-inband", chunk_bytes=8 << 10) as producer:
        stream(producer)
    before = set(glob.glob("/dev/shm/kvcal-py-*"))
    with kvcal.Producer(client, "py-shm", chunk_bytes=8 << 10, window=4,
                        shared_memory=True) as producer:
        stream(producer)
        producer.flush()
        assert len(regions(client)) == 1, "registered while streaming"
    assert producer.shared_memory and producer.shared_memory_fallback is None
    assert regions(client) == [], "unregistered on close"
    assert set(glob.glob("/dev/shm/kvcal-py-*")) == before, "unlinked on close"
    shm, inband = client.status("py-shm"), client.status("py-inband")
    assert shm.chunks_applied == inband.chunks_applied == producer.last_sequence
    assert shm.bytes_ingested == inband.bytes_ingested
    assert exported_statistics(client, "py-shm") == exported_statistics(client, "py-inband")
    client.delete("py-shm")
    client.delete("py-inband")


def test_shared_memory_resumes_after_a_worker_restart(make_worker, worker):
    want, want_status = reference_scales(worker)
    w = make_worker(state_dir=True, snapshot_ms=200)
    client = kvcal.Client(w.target)
    client.create_session(geometry=GEOMETRY, session_id="resume")
    restarted = threading.Event()

    def restart_worker():
        w.stop(signal.SIGKILL)
        time.sleep(0.3)
        w.start()  # same port, from its last snapshot; it never heard of the region
        restarted.set()

    def on_put(n):
        if n == 60:
            producer.flush(durable=False, timeout=20)
            threading.Thread(target=restart_worker).start()

    producer = kvcal.Producer(client, keep_until_durable=True, chunk_bytes=8 << 10,
                              shared_memory=True)
    stream(producer, on_put)
    assert restarted.wait(30)
    producer.close()
    assert producer.shared_memory, producer.shared_memory_fallback
    assert producer.reconnects >= 1
    status = client.status()
    assert status.values_ingested == want_status.values_ingested
    assert status.producers[0].sequence == producer.last_sequence
    for observer, ref in want.items():
        got = client.finalize(observer=observer, granularity="head")
        for name in ref:
            np.testing.assert_array_equal(got[name], ref[name], err_msg=f"{observer} {name}")


def test_shared_memory_falls_back_in_band(make_worker, caplog):
    # --shared-memory=false answers as a worker on another host does.
    w = make_worker(extra_args=["--shared-memory", "false"])
    client = kvcal.Client(w.target)
    client.create_session(geometry=GEOMETRY, session_id="fallback")
    with caplog.at_level(logging.WARNING, logger="kvcal"):
        with kvcal.Producer(client, chunk_bytes=8 << 10, shared_memory=True) as producer:
            stream(producer)
    assert not producer.shared_memory
    assert "not on the producer's host" in producer.shared_memory_fallback
    warnings = [r for r in caplog.records if "shared memory not used" in r.getMessage()]
    assert len(warnings) == 1, "one line, not one per chunk"
    assert client.status().chunks_applied == producer.last_sequence


def test_shared_memory_with_several_workers(make_worker):
    # A sharding client: one ring per worker, each layer's chunks by
    # reference to the worker that owns the layer; the scales of one worker.
    from test_producer import GEOMETRY as SMALL, make_batches, push

    data = make_batches(5, layers=SMALL["num_layers"])
    one = kvcal.Client(make_worker().target)
    one.create_session(geometry=SMALL, session_id="ref")
    push(one, data)
    ws = [make_worker(extra_args=["--worker-id", n]) for n in ("a", "b")]
    client = kvcal.Client([w.target for w in ws])
    client.create_session(geometry=SMALL, session_id="sharded")
    producer = push(client, data, shared_memory=True)
    assert producer.shared_memory
    for observer, granularity in [("static_minmax", "head"), ("minmax", "tensor")]:
        want = one.finalize(observer, granularity, session_id="ref")
        got = client.finalize(observer, granularity, session_id="sharded")
        for name in want:
            np.testing.assert_array_equal(got[name], want[name])
    for w in client.workers:
        assert regions(w) == []


def test_ring_pages_are_allocated_as_chunks_need_them(worker):
    # Slots of 1 MiB for chunks of a few KiB: the object holds the pages the
    # chunks used, not window x chunk_bytes.
    client = kvcal.Client(worker.target)
    client.create_session(geometry=GEOMETRY, session_id="py-lazy")
    with kvcal.Producer(client, chunk_bytes=1 << 20, window=4, shared_memory=True) as producer:
        largest = 0
        for b, layer, role, x in activations(nbatches=3):
            producer.put(layer, role, x, batch=b)
            largest = max(largest, x.nbytes)
        producer.flush()
        path = "/dev/shm" + producer._ring.name
        allocated = os.stat(path).st_blocks * 512
        assert os.path.getsize(path) == 4 << 20
        assert 0 < allocated <= 4 * (largest + mmap.PAGESIZE), allocated
    assert producer.shared_memory
    assert client.status().chunks_applied == producer.last_sequence
    client.delete()


def test_shared_memory_full_mid_stream_sends_the_rest_in_band(worker, monkeypatch, caplog):
    # /dev/shm fills up while streaming: the chunks before went by reference,
    # the rest go in-band, and the statistics are those of in-band.
    import errno

    client = kvcal.Client(worker.target)
    client.create_session(geometry=GEOMETRY, session_id="py-inband")
    with kvcal.Producer(client, "py-inband", chunk_bytes=8 << 10) as producer:
        stream(producer)
    calls = []
    real = os.posix_fallocate

    def fills_up(fd, offset, length):
        calls.append(length)
        if len(calls) > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", fills_up)
    before = set(glob.glob("/dev/shm/kvcal-py-*"))
    client.create_session(geometry=GEOMETRY, session_id="py-shm")
    with caplog.at_level(logging.WARNING, logger="kvcal"):
        with kvcal.Producer(client, "py-shm", chunk_bytes=8 << 10, window=8,
                            shared_memory=True) as producer:
            stream(producer)
    assert len(calls) == 4, "three slots allocated, the fourth refused"
    assert not producer.shared_memory
    assert "No space left" in producer.shared_memory_fallback
    assert "in-band" in caplog.text
    assert set(glob.glob("/dev/shm/kvcal-py-*")) == before, "the object is unlinked"
    assert regions(client) == []
    assert client.status("py-shm").chunks_applied == producer.last_sequence
    assert exported_statistics(client, "py-shm") == exported_statistics(client, "py-inband")
    client.delete("py-shm")
    client.delete("py-inband")


def test_shared_memory_that_cannot_be_allocated_falls_back(worker, monkeypatch):
    # A full /dev/shm from the start: the first chunk's slot cannot be
    # allocated (an error before the write, never a SIGBUS on it) and the
    # chunks go in-band.
    import errno

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    before = set(glob.glob("/dev/shm/kvcal-py-*"))
    client = kvcal.Client(worker.target)
    client.create_session(geometry=GEOMETRY, session_id="py-full")
    with kvcal.Producer(client, chunk_bytes=8 << 10, shared_memory=True) as producer:
        stream(producer)
    assert not producer.shared_memory
    assert "No space left" in producer.shared_memory_fallback
    assert set(glob.glob("/dev/shm/kvcal-py-*")) == before, "the object is unlinked"
    assert client.status().chunks_applied == producer.last_sequence
    client.delete()
