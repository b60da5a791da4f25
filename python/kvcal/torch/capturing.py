"""kvcal.torch.capture: stream a transformers model's attention inputs.

    with kvcal.Producer(client) as producer:
        with kvcal.torch.capture(model, producer):
            for input_ids in batches:
                model(input_ids)          # each forward is one calibration batch

What is captured, for every attention layer L (its `layer_idx`): the query
after RoPE (and after q-norm where the model has one), before the softmax
scale; the key after RoPE (and k-norm); the value as projected: exactly the
tensors the model hands to its attention function, [batch, heads, tokens,
head_dim] with num_attention_heads query heads and num_key_value_heads key
and value heads. That is what vLLM quantizes with q_scale and writes to its
FP8 KV cache (docs/formats.md, "Which activations").

How: transformers Llama-family attention (Llama, Mistral, Qwen2/3, Gemma,
Phi-3 and every model whose attention class calls
`ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)`)
routes q, k and v through one function. While the context is open, the
entry of the model's implementation (eager, sdpa, flash...) is replaced by a
wrapper that sends q, k and v of this model's attention modules to the
producer and calls the original; modules of other models pass straight
through. A forward pre-hook on `model` starts a new batch per forward.

Notes:
- Run calibration forwards without a KV cache (use_cache=False) or with a
  dynamic cache: when the attention sees more keys than queries (a cache
  holds earlier tokens), only the newest keys and values (as many as there
  are queries) are sent, which is right for a dynamic cache only.
- Padding: positions that the forward's 2-D `attention_mask` ([batch,
  tokens], 0 = padding, as tokenizers return it) masks out are not sent, so
  left- and right-padded batches give the scales of the unpadded sequences.
  Left padding needs `position_ids` (cumsum of the mask − 1, as `generate`
  passes them) for RoPE to see the same positions; the capture does not
  change what the model computes. Without a mask every position is sent.
- Held-out batches: set `producer.holdout = True` before the forwards whose
  activations the worker should keep for Finalize's evaluate / auto
  observer. Their sequences are sent whole, one [1, heads, tokens,
  head_dim] tensor per sequence when a padding mask is given.
- Attention recomputed during backward (gradient checkpointing) is not sent
  again.
- Refused up front (UnsupportedModelError naming the config key): models
  whose attention kvcal does not calibrate, checked on `model.config` as
  Client.create_session checks it: DeepSeek-style multi-head latent
  attention (kv_lora_rank; vLLM caches a compressed latent, not per-head K
  and V), encoder-decoder and cross-attention models, hybrid and
  linear-attention models (layer_types other than full, sliding and chunked
  attention; Mamba layers) and layers sharing another's KV cache. For MLA,
  `kvcal.torch.capture_mla` (kvcal/torch/mla.py) sends the latent cache row
  vLLM quantizes instead.
"""
from __future__ import annotations

import contextlib
import sys
import threading
from typing import Callable, Dict, List, Optional

import torch as _torch

_lock = threading.Lock()
# attention module id -> the _Capture that owns it
_owners: Dict[int, "_Capture"] = {}
# implementation name -> (original mapping entry or None, number of users)
_installed: Dict[str, list] = {}


class UnsupportedModelError(TypeError):
    pass


def _attention_interface():
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError as e:  # pragma: no cover
        raise UnsupportedModelError(
            "kvcal.torch.capture needs transformers >= 4.48 (its AttentionInterface)") from e
    return ALL_ATTENTION_FUNCTIONS


def _layer_attention_modules(model):
    """The model's modules that are a layer's attention: a class named
    ...Attention with an integer layer_idx (transformers' convention)."""
    for module in model.modules():
        if (type(module).__name__.endswith("Attention")
                and isinstance(getattr(module, "layer_idx", None), int)):
            yield module


def _attention_modules(model) -> List:
    """The model's self-attention modules: a layer_idx, a config naming the
    attention implementation, and q/k/v projections or a fused qkv."""
    found = []
    for module in _layer_attention_modules(model):
        if getattr(getattr(module, "config", None), "_attn_implementation", None) is None:
            continue
        if getattr(module, "is_cross_attention", False):
            continue
        found.append(module)
    return found


