"""vLLM 0.34.0's own code, run on what `kvcal patch` writes.

run_python_tests.sh unpacks the vLLM wheel from PyPI, without its
dependencies, into .venv/vllm-0.34.0/ (tests/python/requirements-vllm.txt:
vLLM, vLLM's compressed-tensors pin and the small packages its imports need).
vLLM runs in one child process per module that puts that directory first on
sys.path: vLLM's compressed-tensors 0.17.0 then shadows .venv's 0.19.0, and
vLLM's global state (its config context, a one-rank gloo group that its
tensor-parallel loaders ask for their rank, its loggers) stays out of the
other tests. The child runs the `_vllm_*` functions below and returns plain
data; the tests assert on that.

What runs is vLLM's load path for attention scales on a CPU: ModelConfig
(config.json, quantization method), resolve_kv_cache_dtype_string (the
engine's cache dtype), VllmConfig/get_quant_config (the quantization config
from_config, the head counts for per-head scales), real `Attention` layers
(kv_cache_dtype, _init_kv_cache_quant, the KV cache method's create_weights),
LlamaForCausalLM.load_weights/LlamaModel.load_weights through AutoWeightsLoader
(the cache-scale mapper, the weight loaders) and process_weights_after_loading.
The one thing chosen for it: attention-backend selection needs a GPU platform
(on CPU vLLM's platform is "unspecified" and selects nothing), so the layers
are built with TRITON_ATTN given explicitly; which backend accepts per-head
scales on a GPU (FlashAttention 3 only) is `kvcal inspect`'s business. The
model around the attention layers holds only them (Llama's names, vLLM's
load_weights methods): the tests feed it the scale tensors kvcal added.
The same path runs NVFP4 caches (`kvcal patch --kv-cache-dtype nvfp4`):
the cache dtype from the ModelOpt config, the global scales as loaded, and
the validators and loaders that make kvcal refuse the other targets, per-head
scales and a flat MIXED_PRECISION config; which GPUs serve NVFP4 (FlashInfer
only) is again backend selection, `kvcal inspect`'s business.
"""
import json
import os
import re
import select
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _pins():
    pins = {}
    with open(os.path.join(os.path.dirname(__file__), "requirements-vllm.txt")) as f:
        for line in f:
            m = re.match(r"([A-Za-z0-9_.-]+)==(\S+)", line.strip())
            if m:
                pins[m.group(1).lower()] = m.group(2)
    return pins


PINS = _pins()
VLLM_VERSION = PINS["vllm"]
# Where run_python_tests.sh unpacks it (KVCAL_VLLM_DIR overrides).
VLLM_DIR = os.environ.get("KVCAL_VLLM_DIR", os.path.join(ROOT, ".venv", f"vllm-{VLLM_VERSION}"))
HEADS, KV_HEADS, LAYERS = 4, 2, 2

# ---------------------------------------------------------------------------
# Child side: runs with VLLM_DIR first on sys.path.
# ---------------------------------------------------------------------------

_WARNINGS = []
_STORE = []


def _vllm_shutdown():
    for path in _STORE:
        if os.path.exists(path):
            os.unlink(path)


def _vllm_bootstrap():
    """Imports vLLM once; a one-rank gloo group for the TP rank the per-head
    loader asks for (what vLLM's own tests do in tests/conftest.py dist_init)."""
    import logging

    import vllm
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    class Collect(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                _WARNINGS.append(record.getMessage())

    logging.getLogger("vllm").addHandler(Collect())
    store = tempfile.mkstemp(prefix="kvcal-vllm-dist-")
    os.close(store[0])
    _STORE.append(store[1])
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"file://{store[1]}",
                                     local_rank=0, backend="gloo")
        initialize_model_parallel(1, 1)
    return {"vllm": vllm.__version__, "vllm_file": vllm.__file__,
            "compressed_tensors": __import__("compressed_tensors").__version__}


