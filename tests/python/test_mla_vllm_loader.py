"""Which checkpoint names give vLLM 0.34.0's DeepSeek MLA layers their
FP8 KV-cache scales: vLLM's own DeepseekV3ForCausalLM, built on a CPU from a
tiny DeepSeek-V3 config.json, loading scale tensors through its own
load_weights.

What runs (in a child process with vLLM on its path, as
test_vllm_own_code.py runs it): ModelConfig (config.json, quantization
method), resolve_kv_cache_dtype_string, VllmConfig (the quantization config),
`DeepseekV3ForCausalLM(vllm_config=...)` (models/deepseek_v2.py: every layer's
DeepseekV2MLAAttention -> MultiHeadLatentAttentionWrapper -> MLAAttention at
`model.layers.L.self_attn.mla_attn.mla_attn`, whose _init_kv_cache_quant asks
the quantization config for a KV cache method), `model.load_weights`
(AutoWeightsLoader with the quantization config's cache-scale mapper, then
DeepseekV2Model.load_weights with maybe_remap_kv_scale_name) and
process_weights_after_loading. Three things chosen for it, none of them on
the scale path: attention-backend selection needs a GPU platform, so
TRITON_MLA is given for the decode backend and the CPU SDPA backend for
prefill, and TritonMLAImpl's SM count (a kernel launch parameter) is 1.
All layers use the dense MLP (first_k_dense_replace = layers), so no MoE
kernels are needed.

The finding, pinned below: no scale name reaches the MLA layer's `_k_scale`
under any quantization config a kvcal patch could write. Only ModelOpt
configs give MLAAttention scale parameters (modelopt.py
ModelOptQuantConfigBase.get_quant_method: `(Attention, MLAAttention)`;
compressed-tensors, fp8 and quark test `Attention` only), and for those the
cache-scale mapper (base_config.py QuantizationConfig.get_cache_scale_mapper,
applied by models/utils.py AutoWeightsLoader.load_weights) turns every
`*_scale` name into `.attn.*_scale` before DeepseekV2Model.load_weights'
maybe_remap_kv_scale_name (model_loader/weight_utils.py), whose MLA-aware
rule (`.self_attn.{k,v}_proj.{k,v}_scale` -> `.self_attn.mla_attn.mla_attn.*`)
would have found the parameter; it appends another `.attn` instead and drops
the tensor with a "not loaded" warning. The layers keep 1.0.
"""
import json
import os
import tempfile

import numpy as np
import pytest

import test_vllm_own_code as own
from test_vllm_own_code import PINS, QUARK, VLLM_DIR, VllmProcess

LAYERS_Q_LORA = 8  # DeepSeek-V3 shape: q_lora_rank set (fused_qkv_a_proj)
KV_LORA_RANK, ROPE_DIM = 16, 8

# The scale-name forms tried, one per decoder layer (layer i gets FORMS[i]):
# (label, [q name, k name, v name] after `model.layers.{i}.`).
FORMS = [
    ("kvcal compressed-tensors", ["self_attn.q_scale", "self_attn.k_scale", "self_attn.v_scale"]),
    ("kvcal modelopt", ["self_attn.q_scale", "self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale"]),
    ("the parameter's own name", ["self_attn.mla_attn.mla_attn.q_scale",
                                  "self_attn.mla_attn.mla_attn.k_scale",
                                  "self_attn.mla_attn.mla_attn.v_scale"]),
    ("Llama's parameter name", ["self_attn.attn.q_scale", "self_attn.attn.k_scale",
                                "self_attn.attn.v_scale"]),
    ("on the latent projection", ["self_attn.kv_a_proj_with_mqa.q_scale",
                                  "self_attn.kv_a_proj_with_mqa.k_scale",
                                  "self_attn.kv_a_proj_with_mqa.v_scale"]),
    ("deprecated kv_scale", ["self_attn.kv_scale"]),
]
LAYERS = len(FORMS)

_KV_SCHEME = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "tensor",
              "group_size": None, "block_structure": None, "actorder": None, "observer": "minmax",
              "observer_kwargs": {}}
# What `kvcal patch` writes (docs/formats.md "Checkpoint targets"), on a
# DeepSeek config. ModelOpt's linear layers are excluded ("*") because FP8
# linear kernels need a GPU; the KV cache method is chosen before exclusion
# (ModelOptQuantConfigBase.get_quant_method).
CONFIGS = {
    "none": None,
    "compressed-tensors": {"quant_method": "compressed-tensors", "config_groups": {}, "ignore": [],
                           "format": "dense", "quantization_status": "compressed",
                           "kv_cache_scheme": _KV_SCHEME},
    "modelopt-flat": {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_scheme": _KV_SCHEME,
                      "exclude_modules": ["*"], "producer": {"name": "modelopt", "version": "0.37.0"}},
    "modelopt-nested": {"quant_method": "modelopt", "producer": {"name": "modelopt", "version": "0.29.0"},
                        "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
                                         "exclude_modules": ["*"]}},
}


