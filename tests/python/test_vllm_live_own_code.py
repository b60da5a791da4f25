"""kvcal.vllm.update_attention_scales on vLLM 0.34.0's own attention layers.

test_vllm_live.py checks update_attention_scales against a hand-written
stand-in of vLLM's layers (vllm_standin.py); this module checks it against
vLLM's real code, in the child process of test_vllm_own_code.py (vLLM's wheel
from .venv/vllm-0.34.0/ first on sys.path, a one-rank gloo group; see that
module's docstring and tests/README.md). For each loading path:

- compressed-tensors `tensor` and `attn_head` (8 query heads, 2 KV heads),
  ModelOpt and Quark (vLLM's BaseKVCacheMethod),

the child builds real `Attention` layers (TRITON_ATTN, CPU) and loads the
scales S1 of a checkpoint `kvcal patch` wrote through vLLM's own loader
(LlamaForCausalLM.load_weights -> AutoWeightsLoader -> the weight loaders ->
process_weights_after_loading: test_vllm_own_code._vllm_load, unchanged),
then calls update_attention_scales(model, S2) on them and loads S2 the same
way into fresh layers. Everything scale-related on a layer must then be
bitwise what the fresh load of S2 left: the `_q_scale`/`_k_scale`/`_v_scale`
(and `_prob_scale`) buffers, the `q_scale`/`k_scale`/`v_scale` parameters
and the zero points, `_{q,k,v}_scale_float`, `_k_scale_cpu`/`_v_scale_cpu`
and any other attribute of the layer or its backend impl whose name says
"scale" (dtype, shape, device, bytes; floats by type and hex), and whether a
buffer shares its parameter's storage. The buffer and parameter objects
stay the same objects on the same storage (CUDA graphs captured them). An
update that is refused (NaN, wrong head count, per-head scales for a
per-tensor layer) raises and changes none of it.

Tensor parallelism: vLLM's per-head loader slices by
get_tensor_model_parallel_rank()/world_size(), and more than one rank needs
one process per rank in a process group; this module runs tp_size 1 only
(given as tp_rank=0, tp_size=1, and once read from vLLM's own group). The
slicing for tp_size 2 and 4 is covered against the stand-in in
test_vllm_live.py.
"""
import json
import os
import re

import numpy as np
import pytest

import test_vllm_own_code as own

HERE = os.path.dirname(os.path.abspath(__file__))
HEADS, KV_HEADS, LAYERS = 8, 2, own.LAYERS

# ---------------------------------------------------------------------------
# Child side: runs with vLLM first on sys.path (imports this module there).
# ---------------------------------------------------------------------------

_vllm_bootstrap = own._vllm_bootstrap
_vllm_shutdown = own._vllm_shutdown
# Attributes vLLM 0.34's attention reads after loading (attention.py,
# quantization/kv_cache.py, compressed_tensors.py); each must be present.
READ_BY_VLLM = (["buffer _q_scale", "buffer _k_scale", "buffer _v_scale",
                 "value _q_scale_float", "value _k_scale_float", "value _v_scale_float",
                 "tensor _k_scale_cpu", "tensor _v_scale_cpu",
                 "parameter q_scale", "parameter k_scale", "parameter v_scale"])
IDENTITIES = ("_q_scale", "_k_scale", "_v_scale", "_prob_scale", "_k_scale_cpu", "_v_scale_cpu",
              "q_scale", "k_scale", "v_scale")


def _load_model(checkpoint, scale_names, kv_cache_dtype):
    """test_vllm_own_code._vllm_load (vLLM's config, real Attention layers,
    load_weights, process_weights_after_loading), keeping the model it built:
    vLLM's process_weights_after_loading is wrapped for the call to see which
    model it processes."""
    from vllm.model_executor.model_loader import utils

    original = utils.process_weights_after_loading
    built = []

    def keep(model, model_config, target_device):
        built.append(model)
        return original(model, model_config, target_device)

    utils.process_weights_after_loading = keep
    try:
        loaded = own._vllm_load(checkpoint, scale_names, kv_cache_dtype)
    finally:
        utils.process_weights_after_loading = original
    assert len(built) == 1, built
    return built[0], loaded


