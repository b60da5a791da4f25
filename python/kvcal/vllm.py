"""kvcal.vllm: kvcal's scales in vLLM 0.34's attention layers.

Scales reach vLLM in one of two ways:

- from a checkpoint, when the engine starts: `kvcal patch` writes them and
  vLLM loads them;
- into a running engine: `update_attention_scales` writes new scales into
  every attention layer in place, so a reinforcement-learning loop can
  recalibrate each training step without restarting vLLM:

    scales = client.finalize(observer="static_minmax", granularity="head")
    changes = llm.apply_model(   # one list per worker; VLLM_ALLOW_INSECURE_SERIALIZATION=1
        lambda model: kvcal.vllm.update_attention_scales(model, scales))

What a running vLLM 0.34 attention layer holds (read from vLLM's source):
after loading, `quant_method.process_weights_after_loading` turned the
`q_scale`/`k_scale`/`v_scale` parameters the checkpoint loaded into

- buffers `_q_scale`, `_k_scale`, `_v_scale` that kernels and CUDA graphs read
  (0-d after ModelOpt/Quark/fp8, `[1]` after compressed-tensors per tensor,
  `[this rank's KV heads]` after compressed-tensors `attn_head`, q reduced to
  one scale per KV group by max);
- Python floats `_q_scale_float`, `_k_scale_float`, `_v_scale_float` (the
  maximum for per-head scales) that most backends read;
- `_k_scale_cpu`, `_v_scale_cpu`, the "host" copies (created while the model
  is built under the target device, so on a GPU engine they live on the GPU).

The parameters stay registered but nothing reads them after loading
(compressed-tensors' buffers share their storage). `update_attention_scales`
rewrites all of these exactly as loading the same scales from a checkpoint
would have left them (below). `scales_for_vllm` only renames scales
to the parameter names vLLM loads a checkpoint into.

What update_attention_scales writes
-----------------------------------

For each (layer, role) the scales name, it writes the buffer `_{r}_scale`
with `.copy_()` on the buffer's own device and dtype (the tensor objects
stay the same, so CUDA graphs that captured them see the new values), the
float `_{r}_scale_float`, for k and v `_{r}_scale_cpu` (`.fill_()`), and
the loading parameter `{r}_scale`, all exactly as vLLM's
`process_weights_after_loading` leaves them after loading the same scales
from a checkpoint:

- compressed-tensors `tensor`: the value itself.
- compressed-tensors `attn_head`: this rank's KV heads (ranks hold
  consecutive heads; with fewer KV heads than ranks each is replicated on
  tp_size/KV consecutive ranks), q first reduced to one scale per KV
  group by max over num_attention_heads/num_key_value_heads consecutive
  query heads; floats are the maximum.
- ModelOpt, Quark, fp8 (BaseKVCacheMethod): one value per role; times 2
  on fnuz. k and v only where the KV cache is quantized (vLLM ignores
  them on a bf16/fp16 cache and on per-token-head caches: refused here).

Decisions where a checkpoint has no answer:
- A role the scales do not name is left as it is (q, typically). A
  checkpoint without q would load q = 1.0 instead; pass q to change it.
- One value per tensor for a per-head layer applies to every head (the
  layer then holds what an attn_head checkpoint with equal heads loads).
- Per-head scales for a per-tensor layer are refused: one scale from many
  heads depends on the observer; finalize with granularity="tensor".
- q holding one value per KV group (kvcal's `q_per_kv_group`) is accepted
  as already reduced.
"""
from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

_NAME = re.compile(r"model\.layers\.(\d+)\.self_attn\.([qkv])_scale")

ROLES = ("q", "k", "v")
COMPRESSED_TENSORS = "compressed-tensors"
BASE_KV_CACHE = "base"  # vLLM's BaseKVCacheMethod: ModelOpt, Quark, fp8

# Names a caller may give for `quant_method=`: how vLLM loaded the scales.
_METHODS = {
    "compressed-tensors": COMPRESSED_TENSORS,
    "compressed_tensors": COMPRESSED_TENSORS,
    "base": BASE_KV_CACHE,
    "modelopt": BASE_KV_CACHE,
    "quark": BASE_KV_CACHE,
    "fp8": BASE_KV_CACHE,
}
# vLLM's class names (model_executor/layers/quantization/): how a layer's
# `quant_method` tells which of the two post-loading paths ran.
_CT_METHOD_CLASS = "CompressedTensorsKVCacheMethod"
_BASE_METHOD_CLASS = "BaseKVCacheMethod"