_QUARK_OUTPUT = {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "ch_axis": None, "group_size": None,
                 "symmetric": True, "round_method": "half_even", "scale_type": "float", "is_dynamic": False,
                 "observer_cls": "PerTensorMinMaxObserver"}
QUARK_PATCHED = json.loads(json.dumps(QUARK))
QUARK_PATCHED["export"]["kv_cache_group"] = ["*k_proj", "*v_proj"]
QUARK_PATCHED["layer_quant_config"] = {
    p: dict(QUARK["global_quant_config"], output_tensors=_QUARK_OUTPUT) for p in ("*k_proj", "*v_proj")}


def scale_value(layer, role_index):
    """A distinct value per layer and role, none of them 1.0."""
    return 0.01 * (layer + 1) + 0.001 * (role_index + 1)


# ---------------------------------------------------------------------------
# Child side
# ---------------------------------------------------------------------------

# The vLLM warnings and the gloo group's store files, shared with
# test_vllm_own_code's bootstrap (the same lists).
_WARNINGS = own._WARNINGS
_STORE = own._STORE
_vllm_shutdown = own._vllm_shutdown


def _mla_bootstrap():
    """test_vllm_own_code's bootstrap (vLLM once, a one-rank gloo group,
    warnings collected), then the MLA backends a CPU cannot select."""
    info = own._vllm_bootstrap()
    from vllm.model_executor.layers.attention import mla_attention
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.mla.prefill.registry import MLAPrefillBackendEnum
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    # Backend selection needs a GPU platform (module docstring).
    triton_mla = AttentionBackendEnum["TRITON_MLA"].get_class()
    mla_attention.get_attn_backend = lambda *args, **kwargs: triton_mla
    cpu_prefill = MLAPrefillBackendEnum["CPU"].get_class()
    mla_attention.get_mla_prefill_backend = lambda *args, **kwargs: cpu_prefill
    current_platform.num_compute_units = lambda *args, **kwargs: 1
    return {"vllm": info["vllm"], "vllm_file": info["vllm_file"]}


def _deepseek_checkpoint(quantization_config):
    path = tempfile.mkdtemp(prefix="kvcal-mla-ckpt-")
    config = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 64,
              "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
              "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 4,
              "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
              "first_k_dense_replace": LAYERS, "kv_lora_rank": KV_LORA_RANK, "q_lora_rank": LAYERS_Q_LORA,
              "qk_rope_head_dim": ROPE_DIM, "qk_nope_head_dim": 8, "v_head_dim": 8,
              "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "torch_dtype": "float32",
              "tie_word_embeddings": False}
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def _mla_load(config_name, kv_cache_dtype, weights, direct=False):
    """Builds vLLM's DeepseekV3ForCausalLM for CONFIGS[config_name] and loads
    `weights` ({name: float}) through `model.load_weights` (or, with
    `direct`, through DeepseekV2Model.load_weights alone, without
    AutoWeightsLoader's mapper, names without the `model.` prefix).
    Returns what the MLA layers hold afterwards."""
    import torch
    import vllm.logger
    from vllm.config import CacheConfig, DeviceConfig, LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.deepseek_v2 import DeepseekV3ForCausalLM
    from vllm.utils.torch_utils import resolve_kv_cache_dtype_string

    del _WARNINGS[:]
    vllm.logger._print_warning_once.cache_clear()  # each load's own warnings
    model_config = ModelConfig(model=_deepseek_checkpoint(CONFIGS[config_name]), skip_tokenizer_init=True)
    cache_dtype = resolve_kv_cache_dtype_string(kv_cache_dtype, model_config)
    vllm_config = VllmConfig(model_config=model_config, cache_config=CacheConfig(cache_dtype=cache_dtype),
                             load_config=LoadConfig(), device_config=DeviceConfig(device="cpu"))
    out = {"quantization": model_config.quantization, "use_mla": model_config.use_mla,
           "cache_dtype": cache_dtype, "quant_config": type(vllm_config.quant_config).__name__}
    with set_current_vllm_config(vllm_config):
        model = DeepseekV3ForCausalLM(vllm_config=vllm_config)
        out["scale_parameters"] = sorted(n for n, _ in model.named_parameters() if n.endswith("_scale"))
        tensors = [(name, torch.tensor(value, dtype=torch.float32)) for name, value in weights.items()]
        if direct:
            model.model.load_weights(iter(tensors))
        else:
            model.load_weights(iter(tensors))
        process_weights_after_loading(model, model_config, torch.device("cpu"))
    out["layers"] = []
    for layer in model.model.layers:
        attn = layer.self_attn.mla_attn.mla_attn
        out["layers"].append({
            "type": type(attn).__name__, "layer_name": attn.layer_name,
            "kv_cache_dtype": attn.kv_cache_dtype,
            "quant_method": type(getattr(attn, "quant_method", None)).__name__,
            **{f"_{r}_scale": float(getattr(attn, f"_{r}_scale").reshape(-1)[0]) for r in "qkv"},
        })
    out["warnings"] = list(_WARNINGS)
    return out