def _vllm_load(checkpoint, scale_names, kv_cache_dtype="auto", skip_layers=None):
    """vLLM's load path for the attention scales of `checkpoint`; returns what
    vLLM made of them. `skip_layers`: CacheConfig.kv_cache_dtype_skip_layers."""
    import torch
    from safetensors import safe_open
    from vllm.config import (CacheConfig, DeviceConfig, LoadConfig, ModelConfig, VllmConfig,
                             set_current_vllm_config)
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.llama import LlamaForCausalLM, LlamaModel
    from vllm.utils.torch_utils import get_kv_cache_quant_algo_string, resolve_kv_cache_dtype_string
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    del _WARNINGS[:]
    out = {}
    # vllm/config/model.py ModelConfig: reads config.json, picks and verifies
    # the quantization method.
    model_config = ModelConfig(model=checkpoint, skip_tokenizer_init=True)
    out["quantization"] = model_config.quantization
    hf_quant = getattr(model_config.hf_config, "quantization_config", None)
    hf_quant = dict(hf_quant) if hf_quant is not None else None
    # vllm/utils/torch_utils.py get_kv_cache_quant_algo_string, called by
    # resolve_kv_cache_dtype_string from engine/arg_utils.py
    # create_engine_config: the cache dtype `--kv-cache-dtype auto` becomes.
    out["kv_cache_quant_algo"] = get_kv_cache_quant_algo_string(hf_quant) if hf_quant else None
    cache_dtype = resolve_kv_cache_dtype_string(kv_cache_dtype, model_config)
    out["cache_dtype"] = cache_dtype
    # vllm/config/vllm.py VllmConfig -> model_loader/weight_utils.py
    # get_quant_config: injects total_num_heads/total_num_kv_heads into a
    # compressed-tensors config with config_groups, then <Config>.from_config.
    cache_config = CacheConfig(cache_dtype=cache_dtype, kv_cache_dtype_skip_layers=skip_layers or [])
    vllm_config = VllmConfig(model_config=model_config, cache_config=cache_config,
                             load_config=LoadConfig(), device_config=DeviceConfig(device="cpu"))
    quant_config = vllm_config.quant_config
    out["quant_config"] = type(quant_config).__name__
    out["total_num_heads"] = getattr(quant_config, "total_num_heads", None)
    out["total_num_kv_heads"] = getattr(quant_config, "total_num_kv_heads", None)
    out["kv_cache_scheme"] = getattr(quant_config, "kv_cache_scheme", None)
    # ModelOpt: what from_config made of kv_cache_scheme / kv_cache_quant_algo;
    # Quark: export.kv_cache_group and the output_tensors it matched.
    out["kv_cache_quant_method"] = getattr(quant_config, "kv_cache_quant_method", None)
    out["kv_cache_group"] = getattr(quant_config, "kv_cache_group", None)
    out["kv_cache_config"] = getattr(quant_config, "kv_cache_config", None)
    # The mapper AutoWeightsLoader.load_weights (models/utils.py) applies
    # first, from the quant config: QuantizationConfig.get_cache_scale_mapper
    # (base_config.py) or its Quark override (quark/quark.py).
    mapper = quant_config.get_cache_scale_mapper()
    out["mapped"] = {name: mapper.map_name(name) for name in scale_names}

    hf = model_config.hf_config
    backend = AttentionBackendEnum["TRITON_ATTN"].get_class()

    class SelfAttn(torch.nn.Module):
        def __init__(self, layer):
            super().__init__()
            # models/llama.py LlamaAttention builds this layer the same way.
            self.attn = Attention(hf.num_attention_heads, hf.head_dim, hf.head_dim ** -0.5,
                                  num_kv_heads=hf.num_key_value_heads, cache_config=vllm_config.cache_config,
                                  quant_config=quant_config, prefix=f"model.layers.{layer}.self_attn.attn",
                                  attn_backend=backend)

    class DecoderLayer(torch.nn.Module):
        def __init__(self, layer):
            super().__init__()
            self.self_attn = SelfAttn(layer)

    class Model(torch.nn.Module):  # LlamaModel's names and load_weights
        hf_to_vllm_mapper = LlamaModel.hf_to_vllm_mapper
        load_weights = LlamaModel.load_weights

        def __init__(self):
            super().__init__()
            self.quant_config = quant_config
            self.layers = torch.nn.ModuleList(DecoderLayer(i) for i in range(hf.num_hidden_layers))

    class CausalLM(torch.nn.Module):  # LlamaForCausalLM's names and load_weights
        load_weights = LlamaForCausalLM.load_weights

        def __init__(self):
            super().__init__()
            self.model = Model()

    with set_current_vllm_config(vllm_config):
        model = CausalLM()
        tensors = {}
        for file in sorted(os.listdir(checkpoint)):
            if file.endswith(".safetensors"):
                with safe_open(os.path.join(checkpoint, file), framework="pt") as f:
                    for key in f.keys():
                        if key in scale_names:
                            tensors[key] = f.get_tensor(key)
        out["read"] = sorted(tensors)
        out["loaded"] = sorted(model.load_weights(iter(sorted(tensors.items()))))
        process_weights_after_loading(model, model_config, torch.device("cpu"))

    def values(t):
        return [float(x) for x in t.detach().reshape(-1).tolist()]

    out["layers"] = {}
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn.attn
        out["layers"][i] = {
            "kv_cache_dtype": attn.kv_cache_dtype,
            "quant_method": type(getattr(attn, "quant_method", None)).__name__,
            **{f"_{r}_scale": values(getattr(attn, f"_{r}_scale")) for r in "qkv"},
            **{f"_{r}_scale_float": float(getattr(attn, f"_{r}_scale_float")) for r in "qkv"},
        }
    out["warnings"] = list(_WARNINGS)
    return out


def _vllm_parse_skip_layers(argv):
    """What vLLM's own command line (FlexibleArgumentParser with
    EngineArgs.add_cli_args, as `vllm serve` builds it) makes of `argv`:
    EngineArgs.kv_cache_dtype_skip_layers, or the parser's error."""
    import contextlib
    import io

    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    # add_cli_args builds DeviceConfig() for its defaults, which needs a
    # device type; vLLM's platform on a CPU-only machine has none.
    previous = current_platform.device_type
    current_platform.device_type = previous or "cpu"
    try:
        parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                args = parser.parse_args(argv)
        except SystemExit:
            return {"error": err.getvalue().strip().splitlines()[-1]}
    finally:
        current_platform.device_type = previous
    return {"kv_cache_dtype_skip_layers": args.kv_cache_dtype_skip_layers}


def _vllm_validate_kv_cache_scheme(scheme):
    # compressed_tensors/compressed_tensors.py
    # CompressedTensorsKVCacheMethod.validate_kv_cache_scheme
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsKVCacheMethod)

    CompressedTensorsKVCacheMethod.validate_kv_cache_scheme(scheme)
    return "accepted"


def _vllm_validate_quark_kv_cache_config(config):
    # quark/quark.py QuarkKVCacheMethod.validate_kv_cache_config
    from vllm.model_executor.layers.quantization.quark.quark import QuarkKVCacheMethod

    QuarkKVCacheMethod.validate_kv_cache_config(config)
    return "accepted"