def _attention(model):
    return [layer.self_attn.attn for layer in model.model.layers]


def _bits(t):
    import torch

    t = t.detach()
    raw = t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes().hex()
    return [str(t.dtype), list(t.shape), t.device.type, raw]


def _plain(value):
    import torch

    if isinstance(value, torch.Tensor):
        return _bits(value)
    if isinstance(value, float):
        return ["float", value.hex()]
    if value is None or isinstance(value, (bool, int, str)):
        return [type(value).__name__, value]
    return [type(value).__name__, repr(value)]


def _state(model):
    """{layer name: {what: bits}} of everything scale-related on each layer."""
    import torch

    out = {}
    for attn in _attention(model):
        entry = {}
        for name, buf in attn.named_buffers(recurse=False):
            entry["buffer " + name] = _bits(buf)
        for name, param in attn.named_parameters(recurse=False):
            entry["parameter " + name] = _bits(param) + [type(param).__name__, param.requires_grad]
        for name, value in vars(attn).items():
            if "scale" in name and not name.startswith("_parameters") and not name.startswith("_buffers"):
                entry[("tensor " if isinstance(value, torch.Tensor) else "value ") + name] = _plain(value)
        impl = getattr(attn, "impl", None)
        for name, value in (vars(impl).items() if impl is not None else ()):
            if "scale" in name:
                entry["impl " + name] = _plain(value)
        for role in "qkv":
            buf, param = getattr(attn, f"_{role}_scale"), getattr(attn, f"{role}_scale")
            entry[f"_{role}_scale on {role}_scale's storage"] = buf.data_ptr() == param.data_ptr()
        out[attn.layer_name] = entry
    return out


def _identities(model):
    return {f"{attn.layer_name} {name}": [id(getattr(attn, name)), getattr(attn, name).data_ptr()]
            for attn in _attention(model) for name in IDENTITIES}


def _scales(spec):
    """A kvcal.Scales from a scales file (as Scales.load reads it) or from
    {granularity, tensors: {name: nested list}} (JSON carries NaN)."""
    import kvcal

    if "path" in spec:
        return kvcal.Scales.load(spec["path"])
    return kvcal.Scales({name: np.asarray(value, np.float32) for name, value in spec["tensors"].items()},
                        granularity=spec["granularity"], observer="static_minmax")


def _update(model, spec, tp):
    import kvcal.vllm

    kw = dict(tp_rank=0, tp_size=1) if tp == "given" else {}
    return kvcal.vllm.update_attention_scales(model, _scales(spec), **kw)


def _vllm_live_update(s1_dir, s2_dir, scale_names, kv_cache_dtype, s2, tp):
    """Loads S1, pushes S2 into those layers, loads S2 fresh; returns what
    each layer held before and after the push and what the fresh load left."""
    live, loaded = _load_model(s1_dir, scale_names, kv_cache_dtype)
    before, ids = _state(live), _identities(live)
    changes = _update(live, s2, tp)
    fresh, _ = _load_model(s2_dir, scale_names, kv_cache_dtype)

    def buffers(model):
        return {attn.layer_name: {r: getattr(attn, f"_{r}_scale").reshape(-1).tolist() for r in "qkv"}
                for attn in _attention(model)}

    return {"quant_methods": sorted({layer["quant_method"] for layer in loaded["layers"].values()}),
            "before": before, "after": _state(live), "fresh": _state(fresh),
            "same_objects": ids == _identities(live), "fresh_buffers": buffers(fresh),
            "changes": [[c.layer, c.module, c.role, list(c.old), list(c.new), c.changed]
                        for c in changes]}


def _vllm_refused_updates(s1_dir, scale_names, kv_cache_dtype, bad):
    """Loads S1 and tries each of the `bad` scales; returns the error and
    whether anything on the layers changed, for each."""
    live, _ = _load_model(s1_dir, scale_names, kv_cache_dtype)
    before, ids = _state(live), _identities(live)
    out = []
    for spec in bad:
        try:
            _update(live, spec, "given")
            error = None
        except ValueError as e:
            error = str(e)
        out.append({"error": error, "unchanged": _state(live) == before,
                    "same_objects": _identities(live) == ids})
    return out


