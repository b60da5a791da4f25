"""The multi-worker fault test (issue 12): four workers with state dirs on
loopback; two producers push a generated model's activation dumps with the
`kvcal` CLI and one with the Python client, all at once; the worker that owns
layer 0 is SIGKILLed mid-push and restarted on another port (a new address,
the same worker id); every producer finds it again through the `file:`
endpoint list and resends what it lost. A fifth worker is added between two
sessions. The final scales of every observer are bit-identical to those of
one worker that saw everything, and a client given a different worker set for
an existing session gets the clear error. Prints the figures: chunks resent,
reconnects, the share of layers that moved to the fifth worker, time.

Bounded: every wait has a timeout; the workers are killed by the fixture."""
import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest
from safetensors.numpy import save_file

import kvcal
from kvcal import sharding

GEOMETRY = dict(num_layers=12, num_attention_heads=8, num_key_value_heads=2, head_dim=32)
OBSERVERS = [("static_minmax", "tensor"), ("static_minmax", "head"), ("minmax", "head"),
             ("memoryless_minmax", "tensor"), ("mse", "head"), ("percentile", "tensor")]
CHUNK_BYTES = 4096
PUSH_TIMEOUT = 240


def write_dumps(path, seed, batches=3, tokens=192):
    """A generated model's post-RoPE Q/K/V for `batches` forward passes."""
    rng = np.random.default_rng(seed)
    os.makedirs(path)
    g = GEOMETRY
    for b in range(batches):
        tensors = {}
        for layer in range(g["num_layers"]):
            for role, heads in (("q", g["num_attention_heads"]), ("k", g["num_key_value_heads"]),
                                ("v", g["num_key_value_heads"])):
                x = rng.standard_t(4, (tokens, heads, g["head_dim"])) * (1 + 0.3 * layer)
                tensors[f"model.layers.{layer}.self_attn.{role}"] = x.astype(np.float32)
        save_file(tensors, os.path.join(path, f"batch{b:03d}.safetensors"))


def python_batches(seed, batches=3, tokens=96):
    rng = np.random.default_rng(seed)
    g = GEOMETRY
    out = []
    for _ in range(batches):
        per_layer = {}
        for layer in range(g["num_layers"]):
            per_layer[layer] = {
                role: (rng.standard_normal((1, heads, tokens, g["head_dim"])) * (2 + layer))
                .astype(np.float32)
                for role, heads in (("q", g["num_attention_heads"]), ("k", g["num_key_value_heads"]),
                                    ("v", g["num_key_value_heads"]))}
        out.append(per_layer)
    return out


def put_all(producer, batches, first_batch=0):
    for i, per_layer in enumerate(batches):
        for layer, roles in per_layer.items():
            for role, x in roles.items():
                producer.put(layer, role, x, batch=first_batch + i)


def cli(kvcal_cli, *args, timeout=PUSH_TIMEOUT):
    return subprocess.run([kvcal_cli, *args], capture_output=True, text=True, timeout=timeout)