_CHILD = r"""
import json, os, sys, traceback
proto = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # vLLM's log lines go to the log, not into the replies
sys.path[:0] = [os.environ["KVCAL_VLLM_DIR"], os.environ["KVCAL_TESTS_DIR"]]
import importlib
module = importlib.import_module(os.environ["KVCAL_TEST_MODULE"])
for line in sys.stdin:
    request = json.loads(line)
    try:
        reply = {"result": getattr(module, request["fn"])(*request["args"])}
    except BaseException as e:
        reply = {"error": type(e).__name__, "message": str(e), "traceback": traceback.format_exc()}
    proto.write(json.dumps(reply) + "\n")
    proto.flush()
module._vllm_shutdown()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)  # nothing to tear down that outlives the process (gloo, vLLM's exit hooks)
"""


class VllmError(Exception):
    def __init__(self, reply):
        super().__init__(f"{reply['error']}: {reply['message']}\n{reply['traceback']}")
        self.type = reply["error"]
        self.message = reply["message"]


class VllmProcess:
    """A child Python with vLLM on its path; call() runs one `_vllm_*`
    function there and returns its result or raises VllmError."""

    def __init__(self, log_path, module=__name__, tests_dir=os.path.dirname(__file__)):
        # PYTHONPATH as well as the child's sys.path: vLLM inspects model
        # classes in a process of its own (`python -m
        # vllm.model_executor.models.registry`), which must find the same
        # vLLM. Its model-info cache lives beside the log, so what an earlier
        # run on this machine cached decides nothing.
        path = [VLLM_DIR, tests_dir] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        env = dict(os.environ, KVCAL_VLLM_DIR=VLLM_DIR, KVCAL_TESTS_DIR=tests_dir,
                   KVCAL_TEST_MODULE=module.rpartition(".")[2], PYTHONPATH=os.pathsep.join(path),
                   VLLM_CACHE_ROOT=os.path.join(os.path.dirname(log_path), "vllm-cache"),
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
                   VLLM_DO_NOT_TRACK="1")
        self.log_path = log_path
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, env=env, text=True)

    def call(self, fn, *args, timeout=600):
        self.proc.stdin.write(json.dumps({"fn": fn, "args": list(args)}) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while True:
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if ready:
                break
            if time.monotonic() >= deadline:
                raise RuntimeError(f"vLLM child: no reply to {fn} in {timeout} s; log:\n{self.tail()}")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"vLLM child exited ({self.proc.wait()}); log:\n{self.tail()}")
        reply = json.loads(line)
        if "error" in reply:
            raise VllmError(reply)
        return reply["result"]

    def tail(self):
        self.log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()[-6000:]

    def close(self):
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def require_vllm():
    """Skips the caller, or fails it under CI=true, when run_python_tests.sh
    has not unpacked vLLM 0.34.0 (every test running vLLM's code calls it)."""
    if not os.path.isfile(os.path.join(VLLM_DIR, "vllm", "__init__.py")):
        message = (f"vLLM {VLLM_VERSION} is not unpacked in {VLLM_DIR}: tests/python/run_python_tests.sh "
                   "installs it (tests/python/requirements-vllm.txt)")
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    """vLLM 0.34.0 in a child process (skipped, or failed under CI=true, when
    run_python_tests.sh has not installed it)."""
    require_vllm()
    child = VllmProcess(str(tmp_path_factory.mktemp("vllm") / "vllm.log"))
    try:
        info = child.call("_vllm_bootstrap")
        # The wheel from VLLM_DIR, with vLLM's own compressed-tensors pin.
        assert info["vllm"] == VLLM_VERSION, info
        assert info["vllm_file"].startswith(VLLM_DIR), info
        assert info["compressed_tensors"] == PINS["compressed-tensors"], info
        yield child
    finally:
        child.close()


# ---------------------------------------------------------------------------
# Parent side: checkpoints patched by the kvcal CLI.
# ---------------------------------------------------------------------------

_CT_FP8 = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "block_structure": None,
           "actorder": None, "observer_kwargs": {}}
# What llm-compressor writes for an FP8 (W8A8, dynamic per-token activations)
# model: kvcal keeps all of it and only adds kv_cache_scheme.
CT_FP8_W8A8 = {"quant_method": "compressed-tensors", "format": "float-quantized",
               "quantization_status": "compressed", "global_compression_ratio": None, "ignore": ["lm_head"],
               "config_groups": {"group_0": {
                   "targets": ["Linear"], "format": "float-quantized", "output_activations": None,
                   "weights": dict(_CT_FP8, strategy="channel", dynamic=False, observer="minmax"),
                   "input_activations": dict(_CT_FP8, strategy="token", dynamic=True, observer=None)}},
               "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {}, "version": "0.12.2"}
MODELOPT_FLAT = {"quant_method": "modelopt", "quant_algo": "FP8", "exclude_modules": ["lm_head"],
                 "producer": {"name": "modelopt", "version": "0.37.0"}}
# A MIXED_PRECISION export (per-layer algorithms): from_config
# (ModelOptMixedPrecisionConfig) makes a KV cache method only from a
# kv_cache_scheme; without one vLLM drops every KV scale.
MODELOPT_MIXED = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",
                  "producer": {"name": "modelopt", "version": "0.37.0"},
                  "quantized_layers": {f"model.layers.{i}.{proj}": {"quant_algo": "FP8"}
                                       for i in range(2) for proj in
                                       ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                        "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                        "mlp.down_proj")}}
MODELOPT_NESTED = {"quant_method": "modelopt",
                   "producer": {"name": "modelopt", "version": "0.29.0"},
                   "quantization": {"quant_algo": "FP8", "exclude_modules": ["lm_head"]}}
_QUARK_FP8 = {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "ch_axis": None, "group_size": None,
              "symmetric": True, "round_method": "half_even", "scale_type": "float", "is_dynamic": False,
              "observer_cls": "PerTensorMinMaxObserver"}
# What Quark exports for an FP8 (weights and activations, per tensor) model
# quantized without a KV cache: an empty kv_cache_group.
QUARK = {"quant_method": "quark",
         "export": {"kv_cache_group": [], "min_kv_scale": 0.0, "pack_method": "reorder",
                    "weight_format": "real_quantized", "weight_merge_groups": None},
         "global_quant_config": {"weight": dict(_QUARK_FP8), "input_tensors": dict(_QUARK_FP8),
                                 "output_tensors": None, "bias": None, "target_device": None},
         "layer_quant_config": {}, "layer_type_quant_config": {}, "exclude": ["lm_head"],
         "algo_config": None, "quant_mode": "eager_mode", "version": "0.10"}


def make_scales(granularity, heads=HEADS, kv_heads=KV_HEADS, seed=0):
    """Distinct positive scales per layer, role and head."""
    rng = np.random.default_rng(seed)
    scales = {}
    for layer in range(LAYERS):
        for role, n in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
            shape = (n, 1, 1) if granularity == "head" else (1,)
            scales[f"model.layers.{layer}.self_attn.{role}_scale"] = \
                rng.uniform(0.01, 0.2, size=shape).astype(np.float32)
    return scales


def write_checkpoint(path, quantization_config=None, head_dim=16):
    from tiny_llama import tiny_llama

    tiny_llama(num_kv_heads=KV_HEADS, heads=HEADS, layers=LAYERS, head_dim=head_dim).save_pretrained(path)
    if quantization_config is not None:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        config["quantization_config"] = quantization_config
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
    return path


def tensor_names(directory):
    from safetensors import safe_open

    names = set()
    for file in os.listdir(directory):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(directory, file), framework="np") as f:
                names.update(f.keys())
    return names


def read_tensors(directory, names):
    from safetensors import safe_open

    found = {}
    for file in os.listdir(directory):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(directory, file), framework="np") as f:
                for key in f.keys():
                    if key in names:
                        found[key] = f.get_tensor(key)
    return found