# ---------------------------------------------------------------------------
# Parent side.
# ---------------------------------------------------------------------------


class _Child(own.VllmProcess):
    """test_vllm_own_code's child process, running this module's `_vllm_*`
    functions."""

    def __init__(self, log_path):
        super().__init__(log_path, module=__name__, tests_dir=HERE)


@pytest.fixture(scope="module")
def vllm_child(tmp_path_factory):
    """vLLM 0.34.0 in a child process (skipped, or failed under CI=true, when
    run_python_tests.sh has not installed it)."""
    own.require_vllm()
    child = _Child(str(tmp_path_factory.mktemp("vllm") / "vllm.log"))
    try:
        info = child.call("_vllm_bootstrap")
        assert info["vllm"] == own.VLLM_VERSION, info
        assert info["vllm_file"].startswith(own.VLLM_DIR), info
        assert info["compressed_tensors"] == own.PINS["compressed-tensors"], info
        yield child
    finally:
        child.close()


# name: (quantization_config of the model, kvcal patch --target, granularity,
#        --kv-cache-dtype, vLLM's KV cache method class)
CASES = {
    "compressed-tensors-tensor": (None, None, "tensor", "auto", "CompressedTensorsKVCacheMethod"),
    "compressed-tensors-attn_head": (None, None, "head", "auto", "CompressedTensorsKVCacheMethod"),
    "modelopt": (own.MODELOPT_FLAT, "modelopt", "tensor", "auto", "ModelOptKVCacheMethod"),
    "quark": (own.QUARK, "quark", "tensor", "fp8", "QuarkKVCacheMethod"),
}


def _patched(tmp_path, kvcal_cli, case, seed):
    """A checkpoint (8 query heads, 2 KV heads) with scales `seed` written by
    `kvcal patch`; returns (directory, scales file, scale tensors added)."""
    from tiny_llama import tiny_llama

    config, target, granularity, _, _ = CASES[case]
    src = str(tmp_path / "model")
    if not os.path.isdir(src):
        tiny_llama(num_kv_heads=KV_HEADS, heads=HEADS, layers=LAYERS).save_pretrained(src)
        if config is not None:
            with open(os.path.join(src, "config.json")) as f:
                full = json.load(f)
            full["quantization_config"] = json.loads(json.dumps(config))
            with open(os.path.join(src, "config.json"), "w") as f:
                json.dump(full, f, indent=2)
    scales = own.make_scales(granularity, heads=HEADS, kv_heads=KV_HEADS, seed=seed)
    out = str(tmp_path / f"patched-{seed}")
    result = own.kvcal_patch(kvcal_cli, src, scales, granularity, out, target)
    assert result.returncode == 0, result.stderr
    added = sorted(own.tensor_names(out) - own.tensor_names(src))
    return out, out + ".scales.safetensors", added, scales


def _spec(scales, granularity):
    return {"granularity": granularity,
            "tensors": {name: np.asarray(v, np.float32).tolist() for name, v in scales.items()}}


@pytest.mark.parametrize("case,tp", [(case, "given") for case in CASES]
                         + [("compressed-tensors-attn_head", "from vLLM")])
