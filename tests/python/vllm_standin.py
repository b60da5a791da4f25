"""A stand-in for vLLM 0.34.0's attention layers and the way they load q/k/v
scales, for tests that cannot install vLLM.

Written from vLLM 0.34.0's source (the sdist, paths inside `vllm/`); every
method below names the function it follows. It runs vLLM's sequence:

    build (Attention.__init__ -> _init_kv_cache_quant -> create_weights)
    -> load_checkpoint (cache-scale name mapping -> each parameter's weight_loader)
    -> process_weights_after_loading (quant method, then the Attention hook)

for compressed-tensors (per tensor and `attn_head`, with the tensor-parallel
slicing of `_tp_aware_loader`) and for BaseKVCacheMethod (ModelOpt, Quark,
fp8; doubling on float8_e4m3fnuz). What it leaves on a layer is what a
running engine's layer holds, so tests can compare a checkpoint load with a
live update bit for bit.

    model = build_model("compressed-tensors", strategy="attn_head", tp_rank=1, tp_size=2)
    load_checkpoint(model, checkpoint_tensors(scales, "compressed-tensors"))
    model.model.layers[0].self_attn.attn._k_scale   # this rank's KV head
"""
from __future__ import annotations

import re
from functools import partial
from typing import Dict, Mapping, Optional

import numpy as np
import torch


# -- model_executor/layers/attention/attention.py --------------------------------

def set_default_quant_scales(layer: torch.nn.Module, register_buffer: bool) -> None:
    """attention.py `set_default_quant_scales`: 0-d float32 buffers of 1.0,
    floats of 1.0 and the two "host" copies (plain tensors, created on the
    current default device)."""
    if register_buffer:
        for role in ("k", "v", "q", "prob"):
            layer.register_buffer(f"_{role}_scale", torch.tensor(1.0, dtype=torch.float32))
    else:
        for role in ("k", "v", "q", "prob"):
            getattr(layer, f"_{role}_scale").fill_(1.0)
    layer._q_scale_float = 1.0
    layer._k_scale_float = 1.0
    layer._v_scale_float = 1.0
    layer._k_scale_cpu = torch.tensor(1.0, dtype=torch.float32)
    layer._v_scale_cpu = torch.tensor(1.0, dtype=torch.float32)
    layer._prob_scale_float = 1.0


class Attention(torch.nn.Module):
    """The scale-related part of attention.py `Attention`. num_heads and
    num_kv_heads are this rank's (what Llama passes: total / tp_size, at least
    one KV head)."""

    def __init__(self, num_heads: int, num_kv_heads: int, quant_method, kv_cache_dtype: str,
                 prefix: str):
        super().__init__()
        # Attention.__init__
        self.kv_cache_dtype = kv_cache_dtype
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.layer_name = prefix
        # _init_kv_cache_quant: default scales registered as buffers, then the
        # quant method's parameters (should_load_quant_weights: any method that
        # is not UnquantizedLinearMethod).
        set_default_quant_scales(self, register_buffer=True)
        self._o_scale_float = None
        self.quant_method = quant_method
        if quant_method is not None:
            quant_method.create_weights(self)

    def process_weights_after_loading(self) -> None:
        """Attention.process_weights_after_loading: with a quant method it only
        runs the backend impl's hook (no scales); without one, defaults again."""
        if self.quant_method is None:
            set_default_quant_scales(self, register_buffer=False)


# -- model_executor/layers/quantization/compressed_tensors/compressed_tensors.py --

class CompressedTensorsConfig:
    """The fields CompressedTensorsKVCacheMethod reads. total_num_heads and
    total_num_kv_heads come from model_loader/weight_utils.py
    `get_quant_config` (only when the config has `config_groups`)."""

    def __init__(self, strategy: Optional[str], total_num_heads: Optional[int],
                 total_num_kv_heads: Optional[int]):
        self.kv_cache_scheme = None if strategy is None else {
            "num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
            "strategy": strategy}
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads


class TensorParallel:
    """get_tensor_model_parallel_rank() / _world_size() of vllm.distributed."""

    def __init__(self, rank: int = 0, size: int = 1):
        self.rank, self.size = rank, size


