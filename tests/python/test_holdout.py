"""Held-out batches (IngestRequest.holdout): the worker keeps them whole,
outside the statistics, within the session's budget; they are counted,
exported, imported and survive a worker restart."""
import grpc
import numpy as np
import pytest
import torch

import kvcal
from kvcal.v1 import pb

GEOMETRY = dict(num_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def qkv(seed, scale=1.0, batch=2, tokens=5):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 4, tokens, 8, generator=g) * scale
    k = torch.randn(batch, 2, tokens, 8, generator=g) * scale
    v = torch.randn(batch, 2, tokens, 8, generator=g) * scale
    return q, k, v


def push(client, calib_seeds, holdout_seeds, chunk_bytes=4 << 20):
    with kvcal.Producer(client, chunk_bytes=chunk_bytes) as producer:
        for seed in calib_seeds:
            producer.new_batch()
            for layer in range(2):
                for role, t in zip("qkv", qkv(seed * 10 + layer)):
                    producer.put(layer, role, t)
        producer.holdout = True
        for seed in holdout_seeds:
            producer.new_batch()
            for layer in range(2):
                # 100x larger: a static absmax that saw them would show it.
                for role, t in zip("qkv", qkv(seed * 10 + layer, scale=100.0)):
                    producer.put(layer, role, t)
        producer.flush()  # durable too when the worker persists


def ingest(client, **fields):
    def one():
        yield pb.IngestRequest(session_id=client.session_id, **fields)
    return list(client.stub.Ingest(one()))


def test_held_out_chunks_are_kept_not_calibrated(make_worker):
    w = make_worker(state_dir=True)
    client = kvcal.Client(w.target)
    client.create_session(geometry=GEOMETRY)
    push(client, [1, 2], [3])
    s = client.status()
    assert s.holdout_chunks == 6 and s.holdout_batches == 1
    assert s.holdout_bytes == 2 * (2 * 4 * 5 * 8 + 2 * 2 * 2 * 5 * 8) * 4
    assert s.holdout_budget_bytes == 64 << 20
    assert s.chunks_applied == 18  # counted like every chunk

    # The statistics saw the calibration batches only.
    reference = kvcal.Client(w.target)
    reference.create_session(geometry=GEOMETRY, session_id="reference")
    push(reference, [1, 2], [])
    got = client.finalize_response()
    want = reference.finalize_response()
    assert [l.k.absmax for l in got.layers] == [l.k.absmax for l in want.layers]
    assert max(got.layers[0].k.absmax) < 10  # the 100x held-out batch is not in it

    # Survives a hard kill after it became durable.
    exported = client.export_state()
    w.stop(sig=9)
    w.start()
    client = kvcal.Client(w.target, session_id=client.session_id)
    s2 = client.status()
    assert (s2.holdout_chunks, s2.holdout_bytes, s2.holdout_batches) == (
        s.holdout_chunks, s.holdout_bytes, s.holdout_batches)
    restored = client.export_state()
    assert list(restored.holdout_chunks) == list(exported.holdout_chunks)
    assert len(exported.holdout_chunks) == 6
    assert exported.holdout_chunks[0].producer_id == "default"


def test_duplicates_and_imports_are_exactly_once(make_worker):
    w = make_worker()
    client = kvcal.Client(w.target)
    client.create_session(geometry=GEOMETRY)
    q = np.ones((1, 4, 3, 8), np.float32)
    fields = dict(sequence=1, batch=0, layer=0, role=pb.ROLE_Q, dtype=pb.DTYPE_F32,
                  layout=pb.LAYOUT_HEADS_TOKENS_DIM, shape=list(q.shape), data=q.tobytes(),
                  holdout=True)
    assert ingest(client, **fields)[0].applied
    assert not ingest(client, **fields)[0].applied  # a resend
    s = client.status()
    assert s.holdout_chunks == 1 and s.holdout_bytes == q.nbytes

    state = client.export_state()
    for import_id in ("first", "second"):  # the second import merges...
        client.stub.ImportState(pb.ImportStateRequest(session_id="copy", state=state,
                                                      import_id=import_id))
    copy = client.status("copy")
    assert copy.chunks_applied == 2  # counters add
    # ...but held-out chunks are keyed by (producer, sequence): still one.
    assert copy.holdout_chunks == 1 and copy.holdout_bytes == q.nbytes