# Accepted scale names: kvcal's checkpoint names, vLLM's parameter names
# (`...self_attn.attn.k_scale`, what scales_for_vllm returns), any prefix.
_SCALE_NAME = re.compile(r"(?:.*\.)?layers\.(\d+)\.self_attn\.(?:attn\.)?([qkv])_scale")
# Where decoder layer L keeps its vLLM Attention module.
_ATTENTION_PATH = re.compile(r"(?P<prefix>(?:.+\.)?layers)\.(?P<layer>\d+)\.self_attn\.attn")
# kv_cache_dtype values that leave the KV cache unquantized: vLLM's
# BaseKVCacheMethod then ignores k/v scales (get_kv_quant_mode -> NONE).
_UNQUANTIZED_CACHE = frozenset({"auto", "float16", "half", "bfloat16", "float", "float32"})


def scales_for_vllm(scales: Mapping, prefix: str = "model.layers", as_torch: bool = True,
                    device=None) -> Dict[str, object]:
    """{`{prefix}.{L}.self_attn.attn.{q,k,v}_scale`: tensor}; numpy arrays with
    as_torch=False. Per tensor 0-d, per head flattened to [heads].

    These are the names of the parameters vLLM creates for a checkpoint to load
    into (the names its cache-scale mapper gives `model.layers.{L}.self_attn.k_scale`),
    valid only while a model loads. Once loaded, vLLM has processed them into
    the `_q_scale`/`_k_scale`/`_v_scale` buffers and their float copies, and
    writing these parameters no longer changes what attention uses. To change
    the scales of a running engine, use update_attention_scales.
    """
    import numpy as np

    out: Dict[str, object] = {}
    for name, value in scales.items():
        m = _NAME.fullmatch(name)
        if m is None:
            raise ValueError(f"kvcal: {name!r} is not model.layers.{{L}}.self_attn.{{q,k,v}}_scale")
        if hasattr(value, "detach"):
            value = value.detach().to("cpu").float().numpy()
        array = np.asarray(value, dtype=np.float32).reshape(-1)
        if array.size == 1 and getattr(scales, "granularity", "tensor") != "head":
            array = array.reshape(())
        key = f"{prefix}.{m.group(1)}.self_attn.attn.{m.group(2)}_scale"
        if as_torch:
            import torch

            out[key] = torch.as_tensor(array.copy(), device=device)
        else:
            out[key] = array
    return out


@dataclass(frozen=True)
class ScaleChange:
    """One (layer, role) that update_attention_scales wrote: the scales the
    layer's buffer held before and holds now (this rank's heads; ModelOpt/Quark
    scales doubled on fnuz, as vLLM holds them)."""

    layer: int
    module: str
    role: str
    old: Tuple[float, ...]
    new: Tuple[float, ...]

    @property
    def changed(self) -> bool:
        return self.old != self.new

    def __str__(self) -> str:
        def text(values):
            return ", ".join(f"{v:.6g}" for v in values)

        return f"layer {self.layer} {self.role}: [{text(self.old)}] -> [{text(self.new)}]"