class CompressedTensorsKVCacheMethod:
    """compressed_tensors.py `CompressedTensorsKVCacheMethod` (the name is
    vLLM's: kvcal recognizes the method by class name)."""

    def __init__(self, quant_config: CompressedTensorsConfig, tp: TensorParallel):
        self.quant_config = quant_config
        self.tp = tp

    def create_weights(self, layer: torch.nn.Module) -> None:
        """CompressedTensorsKVCacheMethod.create_weights: float32 parameters of
        ones, one per KV head for attn_head (q too), else one; zero points;
        for attn_head a TP-aware weight loader on each."""
        scheme = self.quant_config.kv_cache_scheme
        per_head = scheme is not None and scheme["strategy"] == "attn_head"
        n = int(layer.num_kv_heads) if per_head else 1
        for role in ("k", "v", "q"):
            setattr(layer, f"{role}_scale", torch.nn.Parameter(
                torch.ones(n, dtype=torch.float32), requires_grad=False))
        for role in ("k", "v", "q"):
            setattr(layer, f"{role}_zero_point", torch.nn.Parameter(
                torch.zeros(n), requires_grad=False))
        if per_head:
            for role in ("q", "k", "v"):
                getattr(layer, f"{role}_scale").weight_loader = partial(
                    self._load_head_scales, layer, role)
                getattr(layer, f"{role}_zero_point").weight_loader = _ignore

    def _load_head_scales(self, layer, role, param, loaded_weight) -> None:
        """The `_tp_aware_loader` closure of create_weights, for scales: flatten
        ([heads, 1, 1] in llm-compressor checkpoints); q: max over each group
        of total_num_heads // total_num_kv_heads consecutive query heads; then
        this rank's KV heads, or, when the model has fewer KV heads than
        ranks, the one head this rank replicates."""
        values = loaded_weight.flatten()
        config = self.quant_config
        if role == "q":
            group = config.total_num_heads // config.total_num_kv_heads
            values = values.view(-1, group).amax(dim=1)
        rank, size = self.tp.rank, self.tp.size
        here = layer.num_kv_heads
        if here * size == config.total_num_kv_heads:
            values = values[rank * here:(rank + 1) * here]
        else:
            assert here == 1
            replicas = size // config.total_num_kv_heads
            head = rank // replicas
            values = values[head:head + 1]
        param.data.copy_(values.to(dtype=param.dtype))

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """CompressedTensorsKVCacheMethod.process_weights_after_loading: the
        loaded parameters become the buffers (detach: same storage), floats
        are the value or, per head, the maximum; the host copies are filled
        in place. No doubling on fnuz here."""
        for role in ("k", "v", "q"):
            layer.register_buffer(f"_{role}_scale", getattr(layer, f"{role}_scale").detach())

        def scalar(t: torch.Tensor) -> float:
            return t.max().item() if t.numel() > 1 else t.item()

        layer._k_scale_float = scalar(layer.k_scale)
        layer._v_scale_float = scalar(layer.v_scale)
        layer._q_scale_float = scalar(layer.q_scale)
        layer._k_scale_cpu.fill_(layer._k_scale_float)
        layer._v_scale_cpu.fill_(layer._v_scale_float)


def _ignore(param, loaded_weight) -> None:
    """`_tp_aware_loader` for zero points: vLLM ignores them."""


# -- model_executor/layers/quantization/kv_cache.py ------------------------------

def _scalar_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """kv_cache.py `KVCacheScaleParameter.weight_loader`: one element, or
    ValueError."""
    if loaded_weight.numel() != 1:
        raise ValueError(f"KV-cache scale expects a scalar weight, got shape "
                         f"{tuple(loaded_weight.shape)}")
    param.data.copy_(loaded_weight.reshape(()))


def _kv_cache_scale_parameter() -> torch.nn.Parameter:
    """kv_cache.py `KVCacheScaleParameter()`: a 0-d -1.0 (not loaded)."""
    param = torch.nn.Parameter(torch.tensor(-1.0), requires_grad=False)
    param.weight_loader = _scalar_loader
    return param


def _quantized_cache(kv_cache_dtype: str) -> bool:
    """v1/kv_cache_interface.py `is_quantized_kv_cache` for the dtypes used here."""
    return kv_cache_dtype.startswith("fp8")


def _per_token_head_cache(kv_cache_dtype: str) -> bool:
    """v1/kv_cache_interface.py `kv_cache_uses_per_token_head_scales`."""
    return kv_cache_dtype.endswith("per_token_head")


