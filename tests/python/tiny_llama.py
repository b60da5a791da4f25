"""A tiny random LlamaForCausalLM (no download) and an independent recorder
of post-RoPE q/k and projected v for checking kvcal.torch.capture."""
import contextlib

import torch
import transformers
from transformers.models.llama import modeling_llama


def tiny_llama(num_kv_heads=2, dtype=torch.float32, layers=2, heads=4, head_dim=16, seed=0,
               attn_implementation="sdpa"):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=heads * head_dim, intermediate_size=96,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=num_kv_heads,
        head_dim=head_dim, max_position_embeddings=64, tie_word_embeddings=False,
        attn_implementation=attn_implementation)
    model = transformers.LlamaForCausalLM(config).to(dtype).eval()
    return model


FAMILIES = {
    # name: (config class, model class, modeling module)
    "llama": ("LlamaConfig", "LlamaForCausalLM", "transformers.models.llama.modeling_llama"),
    "mistral": ("MistralConfig", "MistralForCausalLM", "transformers.models.mistral.modeling_mistral"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "transformers.models.qwen2.modeling_qwen2"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "transformers.models.qwen3.modeling_qwen3"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", "transformers.models.gemma.modeling_gemma"),
}


def tiny_model(family, num_kv_heads=2, layers=2, heads=4, head_dim=16, seed=0):
    config_cls, model_cls, _ = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(
        vocab_size=128, hidden_size=heads * head_dim, intermediate_size=96,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=num_kv_heads,
        head_dim=head_dim, max_position_embeddings=64, attn_implementation="sdpa")
    return getattr(transformers, model_cls)(config).eval()


@contextlib.contextmanager
def record_rotary_and_v(model, modeling=modeling_llama):
    """Records, per forward, {layer: {"q","k","v"}} with hooks of its own:
    a wrapper around modeling_llama.apply_rotary_pos_emb (its outputs are the
    post-RoPE q and k; layers run in order) and forward hooks on v_proj."""
    num_layers = model.config.num_hidden_layers
    head_dim = model.config.head_dim
    forwards = []
    calls = {"rotary": 0}
    original = modeling.apply_rotary_pos_emb

    def rotary(q, k, cos, sin, *args, **kwargs):
        q_out, k_out = original(q, k, cos, sin, *args, **kwargs)
        layer = calls["rotary"] % num_layers
        forwards[-1].setdefault(layer, {}).update(q=q_out.detach().clone(), k=k_out.detach().clone())
        calls["rotary"] += 1
        return q_out, k_out

    handles = [model.register_forward_pre_hook(lambda module, args: forwards.append({}))]
    for layer, block in enumerate(model.model.layers):
        def hook(module, args, output, layer=layer):
            b, s, _ = output.shape
            v = output.view(b, s, -1, head_dim).transpose(1, 2)
            forwards[-1].setdefault(layer, {})["v"] = v.detach().clone()
        handles.append(block.self_attn.v_proj.register_forward_hook(hook))
    modeling.apply_rotary_pos_emb = rotary
    try:
        yield forwards
    finally:
        modeling.apply_rotary_pos_emb = original
        for h in handles:
            h.remove()