def test_update_leaves_what_a_fresh_load_leaves(vllm_child, kvcal_cli, tmp_path, case, tp):
    _, _, granularity, cache, method = CASES[case]
    s1_dir, _, added, _ = _patched(tmp_path, kvcal_cli, case, seed=1)
    s2_dir, s2_path, added2, s2 = _patched(tmp_path, kvcal_cli, case, seed=2)
    assert added == added2
    got = vllm_child.call("_vllm_live_update", s1_dir, s2_dir, added, cache, {"path": s2_path}, tp)

    assert got["quant_methods"] == [method]
    before, after, fresh = got["before"], got["after"], got["fresh"]
    assert sorted(after) == [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    for layer, entry in after.items():
        missing = [name for name in READ_BY_VLLM if name not in entry]
        assert not missing, (layer, missing)
        # Bitwise what vLLM's load of S2 leaves, attribute by attribute.
        assert entry.keys() == fresh[layer].keys(), layer
        for name in entry:
            assert entry[name] == fresh[layer][name], (layer, name, before[layer][name])
        for role in "qkv":
            assert entry[f"buffer _{role}_scale"] != before[layer][f"buffer _{role}_scale"], (layer, role)
    # The same tensor objects on the same storage.
    assert got["same_objects"]
    # What changed, per (layer, role): old as S1 loaded, new as S2 loads.
    changes = got["changes"]
    assert [(c[0], c[2]) for c in changes] == [(i, r) for i in range(LAYERS) for r in "qkv"]
    for index, module, role, old, new, changed in changes:
        assert module == f"model.layers.{index}.self_attn.attn"
        assert new == got["fresh_buffers"][module][role]
        assert bytes.fromhex(before[module][f"buffer _{role}_scale"][3]) == \
            np.asarray(old, np.float32).tobytes()
        assert changed
    if granularity == "head":
        # The per-head path: k/v one per KV head, q reduced per KV group.
        k = s2["model.layers.1.self_attn.k_scale"].reshape(-1)
        q = s2["model.layers.1.self_attn.q_scale"].reshape(-1)
        assert got["fresh_buffers"]["model.layers.1.self_attn.attn"]["k"] == k.tolist()
        assert got["fresh_buffers"]["model.layers.1.self_attn.attn"]["q"] == \
            q.reshape(KV_HEADS, -1).max(axis=1).tolist()


def _bad_sets(case, s2):
    """(what, expected message, scales) that update_attention_scales must refuse."""
    granularity = CASES[case][2]
    out = []
    for role in "qkv":
        bad = {k: v.copy() for k, v in s2.items()}
        bad[f"model.layers.1.self_attn.{role}_scale"].reshape(-1)[-1] = np.nan
        out.append((f"NaN {role}", rf"layer 1 .* {role}(\[\d\])? = nan.*finite and > 0",
                    _spec(bad, granularity)))

    def with_heads(role, n):
        bad = dict(s2)
        bad[f"model.layers.1.self_attn.{role}_scale"] = np.full((n, 1, 1), 0.05, np.float32)
        return _spec(bad, "head")

    if granularity == "head":
        out += [("3 KV heads for k", r"layer 1 .* k: 3 scales; the model has 2", with_heads("k", 3)),
                ("1 KV head for v", r"layer 1 .* v: 1 scales; the model has 2", with_heads("v", 1)),
                ("3 query heads", r"layer 1 .* q: 3 scales; the model has 8 .* or 2", with_heads("q", 3)),
                ("16 query heads", r"layer 1 .* q: 16 scales", with_heads("q", 16))]
    else:
        per_head = own.make_scales("head", heads=HEADS, kv_heads=KV_HEADS, seed=3)
        out += [("per-head scales", r"layer 0 .* q: 8 per-head scales for a per-tensor layer",
                 _spec(per_head, "head")),
                ("2 heads for k", r"layer 1 .* k: 2 per-head scales for a per-tensor layer",
                 with_heads("k", 2))]
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_refused_update_changes_nothing(vllm_child, kvcal_cli, tmp_path, case):
    cache = CASES[case][3]
    s1_dir, _, added, _ = _patched(tmp_path, kvcal_cli, case, seed=1)
    s2 = own.make_scales(CASES[case][2], heads=HEADS, kv_heads=KV_HEADS, seed=2)
    bad = _bad_sets(case, s2)
    results = vllm_child.call("_vllm_refused_updates", s1_dir, added, cache, [spec for _, _, spec in bad])

    for (what, pattern, _), result in zip(bad, results):
        assert result["error"] is not None, what
        assert re.search(pattern, result["error"]), (what, result["error"])
        assert "nothing was changed" in result["error"], (what, result["error"])
        assert result["unchanged"] and result["same_objects"], what