def update_attention_scales(model_or_layers: Any, scales: Mapping, *,
                            tp_rank: Optional[int] = None, tp_size: Optional[int] = None,
                            quant_method: Optional[str] = None, fnuz: Optional[bool] = None,
                            prefix: Optional[str] = None,
                            partial: bool = False) -> List[ScaleChange]:
    """Writes new q/k/v scales into the attention layers of a running vLLM
    0.34 engine, in place, and returns what changed (a ScaleChange per layer
    and role written, in layer order; `str()` of one is a log line).

    model_or_layers: the model (`llm.apply_model` hands it over inside each
      worker): its `{prefix}.{L}.self_attn.attn` modules are the layers
      (`model.layers`, `language_model.model.layers`, ...); or a mapping
      {layer index: attention module}.
    scales: a kvcal.Scales (`client.finalize()`, `Scales.load()`), any mapping
      from `model.layers.{L}.self_attn.{q,k,v}_scale` (or vLLM's
      `...self_attn.attn.{q,k,v}_scale`) to an array or tensor, or
      {L: {"q": ..., "k": ..., "v": ...}}. Per tensor one value (shape (),
      [1] or [1,1,1]); per head [heads] or [heads,1,1] for ALL heads of the
      model: q `num_attention_heads`, k and v `num_key_value_heads`.
    tp_rank, tp_size: this worker's tensor-parallel position, needed for
      per-head layers; by default vLLM's own (vllm.distributed).
    quant_method: how vLLM loaded the model's scales: "compressed-tensors", or
      "modelopt" / "quark" / "fp8" (all vLLM's BaseKVCacheMethod). By default
      read from each layer's `quant_method` class; given and contradicted by
      it, an error.
    fnuz: whether vLLM runs float8_e4m3fnuz (ROCm MI300), where its
      BaseKVCacheMethod doubles every checkpoint scale (compressed-tensors
      does not). By default vLLM's `current_platform.is_fp8_fnuz()`, or,
      without vLLM, whether torch runs on a gfx94x ROCm device. Ignored for
      compressed-tensors layers.
    prefix: which `{prefix}.{L}.self_attn.attn` modules to take when a model
      has several stacks of them (a vision tower and a language model).
    partial: allow model layers that the scales do not name (left as they are).

    What it writes for each method, and its decisions where a checkpoint
    has no answer: the module docs ("What update_attention_scales writes").

    Nothing is written unless everything is valid: a scale that is not finite
    and > 0 (in float32, and after doubling), a shape or head count that does
    not fit the layer, an unknown layer, or a model layer that the scales do
    not name (unless partial) raises ValueError naming layer, role and value,
    with the engine untouched. Call it between engine steps (`apply_model`
    and `collective_rpc` run there).

    Where a running engine does not pick the values up: FlashInfer multiplies
    the floats into `impl.bmm1_scale`/`bmm2_scale` on its first forward and
    keeps them (a warning says so), and kernels captured in a full CUDA graph
    keep the floats they were captured with; the buffers are always current.
    """
    layers = _attention_layers(model_or_layers, prefix)
    per_layer = _scales_by_layer(scales)
    _check_layers_named(layers, per_layer, partial)
    if tp_rank is not None or tp_size is not None:
        tp_rank, tp_size = _check_tp(tp_rank, tp_size)
    writes: List[_Write] = []
    changes: List[ScaleChange] = []
    stale_products: List[str] = []
    for index in sorted(per_layer):
        name, layer = layers[index]
        layout, tp_rank, tp_size, fnuz = _layout_of(index, name, layer, quant_method,
                                                    per_layer[index], tp_rank, tp_size, fnuz)
        for role in ROLES:
            if role not in per_layer[index]:
                continue
            plan = layout.plan(role, per_layer[index][role], getattr(scales, "granularity", None))
            writes.extend(plan.writes)
            changes.append(ScaleChange(index, name, role, plan.old, plan.new))
        impl = getattr(layer, "impl", None)
        if getattr(impl, "bmm1_scale", None) is not None or getattr(impl, "bmm2_scale", None) is not None:
            stale_products.append(name)

    _apply(writes)
    if stale_products:
        warnings.warn(f"kvcal: {len(stale_products)} attention layers (e.g. {stale_products[0]}) "
                      "keep scale products their backend (FlashInfer) computed at its first "
                      "forward (impl.bmm1_scale/bmm2_scale); the new scales do not reach those "
                      "kernels", RuntimeWarning, stacklevel=2)
    return changes


def _check_layers_named(layers: dict, per_layer: dict, partial: bool) -> None:
    """ValueError when the scales name a layer the model lacks, or (unless
    `partial`) leave one of the model's layers out."""
    unknown = sorted(set(per_layer) - set(layers))
    if unknown:
        raise ValueError(f"kvcal: the scales name layers {unknown} that the model does not have "
                         f"(its attention layers: {_ranges(sorted(layers))}); nothing was changed")
    missing = sorted(set(layers) - set(per_layer))
    if missing and not partial:
        raise ValueError(f"kvcal: the scales do not name layers {_ranges(missing)} of the model; "
                         f"pass partial=True to leave them as they are; nothing was changed")


