"""What kvcal writes, opened by the libraries users load it with (from PyPI):
safetensors, compressed-tensors' QuantizationConfig and transformers."""
import json
import logging
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import kvcal
import kvcal.torch
from tiny_llama import tiny_llama

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def calibrated_checkpoint(worker, tmp_path, kvcal_cli, granularity):
    model = tiny_llama(num_kv_heads=2)
    src = str(tmp_path / "model")
    model.save_pretrained(src)
    client = kvcal.Client(worker.target)
    client.create_session(model.config)
    with kvcal.Producer(client) as producer, kvcal.torch.capture(model, producer):
        with torch.no_grad():
            for seed in range(3):
                model(torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(seed)))
    scales = client.finalize(observer="static_minmax", granularity=granularity)
    client.delete()
    scales_path = str(tmp_path / "scales.safetensors")
    scales.save(scales_path)
    out = str(tmp_path / "patched")
    subprocess.run([kvcal_cli, "patch", "--checkpoint", src, "--scales", scales_path, "--out", out],
                   check=True, capture_output=True)
    return model, src, out, scales


@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_patched_checkpoint_opens_everywhere(worker, tmp_path, kvcal_cli, granularity):
    from safetensors import safe_open

    model, src, out, scales = calibrated_checkpoint(worker, tmp_path, kvcal_cli, granularity)

    # safetensors: every original tensor is unchanged, the scales are there.
    def tensors(directory):
        found = {}
        for name in sorted(os.listdir(directory)):
            if name.endswith(".safetensors"):
                with safe_open(os.path.join(directory, name), framework="pt") as f:
                    for key in f.keys():
                        found[key] = f.get_tensor(key)
        return found

    before, after = tensors(src), tensors(out)
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name
    added = set(after) - set(before)
    assert added == set(scales)
    heads = {"q": 4, "k": 2, "v": 2}
    for name in added:
        role = name.split(".")[-1][0]
        assert after[name].dtype == torch.float32
        want_shape = (heads[role], 1, 1) if granularity == "head" else (1,)
        assert tuple(after[name].shape) == want_shape, name
        np.testing.assert_array_equal(after[name].numpy(), scales[name])

    # compressed-tensors accepts the quantization_config.
    from compressed_tensors.quantization import QuantizationConfig

    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    qc = config["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    parsed = QuantizationConfig.model_validate(qc)
    kv = parsed.kv_cache_scheme
    assert kv.num_bits == 8 and kv.type == "float" and kv.symmetric and not kv.dynamic
    assert kv.strategy == ("attn_head" if granularity == "head" else "tensor")

    # transformers loads it; the only keys it may complain about are scales.
    import transformers
    from transformers.utils import logging as hf_logging

    records = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Collect()
    hf_logger = hf_logging.get_logger("transformers")
    hf_logger.addHandler(handler)
    try:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    finally:
        hf_logger.removeHandler(handler)
    # transformers 5 prints a load report: one row per key (or a compacted
    # group of keys) whose status is UNEXPECTED, MISSING or MISMATCH. Scale
    # tensors it does not know (q_scale: compressed-tensors registers only
    # k_scale and v_scale) may appear there; nothing else may.
    rows = []
    for message in records:
        for line in message.splitlines():
            cells = [c.strip() for c in line.split("|")]
            if len(cells) > 1 and cells[1] in ("UNEXPECTED", "MISSING", "MISMATCH"):
                rows.append((cells[0], cells[1]))
        lowered = message.lower()
        if "unexpected" in lowered and "|" not in message:  # transformers 4 style
            rows.extend((name, "UNEXPECTED") for name in re.findall(r"[\w.]+_scale", message))
    for key, status in rows:
        assert status == "UNEXPECTED" and re.fullmatch(r"model\.layers\..+\.self_attn\.[qkv]_scale", key), \
            (key, status)
    # Every weight loads unchanged; compressed-tensors registered k_scale and
    # v_scale for the kv_cache_scheme and they hold kvcal's values (its
    # forward then fake-quantizes K and V, so logits differ on purpose).
    state = loaded.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(state[name], tensor), name
    loaded_scales = {k: v for k, v in state.items() if k.endswith(("k_scale", "v_scale"))}
    assert len(loaded_scales) == 4, sorted(state)
    for name, value in loaded_scales.items():
        np.testing.assert_array_equal(value.float().numpy().reshape(-1), scales[name].reshape(-1))
