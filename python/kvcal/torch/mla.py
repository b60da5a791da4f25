"""kvcal.torch.capture_mla: what vLLM's FP8 KV cache holds for a DeepSeek
multi-head latent attention (MLA) model, streamed from transformers.

    geometry = kvcal.torch.mla_geometry(model.config)
    client.create_session(geometry=geometry, roles=("q", "k"))
    with kvcal.Producer(client) as producer:
        with kvcal.torch.capture_mla(model, producer):
            for input_ids in batches:
                model(input_ids)          # each forward is one calibration batch

vLLM 0.34 caches, per MLA layer and token, one row: the compressed latent
`c_kv` (kv_a_proj_with_mqa's first kv_lora_rank outputs after
kv_a_layernorm) followed by the shared RoPE key `k_pe` (its last
qk_rope_head_dim outputs after RoPE), quantized with the layer's one
`_k_scale` (MLAAttention.update_kv_cache ->
do_kv_cache_update(kv_c_normed, k_pe, ..., k_scale)). The per-head K and V
that transformers' DeepSeek attention expands from the latent (kv_b_proj)
are not cached and are not sent. What is sent, per layer:

- "k": [batch, 1, tokens, kv_lora_rank + qk_rope_head_dim], c_kv and k_pe
  side by side: one KV "head" of that width. They are taken where the
  model hands them to its cache (`past_key_values.update(c_kv, k_pe,
  layer_idx)` in DeepseekV3Attention / DeepseekV2Attention): while the
  context is open, each MLA module's cache argument is wrapped (or, without
  a cache, replaced) by a recorder that passes the call through unchanged.
  With transformers' `rope_interleave` (DeepSeek-V3's default) k_pe's
  dimensions come out as the even then the odd ones of vLLM's interleaved
  layout (DeepSeek-V2's code keeps vLLM's layout); no maximum, per tensor
  or per head, depends on that order.
- "q" (when in `roles`): the query vLLM's MLA decode quantizes with
  `_q_scale` when the cache is FP8 and the backend takes an FP8 query
  (MLACommonImpl, e.g. FlashMLA and FlashInfer MLA; Triton MLA does not):
  per query head, q_nope multiplied into the latent space by kv_b_proj's key
  part (W_UK) followed by q_pe after RoPE, [batch, heads, tokens,
  kv_lora_rank + qk_rope_head_dim] (MLAAttention._prepare_mqa_query). It is
  computed from the query the attention hands to transformers' attention
  interface and the module's kv_b_proj weight.
- "v": nothing. MLA has no separate V cache: the latent is both, and vLLM's
  MLA backends read only `_k_scale` for it (`_v_scale` is not used).

The session's geometry is therefore num_attention_heads query heads, one KV
head, head_dim kv_lora_rank + qk_rope_head_dim (`mla_geometry`).

Whether vLLM 0.34 can load the scales is another matter: it cannot. No
checkpoint tensor name reaches MLAAttention's `_k_scale` under any
quantization config (tests/python/test_mla_vllm_loader.py; docs/formats.md,
"MLA"), so kvcal still refuses to create sessions from, and to patch, MLA
checkpoints. This capture gives the scales those tensors would need.

Masks, held-out batches, gradient checkpointing and dynamic caches behave as
in kvcal.torch.capture (its module docs). The worker's held-out evaluation
(Finalize's evaluate and observer "auto") runs standard attention on Q, K
and V and refuses a session without V (FAILED_PRECONDITION): it does not
measure MLA.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import List

import torch as _torch

from . import capturing as _kt

MLA_ROLES = ("q", "k")


def _get(config, key):
    if isinstance(config, dict):
        return config.get(key)
    return getattr(config, key, None)


def mla_geometry(config):
    """kvcal.Geometry of what vLLM caches for an MLA config (transformers
    config or config.json dict): num_hidden_layers layers,
    num_attention_heads query heads, 1 KV head of kv_lora_rank +
    qk_rope_head_dim."""
    from kvcal.client import Geometry

    text = _get(config, "text_config") if _get(config, "num_hidden_layers") is None else None
    config = text if text is not None else config
    values = {k: _get(config, k) for k in ("num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                                           "qk_rope_head_dim")}
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"kvcal: not an MLA config: {key} is {value!r}, not a positive integer")
    return Geometry(values["num_hidden_layers"], values["num_attention_heads"], 1,
                    values["kv_lora_rank"] + values["qk_rope_head_dim"])


def _mla_modules(model) -> List:
    found = []
    for module in _kt._layer_attention_modules(model):
        if not all(hasattr(module, a) for a in ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
                                                "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                                                "v_head_dim", "num_heads")):
            continue
        found.append(module)
    return found


def _cache_argument(module):
    """Position of forward's `past_key_values` among its positional
    arguments (the bound method's, without self), or None."""
    parameters = list(inspect.signature(module.forward).parameters)
    if "past_key_values" not in parameters:
        return None
    return parameters.index("past_key_values")


class _RecordingCache:
    """Stands in for a layer's `past_key_values` during one call: records
    what the attention stores, then stores it in the real cache (if any)."""

    def __init__(self, real, on_update, module):
        self._real = real
        self._on_update = on_update
        self._module = module

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self._on_update(self._module, key_states, value_states, layer_idx)
        if self._real is None:
            return key_states, value_states
        return self._real.update(key_states, value_states, layer_idx, *args, **kwargs)

    def __getattr__(self, name):
        real = self.__dict__.get("_real")
        if real is None:
            raise AttributeError(name)
        return getattr(real, name)


class _MLACapture(_kt._Capture):
    def __init__(self, model, producer, roles, modules):
        super().__init__(model, producer, roles)
        self.modules = modules
        g = self.geometry
        if g is not None:
            m = modules[0]
            width = m.kv_lora_rank + m.qk_rope_head_dim
            if g.num_key_value_heads != 1 or g.head_dim != width or g.num_attention_heads != m.num_heads:
                raise _kt._unsupported(model, (
                    f"the session's geometry ({g.num_attention_heads} query heads, "
                    f"{g.num_key_value_heads} key/value heads of head_dim {g.head_dim}) is not MLA's "
                    f"({m.num_heads} query heads, 1 latent head of kv_lora_rank + qk_rope_head_dim = "
                    f"{width}): create it with geometry=kvcal.torch.mla_geometry(model.config)"))

    def pre_attention(self, module, args, kwargs):
        index = _cache_argument(module)
        if "past_key_values" in kwargs or len(args) <= index:
            kwargs["past_key_values"] = _RecordingCache(kwargs.get("past_key_values"), self._on_cache,
                                                        module)
        else:
            args = list(args)
            args[index] = _RecordingCache(args[index], self._on_cache, module)
            args = tuple(args)
        return args, kwargs

    def _on_cache(self, module, c_kv, k_pe, layer_idx) -> None:
        layer = module.layer_idx
        if layer_idx != layer:
            raise RuntimeError(f"kvcal.torch.capture_mla: {type(module).__name__} {layer} updated the "
                               f"cache of layer {layer_idx}")
        if not self._enter(layer):
            return
        r, p = module.kv_lora_rank, module.qk_rope_head_dim
        if (c_kv.dim() != 4 or k_pe.dim() != 4 or c_kv.shape[1] != 1 or k_pe.shape[1] != 1
                or c_kv.shape[-1] != r or k_pe.shape[-1] != p or c_kv.shape[:3] != k_pe.shape[:3]):
            raise _kt._unsupported(self.model, (
                f"layer {layer}: {type(module).__name__} stored {tuple(c_kv.shape)} and "
                f"{tuple(k_pe.shape)} in its cache, not the latent [batch, 1, tokens, {r}] and the "
                f"RoPE key [batch, 1, tokens, {p}]"))
        latent = _torch.cat([c_kv, k_pe.to(c_kv.dtype)], dim=-1)
        self._send(layer, (("k", latent),))

    def _record(self, module, query, key, value) -> None:
        """The attention interface's call: the absorbed decode query."""
        if "q" not in self.roles or _torch._C._current_graph_task_id() != -1:
            return
        layer = module.layer_idx
        if layer not in self.seen:
            raise RuntimeError(f"kvcal.torch.capture_mla: layer {layer} ran attention without "
                               f"storing its latent in the cache first")
        nope, rope, heads = module.qk_nope_head_dim, module.qk_rope_head_dim, module.num_heads
        if query.dim() != 4 or query.shape[1] != heads or query.shape[-1] != nope + rope:
            raise _kt._unsupported(self.model, (
                f"layer {layer}: the query {tuple(query.shape)} is not [batch, {heads}, tokens, "
                f"{nope} + {rope}]"))
        weight = module.kv_b_proj.weight
        w_uk = weight.view(heads, nope + module.v_head_dim, module.kv_lora_rank)[:, :nope, :]
        q_nope, q_pe = query[..., :nope], query[..., nope:]
        latent = _torch.einsum("bhtn,hnr->bhtr", q_nope.float(), w_uk.float()).to(query.dtype)
        self._send(layer, (("q", _torch.cat([latent, q_pe], dim=-1)),))


@contextlib.contextmanager
def capture_mla(model, producer, roles=MLA_ROLES):
    """Streams, for every MLA layer of `model` and every forward inside the
    block, the latent cache row vLLM quantizes with k_scale ("k") and the
    absorbed decode query it quantizes with q_scale ("q"); see the module
    docs."""
    roles = tuple(roles)
    extra = sorted(set(roles) - set(MLA_ROLES))
    if extra or not roles:
        raise ValueError(f"kvcal.torch.capture_mla: roles {roles!r}: MLA has roles q and k only "
                         f"(vLLM's MLA cache holds the latent once, under k_scale; no v_scale is read)")
    modules = _mla_modules(model)
    if not modules:
        raise _kt._unsupported(model, "no multi-head latent attention modules (kv_a_proj_with_mqa, "
                                      "kv_a_layernorm, kv_b_proj, kv_lora_rank) were found")
    if any(_cache_argument(m) is None for m in modules):
        raise _kt._unsupported(model, f"{type(modules[0]).__name__}.forward takes no past_key_values")
    names = sorted({m.config._attn_implementation for m in modules}) if "q" in roles else []
    for name in names:
        if name == "eager" and any(_kt._eager_for(m) is None for m in modules):
            raise _kt._unsupported(model, f"{type(modules[0]).__name__}'s module has no "
                                          f"eager_attention_forward")
    state = _MLACapture(model, producer, set(roles), modules)
    with _kt._lock:
        for m in modules:
            if id(m) in _kt._owners:
                raise RuntimeError("kvcal.torch.capture_mla: this model is already being captured")
        installed = []
        try:
            for name in names:
                _kt._install(name)
                installed.append(name)
        except BaseException:
            for name in installed:
                _kt._uninstall(name)
            raise
        if names:
            for m in modules:
                _kt._owners[id(m)] = state
    hooks = [model.register_forward_pre_hook(state.pre_forward, with_kwargs=True),
             model.register_forward_hook(state.post_forward)]
    hooks += [m.register_forward_pre_hook(state.pre_attention, with_kwargs=True) for m in modules]
    try:
        yield state
    finally:
        for h in hooks:
            h.remove()
        with _kt._lock:
            for m in modules:
                if _kt._owners.get(id(m)) is state:
                    del _kt._owners[id(m)]
            for name in names:
                _kt._uninstall(name)


__all__ = ["capture_mla", "mla_geometry", "MLA_ROLES"]