def _mla_quant_methods():
    """The KV cache method each quantization config gives an MLAAttention
    layer (the `get_quant_method` that _init_kv_cache_quant calls)."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.attention import MLAAttention
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig)
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config
    from vllm.model_executor.layers.quantization.modelopt import ModelOptFp8Config
    from vllm.model_executor.layers.quantization.quark.quark import QuarkConfig

    from vllm.model_executor.layers.attention import Attention

    # isinstance / issubclass is all get_quant_method asks of the layer.
    layers = {"mla": MLAAttention.__new__(MLAAttention), "attention": Attention.__new__(Attention)}
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        configs = {
            "compressed-tensors": CompressedTensorsConfig.from_config(CONFIGS["compressed-tensors"]),
            "modelopt": ModelOptFp8Config.from_config(CONFIGS["modelopt-flat"]),
            # DeepSeek-V3's own FP8 checkpoint config.
            "fp8": Fp8Config.from_config({"quant_method": "fp8", "activation_scheme": "dynamic",
                                          "fmt": "e4m3", "weight_block_size": [128, 128]}),
            # What `kvcal patch --target quark` writes (test_vllm_own_code.py).
            "quark": QuarkConfig.from_config(QUARK_PATCHED),
        }
        return {kind: {name: type(config.get_quant_method(layer, "model.layers.0.self_attn.attn")).__name__
                       for name, config in configs.items()}
                for kind, layer in layers.items()}


# ---------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    own.require_vllm()
    child = VllmProcess(str(tmp_path_factory.mktemp("vllm-mla") / "vllm.log"), module=__name__)
    try:
        info = child.call("_mla_bootstrap")
        assert info["vllm"] == PINS["vllm"], info
        assert info["vllm_file"].startswith(VLLM_DIR), info
        yield child
    finally:
        child.close()


def f32(x):
    return float(np.float32(x))


def all_forms():
    weights = {}
    for layer, (_, names) in enumerate(FORMS):
        for i, name in enumerate(names):
            weights[f"model.layers.{layer}.{name}"] = scale_value(layer, i)
    return weights


def test_mla_layer_sits_where_vllm_builds_it(vllm):
    loaded = vllm.call("_mla_load", "modelopt-flat", "auto", {})
    assert loaded["use_mla"] is True
    for i, layer in enumerate(loaded["layers"]):
        # models/deepseek_v2.py DeepseekV2MLAAttention.mla_attn ->
        # layers/mla.py MultiHeadLatentAttentionWrapper.mla_attn (an
        # MLAAttention whose layer name is `{prefix}.attn`).
        assert layer["type"] == "MLAAttention"
        assert layer["layer_name"] == f"model.layers.{i}.self_attn.attn"
    # The parameters a checkpoint would have to fill (ModelOpt only).
    assert [n for n in loaded["scale_parameters"] if ".layers.0." in n] == [
        f"model.layers.0.self_attn.mla_attn.mla_attn.{r}_scale" for r in ("k", "prob", "q", "v")]


def test_kv_cache_methods_for_mla(vllm):
    # compressed_tensors.py, fp8.py: `isinstance(layer, Attention)`;
    # quark.py get_quant_method_target: `issubclass(layer_type, Attention)`;
    # modelopt.py ModelOptQuantConfigBase: `(Attention, MLAAttention)`.
    methods = vllm.call("_mla_quant_methods")
    assert methods["mla"] == {"compressed-tensors": "NoneType", "modelopt": "ModelOptKVCacheMethod",
                              "fp8": "NoneType", "quark": "NoneType"}
    # The same configs give Llama's Attention its KV cache method.
    assert methods["attention"] == {"compressed-tensors": "CompressedTensorsKVCacheMethod",
                                    "modelopt": "ModelOptKVCacheMethod", "fp8": "Fp8KVCacheMethod",
                                    "quark": "QuarkKVCacheMethod"}


@pytest.mark.parametrize("config,kv_cache_dtype,cache,method", [
    ("none", "fp8", "fp8", "NoneType"),
    ("compressed-tensors", "auto", "auto", "NoneType"),
    ("compressed-tensors", "fp8", "fp8", "NoneType"),
    ("modelopt-flat", "auto", "fp8_e4m3", "ModelOptKVCacheMethod"),
    ("modelopt-nested", "auto", "fp8_e4m3", "ModelOptKVCacheMethod"),
])
def test_no_scale_name_reaches_the_mla_layer(vllm, config, kv_cache_dtype, cache, method):
    loaded = vllm.call("_mla_load", config, kv_cache_dtype, all_forms())
    assert loaded["cache_dtype"] == cache
    for i, layer in enumerate(loaded["layers"]):
        label = FORMS[i][0]
        # A compressed-tensors kv_cache_scheme does not make the MLA cache
        # fp8 (only Attention.__init__ asks quant_config.get_kv_cache_dtype).
        assert layer["kv_cache_dtype"] == cache, (label, layer)
        assert layer["quant_method"] == method, (label, layer)
        # Every name form: the calibrated value never arrives.
        for role in "qkv":
            assert layer[f"_{role}_scale"] == 1.0, (label, role, layer)
    if method != "NoneType":
        # The parameters exist; each name was dropped by
        # maybe_remap_kv_scale_name after the cache-scale mapper.
        dropped = [w for w in loaded["warnings"] if w.endswith("is not loaded.")]
        for i, (label, names) in enumerate(FORMS):
            roles = "k" if names == ["self_attn.kv_scale"] else "qkv"
            for role in roles:
                # weight_utils.py maybe_remap_kv_scale_name's warning, naming
                # the name the mapper made and the `.attn.attn` it looked for.
                assert any(w.startswith(f"Found {role}_scale in the checkpoint (e.g. layers.{i}.") and
                           f"layers.{i}." in w.split("expected name in the model")[1]
                           for w in dropped), (label, role, dropped)
        assert any("Using KV cache scaling factor 1.0" in w for w in loaded["warnings"]), loaded["warnings"]


def test_deepseek_remap_alone_would_load_them(vllm):
    """The control: DeepseekV2Model.load_weights called without
    AutoWeightsLoader's mapper puts the ModelOpt name and the parameter's own
    name into the MLA layer, so the harness sees a value that arrives; it is
    the mapper in front of it that breaks the path."""
    weights = {"layers.0.self_attn.k_proj.k_scale": scale_value(0, 1),
               "layers.0.self_attn.v_proj.v_scale": scale_value(0, 2),
               "layers.1.self_attn.mla_attn.mla_attn.q_scale": scale_value(1, 0),
               "layers.1.self_attn.mla_attn.mla_attn.k_scale": scale_value(1, 1),
               "layers.1.self_attn.mla_attn.mla_attn.v_scale": scale_value(1, 2)}
    loaded = vllm.call("_mla_load", "modelopt-flat", "auto", weights, True)
    l0, l1 = loaded["layers"][0], loaded["layers"][1]
    assert l0["_k_scale"] == f32(scale_value(0, 1)) and l0["_v_scale"] == f32(scale_value(0, 2))
    # No q in the checkpoint: BaseKVCacheMethod.process_weights_after_loading
    # warns "Setting it to k_scale", copies k, then sets q to 1.0 (q_scale
    # < 0 -> 1.0) a few lines later: the layer ends with 1.0.
    assert l0["_q_scale"] == 1.0
    assert any("does not provide a q scaling factor" in w for w in loaded["warnings"])
    assert [l1[f"_{r}_scale"] for r in "qkv"] == [f32(scale_value(1, i)) for i in range(3)]
    # The same names through the model's own load_weights: dropped.
    through = vllm.call("_mla_load", "modelopt-flat", "auto",
                        {"model." + name: value for name, value in weights.items()})
    for layer in through["layers"][:2]:
        assert [layer[f"_{r}_scale"] for r in "qkv"] == [1.0, 1.0, 1.0]
    assert any("layers.0.self_attn.attn.attn.k_scale" in w for w in through["warnings"]), through["warnings"]
    assert any("layers.1.self_attn.mla_attn.mla_attn.attn.attn.k_scale" in w
               for w in through["warnings"]), through["warnings"]