def _layout_of(index, name, layer, quant_method, roles, tp_rank, tp_size, fnuz):
    """The layer's _Layout, placed on this tensor-parallel rank where it is
    per head; returns it with tp_rank, tp_size and fnuz as now known."""
    method = _loading_method(name, layer, quant_method)
    layout = _Layout(index, name, layer, method)
    if layout.per_head and tp_size is None:
        tp_rank, tp_size = _vllm_tensor_parallel(name)
    if layout.per_head:
        layout.place(tp_rank, tp_size, roles)
    if method == BASE_KV_CACHE:
        if fnuz is None:
            fnuz = _platform_is_fp8_fnuz()
        layout.fnuz = bool(fnuz)
    return layout, tp_rank, tp_size, fnuz


# -- finding layers and scales -----------------------------------------------

def _refuse_mla(name: str, module: Any) -> None:
    """vLLM's MLAAttention caches one compressed latent per token, quantized
    with k_scale alone: per-head K/V scales do not apply to it."""
    if type(module).__name__ == "MLAAttention" or hasattr(module, "kv_lora_rank"):
        from kvcal.client import MLA_NOT_SUPPORTED

        raise ValueError(f"kvcal: {name} ({type(module).__name__}): {MLA_NOT_SUPPORTED}")


def _attention_layers(model_or_layers: Any, prefix: Optional[str]) -> Dict[int, Tuple[str, Any]]:
    """{L: (name, module)} from a model or a {L: module} mapping."""
    if isinstance(model_or_layers, Mapping):
        out = {}
        for index, module in model_or_layers.items():
            _refuse_mla(f"layer {index}", module)
            if isinstance(index, bool) or not isinstance(index, int) or index < 0:
                raise ValueError(f"kvcal: layer mapping keys must be layer indices, got {index!r}")
            out[index] = (getattr(module, "layer_name", None) or f"layer {index}", module)
        if not out:
            raise ValueError("kvcal: the layer mapping is empty")
        return out
    if not hasattr(model_or_layers, "named_modules"):
        raise ValueError(f"kvcal: expected a torch model or {{layer index: attention module}}, "
                         f"got {type(model_or_layers).__name__}")
    stacks: Dict[str, Dict[int, Tuple[str, Any]]] = {}
    for name, module in model_or_layers.named_modules():
        if hasattr(module, "_k_scale"):
            _refuse_mla(name, module)
        m = _ATTENTION_PATH.fullmatch(name)
        if m is None or not hasattr(module, "_k_scale"):
            continue
        stacks.setdefault(m.group("prefix"), {})[int(m.group("layer"))] = (name, module)
    if prefix is not None:
        if prefix not in stacks:
            raise ValueError(f"kvcal: no attention layers under {prefix!r}.{{L}}.self_attn.attn "
                             f"(found: {sorted(stacks) or 'none'})")
        return stacks[prefix]
    if not stacks:
        raise ValueError("kvcal: the model has no vLLM attention layers at "
                         "...layers.{L}.self_attn.attn; pass {layer index: module}")
    if len(stacks) > 1:
        raise ValueError(f"kvcal: attention layers under several prefixes {sorted(stacks)}; "
                         "pass prefix= to pick one")
    return next(iter(stacks.values()))


def _scales_by_layer(scales: Mapping) -> Dict[int, Dict[str, Any]]:
    out: Dict[int, Dict[str, Any]] = {}
    for key, value in scales.items():
        if isinstance(key, int) and not isinstance(key, bool):
            if not isinstance(value, Mapping):
                raise ValueError(f"kvcal: scales[{key}] must map roles q/k/v to scales")
            for role, scale in value.items():
                if role not in ROLES:
                    raise ValueError(f"kvcal: scales[{key}] has role {role!r}; roles are q, k, v")
                _put(out, key, role, scale, f"scales[{key}][{role!r}]")
            continue
        m = _SCALE_NAME.fullmatch(str(key))
        if m is None:
            raise ValueError(f"kvcal: {key!r} is not model.layers.{{L}}.self_attn.{{q,k,v}}_scale")
        _put(out, int(m.group(1)), m.group(2), value, repr(key))
    if not out:
        raise ValueError("kvcal: no scales to write")
    return out