def test_over_budget_is_resource_exhausted_and_changes_nothing(make_worker):
    w = make_worker()
    client = kvcal.Client(w.target)
    client.create_session(geometry=GEOMETRY, holdout_budget_bytes=1000)
    assert client.status().holdout_budget_bytes == 1000
    small = np.ones((1, 2, 3, 8), np.float32)  # 192 bytes
    big = np.ones((1, 4, 10, 8), np.float32)   # 1280 bytes
    common = dict(batch=0, layer=0, dtype=pb.DTYPE_F32, layout=pb.LAYOUT_HEADS_TOKENS_DIM,
                  holdout=True)
    assert ingest(client, sequence=1, role=pb.ROLE_K, shape=list(small.shape),
                  data=small.tobytes(), **common)[0].applied
    with pytest.raises(grpc.RpcError) as e:
        ingest(client, sequence=2, role=pb.ROLE_Q, shape=list(big.shape), data=big.tobytes(),
               **common)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "held-out budget of 1000 bytes" in e.value.details()
    assert "chunk 2 from producer 'default'" in e.value.details()
    s = client.status()
    assert s.holdout_chunks == 1 and s.holdout_bytes == 192
    assert s.producers[0].sequence == 1 and s.chunks_applied == 1


def test_held_out_tensors_are_split_by_heads_never_by_tokens(make_worker):
    w = make_worker()
    client = kvcal.Client(w.target)
    client.create_session(geometry=GEOMETRY)
    # chunk_bytes below one head of one sequence: calibration chunks would be
    # cut along tokens, held-out ones go one (sequence, head) per chunk.
    push(client, [1], [2], chunk_bytes=64)
    state = client.export_state()
    shapes = {tuple(c.shape) for c in state.holdout_chunks}
    assert shapes == {(1, 1, 5, 8)}
    assert len(state.holdout_chunks) == 2 * 2 * (4 + 2 + 2)


def test_cli_push_holdout_batches(make_worker, kvcal_cli, tmp_path):
    import json
    import os
    import subprocess

    from safetensors.numpy import save_file

    rng = np.random.default_rng(5)
    dumps = tmp_path / "dumps"
    os.makedirs(dumps)
    data = {}
    for b in range(3):
        tensors = {}
        for layer in range(2):
            for role, heads in (("q", 4), ("k", 2), ("v", 2)):
                scale = 100.0 if b == 2 else 1.0  # the held-out batch is larger
                x = (rng.standard_normal((40, heads, 8)) * scale).astype(np.float32)
                tensors[f"model.layers.{layer}.self_attn.{role}"] = x
                data[(b, layer, role)] = x
        save_file(tensors, str(dumps / f"batch{b:03d}.safetensors"))
    w = make_worker()
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "head_dim": 8, "hidden_size": 32}))
    r = subprocess.run([kvcal_cli, "create", "--server", w.target, "--config", str(config),
                        "--session", "cli", "--holdout-budget-bytes", "100000", "--json"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["holdout_budget_bytes"] == 100000
    client = kvcal.Client(w.target, session_id="cli")

    def push(*extra):
        return subprocess.run([kvcal_cli, "push", "--server", w.target, "--session", "cli",
                               "--chunk-bytes", "512", "--json", *extra, str(dumps)],
                              capture_output=True, text=True)

    r = push("--holdout-batches", "3")
    assert r.returncode != 0 and "has only 3 batches" in r.stderr
    assert client.status().chunks_applied == 0
    r = push("--holdout-batches", "1")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["holdout_batches"] == [2]
    s = client.status()
    # Held out: whole [40, heads, 8] tensors, never cut to --chunk-bytes.
    assert s.holdout_batches == 1 and s.holdout_chunks == 6
    state = client.export_state()
    assert {tuple(c.shape) for c in state.holdout_chunks} == {(40, 4, 8), (40, 2, 8)}
    got = client.finalize_response(evaluate=True)
    want_k = max(float(np.abs(data[(b, 1, "k")]).max()) for b in range(2))
    assert max(got.layers[1].k.absmax) == np.float32(want_k)
    assert got.evaluation.sequences == 1 and got.evaluation.tokens == 40


def test_sharded_sessions_hold_and_evaluate_their_own_layers(make_worker):
    workers = [make_worker(extra_args=["--worker-id", f"w{i}"]) for i in range(2)]
    client = kvcal.Client(",".join(w.target for w in workers))
    # A fixed id: its layers land on both workers (rendezvous hashing).
    client.create_session(geometry=dict(GEOMETRY, num_layers=4, head_dim=16),
                          session_id="shard-eval")
    g = torch.Generator().manual_seed(3)
    with kvcal.Producer(client) as producer:
        for holdout in (False, True):
            producer.holdout = holdout
            producer.new_batch()
            for layer in range(4):
                for role, heads in (("q", 4), ("k", 2), ("v", 2)):
                    producer.put(layer, role, torch.randn(1, heads, 6, 16, generator=g))
    s = client.status()
    assert s.holdout_chunks == 4 * 3 and s.holdout_batches == 1
    per_worker = [w.status(client.session_id).holdout_chunks for w in client.workers]
    assert 0 not in per_worker  # both workers hold some layers
    r = client.finalize_response(evaluate=True)
    assert [row.layer for row in r.evaluation.layers] == [0, 1, 2, 3]
    assert all(row.error > 0 for row in r.evaluation.layers)