def push_cli(kvcal_cli, server, session, producer, dumps):
    return subprocess.Popen([kvcal_cli, "push", "--server", server, "--session", session,
                             "--producer", producer, "--chunk-bytes", str(CHUNK_BYTES),
                             "--window", "4", "--json", dumps],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def all_scales(client, session_id):
    return {(o, g): client.finalize(o, g, session_id=session_id) for o, g in OBSERVERS}


def assert_bit_identical(got, want):
    for key, w in want.items():
        g = got[key]
        assert sorted(g) == sorted(w), key
        for name in w:
            assert np.array_equal(np.asarray(g[name]).view(np.uint32),
                                  np.asarray(w[name]).view(np.uint32)), (key, name)


def test_four_workers_a_kill_a_move_and_a_fifth_worker(make_worker, kvcal_cli, tmp_path):
    t0 = time.monotonic()
    dumps = [str(tmp_path / f"dumps{i}") for i in range(2)]
    for i, d in enumerate(dumps):
        write_dumps(d, seed=100 + i)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_hidden_layers": GEOMETRY["num_layers"],
                                  "num_attention_heads": GEOMETRY["num_attention_heads"],
                                  "num_key_value_heads": GEOMETRY["num_key_value_heads"],
                                  "head_dim": GEOMETRY["head_dim"], "hidden_size": 256}))
    py_data = python_batches(7)

    # One worker that sees everything: the reference.
    ref = make_worker(extra_args=["--worker-id", "ref"])
    assert cli(kvcal_cli, "create", "--server", ref.target, "--config", str(config),
               "--session", "ref").returncode == 0
    for i, d in enumerate(dumps):
        r = cli(kvcal_cli, "push", "--server", ref.target, "--session", "ref",
                "--producer", f"cli{i}", "--chunk-bytes", str(CHUNK_BYTES), d)
        assert r.returncode == 0, r.stderr
    ref_client = kvcal.Client(ref.target, session_id="ref")
    with kvcal.Producer(ref_client, producer_id="py", chunk_bytes=CHUNK_BYTES) as p:
        put_all(p, py_data)
    reference = all_scales(ref_client, "ref")

    # Four workers with state dirs, listed in a file the clients read again.
    names = ["w0", "w1", "w2", "w3"]
    workers = {n: make_worker(state_dir=True, snapshot_ms=50, extra_args=["--worker-id", n])
               for n in names}
    listing = tmp_path / "workers.txt"

    def write_listing(ws):
        tmp = listing.with_suffix(".tmp")
        tmp.write_text("".join(w.target + "\n" for w in ws))
        os.replace(tmp, listing)  # readers never see half a file

    write_listing(workers.values())
    server = f"file:{listing}"
    assert cli(kvcal_cli, "create", "--server", server, "--config", str(config),
               "--session", "fault-1").returncode == 0
    owners = sharding.layer_owners("fault-1", GEOMETRY["num_layers"], names)
    victim = names[owners[0]]

    client = kvcal.Client(server, session_id="fault-1")
    producer = kvcal.Producer(client, producer_id="py", chunk_bytes=CHUNK_BYTES, window=4)
    put_all(producer, py_data[:1])
    pushes = [push_cli(kvcal_cli, server, "fault-1", f"cli{i}", d) for i, d in enumerate(dumps)]

    # Mid-push: once the victim holds chunks of both CLI producers, SIGKILL it
    # and bring it back with its state dir on a new port.
    probe = kvcal.Client(workers[victim].target)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            seen = {p.producer_id for p in probe.status("fault-1").producers if p.sequence > 0}
        except kvcal.KvcalError:
            seen = set()
        if {"cli0", "cli1"} <= seen:
            break
        time.sleep(0.01)
    still_pushing = [p.poll() is None for p in pushes]
    old_address = workers[victim].target
    workers[victim].stop(signal.SIGKILL)
    killed_at = time.monotonic()
    workers[victim].port = 0  # a new address
    workers[victim].start()
    write_listing(workers.values())
    assert workers[victim].target != old_address
    put_all(producer, py_data[1:], first_batch=1)  # streams to the restarted worker too
    producer.close()

    results = []
    for p in pushes:
        out, err = p.communicate(timeout=PUSH_TIMEOUT)
        assert p.returncode == 0, err
        results.append(json.loads(out))
    push_done = time.monotonic()

    scales_1 = all_scales(client, "fault-1")
    assert_bit_identical(scales_1, reference)

    # A fifth worker between two sessions: the new session's layers spread
    # over five; the old session keeps its four and refuses the new set.
    workers["w4"] = make_worker(state_dir=True, snapshot_ms=50, extra_args=["--worker-id", "w4"])
    write_listing(workers.values())
    five = kvcal.Client(server)
    assert five.worker_ids == names + ["w4"]
    with pytest.raises(ValueError, match=r"added \[w4\]"):
        kvcal.Producer(five, session_id="fault-1", producer_id="late")
    r = cli(kvcal_cli, "push", "--server", server, "--session", "fault-1", "--producer", "late",
            dumps[0])
    assert r.returncode != 0 and "added [w4]" in r.stderr, r.stderr
    before = client.workers[0].status("fault-1").values_ingested
    assert before > 0

    five.create_session(config=str(config), session_id="fault-2")
    for i, d in enumerate(dumps):
        r = cli(kvcal_cli, "push", "--server", server, "--session", "fault-2",
                "--producer", f"cli{i}", "--chunk-bytes", str(CHUNK_BYTES), d)
        assert r.returncode == 0, r.stderr
    with kvcal.Producer(five, producer_id="py", chunk_bytes=CHUNK_BYTES) as p:
        put_all(p, py_data)
    assert_bit_identical(all_scales(five, "fault-2"), reference)
    assert client.workers[0].status("fault-1").values_ingested == before  # untouched

    four_map = sharding.layer_owners("fault-2", GEOMETRY["num_layers"], names)
    five_map = list(five.status("fault-2").shard_map.layer_owners)
    moved = [l for l in range(GEOMETRY["num_layers"]) if five_map[l] != four_map[l]]
    assert all(five_map[l] == 4 for l in moved), "a layer moved between old workers"
    big = 4096  # the same rule over many layers: the expected share is 1/5
    moved_big = sum(1 for l in range(big) if sharding.layer_owner("fault-2", l, names + ["w4"]) == 4)

    cli_resent = sum(r["chunks_sent"] - (r["chunks"] - r["chunks_skipped"]) for r in results)
    py_resent = sum(acked - watermark for watermark, acked in producer.resumes)
    print("\n[multi-worker fault test]"
          f"\n  victim {victim} (owner of layers {[l for l, o in enumerate(owners) if names[o] == victim]}) "
          f"SIGKILLed while {sum(still_pushing)} of 2 CLI pushes were running; back at "
          f"{workers[victim].target} (was {old_address})"
          f"\n  CLI pushes: {sum(r['chunks'] for r in results)} chunks, "
          f"{sum(r['chunks_sent'] for r in results)} sent, {cli_resent} resent, "
          f"{sum(r['reconnects'] for r in results)} reconnects"
          f"\n  Python producer: {producer.last_sequence} chunks, {py_resent} resent, "
          f"{producer.reconnects} reconnects"
          f"\n  push finished {push_done - killed_at:.2f} s after the kill"
          f"\n  fifth worker: {len(moved)} of {GEOMETRY['num_layers']} layers of session fault-2 "
          f"moved to w4 ({len(moved) / GEOMETRY['num_layers']:.1%}); over {big} layers "
          f"{moved_big / big:.1%} (1/5 = 20%); none moved between old workers"
          f"\n  scales of {len(OBSERVERS)} observer settings bit-identical to one worker, "
          f"both sessions; total {time.monotonic() - t0:.1f} s")