def kvcal_patch(kvcal_cli, src, scales, granularity, out, target=None, fmt="float8_e4m3fn",
                kv_cache_dtype=None):
    import kvcal

    scales_path = out + ".scales.safetensors"
    kvcal.Scales(scales, granularity=granularity, observer="static_minmax", fmt=fmt).save(scales_path)
    cmd = [kvcal_cli, "patch", "--checkpoint", src, "--scales", scales_path, "--out", out]
    if target:
        cmd += ["--target", target]
    if kv_cache_dtype:
        cmd += ["--kv-cache-dtype", kv_cache_dtype]
    return subprocess.run(cmd, capture_output=True, text=True)


def patched(tmp_path, kvcal_cli, granularity, quantization_config=None, target=None, kv_cache_dtype=None,
            head_dim=16):
    src = write_checkpoint(str(tmp_path / "model"), quantization_config, head_dim)
    scales = make_scales(granularity)
    out = str(tmp_path / "patched")
    result = kvcal_patch(kvcal_cli, src, scales, granularity, out, target, kv_cache_dtype=kv_cache_dtype)
    assert result.returncode == 0, result.stderr
    added = sorted(tensor_names(out) - tensor_names(src))
    return out, scales, added


def per_role(scales):
    """{(layer, role): flat float32 values} of kvcal's scales file."""
    out = {}
    for name, value in scales.items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.self_attn\.([qkv])_scale", name)
        out[(int(m.group(1)), m.group(2))] = np.asarray(value, np.float32).reshape(-1)
    return out


def assert_mapped_to_attention(loaded, added):
    # QuantizationConfig.get_cache_scale_mapper (base_config.py), or Quark's
    # (quark/quark.py QuarkConfig.get_cache_scale_mapper): every name kvcal
    # wrote becomes the attention layer's `self_attn.attn.{q,k,v}_scale`.
    for name, mapped in loaded["mapped"].items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.self_attn\.(?:([qkv])_scale|([qkv])_proj\.\3_scale"
                         r"|([qkv])_proj\.output_scale)", name)
        assert m, name
        role = m.group(2) or m.group(3) or m.group(4)
        assert mapped == f"model.layers.{m.group(1)}.self_attn.attn.{role}_scale", (name, mapped)
    # models/utils.py AutoWeightsLoader.load_weights, called from
    # models/llama.py LlamaForCausalLM/LlamaModel.load_weights: every scale
    # lands in a parameter (nothing dropped, nothing routed to qkv_proj).
    assert loaded["read"] == sorted(added)
    assert loaded["loaded"] == sorted(loaded["mapped"].values())
    assert len(loaded["loaded"]) == 3 * LAYERS


def assert_no_scale_warnings(loaded):
    # quantization/kv_cache.py BaseKVCacheMethod.process_weights_after_loading
    # warns when it falls back to 1.0 or to k_scale for a missing scale.
    for message in loaded["warnings"]:
        if re.match(r"Using uncalibrated q_scale Parameter.* and/or prob_scale 1\.0", message, re.S):
            # The same method with an "fp8" cache: q is kvcal's (the values
            # are checked); prob_scale (softmax output, FP8 attention
            # kernels only) is not something kvcal calibrates.
            continue
        assert not re.search(r"scal", message, re.I), message


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------


