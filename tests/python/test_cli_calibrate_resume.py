"""`kvcal calibrate --resume` (what the Kubernetes Job's rerun does), as
processes: two workers, a `kvcal calibrate` killed with SIGKILL while it
pushes, the same command again without --resume (refused, nothing changed),
then with --resume: it skips what the workers applied and its scales, and
the patched checkpoint's scale tensors, are bit-identical to those of an
uninterrupted run of the same dump.

Bounded: every wait has a timeout; the workers are killed by the fixture."""
import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import kvcal
from tiny_llama import tiny_llama

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 4, 4, 2, 16
BATCHES, TOKENS = 4, 1024
CHUNK_BYTES = 1024  # many chunks, so that the push is still running when killed
TIMEOUT = 240


def write_dumps(path):
    rng = np.random.default_rng(5)
    os.makedirs(path)
    for b in range(BATCHES):
        tensors = {}
        for layer in range(LAYERS):
            for role, heads in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
                x = rng.standard_t(4, (TOKENS, heads, HEAD_DIM)) * (1 + 0.5 * layer)
                tensors[f"model.layers.{layer}.self_attn.{role}"] = x.astype(np.float32)
        save_file(tensors, os.path.join(path, f"batch{b:03d}.safetensors"))


def calibrate(kvcal_cli, server, model, session, out_dir, scales, *extra):
    return [kvcal_cli, "calibrate", "--server", server, "--checkpoint", model,
            "--session", session, "--chunk-bytes", str(CHUNK_BYTES), "--out", out_dir,
            "-o", scales, "--json", *extra]


def scale_tensors(path):
    return {k: v for k, v in load_file(path).items() if k.endswith("_scale")}


def assert_bit_identical(got, want):
    assert sorted(got) == sorted(want) and want
    for name, w in want.items():
        assert got[name].dtype == w.dtype, name
        assert np.array_equal(got[name].view(np.uint8), w.view(np.uint8)), name


def patched_scales(directory):
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out.update(scale_tensors(os.path.join(directory, name)))
    return out


@pytest.fixture
def setup(make_worker, tmp_path):
    model = str(tmp_path / "model")
    tiny_llama(num_kv_heads=KV_HEADS, layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM) \
        .save_pretrained(model)
    dumps = str(tmp_path / "dumps")
    write_dumps(dumps)
    workers = [make_worker(extra_args=["--worker-id", f"w{i}"]) for i in range(2)]
    return model, dumps, ",".join(w.target for w in workers)


def kill_mid_push(kvcal_cli, server, model, dumps, tmp_path, session, threshold):
    """Starts calibrate, SIGKILLs it once the workers applied `threshold` chunks;
    returns the chunks applied when it settled (fewer than all: the caller
    checks), or None when the push finished before the kill."""
    client = kvcal.Client(server)
    proc = subprocess.Popen(
        calibrate(kvcal_cli, server, model, session, str(tmp_path / f"out-{session}"),
                  str(tmp_path / f"scales-{session}.safetensors"), dumps),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + TIMEOUT
    applied = 0
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            applied = client.status(session).chunks_applied
        except (kvcal.KvcalError, ValueError):  # not created yet, or on one worker only
            applied = 0
        if applied >= threshold:
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    if proc.returncode != -signal.SIGKILL:
        return None  # it ended by itself first
    # Chunks in flight when the client died may still be applied: wait until
    # the count stops moving.
    last = -1
    while time.monotonic() < deadline:
        now = client.status(session).chunks_applied
        if now == last:
            return now
        last = now
        time.sleep(0.2)
    raise AssertionError("the workers' chunk count did not settle")


def test_calibrate_resume_after_sigkill_is_bit_identical(setup, kvcal_cli, tmp_path):
    model, dumps, server = setup
    model_files = {n: open(os.path.join(model, n), "rb").read() for n in os.listdir(model)}

    # The uninterrupted run.
    ref = subprocess.run(
        calibrate(kvcal_cli, server, model, "ref", str(tmp_path / "out-ref"),
                  str(tmp_path / "scales-ref.safetensors"), dumps),
        capture_output=True, text=True, timeout=TIMEOUT)
    assert ref.returncode == 0, ref.stderr
    total = json.loads(ref.stdout)["push"]["chunks"]
    assert total > 1000

    # Killed mid-push (a new session per try, in case a push ends first).
    for attempt in range(3):
        session = f"killed-{attempt}"
        applied = kill_mid_push(kvcal_cli, server, model, dumps, tmp_path, session,
                                threshold=total // 8)
        if applied is not None and 0 < applied < total:
            break
    else:
        pytest.fail(f"no calibrate was killed mid-push in 3 tries (total {total} chunks)")
    print(f"calibrate killed with {applied} of {total} chunks applied (try {attempt + 1})")
    out_dir = str(tmp_path / f"out-{session}")
    scales = str(tmp_path / f"scales-{session}.safetensors")
    assert not os.path.exists(out_dir) and not os.path.exists(scales)

    # Again without --resume: one clear line, nothing changed.
    again = subprocess.run(calibrate(kvcal_cli, server, model, session, out_dir, scales, dumps),
                           capture_output=True, text=True, timeout=TIMEOUT)
    assert again.returncode == 1
    # (Progress lines come before the error, which is the last line.)
    error = again.stderr.splitlines()[-1]
    assert error.startswith("kvcal calibrate: ") and "chunks applied" in error, again.stderr
    assert kvcal.Client(server).status(session).chunks_applied == applied
    assert not os.path.exists(out_dir) and not os.path.exists(scales)

    # --resume: finishes, skipping what the workers had.
    resumed = subprocess.run(
        calibrate(kvcal_cli, server, model, session, out_dir, scales, "--resume", dumps),
        capture_output=True, text=True, timeout=TIMEOUT)
    assert resumed.returncode == 0, resumed.stderr
    push = json.loads(resumed.stdout)["push"]
    assert push["chunks"] == total
    assert push["chunks_skipped"] > 0
    assert push["chunks_skipped"] + push["chunks_sent"] >= total
    assert kvcal.Client(server).status(session).chunks_applied == total

    assert_bit_identical(scale_tensors(scales),
                         scale_tensors(str(tmp_path / "scales-ref.safetensors")))
    assert_bit_identical(patched_scales(out_dir), patched_scales(str(tmp_path / "out-ref")))
    # The source checkpoint was never touched (--out).
    assert {n: open(os.path.join(model, n), "rb").read() for n in os.listdir(model)} == model_files


def test_resume_needs_a_session(setup, kvcal_cli, tmp_path):
    model, dumps, server = setup
    proc = subprocess.run([kvcal_cli, "calibrate", "--server", server, "--checkpoint", model,
                           "--resume", dumps], capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 1
    assert proc.stderr == "kvcal calibrate: --resume needs --session: the id of the run to continue\n"
    assert list(kvcal.Client(server).list_sessions()) == []  # nothing was created
