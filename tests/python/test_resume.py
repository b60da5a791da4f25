"""Producer resume: the worker is killed and restarted mid-stream; every
chunk is applied exactly once and the scales equal an uninterrupted run."""
import signal
import threading
import time

import numpy as np
import pytest

import kvcal

GEOMETRY = dict(num_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def activations(nbatches=40, seed=7):
    rng = np.random.default_rng(seed)
    for b in range(nbatches):
        for layer in range(2):
            yield b, layer, "q", rng.standard_normal((2, 4, 32, 16)).astype(np.float32) * (1 + b % 5)
            yield b, layer, "k", rng.standard_t(4, (2, 2, 32, 16)).astype(np.float32)
            yield b, layer, "v", rng.standard_normal((2, 2, 32, 16)).astype(np.float32)


def stream(producer, on_put=None):
    n = 0
    for b, layer, role, x in activations():
        producer.put(layer, role, x, batch=b)
        n += 1
        if on_put:
            on_put(n)
    return n


def reference_scales(worker):
    client = kvcal.Client(worker.target)
    client.create_session(geometry=GEOMETRY)
    with kvcal.Producer(client) as producer:
        stream(producer)
    out = {o: client.finalize(observer=o, granularity="head") for o in ("static_minmax", "minmax", "memoryless_minmax")}
    status = client.status()
    client.delete()
    return out, status


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_resume_after_worker_restart(make_worker, worker, how):
    want, want_status = reference_scales(worker)
    w = make_worker(state_dir=True, snapshot_ms=1000)
    client = kvcal.Client(w.target)
    client.create_session(geometry=GEOMETRY, session_id="resume")
    restarted = threading.Event()
    stopped = []

    def restart_worker():
        stopped.append((w.stop(how), w.log()))
        time.sleep(0.3)  # the producer keeps putting and retrying meanwhile
        w.start()
        restarted.set()

    def on_put(n):
        if n == 30:  # let the session and some chunks reach the state file
            producer.flush(durable=True, timeout=20)
        if n == 60:  # mid-stream, with acknowledged chunks not yet durable
            producer.flush(durable=False, timeout=20)
            threading.Thread(target=restart_worker).start()

    producer = kvcal.Producer(client, keep_until_durable=True, chunk_bytes=8 << 10)
    total = stream(producer, on_put)
    assert restarted.wait(30)
    producer.close()
    assert producer.reconnects >= 1
    assert producer.resumes, "the producer never resumed"
    if how == signal.SIGKILL:
        # The killed worker came back from its last snapshot, behind what it
        # had acknowledged; the producer sent the lost chunks again.
        assert any(0 < mark < acked for mark, acked in producer.resumes), producer.resumes
    else:
        # SIGTERM drains and saves: nothing acknowledged is lost (the worker
        # may have applied chunks whose responses the drain cut off).
        returncode, log = stopped[0]
        assert returncode == 0, log
        assert all(mark >= acked for mark, acked in producer.resumes), (producer.resumes, log)
    status = client.status()
    # Exactly once: the same chunk and value counts as the reference.
    assert status.values_ingested == want_status.values_ingested
    assert status.chunks_applied == producer.last_sequence
    assert status.producers[0].sequence == producer.last_sequence
    for observer, ref in want.items():
        got = client.finalize(observer=observer, granularity="head")
        for name in ref:
            np.testing.assert_array_equal(got[name], ref[name], err_msg=f"{observer} {name}")
    assert total == 240


def test_restart_without_state_is_a_clear_error(make_worker):
    w = make_worker()
    client = kvcal.Client(w.target)
    client.create_session(geometry=GEOMETRY)
    producer = kvcal.Producer(client, reconnect_timeout=20)
    for i, (b, layer, role, x) in enumerate(activations(nbatches=2)):
        producer.put(layer, role, x, batch=b)
    producer.flush()
    w.restart()  # no --state-dir: the session is gone
    with pytest.raises(kvcal.ProducerError, match="gone from the worker"):
        for b, layer, role, x in activations(nbatches=40):
            producer.put(layer, role, x, batch=b + 2)
        producer.close()


def test_waiting_for_durability_that_never_comes_is_a_clear_error(make_worker):
    # keep_until_durable=True against a worker without --state-dir: nothing
    # ever becomes durable; close() says so instead of waiting forever.
    w = make_worker()
    client = kvcal.Client(w.target)
    client.create_session(geometry=GEOMETRY)
    producer = kvcal.Producer(client, keep_until_durable=True, durable_timeout=1.0)
    for b, layer, role, x in activations(nbatches=1):
        producer.put(layer, role, x, batch=b)
    # close() must come back with the error by itself (a thread, so that a
    # close() that waits forever fails the test instead of hanging the suite).
    outcome = {}

    def close():
        try:
            producer.close()
        except kvcal.ProducerError as e:
            outcome["error"] = e

    closer = threading.Thread(target=close, daemon=True)
    closer.start()
    closer.join(timeout=300)
    assert not closer.is_alive(), "close() kept waiting for durability that never comes"
    assert "--state-dir" in str(outcome.get("error")), outcome
    assert client.status().chunks_applied == producer.last_sequence  # applied, not durable


def test_each_outage_gets_the_whole_reconnect_timeout(make_worker):
    # Two restarts further apart than reconnect_timeout: the second outage is
    # a new one, not the continuation of the first.
    w = make_worker(state_dir=True, snapshot_ms=50)
    client = kvcal.Client(w.target)
    client.create_session(geometry=GEOMETRY, session_id="outages")
    producer = kvcal.Producer(client, keep_until_durable=True, reconnect_timeout=2.0,
                              chunk_bytes=8 << 10)
    batches = iter(activations(nbatches=200))
    for restart in range(2):
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:
            b, layer, role, x = next(batches)
            producer.put(layer, role, x, batch=b)
            time.sleep(0.01)
        producer.flush(durable=False, timeout=20)
        w.restart()
    for _ in range(30):
        b, layer, role, x = next(batches)
        producer.put(layer, role, x, batch=b)
    producer.close()
    assert producer.reconnects >= 2
    status = client.status()
    assert status.chunks_applied == producer.last_sequence
    assert status.producers[0].sequence == producer.last_sequence
