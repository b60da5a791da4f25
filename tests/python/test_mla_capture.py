"""kvcal.torch.capture_mla on tiny random DeepSeek-V3 (and V2) models built
by transformers: what it sends equals, to float rounding, the latent cache row
vLLM stores (c_kv after kv_a_layernorm, then k_pe after RoPE) and the
absorbed decode query, both computed here from the modules' weights with
RMSNorm and RoPE written out in the test (vLLM's interleaved RoPE pairs);
through a kvcal-worker the per-tensor k_scale is amax(|c_kv|, |k_pe|) / 448."""
import numpy as np
import pytest
import torch

import kvcal
import kvcal.torch

R, P, NOPE, V, HEADS, LAYERS = 16, 8, 8, 8, 4, 2


def tiny_deepseek(q_lora_rank=None, seed=0, version=3):
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    config_class, model_class = ((DeepseekV3Config, DeepseekV3ForCausalLM) if version == 3 else
                                 (DeepseekV2Config, DeepseekV2ForCausalLM))
    config = config_class(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
        kv_lora_rank=R, q_lora_rank=q_lora_rank, qk_rope_head_dim=P, qk_nope_head_dim=NOPE, v_head_dim=V,
        attn_implementation="sdpa")
    assert config.rope_parameters["rope_type"] == "default"
    torch.manual_seed(seed)
    model = model_class(config).eval()
    # A non-trivial norm weight, so that the norm's weight is checked too.
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.kv_a_layernorm.weight.uniform_(0.5, 2.0)
    return model


class Recorder:
    """A producer that keeps what it is given."""

    def __init__(self, geometry=None):
        self.geometry = geometry
        self.client = None
        self.holdout = False
        self.batches = []

    def new_batch(self):
        self.batches.append([])

    def put(self, layer, role, tensor, layout="heads_tokens_dim", **kwargs):
        self.batches[-1].append((layer, role, tensor.detach().clone(), layout))


def vllm_rope(x, positions, theta):
    """vLLM's DeepSeek RoPE (get_rope(..., is_neox_style=False)): pair
    (2i, 2i+1) rotated by positions * theta^(-2i/d)."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    angle = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # [T, d/2]
    cos, sin = angle.cos(), angle.sin()
    x = x.to(torch.float64)
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = odd * cos + even * sin
    return out


def transformers_order(model, x):
    """The order transformers' RoPE leaves the dimensions in: DeepSeek-V3
    with rope_interleave gives the even dimensions of vLLM's layout, then
    the odd ones; DeepSeek-V2 (complex pairs) keeps vLLM's layout."""
    if getattr(model.config, "rope_interleave", None):
        return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
    return x


def expected(model, hidden, positions):
    """{layer: (k [B,1,T,R+P], q [B,H,T,R+P])} from the modules' weights."""
    theta = model.config.rope_parameters["rope_theta"]
    eps = model.config.rms_norm_eps
    out = {}
    for layer, h in hidden.items():
        attn = model.model.layers[layer].self_attn
        h = h.to(torch.float64)
        b, t, _ = h.shape
        kv = h @ attn.kv_a_proj_with_mqa.weight.to(torch.float64).T  # [B, T, R + P]
        latent, rope = kv[..., :R], kv[..., R:]
        c_kv = attn.kv_a_layernorm.weight.to(torch.float64) * latent / torch.sqrt(
            latent.pow(2).mean(-1, keepdim=True) + eps)
        k_pe = transformers_order(model, vllm_rope(rope, positions, theta))
        k = torch.cat([c_kv, k_pe], dim=-1)[:, None]  # [B, 1, T, R + P]
        if attn.q_lora_rank is None:
            q = h @ attn.q_proj.weight.to(torch.float64).T
        else:
            a = h @ attn.q_a_proj.weight.to(torch.float64).T
            a = attn.q_a_layernorm.weight.to(torch.float64) * a / torch.sqrt(a.pow(2).mean(-1, keepdim=True) + eps)
            q = a @ attn.q_b_proj.weight.to(torch.float64).T
        q = q.view(b, t, HEADS, NOPE + P).transpose(1, 2)  # [B, H, T, NOPE + P]
        w_uk = attn.kv_b_proj.weight.to(torch.float64).view(HEADS, NOPE + V, R)[:, :NOPE, :]
        q_latent = torch.einsum("bhtn,hnr->bhtr", q[..., :NOPE], w_uk)
        q_pe = transformers_order(model, vllm_rope(q[..., NOPE:], positions, theta))
        out[layer] = (k, torch.cat([q_latent, q_pe], dim=-1))
    return out