class BaseKVCacheMethod:
    """kv_cache.py `BaseKVCacheMethod`; `fnuz` stands for
    current_platform.is_fp8_fnuz() (platforms/rocm.py: gfx94x)."""

    def __init__(self, fnuz: bool = False):
        self.fnuz = fnuz
        self.quant_config = None

    def create_weights(self, layer: torch.nn.Module) -> None:
        """BaseKVCacheMethod.create_weights: q/k/v/prob scale parameters, -1.0."""
        layer.q_scale = _kv_cache_scale_parameter()
        layer.k_scale = _kv_cache_scale_parameter()
        layer.v_scale = _kv_cache_scale_parameter()
        layer.prob_scale = _kv_cache_scale_parameter()

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """BaseKVCacheMethod.process_weights_after_loading (not pre-processed)."""
        if _per_token_head_cache(layer.kv_cache_dtype):
            layer._k_scale.copy_(1.0)
            layer._v_scale.copy_(1.0)
            layer._k_scale_float = 1.0
            layer._v_scale_float = 1.0
            return
        if _quantized_cache(layer.kv_cache_dtype):
            # k and v: both loaded -> each (doubled on fnuz); neither -> 1.0;
            # one of them -> the larger for both (k must be > 0).
            if layer.k_scale > 0.0 and layer.v_scale > 0.0:
                k = layer.k_scale.to("cpu").tolist()
                v = layer.v_scale.to("cpu").tolist()
                if self.fnuz:
                    k, v = k * 2, v * 2
            elif layer.k_scale < 0.0 and layer.v_scale < 0.0:
                k = v = 1.0
            else:
                assert layer.k_scale > 0.0
                larger = max(layer.k_scale, layer.v_scale)
                k = v = larger.to("cpu").tolist()
                if self.fnuz:
                    k, v = k * 2, v * 2
            if layer.q_scale < 0.0:  # overwritten by the q branch below
                layer._q_scale.copy_(k)
                layer._q_scale_float = k
            layer._k_scale.copy_(k)
            layer._v_scale.copy_(v)
            layer._k_scale_float = k
            layer._v_scale_float = v
            layer._k_scale_cpu.fill_(k)
            layer._v_scale_cpu.fill_(v)
        # q and prob: loaded -> the value (a float32 tensor; doubled on fnuz),
        # else 1.0; whatever the cache.
        q = layer.q_scale * 2 if layer.q_scale > 0.0 and self.fnuz else (
            layer.q_scale if layer.q_scale > 0.0 else 1.0)
        prob = layer.prob_scale * 2 if layer.prob_scale > 0.0 and self.fnuz else (
            layer.prob_scale if layer.prob_scale > 0.0 else 1.0)
        layer._q_scale.copy_(q)
        layer._q_scale_float = q.item() if isinstance(q, torch.Tensor) else q
        layer._prob_scale.copy_(prob)


class ModelOptKVCacheMethod(BaseKVCacheMethod):
    """modelopt.py `ModelOptKVCacheMethod`: BaseKVCacheMethod unchanged."""


class QuarkKVCacheMethod(BaseKVCacheMethod):
    """quark/quark.py `QuarkKVCacheMethod`: BaseKVCacheMethod unchanged."""


class UnknownKVCacheMethod:
    """A quant method kvcal does not know (for the refusal test)."""

    quant_config = None

    def create_weights(self, layer):
        pass

    def process_weights_after_loading(self, layer):
        pass


# -- a Llama-shaped model ----------------------------------------------------------

class _SelfAttention(torch.nn.Module):
    def __init__(self, attn: Attention):
        super().__init__()
        self.attn = attn


class _DecoderLayer(torch.nn.Module):
    def __init__(self, attn: Attention):
        super().__init__()
        self.self_attn = _SelfAttention(attn)


class _Stack(torch.nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)


METHODS = ("compressed-tensors", "modelopt", "quark")


