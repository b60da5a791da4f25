"""kvcal.Client and kvcal.Producer against a real worker (numpy inputs)."""
import json
import os
import subprocess
import threading
import types

import numpy as np
import pytest

import kvcal
from reference import observer_scales

GEOMETRY = dict(num_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def make_batches(seed, nbatches=3, layers=2, shape=(2, 4, 5, 8), kv_shape=(2, 2, 5, 8)):
    rng = np.random.default_rng(seed)
    data = []
    for b in range(nbatches):
        per_layer = {}
        for layer in range(layers):
            scale = 1.0 + layer + b
            per_layer[layer] = {
                "q": (rng.standard_normal(shape) * scale).astype(np.float32),
                "k": (rng.standard_t(3, kv_shape) * scale).astype(np.float32),
                "v": (rng.standard_normal(kv_shape) * scale * 0.5).astype(np.float32),
            }
        data.append(per_layer)
    return data


def push(client, data, **producer_kwargs):
    with kvcal.Producer(client, **producer_kwargs) as producer:
        for per_layer in data:
            producer.new_batch()
            for layer, roles in per_layer.items():
                for role, x in roles.items():
                    producer.put(layer, role, x)
    return producer


@pytest.mark.parametrize("observer", ["static_minmax", "minmax", "memoryless_minmax"])
@pytest.mark.parametrize("granularity", ["head", "tensor"])
def test_finalize_equals_direct_computation(worker, observer, granularity):
    client = kvcal.Client(worker.target)
    client.create_session(geometry=GEOMETRY)
    data = make_batches(1)
    push(client, data)
    scales = client.finalize(observer=observer, granularity=granularity)
    assert scales.granularity == granularity and scales.observer == observer
    for layer in range(2):
        for role in "qkv":
            got = scales[f"model.layers.{layer}.self_attn.{role}_scale"]
            want = observer_scales([d[layer][role] for d in data], observer, granularity)
            assert got.dtype == np.float32
            assert got.shape == ((len(want), 1, 1) if granularity == "head" else (1,))
            np.testing.assert_allclose(got.reshape(-1), want, rtol=2e-7 if observer != "minmax" else 1e-6)
    client.delete()


def test_status_counts_and_chunk_splitting(worker):
    """Tensors split into many chunks give the same statistics."""
    data = make_batches(2)
    values = sum(x.size for per_layer in data for roles in per_layer.values() for x in roles.values())
    results = []
    for chunk_bytes in (1 << 20, 64):  # 64 bytes: one token row of 8 floats... per chunk
        client = kvcal.Client(worker.target)
        client.create_session(geometry=GEOMETRY)
        producer = push(client, data, chunk_bytes=chunk_bytes)
        session = client.status()
        assert session.values_ingested == values
        assert session.chunks_applied == producer.last_sequence
        results.append(client.finalize(observer="minmax", granularity="head"))
        client.delete()
    assert results[1].keys() == results[0].keys()
    for name in results[0]:
        np.testing.assert_array_equal(results[0][name], results[1][name])


def test_tokens_heads_dim_layout_and_head_offset(worker):
    client = kvcal.Client(worker.target)
    client.create_session(geometry=dict(num_layers=1, num_attention_heads=2,
                                        num_key_value_heads=2, head_dim=4))
    x = np.arange(3 * 2 * 4, dtype=np.float32).reshape(3, 2, 4) - 5  # [tokens, heads, dim]
    with kvcal.Producer(client) as producer:
        for role in "qkv":
            producer.put(0, role, x[:, :1], layout="tokens_heads_dim")              # head 0
            producer.put(0, role, x[:, 1:], layout="tokens_heads_dim", head_offset=1)  # head 1
    scales = client.finalize(granularity="head")
    want = np.abs(x).max(axis=(0, 2)) / 448
    np.testing.assert_allclose(scales["model.layers.0.self_attn.k_scale"].reshape(-1), want, rtol=1e-7)


def test_a_producer_name_with_chunks_needs_resume(worker):
    """docs/producers.md: a second producer under a name that already has
    chunks is refused (as the C++ Uploader refuses without --resume); with
    resume=True it continues after the watermark."""
    client = kvcal.Client(worker.target)
    client.create_session(geometry=GEOMETRY)
    data = make_batches(3, nbatches=2)
    push(client, data[:1], producer_id="rank0")
    with pytest.raises(ValueError, match="producer rank0 already has 6 chunks applied"):
        kvcal.Producer(client, producer_id="rank0")
    assert client.status().chunks_applied == 6  # the refusal changed nothing
    second = push(client, data[1:], producer_id="rank0", resume=True)  # starts at watermark + 1
    assert second.last_sequence == 12
    assert client.status().chunks_applied == 12
    client.delete()


def test_invalid_chunk_is_reported(worker):
    client = kvcal.Client(worker.target)
    client.create_session(geometry=GEOMETRY)
    producer = kvcal.Producer(client)
    producer.put(0, "q", np.ones((1, 4, 2, 7), np.float32))  # head_dim 7, session has 8
    with pytest.raises(kvcal.ProducerError, match="head_dim"):
        producer.close()
    client.delete()


def test_missing_data_and_unknown_session(worker):
    client = kvcal.Client(worker.target)
    client.create_session(geometry=GEOMETRY)
    with pytest.raises(kvcal.KvcalError, match="FAILED_PRECONDITION"):
        client.finalize()
    client.delete()
    with pytest.raises(kvcal.KvcalError, match="NOT_FOUND"):
        client.status("no-such-session")


def test_scales_file_round_trip_and_cli_reads_it(worker, tmp_path, kvcal_cli):
    client = kvcal.Client(worker.target)
    client.create_session(geometry=GEOMETRY, session_id="file-test")
    push(client, make_batches(4))
    scales = client.finalize(observer="static_minmax", granularity="head")
    path = str(tmp_path / "scales.safetensors")
    scales.save(path)
    back = kvcal.Scales.load(path)
    assert back.granularity == "head" and back.observer == "static_minmax"
    for name in scales:
        np.testing.assert_array_equal(back[name], scales[name])
    # The C++ CLI writes the same file from the same session.
    cli_path = str(tmp_path / "cli.safetensors")
    subprocess.run([kvcal_cli, "finalize", "--server", worker.target, "--session", "file-test",
                    "--granularity", "head", "-o", cli_path], check=True, capture_output=True)
    cli = kvcal.Scales.load(cli_path)
    assert cli.keys() == scales.keys()
    for name in scales:
        np.testing.assert_array_equal(cli[name], scales[name])
    client.delete()


def test_bearer_token(make_worker, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("team-a:s3cret\n")
    w = make_worker(extra_args=["--auth-token-file", str(tokens)])
    with pytest.raises(kvcal.KvcalError, match="UNAUTHENTICATED"):
        kvcal.Client(w.target).create_session(geometry=GEOMETRY)
    client = kvcal.Client(w.target, token="s3cret")
    client.create_session(geometry=GEOMETRY)
    push(client, make_batches(5, nbatches=1))
    assert client.status().chunks_applied == 6
    client.delete()


def test_producer_factory_picks_the_type_for_one_worker_or_several(worker, make_worker):
    """kvcal.Producer(client) is a WorkerProducer for one worker and a
    ShardedProducer made of one WorkerProducer per worker for several; each
    layer's chunks go to its owner's producer."""
    one = kvcal.Client(worker.target)
    one.create_session(geometry=GEOMETRY)
    with kvcal.Producer(one, producer_id="single") as single:
        assert type(single) is kvcal.WorkerProducer
        assert single.client is one
    one.delete()

    ws = [make_worker(extra_args=["--worker-id", n]) for n in ("b", "a")]
    several = kvcal.Client([w.target for w in ws])
    several.create_session(geometry=GEOMETRY, session_id="factory")
    data = make_batches(5)
    with kvcal.Producer(several, producer_id="sharded") as producer:
        assert type(producer) is kvcal.ShardedProducer
        assert [type(p) for p in producer.producers] == [kvcal.WorkerProducer] * 2
        assert [p.client for p in producer.producers] == several.workers  # by worker id
        assert {p.producer_id for p in producer.producers} == {"sharded"}
        for per_layer in data:
            producer.new_batch()
            for layer, roles in per_layer.items():
                for role, x in roles.items():
                    producer.put(layer, role, x)
    owners = list(several.status("factory").shard_map.layer_owners)
    for i, p in enumerate(producer.producers):
        # A worker's producer numbered exactly the chunks of the layers it owns.
        assert p.last_sequence == 3 * len(data) * owners.count(i)
        assert several.workers[i].status("factory").chunks_applied == p.last_sequence
    assert producer.last_sequence == sum(p.last_sequence for p in producer.producers)
    assert producer.stats()["acknowledged"] == producer.last_sequence

    # Each type refuses the other's client with one clear error.
    with pytest.raises(ValueError, match="streams to one worker and this client has 2"):
        kvcal.WorkerProducer(several, producer_id="x")
    with pytest.raises(ValueError, match="needs a client of several workers"):
        kvcal.ShardedProducer(kvcal.Client(worker.target), session_id="factory")


class _RecordingCondition(threading.Condition):
    """threading.Condition recording each wait's thread and timeout."""
    waits: list = []

    def wait(self, timeout=None):
        _RecordingCondition.waits.append((threading.current_thread(), timeout))
        return super().wait(timeout)


def test_sender_sleeps_without_a_timer_and_close_wakes_it(worker, monkeypatch):
    """The sender waits on the producer's condition without a timeout (no
    periodic polling), so put() and acknowledgements must wake it; close()
    wakes it to half-close the stream, and the producer's thread ends."""
    import kvcal.producer.streaming

    # The streaming producer's threading, with the recording Condition.
    monkeypatch.setattr(kvcal.producer.streaming, "threading",
                        types.SimpleNamespace(**{**vars(threading),
                                                 "Condition": _RecordingCondition}))
    _RecordingCondition.waits = []
    client = kvcal.Client(worker.target)
    client.create_session(geometry=GEOMETRY)
    producer = kvcal.Producer(client, window=2, chunk_bytes=64)
    for per_layer in make_batches(6, nbatches=1):
        for layer, roles in per_layer.items():
            for role, x in roles.items():
                producer.put(layer, role, x)  # many chunks through a window of 2
    producer.flush()
    assert producer.stats()["acknowledged"] == producer.last_sequence > 2

    closer = threading.Thread(target=producer.close)
    closer.start()
    closer.join(60)  # a failure bound: a sender nobody wakes would hang here
    assert not closer.is_alive(), "close() did not return: the sender was not woken"
    assert not producer._thread.is_alive()
    main = threading.main_thread()
    sender_waits = [timeout for thread, timeout in _RecordingCondition.waits
                    if thread is not main and thread is not producer._thread]
    assert sender_waits, "the sender never waited"
    assert set(sender_waits) == {None}, sender_waits
    assert client.status().chunks_applied == producer.last_sequence
    client.delete()
