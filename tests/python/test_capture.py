"""kvcal.torch.capture on tiny random Llama models: the scales equal those
computed directly from the same forward passes, recorded by hooks the test
places itself on the rotary output and v_proj."""
import numpy as np
import pytest
import torch

import kvcal
import kvcal.torch
from reference import observer_scales
from tiny_llama import record_rotary_and_v, tiny_llama


def calibrate(worker, model, batches, **producer_kwargs):
    client = kvcal.Client(worker.target)
    client.create_session(model.config)
    with kvcal.Producer(client, **producer_kwargs) as producer:
        with record_rotary_and_v(model) as recorded, kvcal.torch.capture(model, producer):
            with torch.no_grad():
                for ids in batches:
                    model(ids, use_cache=False)
    return client, recorded


def token_batches(n=3, batch=2, seq=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (batch, seq), generator=g) for _ in range(n)]


def check(client, recorded, model, observers=("static_minmax", "minmax", "memoryless_minmax")):
    for observer in observers:
        for granularity in ("head", "tensor"):
            scales = client.finalize(observer=observer, granularity=granularity)
            for layer in range(model.config.num_hidden_layers):
                for role in "qkv":
                    direct = [f[layer][role].float().numpy() for f in recorded]
                    want = observer_scales(direct, observer, granularity)
                    got = scales[f"model.layers.{layer}.self_attn.{role}_scale"].reshape(-1)
                    np.testing.assert_allclose(got, want, rtol=1e-6,
                                               err_msg=f"{observer} {granularity} {layer} {role}")


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])  # MHA, GQA, MQA
def test_capture_matches_rotary_output(worker, num_kv_heads):
    model = tiny_llama(num_kv_heads=num_kv_heads)
    batches = token_batches()
    client, recorded = calibrate(worker, model, batches)
    assert len(recorded) == len(batches)
    session = client.status()
    per_forward = sum(t.numel() for f in recorded[:1] for roles in f.values() for t in roles.values())
    assert session.values_ingested == per_forward * len(batches)
    scales = client.finalize(granularity="head")
    assert scales["model.layers.0.self_attn.q_scale"].shape == (4, 1, 1)
    assert scales["model.layers.0.self_attn.k_scale"].shape == (num_kv_heads, 1, 1)
    check(client, recorded, model)
    client.delete()


def test_capture_eager_attention(worker):
    model = tiny_llama(attn_implementation="eager")
    client, recorded = calibrate(worker, model, token_batches(n=2))
    check(client, recorded, model, observers=("static_minmax",))
    client.delete()


def test_bf16_model_streams_bf16(worker):
    model = tiny_llama(dtype=torch.bfloat16)
    batches = token_batches()
    client, recorded = calibrate(worker, model, batches)
    assert recorded[0][0]["q"].dtype == torch.bfloat16
    session = client.status()
    # bf16 on the wire: two bytes per value.
    assert session.bytes_ingested == 2 * session.values_ingested
    check(client, recorded, model)
    client.delete()


def test_one_forward_is_one_batch(worker):
    model = tiny_llama()
    client = kvcal.Client(worker.target)
    client.create_session(model.config)
    with kvcal.Producer(client) as producer, kvcal.torch.capture(model, producer):
        with torch.no_grad():
            for ids in token_batches(n=4):
                model(ids)
    assert producer.batch == 3
    client.delete()


def test_unsupported_model_names_its_class(worker):
    class NotATransformer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

    client = kvcal.Client(worker.target)
    client.create_session(geometry=dict(num_layers=1, num_attention_heads=1,
                                        num_key_value_heads=1, head_dim=4))
    with kvcal.Producer(client) as producer:
        with pytest.raises(kvcal.torch.UnsupportedModelError, match="NotATransformer"):
            with kvcal.torch.capture(NotATransformer(), producer):
                pass
    client.delete()


def test_capture_restores_attention_functions(worker):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    before = dict(type(ALL_ATTENTION_FUNCTIONS)._global_mapping)
    model = tiny_llama()
    client, _ = calibrate(worker, model, token_batches(n=1))
    assert type(ALL_ATTENTION_FUNCTIONS)._global_mapping == before
    client.delete()


def test_scales_for_vllm(worker):
    model = tiny_llama()
    client, _ = calibrate(worker, model, token_batches(n=1))
    per_tensor = kvcal.vllm.scales_for_vllm(client.finalize())
    assert set(per_tensor) == {f"model.layers.{l}.self_attn.attn.{r}_scale"
                               for l in range(2) for r in "qkv"}
    assert all(v.shape == () and v.dtype == torch.float32 for v in per_tensor.values())
    per_head = kvcal.vllm.scales_for_vllm(client.finalize(granularity="head"))
    assert per_head["model.layers.1.self_attn.attn.k_scale"].shape == (2,)
    assert per_head["model.layers.1.self_attn.attn.q_scale"].shape == (4,)
    client.delete()


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3", "gemma"])
def test_capture_other_llama_family_models(worker, family):
    """Qwen3 has q/k norms before RoPE: the rotary output is still what counts."""
    import importlib

    from tiny_llama import FAMILIES, tiny_model

    model = tiny_model(family)
    modeling = importlib.import_module(FAMILIES[family][2])
    client = kvcal.Client(worker.target)
    client.create_session(model.config)
    with kvcal.Producer(client) as producer:
        with record_rotary_and_v(model, modeling) as recorded, kvcal.torch.capture(model, producer):
            with torch.no_grad():
                for ids in token_batches(n=2):
                    model(ids, use_cache=False)
    assert len(recorded) == 2
    check(client, recorded, model, observers=("static_minmax",))
    client.delete()