def build_model(method: str, *, strategy: Optional[str] = "tensor", num_layers: int = 2,
                num_heads: int = 8, num_kv_heads: int = 2, tp_rank: int = 0, tp_size: int = 1,
                kv_cache_dtype: str = "fp8", fnuz: bool = False, device="cpu",
                prefix: str = "model", config_groups: bool = True) -> torch.nn.Module:
    """A model whose `{prefix}.layers.{L}.self_attn.attn` are stand-in
    Attention layers of one tensor-parallel rank, built under `device` as
    model_loader/base_loader.py `load_model` builds a model (inside
    `with target_device:`, so the host copies land there too)."""
    assert num_heads % tp_size == 0
    heads_here = num_heads // tp_size
    kv_here = max(1, num_kv_heads // tp_size)  # models/llama.py LlamaAttention
    tp = TensorParallel(tp_rank, tp_size)
    with torch.device(device):
        layers = []
        for index in range(num_layers):
            if method == "compressed-tensors":
                config = CompressedTensorsConfig(
                    strategy,
                    num_heads if config_groups else None,
                    num_kv_heads if config_groups else None)
                quant = CompressedTensorsKVCacheMethod(config, tp)
            elif method == "modelopt":
                quant = ModelOptKVCacheMethod(fnuz)
            elif method == "quark":
                quant = QuarkKVCacheMethod(fnuz)
            elif method == "unknown":
                quant = UnknownKVCacheMethod()
            else:
                raise ValueError(method)
            name = f"{prefix}.layers.{index}.self_attn.attn"
            layers.append(_DecoderLayer(Attention(heads_here, kv_here, quant, kv_cache_dtype, name)))
        stack = _Stack(layers)
        root = torch.nn.Module()
        node = root
        parts = prefix.split(".")
        for part in parts[:-1]:
            child = torch.nn.Module()
            node.add_module(part, child)
            node = child
        node.add_module(parts[-1], stack)
    root.standin_prefix = prefix
    return root


def checkpoint_tensors(scales: Mapping, method: str) -> Dict[str, torch.Tensor]:
    """The tensors a checkpoint of `method` holds for kvcal scales
    (`model.layers.{L}.self_attn.{q,k,v}_scale` -> array): compressed-tensors
    keeps kvcal's names and shapes ([1], [heads, 1, 1]); ModelOpt writes 0-d
    `self_attn.{k,v}_proj.{k,v}_scale` and `self_attn.q_scale`; Quark 0-d
    `self_attn.{q,k,v}_proj.output_scale`."""
    out = {}
    for name, value in scales.items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.self_attn\.([qkv])_scale", name)
        assert m, name
        base, role = f"model.layers.{m.group(1)}.self_attn", m.group(2)
        array = torch.from_numpy(np.array(value, dtype=np.float32))
        if method == "compressed-tensors":
            out[name] = array
        elif method == "modelopt":
            key = f"{base}.q_scale" if role == "q" else f"{base}.{role}_proj.{role}_scale"
            out[key] = array.reshape(())
        elif method == "quark":
            out[f"{base}.{role}_proj.output_scale"] = array.reshape(())
        else:
            raise ValueError(method)
    return out


# base_config.py QuantizationConfig.get_cache_scale_mapper (+ Quark's suffixes
# in quark/quark.py QuarkConfig.get_cache_scale_mapper): checkpoint names ->
# the attention layer's parameters.
_CACHE_SCALE_NAMES = [
    (re.compile(r"\.([qkv])_proj\.output_scale$"), r".attn.\1_scale"),
    (re.compile(r"\.self_attn\.[kv]_proj\.([kv])_scale$"), r".self_attn.attn.\1_scale"),
    (re.compile(r"(?<!\.attn)\.([qkv])_scale$"), r".attn.\1_scale"),
    (re.compile(r"(?<!\.attn)\.([qkv])_zero_point$"), r".attn.\1_zero_point"),
]


def _vllm_name(name: str) -> str:
    for pattern, replacement in _CACHE_SCALE_NAMES:
        if pattern.search(name):
            return pattern.sub(replacement, name)
    return name


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """model_loader/weight_utils.py `default_weight_loader`."""
    if param.numel() == 1 and loaded_weight.numel() == 1:
        param.data.copy_(loaded_weight.view(param.shape))
    else:
        assert param.size() == loaded_weight.size()
        param.data.copy_(loaded_weight)


def load_checkpoint(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Loads checkpoint tensors and processes them, as vLLM does when an
    engine starts: names through the cache-scale mapper (AutoWeightsLoader),
    the model's own prefix (hf_to_vllm_mapper), each parameter's
    weight_loader (a name with no parameter is dropped, as vLLM drops it),
    then model_loader/utils.py `process_weights_after_loading`: every quant
    method's hook, then (weight_utils.py `finalize_model_weights`) every
    module's own hook."""
    params = dict(model.named_parameters())
    prefix = getattr(model, "standin_prefix", "model")
    for name, tensor in tensors.items():
        target = _vllm_name(name)
        if prefix != "model" and target.startswith("model."):
            target = prefix + target[len("model"):]
        param = params.get(target)
        if param is None:
            continue
        loader = getattr(param, "weight_loader", default_weight_loader)
        with torch.no_grad():
            loader(param, tensor.to(param.device))
    with torch.no_grad():
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(module)
        for module in model.modules():
            if isinstance(module, Attention):
                module.process_weights_after_loading()


def attention_layers(model: torch.nn.Module):
    return [m for m in model.modules() if isinstance(m, Attention)]