def attention_inputs(model):
    """Hooks of the test's own: each layer's attention input."""
    hidden, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        def pre(module, args, kwargs, i=i):
            hidden[i] = (kwargs.get("hidden_states", args[0] if args else None)).detach().clone()
        hooks.append(layer.self_attn.register_forward_pre_hook(pre, with_kwargs=True))
    return hidden, hooks


@pytest.mark.parametrize("version,q_lora_rank", [(3, None), (3, 8), (2, None)])  # query paths
@pytest.mark.parametrize("use_cache", [False, True])
def test_capture_is_the_latent_cache_row(version, q_lora_rank, use_cache):
    model = tiny_deepseek(q_lora_rank, version=version)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(ids, use_cache=use_cache).logits
    producer = Recorder(kvcal.torch.mla_geometry(model.config))
    hidden, hooks = attention_inputs(model)
    try:
        with torch.no_grad(), kvcal.torch.capture_mla(model, producer):
            logits = model(ids, use_cache=use_cache).logits
    finally:
        for h in hooks:
            h.remove()
    # The capture does not change what the model computes.
    assert torch.equal(logits, plain)
    assert len(producer.batches) == 1
    sent = producer.batches[0]
    # Per layer: one "k" (the latent row, one head) and one "q"; no "v", no
    # per-head decompressed K.
    assert sorted((layer, role) for layer, role, _, _ in sent) == [(0, "k"), (0, "q"), (1, "k"), (1, "q")]
    want = expected(model, hidden, torch.arange(7))
    for layer, role, tensor, layout in sent:
        assert layout == "heads_tokens_dim"
        k, q = want[layer]
        if role == "k":
            assert tuple(tensor.shape) == (2, 1, 7, R + P)
            torch.testing.assert_close(tensor.to(torch.float64), k, rtol=1e-5, atol=1e-5)
        else:
            assert tuple(tensor.shape) == (2, HEADS, 7, R + P)
            torch.testing.assert_close(tensor.to(torch.float64), q, rtol=1e-5, atol=1e-5)
        assert tensor.dtype == torch.float32


def test_k_pe_is_after_rope():
    """The RoPE part differs between positions for the same token, the
    latent part does not: the sent k_pe is rotated."""
    model = tiny_deepseek()
    producer = Recorder()
    ids = torch.full((1, 4), 5)
    with torch.no_grad(), kvcal.torch.capture_mla(model, producer, roles=("k",)):
        model(ids, use_cache=False)
    (layer, role, k, _), _ = producer.batches[0]
    assert (layer, role) == (0, "k")
    torch.testing.assert_close(k[0, 0, 1:, :R], k[0, 0, :1, :R].expand(3, R))
    assert not torch.allclose(k[0, 0, 1, R:], k[0, 0, 0, R:])


def test_padding_and_decode_steps():
    model = tiny_deepseek()
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    producer = Recorder()
    with torch.no_grad(), kvcal.torch.capture_mla(model, producer, roles=("k",)):
        out = model(ids, attention_mask=mask, use_cache=True)
        # One decode step with the dynamic cache: only the new token is sent.
        model(ids[:, :1], past_key_values=out.past_key_values,
              attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1))
    first, second = producer.batches
    for layer, role, tensor, layout in first:
        # 6 + 4 unpadded tokens as [tokens, heads, dim].
        assert layout == "tokens_heads_dim" and tuple(tensor.shape) == (10, 1, R + P)
    for layer, role, tensor, layout in second:
        assert layout == "heads_tokens_dim" and tuple(tensor.shape) == (2, 1, 1, R + P)


