"""kvcal.Client and kvcal.Producer against a real worker (numpy inputs)."""
import json
import os
import subprocess

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
