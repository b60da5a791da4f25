"""`kvcal push --local-statistics`: a dump's calibration batches accumulated
in the kvcal process and sent as numbered partial-statistics messages (one
per --flush-batches batches per worker) instead of their chunks, held-out
batches still as chunks. Against the same dump pushed in-band: every scale
and absmax bit-identical for the five observers, per tensor and per head,
on one worker and sharded over two; a second push with --resume sends
nothing new; --flush-batches without --local-statistics is a usage error."""
import json
import os
import subprocess

import numpy as np
import pytest

import kvcal

from test_local_statistics import exact_bits

OBSERVERS = ["static_minmax", "minmax", "memoryless_minmax", "mse", "percentile"]
CONFIG = {"num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 8, "hidden_size": 32}


@pytest.fixture
def dump(tmp_path):
    """Five batches of heavy-tailed f32 activations, an outlier head and
    channel, NaN in one batch's k."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(11)
    dumps = tmp_path / "dumps"
    os.makedirs(dumps)
    for b in range(5):
        tensors = {}
        for layer in range(CONFIG["num_hidden_layers"]):
            for role, heads in (("q", 4), ("k", 2), ("v", 2)):
                x = rng.standard_t(3, (17 + b, heads, 8)).astype(np.float32) * (1 + layer)
                x[:, (layer + b) % heads, :] *= 15.0
                x[:, :, layer % 8] *= 6.0
                if b == 1 and role == "k":
                    x[2, 1, 3] = np.nan
                tensors[f"model.layers.{layer}.self_attn.{role}"] = x
        save_file(tensors, str(dumps / f"batch{b:03d}.safetensors"))
    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIG))
    return str(dumps), str(config)


def run(cli, *args):
    return subprocess.run([cli, *args], capture_output=True, text=True, timeout=120)


def create_and_push(cli, server, config, session, dumps, *extra):
    r = run(cli, "create", "--server", server, "--config", config, "--session", session,
            "--holdout-budget-bytes", "1000000", "--json")
    assert r.returncode == 0, r.stderr
    r = run(cli, "push", "--server", server, "--session", session, "--chunk-bytes", "256",
            "--holdout-batches", "1", "--json", *extra, dumps)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def scales(client, session):
    return {(o, g): exact_bits(client.finalize_response(session, observer=o, granularity=g))
            for o in OBSERVERS for g in ("tensor", "head")}


def test_push_local_statistics_equals_in_band(make_worker, kvcal_cli, dump):
    dumps, config = dump
    w = make_worker()
    in_band = create_and_push(kvcal_cli, w.target, config, "wired", dumps)
    local = create_and_push(kvcal_cli, w.target, config, "local", dumps,
                            "--local-statistics", "--flush-batches", "2")
    assert in_band["local_statistics_messages"] == 0
    # 4 calibration batches in messages of 2, then nothing else but the
    # held-out batch's 9 tensors as chunks (whole: 21 tokens x heads x 8
    # floats fit no 256-byte chunk, held-out tensors are never cut by tokens).
    assert local["local_statistics_messages"] == 2
    assert local["chunks"] == local["chunks_applied"] == 2 + 9
    assert local["local_statistics_bytes"] > 0
    assert local["bytes"] == in_band["bytes"]  # the dump's data bytes either way
    client = kvcal.Client(w.target)
    a, b = client.status("wired"), client.status("local")
    assert (a.values_ingested, a.nonfinite_values, a.holdout_chunks) == \
        (b.values_ingested, b.nonfinite_values, b.holdout_chunks)
    assert b.nonfinite_values == 3 and b.holdout_chunks == 9  # a NaN in each layer's k
    assert scales(client, "local") == scales(client, "wired")

    # Resumed: every message is at or below the watermark; nothing changes.
    r = run(kvcal_cli, "push", "--server", w.target, "--session", "local", "--chunk-bytes", "256",
            "--holdout-batches", "1", "--local-statistics", "--flush-batches", "2", "--resume",
            "--json", dumps)
    assert r.returncode == 0, r.stderr
    again = json.loads(r.stdout)
    assert again["chunks_skipped"] == 11 and again["chunks_sent"] == 0
    assert client.status("local").values_ingested == a.values_ingested
    # Without --resume the producer is refused, naming what it has.
    r = run(kvcal_cli, "push", "--server", w.target, "--session", "local",
            "--local-statistics", dumps)
    assert r.returncode == 1 and "already has 11 chunks applied" in r.stderr


def test_push_local_statistics_sharded(make_worker, kvcal_cli, dump):
    dumps, config = dump
    ref = make_worker()
    create_and_push(kvcal_cli, ref.target, config, "ref", dumps)
    ws = [make_worker(extra_args=["--worker-id", n]) for n in ("a", "b")]
    server = ",".join(w.target for w in ws)
    local = create_and_push(kvcal_cli, server, config, "sharded", dumps,
                            "--local-statistics", "--flush-batches", "3")
    # 4 calibration batches: 2 messages (3 + 1 batches) per worker.
    assert local["local_statistics_messages"] == 4
    assert scales(kvcal.Client([w.target for w in ws]), "sharded") == \
        scales(kvcal.Client(ref.target), "ref")


def test_flush_batches_needs_local_statistics(kvcal_cli, dump):
    dumps, _ = dump
    r = run(kvcal_cli, "push", "--server", "127.0.0.1:1", "--session", "s",
            "--flush-batches", "2", dumps)
    assert r.returncode == 2
    assert "--flush-batches requires --local-statistics" in r.stderr
    r = run(kvcal_cli, "push", "--server", "127.0.0.1:1", "--session", "s",
            "--local-statistics", "--flush-batches", "0", dumps)
    assert r.returncode == 2 and "--flush-batches" in r.stderr


@pytest.mark.parametrize("mode", [(), ("--local-statistics",)], ids=["in-band", "local"])
def test_push_refuses_a_role_the_session_does_not_collect(make_worker, kvcal_cli, dump, mode):
    """A dump holding Q pushed to a K,V session is refused before anything is
    sent, naming the file, the tensor and the role; the session is unchanged
    (in-band, the worker used to apply the tensors before the first Q)."""
    dumps, config = dump
    w = make_worker()
    client = kvcal.Client(w.target)
    client.create_session(config, session_id="kv", roles=("k", "v"))
    r = run(kvcal_cli, "push", "--server", w.target, "--session", "kv", "--chunk-bytes", "256",
            *mode, dumps)
    assert r.returncode == 1, r.stderr
    assert "batch000.safetensors: tensor 'model.layers.0.self_attn.q': " \
        "role Q is not collected by this session" in r.stderr, r.stderr
    s = client.status("kv")
    assert (s.values_ingested, s.chunks_applied, len(s.producers)) == (0, 0, 0)


def test_a_flush_over_the_workers_message_limit_says_what_to_change(make_worker, kvcal_cli, dump):
    """A worker with a small --max-message-bytes refuses a flush bigger than
    it; the push says so with the sizes and the flags that help, and the
    session keeps nothing of it."""
    dumps, config = dump
    w = make_worker(extra_args=["--max-message-bytes", "65536"])
    r = run(kvcal_cli, "create", "--server", w.target, "--config", config, "--session", "s",
            "--histograms", "64")
    assert r.returncode == 0, r.stderr
    r = run(kvcal_cli, "push", "--server", w.target, "--session", "s", "--local-statistics",
            "--flush-batches", "5", dumps)
    assert r.returncode == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "Received message larger than max" in last and "vs. 65536)" in last, last
    assert "over the worker's --max-message-bytes" in last and "--flush-batches" in last, last
    s = kvcal.Client(w.target).status("s")
    assert (s.values_ingested, s.chunks_applied) == (0, 0)