def _unsupported(model, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"kvcal.torch.capture: {type(model).__name__} is not supported: {why}. Supported: "
        f"transformers models whose attention layers call the attention interface with post-RoPE "
        f"query/key (Llama, Mistral, Qwen2, Qwen3, Gemma and models sharing their attention code)")


def _eager_for(module) -> Optional[Callable]:
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)


def _make_wrapper(name: str) -> Callable:
    def kvcal_capture_attention(module, query, key, value, attention_mask, *args, **kwargs):
        original = _installed[name][0] if name in _installed else None
        if original is None:
            original = _eager_for(module)
            if original is None:
                raise RuntimeError(f"kvcal: no eager_attention_forward next to {type(module).__name__}")
        owner = _owners.get(id(module))
        if owner is not None:
            owner._record(module, query, key, value)
        return original(module, query, key, value, attention_mask, *args, **kwargs)

    kvcal_capture_attention.__kvcal_capture__ = True
    return kvcal_capture_attention


def _install(name: str) -> None:
    interface = type(_attention_interface())
    mapping = interface._global_mapping
    if name in _installed:
        _installed[name][1] += 1
        return
    original = mapping.get(name)
    if original is None and name != "eager":
        raise UnsupportedModelError(f"kvcal: attention implementation {name!r} is not registered")
    _installed[name] = [original, 1]
    mapping[name] = _make_wrapper(name)


def _uninstall(name: str) -> None:
    entry = _installed[name]
    entry[1] -= 1
    if entry[1] > 0:
        return
    mapping = type(_attention_interface())._global_mapping
    if entry[0] is None:
        mapping.pop(name, None)
    else:
        mapping[name] = entry[0]
    del _installed[name]


class _Capture:
    def __init__(self, model, producer, roles):
        self.model = model
        self.producer = producer
        self.roles = roles
        self.modules = _attention_modules(model)
        self.in_forward = False
        self.seen: set = set()
        self.mask = None  # the current forward's 2-D attention_mask
        self.geometry = getattr(producer, "geometry", None) or getattr(producer.client, "geometry", None)

    def _enter(self, layer) -> bool:
        """Batch bookkeeping for one layer's attention; False inside backward."""
        if _torch._C._current_graph_task_id() != -1:
            return False  # recomputation inside backward (gradient checkpointing)
        if not self.in_forward and layer in self.seen:
            self.producer.new_batch()  # attention run without the model's forward hook
            self.seen.clear()
        if not self.in_forward and not self.seen:
            self.producer.new_batch()
        self.seen.add(layer)
        return True

    def _record(self, module, query, key, value) -> None:
        layer = module.layer_idx
        if not self._enter(layer):
            return
        if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
            raise _unsupported(self.model, f"attention inputs of {type(module).__name__} are not "
                                           f"[batch, heads, tokens, head_dim] "
                                           f"(q {tuple(query.shape)}, k {tuple(key.shape)})")
        tokens = query.shape[2]
        if key.shape[2] > tokens:  # a cache holds earlier tokens: send the new ones
            key = key[:, :, -tokens:]
            value = value[:, :, -tokens:]
        g = self.geometry
        if g is not None and (query.shape[-1] != g.head_dim or key.shape[-1] != g.head_dim
                              or value.shape[-1] != g.head_dim
                              or query.shape[1] != g.num_attention_heads
                              or key.shape[1] != g.num_key_value_heads):
            raise _unsupported(self.model, (
                f"layer {layer}: q {tuple(query.shape)}, k {tuple(key.shape)}, v {tuple(value.shape)} "
                f"do not match the session's {g.num_attention_heads} query heads, "
                f"{g.num_key_value_heads} key/value heads of head_dim {g.head_dim}"))
        self._send(layer, (("q", query), ("k", key), ("v", value)))

    def _send(self, layer, tensors) -> None:
        """Sends each (role, [batch, heads, tokens, dim] tensor) of this
        capture's roles, without the positions the padding mask hides."""
        batch, tokens = tensors[0][1].shape[0], tensors[0][1].shape[2]
        keep = self._kept_positions(layer, batch, tokens)
        held_out = bool(getattr(self.producer, "holdout", False))
        for role, tensor in tensors:
            if role not in self.roles:
                continue
            if keep is not None and held_out:
                # Whole sequences: the unpadded tokens of each entry apart.
                for b in range(tensor.shape[0]):
                    row = keep[b].to(tensor.device)
                    if bool(row.any()):
                        self.producer.put(layer, role, tensor[b:b + 1, :, row],
                                          layout="heads_tokens_dim")
            elif keep is None:
                self.producer.put(layer, role, tensor, layout="heads_tokens_dim")
            else:
                # [batch, heads, tokens, dim] -> the unmasked [n, heads, dim]
                kept = tensor.transpose(1, 2)[keep.to(tensor.device)]
                if kept.shape[0] > 0:
                    self.producer.put(layer, role, kept, layout="tokens_heads_dim")

    def _kept_positions(self, layer, batch, tokens):
        """[batch, tokens] bool of the positions to send, or None for all."""
        mask = self.mask
        if mask is None:
            return None
        if mask.shape[0] != batch or mask.shape[1] < tokens:
            raise _unsupported(self.model, (
                f"layer {layer}: the attention_mask {tuple(mask.shape)} does not cover the "
                f"attention's {batch} sequences of {tokens} tokens"))
        keep = mask[:, -tokens:] != 0  # the mask covers cached tokens first
        return None if bool(keep.all()) else keep

    def pre_forward(self, module, args, kwargs):
        self.producer.new_batch()
        self.seen.clear()
        self.in_forward = True
        mask = kwargs.get("attention_mask")
        if mask is None and len(args) > 1:
            mask = args[1]  # forward(input_ids, attention_mask, ...)
        self.mask = mask if isinstance(mask, _torch.Tensor) and mask.dim() == 2 else None

    def post_forward(self, module, args, output):
        self.in_forward = False
        self.mask = None
        expected = {m.layer_idx for m in self.modules}
        if not self.seen:
            raise _unsupported(self.model, (
                f"a forward pass ran but none of its {len(self.modules)} attention modules "
                f"({type(self.modules[0]).__name__}) called the attention interface"))
        missing = sorted(expected - self.seen)
        if missing:
            raise RuntimeError(f"kvcal.torch.capture: {type(self.model).__name__}: a forward pass "
                               f"skipped attention layers {missing[:20]}; their scales would be "
                               f"missing")


