"""SmolLM2-135M-Instruct, a trained model (30 layers, 9 query heads, 3 KV
heads, head_dim 64), end to end: kvcal.torch.capture -> worker -> finalize
per head and per tensor -> scales file -> `kvcal patch` -> transformers +
compressed-tensors load the scales. Static min-max equals the scale computed
from the tensors this test records with hooks of its own, and padded batches
give the scales of the unpadded sequences.

Cost on two cores: ~35 s to convert the GGUF file the first time (cached in
.venv, smollm2.py), then ~15 s for the whole module."""
import json
import os
import subprocess

import numpy as np
import pytest
import torch

import kvcal
import kvcal.torch
import smollm2
from reference import observer_scales
from tiny_llama import record_rotary_and_v

smollm2.require()

from smollm2 import DIM, HEADS, KV_HEADS, LAYERS  # noqa: E402


@pytest.fixture(scope="module")
def model_and_tokenizer():
    model, tokenizer = smollm2.load()
    assert (model.config.num_hidden_layers, model.config.num_attention_heads,
            model.config.num_key_value_heads, model.config.head_dim) == (LAYERS, HEADS, KV_HEADS, DIM)
    return model, tokenizer


def forward(model, ids, **kwargs):
    # logits_to_keep=1: the 49152-way head on one position, not all of them.
    with torch.no_grad():
        model(ids, use_cache=False, logits_to_keep=1, **kwargs)


@pytest.fixture(scope="module")
def calibrated(worker, model_and_tokenizer):
    """A session calibrated on 3 batches of 2 x 64 tokens of GPL-3 text and
    what the test's own hooks recorded in the same forwards."""
    model, tokenizer = model_and_tokenizer
    batches = smollm2.token_batches(tokenizer, smollm2.CALIBRATION_FILES, 3, 2, 64)
    client = kvcal.Client(worker.target)
    client.create_session(model.config)
    with kvcal.Producer(client) as producer:
        with record_rotary_and_v(model) as recorded, kvcal.torch.capture(model, producer):
            for ids in batches:
                forward(model, ids)
    yield client, recorded
    client.delete()


@pytest.mark.parametrize("granularity", ["head", "tensor"])
def test_static_minmax_equals_own_hooks(calibrated, granularity):
    client, recorded = calibrated
    assert len(recorded) == 3
    scales = client.finalize(observer="static_minmax", granularity=granularity)
    for layer in range(LAYERS):
        for role in "qkv":
            want = observer_scales([f[layer][role].numpy() for f in recorded], "static_minmax",
                                   granularity)
            got = scales[f"model.layers.{layer}.self_attn.{role}_scale"].reshape(-1)
            np.testing.assert_array_equal(got, want, err_msg=f"{granularity} {layer} {role}")
    heads = {"q": HEADS, "k": KV_HEADS, "v": KV_HEADS}
    for role, n in heads.items():
        shape = (n, 1, 1) if granularity == "head" else (1,)
        assert scales[f"model.layers.0.self_attn.{role}_scale"].shape == shape


@pytest.mark.parametrize("granularity", ["head", "tensor"])
def test_patched_checkpoint_loads_with_scales(calibrated, tmp_path, kvcal_cli, granularity):
    import transformers
    from compressed_tensors.quantization import QuantizationConfig

    client, _ = calibrated
    scales = client.finalize(observer="static_minmax", granularity=granularity)
    scales_path = str(tmp_path / "scales.safetensors")
    scales.save(scales_path)
    out = str(tmp_path / "smollm2-fp8kv")
    subprocess.run([kvcal_cli, "patch", "--checkpoint", smollm2.checkpoint_dir(), "--scales",
                    scales_path, "--out", out], check=True, capture_output=True)
    with open(os.path.join(out, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    kv = QuantizationConfig.model_validate(qc).kv_cache_scheme
    assert kv.strategy == ("attn_head" if granularity == "head" else "tensor")
    assert kv.observer == "static_minmax"

    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    state = loaded.state_dict()
    found = 0
    for layer in range(LAYERS):
        for role in "kv":  # compressed-tensors registers k_scale and v_scale
            name = f"model.layers.{layer}.self_attn.{role}_scale"
            np.testing.assert_array_equal(state[name].float().numpy().reshape(-1),
                                          scales[name].reshape(-1), err_msg=name)
            found += 1
    assert found == 2 * LAYERS


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_gives_unpadded_scales(worker, model_and_tokenizer, side):
    """Three sequences of different lengths in one padded batch vs. each
    alone: the same scales (padding is not sent). Left padding passes
    position_ids as generate() does, so RoPE sees the same positions."""
    model, tokenizer = model_and_tokenizer
    ids = smollm2.token_batches(tokenizer, smollm2.EVALUATION_FILES, 1, 1, 96)[0][0]
    sequences = [ids[:40], ids[40:57], ids[57:96]]

    def run(calls):
        client = kvcal.Client(worker.target)
        client.create_session(model.config)
        with kvcal.Producer(client) as producer, kvcal.torch.capture(model, producer):
            for args, kwargs in calls:
                forward(model, *args, **kwargs)
        try:
            return {g: client.finalize(observer="static_minmax", granularity=g)
                    for g in ("head", "tensor")}
        finally:
            client.delete()

    alone = run([((s.view(1, -1),), {}) for s in sequences])
    longest = max(len(s) for s in sequences)
    batch = torch.full((len(sequences), longest), tokenizer.pad_token_id or 0, dtype=torch.long)
    mask = torch.zeros_like(batch)
    for i, s in enumerate(sequences):
        where = slice(longest - len(s), longest) if side == "left" else slice(0, len(s))
        batch[i, where] = s
        mask[i, where] = 1
    kwargs = {"attention_mask": mask}
    if side == "left":
        kwargs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    padded = run([((batch,), kwargs)])
    for g in ("head", "tensor"):
        for name, want in alone[g].items():
            # Same values up to the float32 rounding of batched matmuls.
            np.testing.assert_allclose(padded[g][name], want, rtol=2e-5, err_msg=f"{g} {name}")