def test_skip_layers_argument_keeps_those_layers_unquantized(vllm, kvcal_cli, tmp_path):
    """kvcal-calibrate's skip-layer advice (kvcal.calibrate.skip_layers.argument) as
    vLLM 0.34 reads it: its own parser gives the layer list, and
    Attention.__init__ (extract_layer_index of the layer's prefix) keeps
    exactly those layers' cache in the model dtype ("auto") while the
    others take the checkpoint's FP8 cache with kvcal's scales."""
    import shlex

    from kvcal.calibrate import skip_layers

    line = skip_layers.argument([1])
    assert line == "--kv-cache-dtype-skip-layers 1"
    parsed = vllm.call("_vllm_parse_skip_layers", shlex.split(line))
    assert parsed == {"kv_cache_dtype_skip_layers": ["1"]}
    # Several layers are separate words (nargs="+", strings); a comma list
    # is one string that would match no layer, which is why kvcal never
    # prints one.
    assert vllm.call("_vllm_parse_skip_layers", shlex.split(skip_layers.argument([3, 0]))) == \
        {"kv_cache_dtype_skip_layers": ["0", "3"]}
    assert vllm.call("_vllm_parse_skip_layers", ["--kv-cache-dtype-skip-layers", "0,3"]) == \
        {"kv_cache_dtype_skip_layers": ["0,3"]}
    out, scales, added = patched(tmp_path, kvcal_cli, "tensor")
    loaded = vllm.call("_vllm_load", out, added, "auto", parsed["kv_cache_dtype_skip_layers"])
    assert_mapped_to_attention(loaded, added)
    dtypes = {int(layer): got["kv_cache_dtype"] for layer, got in loaded["layers"].items()}
    assert dtypes == {0: "fp8", 1: "auto"}
    want = per_role(scales)
    assert loaded["layers"]["0"]["_k_scale"] == want[(0, "k")].tolist()


@pytest.mark.parametrize("base", ["unquantized", "fp8-w8a8"])
def test_compressed_tensors_per_tensor(vllm, kvcal_cli, tmp_path, base):
    config = json.loads(json.dumps(CT_FP8_W8A8)) if base == "fp8-w8a8" else None
    out, scales, added = patched(tmp_path, kvcal_cli, "tensor", config)
    loaded = vllm.call("_vllm_load", out, added)

    # config/model.py ModelConfig: the quantization method from config.json.
    assert loaded["quantization"] == "compressed-tensors"
    # compressed_tensors.py CompressedTensorsConfig.from_config accepted it.
    assert loaded["quant_config"] == "CompressedTensorsConfig"
    assert loaded["kv_cache_scheme"]["strategy"] == "tensor"
    # utils/torch_utils.py get_kv_cache_quant_algo_string reads ModelOpt
    # configs only; attention.py Attention.__init__ switches an "auto" cache
    # to fp8 itself because the config has a kv_cache_scheme.
    assert loaded["kv_cache_quant_algo"] is None and loaded["cache_dtype"] == "auto"
    assert_mapped_to_attention(loaded, added)
    want = per_role(scales)
    for layer, got in loaded["layers"].items():
        layer = int(layer)
        assert got["kv_cache_dtype"] == "fp8"
        # CompressedTensorsKVCacheMethod.__init__ ran validate_kv_cache_scheme.
        assert got["quant_method"] == "CompressedTensorsKVCacheMethod"
        for role in "qkv":
            # CompressedTensorsKVCacheMethod.process_weights_after_loading:
            # the buffers and floats the kernels read hold kvcal's values.
            assert got[f"_{role}_scale"] == want[(layer, role)].tolist(), (layer, role)
            assert got[f"_{role}_scale_float"] == float(want[(layer, role)][0]), (layer, role)
    assert_no_scale_warnings(loaded)


def test_compressed_tensors_per_head(vllm, kvcal_cli, tmp_path):
    out, scales, added = patched(tmp_path, kvcal_cli, "head")
    loaded = vllm.call("_vllm_load", out, added)

    # compressed_tensors.py CompressedTensorsConfig.from_config accepted it.
    assert loaded["quant_config"] == "CompressedTensorsConfig"
    assert loaded["kv_cache_scheme"]["strategy"] == "attn_head"
    # model_loader/weight_utils.py get_quant_config: head counts injected
    # (only when config_groups exists, which kvcal writes).
    assert (loaded["total_num_heads"], loaded["total_num_kv_heads"]) == (HEADS, KV_HEADS)
    assert_mapped_to_attention(loaded, added)
    want = per_role(scales)
    group = HEADS // KV_HEADS
    for layer, got in loaded["layers"].items():
        layer = int(layer)
        # attention.py Attention.__init__ (fp8 for a kv_cache_scheme);
        # CompressedTensorsKVCacheMethod.__init__ validated the scheme.
        assert got["kv_cache_dtype"] == "fp8"
        assert got["quant_method"] == "CompressedTensorsKVCacheMethod"
        # CompressedTensorsKVCacheMethod.create_weights' _tp_aware_loader:
        # k and v one per KV head; q (num_attention_heads values, as kvcal
        # writes it) reduced by amax over view(-1, H // KV).
        assert got["_k_scale"] == want[(layer, "k")].tolist()
        assert got["_v_scale"] == want[(layer, "v")].tolist()
        q = want[(layer, "q")]
        assert q.size == HEADS
        assert got["_q_scale"] == q.reshape(-1, group).max(axis=1).tolist()
        # process_weights_after_loading: the floats are the maxima.
        for role in "qkv":
            assert got[f"_{role}_scale_float"] == float(want[(layer, role)].max()), (layer, role)
    assert_no_scale_warnings(loaded)