def _put(out, index, role, value, where):
    if role in out.setdefault(index, {}):
        raise ValueError(f"kvcal: {where}: layer {index} {role} is given twice")
    out[index][role] = value


def _ranges(indices: List[int]) -> str:
    return ", ".join(str(i) for i in indices[:16]) + (" ..." if len(indices) > 16 else "")


# -- how vLLM loaded a layer ---------------------------------------------------

def _loading_method(name: str, layer: Any, requested: Optional[str]) -> str:
    classes = {cls.__name__ for cls in type(getattr(layer, "quant_method", None)).__mro__}
    detected = (COMPRESSED_TENSORS if _CT_METHOD_CLASS in classes
                else BASE_KV_CACHE if _BASE_METHOD_CLASS in classes else None)
    if requested is None:
        if detected is None:
            found = type(getattr(layer, "quant_method", None)).__name__
            raise ValueError(f"kvcal: {name}: cannot tell how vLLM loaded its scales (quant_method "
                             f"is {found}); pass quant_method='compressed-tensors', 'modelopt', "
                             f"'quark' or 'fp8'")
        return detected
    method = _METHODS.get(str(requested).lower())
    if method is None:
        raise ValueError(f"kvcal: quant_method {requested!r}: expected one of {sorted(_METHODS)}")
    if detected is not None and detected != method:
        raise ValueError(f"kvcal: {name}: quant_method={requested!r}, but the layer was loaded by "
                         f"{type(layer.quant_method).__name__}")
    return method


def _check_tp(tp_rank, tp_size) -> Tuple[int, int]:
    if tp_rank is None or tp_size is None:
        raise ValueError("kvcal: pass both tp_rank and tp_size, or neither")
    if not (isinstance(tp_size, int) and isinstance(tp_rank, int) and 0 <= tp_rank < tp_size):
        raise ValueError(f"kvcal: tp_rank {tp_rank!r} and tp_size {tp_size!r}: need 0 <= tp_rank < tp_size")
    return tp_rank, tp_size


def _vllm_tensor_parallel(name: str) -> Tuple[int, int]:
    try:
        from vllm.distributed import (get_tensor_model_parallel_rank,
                                      get_tensor_model_parallel_world_size)

        return _check_tp(get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size())
    except (ImportError, AssertionError, AttributeError, RuntimeError) as e:
        raise ValueError(f"kvcal: {name} holds per-head scales and vLLM's tensor-parallel group "
                         f"is not available here ({type(e).__name__}); pass tp_rank= and tp_size=") from e