def test_refusals():
    model = tiny_deepseek()
    with pytest.raises(ValueError, match="MLA has roles q and k only"):
        with kvcal.torch.capture_mla(model, Recorder(), roles=("k", "v")):
            pass
    # A session made from Llama-style geometry is refused before any forward.
    wrong = kvcal.Geometry(LAYERS, HEADS, HEADS, NOPE + P)
    with pytest.raises(kvcal.torch.UnsupportedModelError, match="mla_geometry"):
        with kvcal.torch.capture_mla(model, Recorder(wrong)):
            pass
    # The per-head capture still refuses MLA, naming the key.
    with pytest.raises(kvcal.torch.UnsupportedModelError, match="kv_lora_rank 16"):
        with kvcal.torch.capture(model, Recorder()):
            pass
    from tiny_llama import tiny_llama

    with pytest.raises(kvcal.torch.UnsupportedModelError, match="no multi-head latent attention"):
        with kvcal.torch.capture_mla(tiny_llama(), Recorder()):
            pass
    # Nothing stays installed after a refusal or a block.
    producer = Recorder()
    with torch.no_grad(), kvcal.torch.capture_mla(model, producer):
        model(torch.zeros(1, 3, dtype=torch.long), use_cache=False)
    with torch.no_grad():
        model(torch.zeros(1, 3, dtype=torch.long), use_cache=False)
    assert len(producer.batches) == 1


def test_worker_k_scale_is_latent_amax(worker):
    """A session of 1 KV head of kv_lora_rank + qk_rope_head_dim: the
    per-tensor k_scale the worker finalizes is the maximum |value| of c_kv
    and k_pe over every batch, / 448 (static_minmax)."""
    model = tiny_deepseek(q_lora_rank=8)
    geometry = kvcal.torch.mla_geometry(model.config)
    assert geometry == kvcal.Geometry(LAYERS, HEADS, 1, R + P)
    client = kvcal.Client(worker.target)
    client.create_session(geometry=geometry, roles=("q", "k"))
    batches = [torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    kept = []
    with kvcal.Producer(client) as producer:
        with torch.no_grad(), kvcal.torch.capture_mla(model, producer):
            for ids in batches:
                hidden, hooks = attention_inputs(model)
                model(ids, use_cache=False)
                for h in hooks:
                    h.remove()
                kept.append(expected(model, hidden, torch.arange(5)))
    status = client.status()
    assert status.values_ingested == len(batches) * LAYERS * 2 * 5 * (R + P) * (1 + HEADS)
    scales = client.finalize(observer="static_minmax", granularity="tensor")
    for layer in range(LAYERS):
        k_amax = max(float(e[layer][0].abs().max()) for e in kept)
        q_amax = max(float(e[layer][1].abs().max()) for e in kept)
        got_k = scales[f"model.layers.{layer}.self_attn.k_scale"].reshape(-1)
        got_q = scales[f"model.layers.{layer}.self_attn.q_scale"].reshape(-1)
        np.testing.assert_allclose(got_k, [k_amax / 448.0], rtol=1e-5)
        np.testing.assert_allclose(got_q, [q_amax / 448.0], rtol=1e-5)
        assert f"model.layers.{layer}.self_attn.v_scale" not in scales
    # Per head: the one latent head's scale is the same value.
    head = client.finalize(observer="static_minmax", granularity="head")
    assert head["model.layers.0.self_attn.k_scale"].shape == (1, 1, 1)
    np.testing.assert_allclose(head["model.layers.0.self_attn.k_scale"].reshape(-1),
                               scales["model.layers.0.self_attn.k_scale"].reshape(-1), rtol=1e-6)
    client.delete()