@contextlib.contextmanager
def capture(model, producer, roles=("q", "k", "v")):
    """Streams post-RoPE q, k and v of every attention layer of `model` to
    `producer` for every forward inside the block; see the module docs."""
    config = getattr(model, "config", None)
    if config is not None:
        from kvcal.client import check_attention

        try:
            check_attention(config)
        except ValueError as e:
            why = str(e).removeprefix("kvcal: ")
            if "kv_lora_rank" in why:
                why += " (kvcal.torch.capture_mla captures what vLLM caches for MLA)"
            raise _unsupported(model, why) from None
    modules = _attention_modules(model)
    if not modules:
        raise _unsupported(model, "no attention modules with a layer_idx and an attention "
                                  "implementation were found")
    if not getattr(type(model), "_supports_attention_backend", True):
        raise _unsupported(model, f"{type(modules[0]).__name__} does not use transformers' "
                                  f"attention interface")
    names = sorted({m.config._attn_implementation for m in modules})
    for name in names:
        if name == "eager" and any(_eager_for(m) is None for m in modules):
            raise _unsupported(model, f"{type(modules[0]).__name__}'s module has no "
                                      f"eager_attention_forward")
    state = _Capture(model, producer, set(roles))
    with _lock:
        for m in modules:
            if id(m) in _owners:
                raise RuntimeError("kvcal.torch.capture: this model is already being captured")
        installed = []
        try:
            for name in names:
                _install(name)
                installed.append(name)
        except BaseException:
            for name in installed:
                _uninstall(name)
            raise
        for m in modules:
            _owners[id(m)] = state
    hooks = [model.register_forward_pre_hook(state.pre_forward, with_kwargs=True),
             model.register_forward_hook(state.post_forward)]
    try:
        yield state
    finally:
        for h in hooks:
            h.remove()
        with _lock:
            for m in modules:
                _owners.pop(id(m), None)
            for name in names:
                _uninstall(name)