def _platform_is_fp8_fnuz() -> bool:
    """vLLM's own answer (current_platform.is_fp8_fnuz(): ROCm gfx94x), or the
    same question put to torch where vLLM is not importable."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        current_platform = None
    if current_platform is not None:
        return bool(current_platform.is_fp8_fnuz())
    import torch

    if getattr(torch.version, "hip", None) and torch.cuda.is_available():
        return "gfx94" in getattr(torch.cuda.get_device_properties(0), "gcnArchName", "")
    return False


class _Layout:
    """What one attention layer holds and how a checkpoint's scales map onto it."""

    def __init__(self, index: int, name: str, layer: Any, method: str):
        self.index, self.name, self.layer, self.method = index, name, layer, method
        self.fnuz = False
        config = getattr(getattr(layer, "quant_method", None), "quant_config", None)
        self.config = config
        if method == COMPRESSED_TENSORS:
            if config is not None and hasattr(config, "kv_cache_scheme"):
                scheme = config.kv_cache_scheme or {}
                self.per_head = scheme.get("strategy") == "attn_head"
            else:  # no config to ask: a per-head layer with one KV head per rank looks per tensor
                self.per_head = layer._k_scale.numel() > 1
        else:
            self.per_head = False

    def where(self, role: str) -> str:
        return f"layer {self.index} ({self.name}) {role}"

    def place(self, tp_rank: int, tp_size: int, roles: Mapping[str, Any]) -> None:
        """This rank's KV heads, as vLLM's compressed-tensors per-head loader
        partitions them (evenly, or replicated when KV heads < tp_size)."""
        layer, config = self.layer, self.config
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.local_kv = int(layer.num_kv_heads)
        total_kv = getattr(config, "total_num_kv_heads", None)
        if total_kv is None:  # infer it from k or v
            for role in ("k", "v"):
                if role in roles:
                    total_kv = _as_float32(roles[role], self.where(role)).numel()
                    break
        if total_kv is None:
            raise ValueError(f"kvcal: {self.name}: cannot tell the model's KV head count (its "
                             f"quant_config has no total_num_kv_heads); include k or v")
        self.total_kv = int(total_kv)
        total_heads = getattr(config, "total_num_heads", None)
        if total_heads is None:
            total_heads = int(layer.num_heads) * tp_size
        self.total_heads = int(total_heads)
        heads_here = getattr(layer, "num_heads", None)
        if heads_here is not None and int(heads_here) * tp_size != self.total_heads:
            raise ValueError(f"kvcal: {self.name}: holds {heads_here} query heads, which does not "
                             f"fit {self.total_heads} query heads over tp_size {tp_size}")
        if self.total_heads % self.total_kv:
            raise ValueError(f"kvcal: {self.name}: {self.total_heads} query heads are not a multiple "
                             f"of {self.total_kv} KV heads")
        if self.local_kv * tp_size == self.total_kv:
            self.first, self.count = tp_rank * self.local_kv, self.local_kv
        elif self.local_kv == 1 and self.total_kv < tp_size and tp_size % self.total_kv == 0:
            self.first, self.count = tp_rank // (tp_size // self.total_kv), 1
        else:
            raise ValueError(f"kvcal: {self.name}: holds {self.local_kv} KV heads, which does not fit "
                             f"{self.total_kv} KV heads over tp_size {tp_size}")

    def plan(self, role: str, value: Any, granularity: Optional[str]) -> "_Plan":
        import torch

        where = self.where(role)
        scale = _as_float32(value, where)
        _check_values(scale, where)
        layer = self.layer
        buffer = getattr(layer, f"_{role}_scale", None)
        if not isinstance(buffer, torch.Tensor):
            raise ValueError(f"kvcal: {where}: the layer has no _{role}_scale buffer")
        param = getattr(layer, f"{role}_scale", None)
        if self.method == BASE_KV_CACHE:
            loaded, held = self._base(role, scale, where)
        elif self.per_head:
            loaded = held = self._per_head(role, scale, granularity, where)
        else:
            loaded = held = self._per_tensor(scale, where)
        if held.numel() != buffer.numel() or (buffer.dim() > 1):
            raise ValueError(f"kvcal: {where}: _{role}_scale holds shape {tuple(buffer.shape)}, "
                             f"the scales give {held.numel()} values for it")
        held = held.reshape(buffer.shape)
        on_device = held.to(device=buffer.device, dtype=buffer.dtype)
        _check_values(on_device.detach().cpu().float(), where,
                      "after vLLM doubles it for float8_e4m3fnuz" if self.fnuz else
                      f"as the layer holds it ({buffer.dtype})")
        old = tuple(float(v) for v in buffer.detach().cpu().reshape(-1).tolist())
        new_float = float(on_device.detach().cpu().max().item())
        writes = [_Write(buffer, on_device)]
        if isinstance(param, torch.Tensor) and param is not buffer:
            if param.numel() != loaded.numel():
                raise ValueError(f"kvcal: {where}: parameter {role}_scale holds shape "
                                 f"{tuple(param.shape)}, the layer's buffer {tuple(buffer.shape)}")
            writes.append(_Write(param, loaded.reshape(param.shape).to(device=param.device,
                                                                        dtype=param.dtype)))
        writes.append(_Write(layer, new_float, attr=f"_{role}_scale_float"))
        host = getattr(layer, f"_{role}_scale_cpu", None)
        if role != "q" and isinstance(host, torch.Tensor):
            writes.append(_Write(host, new_float, fill=True))
        new = tuple(float(v) for v in on_device.detach().cpu().reshape(-1).tolist())
        return _Plan(writes, old, new)

    def _per_tensor(self, scale, where):
        if scale.numel() != 1:
            raise ValueError(f"kvcal: {where}: {scale.numel()} per-head scales for a per-tensor "
                             f"layer; one scale from many heads depends on the observer: finalize "
                             f"with granularity='tensor'; nothing was changed")
        return scale.reshape(1)

    def _per_head(self, role, scale, granularity, where):
        import torch

        n = scale.numel()
        full = self.total_heads if role == "q" else self.total_kv
        if n == 1 and full != 1 and granularity != "head":
            return scale.reshape(1).expand(self.count).clone()  # one value for every head
        if role == "q" and n == self.total_heads and self.total_heads != self.total_kv:
            group = self.total_heads // self.total_kv
            scale = torch.amax(scale.reshape(-1, group), dim=1)
        elif n != self.total_kv:
            want = (f"{self.total_heads} (every query head) or {self.total_kv} (one per KV group)"
                    if role == "q" and self.total_heads != self.total_kv else str(full))
            raise ValueError(f"kvcal: {where}: {n} scales; the model has {want} for {role}; "
                             f"nothing was changed")
        return scale[self.first:self.first + self.count].clone()

    def _base(self, role, scale, where):
        """(value of the loading parameter, value of the buffer) after vLLM's
        BaseKVCacheMethod.process_weights_after_loading."""
        if scale.numel() != 1:
            raise ValueError(f"kvcal: {where}: {scale.numel()} per-head scales for a per-tensor "
                             f"layer (vLLM's {type(getattr(self.layer, 'quant_method', None)).__name__} "
                             f"holds one scale per tensor): finalize with granularity='tensor'; "
                             f"nothing was changed")
        cache = str(getattr(self.layer, "kv_cache_dtype", "fp8"))
        if role != "q" and (cache in _UNQUANTIZED_CACHE or cache.endswith("per_token_head")):
            raise ValueError(f"kvcal: {where}: the layer's kv_cache_dtype is {cache!r}, for which "
                             f"vLLM uses no {role} scale (it holds 1.0); leave k and v out; "
                             f"nothing was changed")
        loaded = scale.reshape(())
        return loaded, (loaded * 2 if self.fnuz else loaded.clone())