@pytest.mark.parametrize("form", ["flat", "mixed", "nested"])
def test_modelopt(vllm, kvcal_cli, tmp_path, form):
    config = {"flat": MODELOPT_FLAT, "mixed": MODELOPT_MIXED, "nested": MODELOPT_NESTED}[form]
    out, scales, added = patched(tmp_path, kvcal_cli, "tensor", json.loads(json.dumps(config)), "modelopt")
    assert sorted(added) == sorted(
        [f"model.layers.{i}.self_attn.q_scale" for i in range(LAYERS)]
        + [f"model.layers.{i}.self_attn.{r}_proj.{r}_scale" for i in range(LAYERS) for r in "kv"])
    loaded = vllm.call("_vllm_load", out, added)

    # config/model.py ModelConfig (ModelOptMixedPrecisionConfig.
    # override_quantization_method for MIXED_PRECISION).
    assert loaded["quantization"] == ("modelopt_mixed" if form == "mixed" else "modelopt")
    # modelopt.py ModelOptQuantConfigBase.from_config accepted it and read
    # the KV cache algorithm from what kvcal wrote (flat: kv_cache_scheme;
    # nested: quantization.kv_cache_quant_algo).
    assert loaded["quant_config"] == ("ModelOptMixedPrecisionConfig" if form == "mixed"
                                      else "ModelOptFp8Config")
    assert loaded["kv_cache_quant_method"] == "FP8"
    # utils/torch_utils.py get_kv_cache_quant_algo_string: the flat form's
    # kv_cache_scheme dict / the nested quantization.kv_cache_quant_algo
    # "FP8" make `--kv-cache-dtype auto` an fp8 (e4m3) cache
    # (MODELOPT_TO_VLLM_KV_CACHE_DTYPE_MAP: "fp8" -> "fp8_e4m3").
    assert loaded["kv_cache_quant_algo"] == "fp8_e4m3"
    assert loaded["cache_dtype"] == "fp8_e4m3"
    assert_mapped_to_attention(loaded, added)
    want = per_role(scales)
    for layer, got in loaded["layers"].items():
        layer = int(layer)
        assert got["kv_cache_dtype"] == "fp8_e4m3"
        # modelopt.py ModelOptFp8Config.get_quant_method: the KV cache method
        # for Attention layers (created from the kv_cache_scheme / algo).
        assert got["quant_method"] == "ModelOptKVCacheMethod"
        for role in "qkv":
            # quantization/kv_cache.py BaseKVCacheMethod.process_weights_after_loading
            assert got[f"_{role}_scale_float"] == float(want[(layer, role)][0]), (layer, role)
            assert got[f"_{role}_scale"] == want[(layer, role)].tolist(), (layer, role)
    assert_no_scale_warnings(loaded)


def test_quark(vllm, kvcal_cli, tmp_path):
    out, scales, added = patched(tmp_path, kvcal_cli, "tensor", json.loads(json.dumps(QUARK)), "quark")
    assert sorted(added) == sorted(f"model.layers.{i}.self_attn.{r}_proj.output_scale"
                                   for i in range(LAYERS) for r in "qkv")
    # Nothing switches the cache to fp8 for Quark: users pass --kv-cache-dtype fp8.
    loaded = vllm.call("_vllm_load", out, added, "fp8")

    assert loaded["quantization"] == "quark"
    # quark/quark.py QuarkConfig.from_config: export.kv_cache_group matched
    # by layer_quant_config entries with one fp8_e4m3 per_tensor output.
    assert loaded["quant_config"] == "QuarkConfig"
    assert loaded["kv_cache_group"] == ["*k_proj", "*v_proj"]
    assert loaded["kv_cache_config"]["dtype"] == "fp8_e4m3"
    assert loaded["kv_cache_config"]["qscheme"] == "per_tensor"
    # utils/torch_utils.py get_kv_cache_quant_algo_string: nothing for Quark.
    assert loaded["kv_cache_quant_algo"] is None
    assert_mapped_to_attention(loaded, added)
    want = per_role(scales)
    for layer, got in loaded["layers"].items():
        layer = int(layer)
        assert got["kv_cache_dtype"] == "fp8"
        # QuarkConfig.get_quant_method: QuarkKVCacheMethod for Attention
        # (its validate_kv_cache_config accepted the output_tensors).
        assert got["quant_method"] == "QuarkKVCacheMethod"
        for role in "qkv":
            # quantization/kv_cache.py BaseKVCacheMethod.process_weights_after_loading
            assert got[f"_{role}_scale_float"] == float(want[(layer, role)][0]), (layer, role)
            assert got[f"_{role}_scale"] == want[(layer, role)].tolist(), (layer, role)
    assert_no_scale_warnings(loaded)


def test_int8_kv_cache_scheme_is_refused_by_vllm_and_kvcal(vllm, kvcal_cli, tmp_path):
    int8 = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": False, "strategy": "tensor"}
    # compressed_tensors.py CompressedTensorsKVCacheMethod.validate_kv_cache_scheme
    with pytest.raises(VllmError) as refused:
        vllm.call("_vllm_validate_kv_cache_scheme", int8)
    assert refused.value.type == "NotImplementedError"
    assert "num_bits=8, type=float" in refused.value.message
    # The float/8 scheme kvcal writes passes the same validator.
    fp8 = dict(int8, type="float")
    assert vllm.call("_vllm_validate_kv_cache_scheme", fp8) == "accepted"

    # A checkpoint with an int8 scheme stops vLLM while it builds the
    # attention layers (CompressedTensorsKVCacheMethod.__init__) ...
    out, scales, added = patched(tmp_path, kvcal_cli, "tensor")
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"]["kv_cache_scheme"].update(type="int")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(VllmError) as stopped:
        vllm.call("_vllm_load", out, added)
    assert stopped.value.type == "NotImplementedError", stopped.value
    # ... so kvcal refuses int8 scales instead of writing one.
    src = write_checkpoint(str(tmp_path / "model-int8"))
    result = kvcal_patch(kvcal_cli, src, make_scales("tensor"), "tensor", str(tmp_path / "int8"), fmt="int8")
    assert result.returncode != 0
    assert "int8" in result.stderr, result.stderr
    assert not os.path.exists(str(tmp_path / "int8"))


def test_q_reduced_per_kv_group_loads_wrong_in_vllm_and_kvcal_refuses_it(vllm, kvcal_cli, tmp_path):
    out, scales, added = patched(tmp_path, kvcal_cli, "head")
    # Rewrite q with one value per KV head (what a reduced q would be).
    from safetensors.numpy import load_file, save_file

    path = os.path.join(out, "model.safetensors")
    tensors = load_file(path)
    reduced = {}
    for name in list(tensors):
        if name.endswith("self_attn.q_scale"):
            q = tensors[name].reshape(-1)
            reduced[name] = q.reshape(KV_HEADS, -1).max(axis=1)
            tensors[name] = reduced[name].reshape(KV_HEADS, 1, 1)
    save_file(tensors, path, metadata={"format": "pt"})
    loaded = vllm.call("_vllm_load", out, added)
    # compressed_tensors.py CompressedTensorsKVCacheMethod.create_weights'
    # _tp_aware_loader reduces it once more (view(-1, H // KV) of KV values:
    # one value), slices it and copy_ broadcasts that value to every KV head:
    # vLLM starts, without an error or a warning, with q scales that are not
    # the ones calibrated.
    for layer, got in loaded["layers"].items():
        name = f"model.layers.{layer}.self_attn.q_scale"
        assert got["_q_scale"] == [float(reduced[name].max())] * KV_HEADS
        assert got["_q_scale"] != reduced[name].tolist()
    assert_no_scale_warnings(loaded)
    # kvcal refuses such scales.
    scales = make_scales("head")
    for name in list(scales):
        if name.endswith("q_scale"):
            scales[name] = scales[name].reshape(KV_HEADS, -1).max(axis=1).reshape(KV_HEADS, 1, 1)
    src = write_checkpoint(str(tmp_path / "model-reduced"))
    result = kvcal_patch(kvcal_cli, src, scales, "head", str(tmp_path / "reduced"))
    assert result.returncode != 0, result.stdout
    assert "per KV group" in result.stderr or "per-kv-group" in result.stderr, result.stderr
    assert not os.path.exists(str(tmp_path / "reduced"))


# ---------------------------------------------------------------------------
# NVFP4 KV caches (`kvcal patch --kv-cache-dtype nvfp4`)
# ---------------------------------------------------------------------------

# FlashInfer, the only vLLM 0.34 backend with an NVFP4 cache, serves head
# sizes 64, 128, 256 and 512 (kvcal refuses to patch others).
NVFP4_HEAD_DIM = 64


def nvfp4_patched(tmp_path, kvcal_cli, form):
    config = {"flat": MODELOPT_FLAT, "nested": MODELOPT_NESTED}[form]
    return patched(tmp_path, kvcal_cli, "tensor", json.loads(json.dumps(config)), "modelopt",
                   kv_cache_dtype="nvfp4", head_dim=NVFP4_HEAD_DIM)