@dataclass
class _Plan:
    writes: List["_Write"]
    old: Tuple[float, ...]
    new: Tuple[float, ...]


class _Write:
    """One in-place write, and how to undo it."""

    def __init__(self, target, value, attr: Optional[str] = None, fill: bool = False):
        self.target, self.value, self.attr, self.fill = target, value, attr, fill

    def snapshot(self):
        if self.attr is not None:
            return getattr(self.target, self.attr, None)
        return self.target.detach().clone()

    def apply(self, value):
        if self.attr is not None:
            setattr(self.target, self.attr, value)
        elif self.fill and not hasattr(value, "shape"):
            self.target.fill_(value)
        else:
            self.target.copy_(value)


def _apply(writes: List[_Write]) -> None:
    import torch

    done = []
    with torch.no_grad():
        try:
            for write in writes:
                before = write.snapshot()
                write.apply(write.value)
                done.append((write, before))
        except BaseException:
            for write, before in reversed(done):
                write.apply(before)
            raise


def _as_float32(value: Any, where: str):
    import numpy as np
    import torch

    try:
        if isinstance(value, torch.Tensor):
            tensor = value.detach().to("cpu", torch.float32)
        else:
            tensor = torch.from_numpy(np.array(value, dtype=np.float32))
    except (TypeError, ValueError) as e:
        raise ValueError(f"kvcal: {where}: not a number or array of numbers ({e})") from e
    n = tensor.numel()
    if tensor.dim() > 1 and tuple(tensor.shape) != (n, 1, 1):
        raise ValueError(f"kvcal: {where}: shape {tuple(tensor.shape)}; scales are (), [heads] or "
                         f"[heads, 1, 1]; nothing was changed")
    if n == 0:
        raise ValueError(f"kvcal: {where}: no values; nothing was changed")
    return tensor.reshape(-1)


def _check_values(tensor, where: str, how: str = "") -> None:
    for i, v in enumerate(tensor.reshape(-1).tolist()):
        if not (math.isfinite(v) and v > 0):
            index = f"[{i}]" if tensor.numel() > 1 else ""
            extra = f" {how}" if how else ""
            raise ValueError(f"kvcal: {where}{index} = {v!r}{extra}: a scale must be finite and > 0; "
                             f"nothing was changed")