@pytest.mark.parametrize("flag", ["auto", "nvfp4"])
@pytest.mark.parametrize("form", ["flat", "nested"])
def test_modelopt_nvfp4(vllm, kvcal_cli, tmp_path, form, flag):
    """What `kvcal patch --target modelopt --kv-cache-dtype nvfp4` writes
    makes vLLM 0.34 run an NVFP4 cache, with `--kv-cache-dtype auto` (the
    checkpoint decides) as with `--kv-cache-dtype nvfp4`, and load every
    k_scale/v_scale (the NVFP4 global scales, 1 / k_scale) and q_scale into
    the attention layers exactly as written."""
    out, scales, added = nvfp4_patched(tmp_path, kvcal_cli, form)
    with open(os.path.join(out, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    if form == "flat":
        assert (qc["kv_cache_scheme"]["num_bits"], qc["kv_cache_scheme"]["type"]) == (4, "float")
    else:
        assert qc["quantization"]["kv_cache_quant_algo"] == "NVFP4"
    loaded = vllm.call("_vllm_load", out, added, flag)

    assert loaded["quantization"] == "modelopt"
    assert loaded["quant_config"] == "ModelOptFp8Config"
    # modelopt.py ModelOptQuantConfigBase.from_config: the nested form reads
    # kv_cache_quant_algo; the flat form makes an algorithm of a num_bits 8
    # scheme only. Neither matters to a non-mixed config, whose
    # get_quant_method gives every Attention its KV-cache method.
    assert loaded["kv_cache_quant_method"] == ("NVFP4" if form == "nested" else None)
    # utils/torch_utils.py get_kv_cache_quant_algo_string: {num_bits 4,
    # type float} / "NVFP4" -> "nvfp4"; resolve_kv_cache_dtype_string makes
    # `auto` that cache.
    assert loaded["kv_cache_quant_algo"] == "nvfp4"
    assert loaded["cache_dtype"] == "nvfp4"
    assert_mapped_to_attention(loaded, added)
    want = per_role(scales)
    for layer, got in loaded["layers"].items():
        layer = int(layer)
        assert got["kv_cache_dtype"] == "nvfp4"
        assert got["quant_method"] == "ModelOptKVCacheMethod"
        for role in "qkv":
            # quantization/kv_cache.py BaseKVCacheMethod.process_weights_after_loading
            # (is_quantized_kv_cache("nvfp4")): the scalars the NVFP4 store
            # kernels read (FlashInferImpl passes layer._k_scale/_v_scale).
            assert got[f"_{role}_scale_float"] == float(want[(layer, role)][0]), (layer, role)
            assert got[f"_{role}_scale"] == want[(layer, role)].tolist(), (layer, role)
    assert_no_scale_warnings(loaded)


def test_nvfp4_per_head_is_refused_by_vllm_and_kvcal(vllm, kvcal_cli, tmp_path):
    out, scales, added = nvfp4_patched(tmp_path, kvcal_cli, "flat")
    # One k_scale per KV head, as a per-head calibration would give.
    from safetensors.numpy import load_file, save_file

    for file in os.listdir(out):
        if not file.endswith(".safetensors"):
            continue
        path = os.path.join(out, file)
        tensors = load_file(path)
        changed = False
        for name in list(tensors):
            if name.endswith("k_proj.k_scale"):
                tensors[name] = np.full((KV_HEADS,), tensors[name].reshape(-1)[0], np.float32)
                changed = True
        if changed:
            save_file(tensors, path, metadata={"format": "pt"})
    # quantization/kv_cache.py KVCacheScaleParameter.weight_loader.
    with pytest.raises(VllmError) as refused:
        vllm.call("_vllm_load", out, added)
    assert refused.value.type == "ValueError"
    assert "KV-cache scale expects a scalar weight" in refused.value.message
    # kvcal refuses per-head scales for an NVFP4 cache, writing nothing.
    src = write_checkpoint(str(tmp_path / "model-head"), json.loads(json.dumps(MODELOPT_FLAT)),
                           NVFP4_HEAD_DIM)
    result = kvcal_patch(kvcal_cli, src, make_scales("head"), "head", str(tmp_path / "head"), "modelopt",
                         kv_cache_dtype="nvfp4")
    assert result.returncode != 0, result.stdout
    assert "NVFP4 KV cache takes per-tensor scales only" in result.stderr, result.stderr
    assert not os.path.exists(str(tmp_path / "head"))


def test_nvfp4_is_refused_for_compressed_tensors_and_quark(vllm, kvcal_cli, tmp_path):
    nvfp4 = {"num_bits": 4, "type": "float", "symmetric": True, "dynamic": False, "strategy": "tensor"}
    # compressed_tensors.py CompressedTensorsKVCacheMethod.validate_kv_cache_scheme
    with pytest.raises(VllmError) as refused:
        vllm.call("_vllm_validate_kv_cache_scheme", nvfp4)
    assert refused.value.type == "NotImplementedError"
    assert "num_bits=4" in refused.value.message
    # quark/quark.py QuarkKVCacheMethod.validate_kv_cache_config
    with pytest.raises(VllmError) as refused:
        vllm.call("_vllm_validate_quark_kv_cache_config", dict(_QUARK_FP8, dtype="fp4"))
    assert refused.value.type == "NotImplementedError"
    assert "dtype=fp8_e4m3" in refused.value.message
    for target, config, rule in (
            ("compressed-tensors", None, "CompressedTensorsKVCacheMethod.validate_kv_cache_scheme"),
            ("quark", QUARK, "QuarkKVCacheMethod.validate_kv_cache_config")):
        src = write_checkpoint(str(tmp_path / f"model-{target}"), json.loads(json.dumps(config)),
                               NVFP4_HEAD_DIM)
        out = str(tmp_path / f"out-{target}")
        result = kvcal_patch(kvcal_cli, src, make_scales("tensor"), "tensor", out, target,
                             kv_cache_dtype="nvfp4")
        assert result.returncode != 0, result.stdout
        assert rule in result.stderr, result.stderr
        assert not os.path.exists(out)


def test_compressed_tensors_fp8_checkpoint_runs_an_nvfp4_cache_when_asked(vllm, kvcal_cli, tmp_path):
    """What kvcal's compressed-tensors refusal suggests: an FP8 per-tensor
    checkpoint started with `--kv-cache-dtype nvfp4` runs an NVFP4 cache
    with the same scales as its global scales."""
    out, scales, added = patched(tmp_path, kvcal_cli, "tensor", head_dim=NVFP4_HEAD_DIM)
    loaded = vllm.call("_vllm_load", out, added, "nvfp4")
    assert loaded["cache_dtype"] == "nvfp4"
    want = per_role(scales)
    for layer, got in loaded["layers"].items():
        layer = int(layer)
        # attention.py Attention.__init__: a kv_cache_scheme switches only
        # an "auto" cache to fp8; the flag wins.
        assert got["kv_cache_dtype"] == "nvfp4"
        assert got["quant_method"] == "CompressedTensorsKVCacheMethod"
        for role in "kv":
            assert got[f"_{role}_scale_float"] == float(want[(layer, role)][0]), (layer, role)


def test_modelopt_mixed_precision_flat_drops_nvfp4_scales_so_kvcal_refuses(vllm, kvcal_cli, tmp_path):
    # An FP8 patch of the flat MIXED_PRECISION config, its scheme then made
    # NVFP4 (num_bits 4) by hand.
    out, scales, added = patched(tmp_path, kvcal_cli, "tensor", json.loads(json.dumps(MODELOPT_MIXED)),
                                 "modelopt", head_dim=NVFP4_HEAD_DIM)
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"]["kv_cache_scheme"]["num_bits"] = 4
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    loaded = vllm.call("_vllm_load", out, added)
    # The cache is nvfp4 (get_kv_cache_quant_algo_string), but from_config
    # made no KV algorithm of the scheme, so ModelOptMixedPrecisionConfig.
    # get_quant_method gives the layers no KV-cache method: every scale 1.0.
    assert loaded["cache_dtype"] == "nvfp4"
    assert loaded["kv_cache_quant_method"] is None
    for got in loaded["layers"].values():
        assert got["kv_cache_dtype"] == "nvfp4"
        assert got["_k_scale_float"] == 1.0 and got["_v_scale_float"] == 1.0
    # kvcal refuses that patch.
    src = write_checkpoint(str(tmp_path / "model-mixed"), json.loads(json.dumps(MODELOPT_MIXED)),
                           NVFP4_HEAD_DIM)
    result = kvcal_patch(kvcal_cli, src, make_scales("tensor"), "tensor", str(tmp_path / "mixed"), "modelopt",
                         kv_cache_dtype="nvfp4")
    assert result.returncode != 0, result.stdout
    assert "MIXED_PRECISION" in result.stderr, result.stderr
    assert not os.path.exists(str(tmp_path / "mixed"))
