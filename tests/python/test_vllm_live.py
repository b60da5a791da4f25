"""kvcal.vllm.update_attention_scales against a stand-in of vLLM 0.34's
attention layers (vllm_standin.py): pushing scales S2 into layers that loaded
S1 must leave exactly what loading S2 from a checkpoint leaves, bit for bit;
invalid scales must change nothing at all."""
import math
import warnings

import numpy as np
import pytest
import torch

import kvcal
import kvcal.vllm
from kvcal.vllm import update_attention_scales
from vllm_standin import (attention_layers, build_model, checkpoint_tensors,
                          load_checkpoint)

HEADS, KV_HEADS, LAYERS = 8, 2, 2

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: the CUDA variant is skipped"))]

# (stand-in method, compressed-tensors strategy, granularity of the scales)
LOADERS = [("compressed-tensors", "tensor", "tensor"),
           ("compressed-tensors", "attn_head", "head"),
           ("modelopt", None, "tensor"),
           ("quark", None, "tensor")]
TP = [(size, rank) for size in (1, 2, 4) for rank in range(size)]


def make_scales(seed, granularity, layers=LAYERS, roles="qkv"):
    """kvcal.Scales as client.finalize() returns them: float32, [1] per tensor,
    [heads, 1, 1] per head; every value different."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(layers):
        for role in roles:
            n = 1 if granularity == "tensor" else (HEADS if role == "q" else KV_HEADS)
            values = rng.uniform(1e-3, 0.5, size=n).astype(np.float32)
            shape = (n, 1, 1) if granularity == "head" else (1,)
            tensors[f"model.layers.{layer}.self_attn.{role}_scale"] = values.reshape(shape)
    return kvcal.Scales(tensors, granularity=granularity, observer="static_minmax")


def loaded(method, strategy, scales, **kw):
    model = build_model(method, strategy=strategy, num_layers=LAYERS, num_heads=HEADS,
                        num_kv_heads=KV_HEADS, **kw)
    load_checkpoint(model, checkpoint_tensors(scales, method))
    return model


SCALAR_ATTRS = ("_q_scale_float", "_k_scale_float", "_v_scale_float", "_prob_scale_float",
                "_o_scale_float")
TENSOR_ATTRS = ("_k_scale_cpu", "_v_scale_cpu")


def _bits(t):
    t = t.detach()
    return (str(t.dtype), tuple(t.shape), t.device.type, t.cpu().contiguous().numpy().tobytes())


def state(model):
    """Everything a layer holds about scales, bitwise: buffers, parameters,
    floats (with their type) and host copies."""
    out = {}
    for layer in attention_layers(model):
        entry = {}
        for name, buf in layer.named_buffers(recurse=False):
            entry["buffer " + name] = _bits(buf)
        for name, param in layer.named_parameters(recurse=False):
            entry["param " + name] = _bits(param)
        for name in SCALAR_ATTRS:
            value = getattr(layer, name)
            entry[name] = None if value is None else (type(value).__name__, float(value).hex())
        for name in TENSOR_ATTRS:
            entry[name] = _bits(getattr(layer, name))
        out[layer.layer_name] = entry
    return out


def identities(model):
    """The tensor objects (and their storage) that CUDA graphs may hold."""
    out = {}
    for layer in attention_layers(model):
        for name in ("_q_scale", "_k_scale", "_v_scale", "_prob_scale", "_k_scale_cpu",
                     "_v_scale_cpu", "q_scale", "k_scale", "v_scale"):
            t = getattr(layer, name)
            out[(layer.layer_name, name)] = (id(t), t.data_ptr())
    return out


def values(t):
    return tuple(float(v) for v in t.detach().cpu().reshape(-1).tolist())


# -- the stand-in loads as vLLM 0.34 does (values worked out by hand) -------------

@pytest.mark.parametrize("tp_size,tp_rank,heads", [(1, 0, [0, 1]), (2, 0, [0]), (2, 1, [1]),
                                                    (4, 0, [0]), (4, 1, [0]), (4, 2, [1]),
                                                    (4, 3, [1])])
def test_standin_per_head_loads_this_ranks_heads(tp_size, tp_rank, heads):
    s = make_scales(1, "head")
    model = loaded("compressed-tensors", "attn_head", s, tp_rank=tp_rank, tp_size=tp_size)
    attn = attention_layers(model)[1]
    k = s["model.layers.1.self_attn.k_scale"].reshape(-1)
    q = s["model.layers.1.self_attn.q_scale"].reshape(-1)
    assert values(attn._k_scale) == tuple(float(k[h]) for h in heads)
    assert values(attn._q_scale) == tuple(float(q[4 * h:4 * h + 4].max()) for h in heads)
    assert attn._k_scale_float == max(float(k[h]) for h in heads)
    assert attn._k_scale.data_ptr() == attn.k_scale.data_ptr()  # detach shares storage
    assert values(attn._k_scale_cpu) == (attn._k_scale_float,)


@pytest.mark.parametrize("fnuz", [False, True])
def test_standin_base_method_doubles_on_fnuz_and_compressed_tensors_does_not(fnuz):
    s = make_scales(1, "tensor")
    k = float(s["model.layers.0.self_attn.k_scale"][0])
    base = attention_layers(loaded("modelopt", None, s, fnuz=fnuz))[0]
    ct = attention_layers(loaded("compressed-tensors", "tensor", s, fnuz=fnuz))[0]
    assert base._k_scale.shape == () and ct._k_scale.shape == (1,)
    assert base._k_scale_float == (2 * k if fnuz else k)
    assert ct._k_scale_float == k


# -- a live update leaves what a checkpoint load leaves ---------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fnuz", [False, True])
@pytest.mark.parametrize("tp_size,tp_rank", TP)
@pytest.mark.parametrize("method,strategy,granularity", LOADERS)
def test_push_equals_checkpoint_load(method, strategy, granularity, tp_size, tp_rank, fnuz,
                                     device):
    kw = dict(tp_rank=tp_rank, tp_size=tp_size, fnuz=fnuz, device=device)
    s1, s2 = make_scales(1, granularity), make_scales(2, granularity)
    live = loaded(method, strategy, s1, **kw)
    before = state(live)
    ids = identities(live)
    changes = update_attention_scales(live, s2, tp_rank=tp_rank, tp_size=tp_size, fnuz=fnuz)
    fresh = loaded(method, strategy, s2, **kw)

    assert state(live) == state(fresh)
    assert state(live) != before
    assert identities(live) == ids
    # what changed: every (layer, role), old as S1 loaded it, new as S2 loads
    old_layers = attention_layers(loaded(method, strategy, s1, **kw))
    new_layers = attention_layers(fresh)
    assert [(c.layer, c.role) for c in changes] == [(l, r) for l in range(LAYERS) for r in "qkv"]
    for c in changes:
        assert c.module == f"model.layers.{c.layer}.self_attn.attn"
        assert c.old == values(getattr(old_layers[c.layer], f"_{c.role}_scale"))
        assert c.new == values(getattr(new_layers[c.layer], f"_{c.role}_scale"))
        assert c.changed and str(c).startswith(f"layer {c.layer} {c.role}: [")


@pytest.mark.parametrize("method", ["modelopt", "quark"])
def test_push_doubles_for_the_base_method_on_fnuz(method):
    s1, s2 = make_scales(1, "tensor"), make_scales(2, "tensor")
    live = loaded(method, None, s1, fnuz=True)
    changes = update_attention_scales(live, s2, fnuz=True)
    q = float(s2["model.layers.1.self_attn.q_scale"][0])
    v = float(s2["model.layers.1.self_attn.v_scale"][0])
    attn = attention_layers(live)[1]
    assert attn._q_scale_float == 2 * q and attn._v_scale_float == 2 * v
    assert float(attn.v_scale) == v  # the loading parameter keeps the checkpoint value
    assert changes[-1].new == (2 * v,)


def test_quant_method_given_explicitly_and_fnuz_detected(monkeypatch):
    s1, s2 = make_scales(1, "tensor"), make_scales(2, "tensor")
    live = loaded("quark", None, s1, fnuz=True)
    monkeypatch.setattr(kvcal.vllm, "_platform_is_fp8_fnuz", lambda: True)
    update_attention_scales(live, s2, quant_method="quark")
    assert state(live) == state(loaded("quark", None, s2, fnuz=True))


def test_fnuz_is_off_on_this_platform():
    expected = bool(getattr(torch.version, "hip", None)) and torch.cuda.is_available() and \
        "gfx94" in torch.cuda.get_device_properties(0).gcnArchName
    assert kvcal.vllm._platform_is_fp8_fnuz() == expected


@pytest.mark.parametrize("tp_size,tp_rank", TP)
def test_per_tensor_scales_for_a_per_head_layer_apply_to_every_head(tp_size, tp_rank):
    kw = dict(tp_rank=tp_rank, tp_size=tp_size)
    s2 = make_scales(2, "tensor")
    live = loaded("compressed-tensors", "attn_head", make_scales(1, "head"), **kw)
    update_attention_scales(live, s2, **kw)
    as_heads = kvcal.Scales({name: np.full((HEADS if name.endswith("q_scale") else KV_HEADS, 1, 1),
                                           v.reshape(-1)[0], np.float32)
                             for name, v in s2.items()}, granularity="head", observer="x")
    assert state(live) == state(loaded("compressed-tensors", "attn_head", as_heads, **kw))


@pytest.mark.parametrize("tp_size,tp_rank", TP)
def test_q_already_reduced_per_kv_group(tp_size, tp_rank):
    kw = dict(tp_rank=tp_rank, tp_size=tp_size)
    s2 = make_scales(2, "head")
    reduced = dict(s2)
    for layer in range(LAYERS):
        name = f"model.layers.{layer}.self_attn.q_scale"
        reduced[name] = s2[name].reshape(KV_HEADS, -1).max(axis=1)
    live = loaded("compressed-tensors", "attn_head", make_scales(1, "head"), **kw)
    update_attention_scales(live, reduced, **kw)
    assert state(live) == state(loaded("compressed-tensors", "attn_head", s2, **kw))


@pytest.mark.parametrize("method,strategy,granularity", LOADERS)
def test_roles_left_out_stay_as_they_are(method, strategy, granularity):
    kw = dict(tp_rank=1, tp_size=2)
    s1, s2 = make_scales(1, granularity), make_scales(2, granularity, roles="kv")
    live = loaded(method, strategy, s1, **kw)
    q_before = [(values(a._q_scale), a._q_scale_float) for a in attention_layers(live)]
    changes = update_attention_scales(live, s2, **kw)
    assert [c.role for c in changes] == ["k", "v"] * LAYERS
    assert [(values(a._q_scale), a._q_scale_float) for a in attention_layers(live)] == q_before
    for attn, fresh in zip(attention_layers(live), attention_layers(loaded(method, strategy, s2, **kw))):
        for role in "kv":
            assert values(getattr(attn, f"_{role}_scale")) == values(getattr(fresh, f"_{role}_scale"))
            assert getattr(attn, f"_{role}_scale_float") == getattr(fresh, f"_{role}_scale_float")


def test_partial_updates_named_layers_only():
    s1, s2 = make_scales(1, "tensor"), make_scales(2, "tensor", layers=1)
    live = loaded("compressed-tensors", "tensor", s1)
    with pytest.raises(ValueError, match=r"do not name layers 1 .*partial=True"):
        update_attention_scales(live, s2)
    untouched = state(live)["model.layers.1.self_attn.attn"]
    changes = update_attention_scales(live, s2, partial=True)
    assert {c.layer for c in changes} == {0}
    assert state(live)["model.layers.1.self_attn.attn"] == untouched


def test_unchanged_values_are_reported_as_unchanged():
    s1 = make_scales(1, "head")
    live = loaded("compressed-tensors", "attn_head", s1)
    changes = update_attention_scales(live, s1, tp_rank=0, tp_size=1)
    assert len(changes) == 3 * LAYERS and not any(c.changed for c in changes)


# -- other ways to name layers and scales ------------------------------------------

def test_layer_mapping_and_nested_scales():
    kw = dict(tp_rank=1, tp_size=4)
    s2 = make_scales(2, "head")
    live = loaded("compressed-tensors", "attn_head", make_scales(1, "head"), **kw)
    nested = {layer: {role: s2[f"model.layers.{layer}.self_attn.{role}_scale"] for role in "qkv"}
              for layer in range(LAYERS)}
    update_attention_scales(dict(enumerate(attention_layers(live))), nested, **kw)
    assert state(live) == state(loaded("compressed-tensors", "attn_head", s2, **kw))


def test_vllm_parameter_names_from_scales_for_vllm():
    s2 = make_scales(2, "tensor")
    live = loaded("modelopt", None, make_scales(1, "tensor"))
    update_attention_scales(live, kvcal.vllm.scales_for_vllm(s2))
    assert state(live) == state(loaded("modelopt", None, s2))


def test_model_with_another_prefix():
    s2 = make_scales(2, "tensor")
    kw = dict(prefix="language_model.model")
    live = loaded("compressed-tensors", "tensor", make_scales(1, "tensor"), **kw)
    changes = update_attention_scales(live, s2)
    assert changes[0].module == "language_model.model.layers.0.self_attn.attn"
    assert state(live) == state(loaded("compressed-tensors", "tensor", s2, **kw))


def test_several_attention_stacks_need_a_prefix():
    root = torch.nn.Module()
    root.text = build_model("compressed-tensors", prefix="model")
    root.vision = build_model("compressed-tensors", prefix="encoder")
    s = make_scales(2, "tensor")
    with pytest.raises(ValueError, match="several prefixes.*prefix="):
        update_attention_scales(root, s)
    changes = update_attention_scales(root, s, prefix="text.model.layers")
    assert changes[0].module == "text.model.layers.0.self_attn.attn"
    assert float(root.vision.encoder.layers[0].self_attn.attn._k_scale) == 1.0


def test_per_head_layers_need_the_tensor_parallel_position_without_vllm():
    live = loaded("compressed-tensors", "attn_head", make_scales(1, "head"))
    before = state(live)
    with pytest.raises(ValueError, match="pass tp_rank= and tp_size="):
        update_attention_scales(live, make_scales(2, "head"))
    assert state(live) == before


def test_flashinfer_cached_products_are_reported():
    live = loaded("modelopt", None, make_scales(1, "tensor"))
    for attn in attention_layers(live):
        attn.impl = type("FlashInferImpl", (), {"bmm1_scale": 0.01, "bmm2_scale": 0.3})()
    with pytest.warns(RuntimeWarning, match="bmm1_scale"):
        update_attention_scales(live, make_scales(2, "tensor"))


# -- refusals change nothing -------------------------------------------------------

BAD_VALUES = [float("nan"), 0.0, -0.0, -1.0, float("inf"), float("-inf"), 1e-50]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", BAD_VALUES, ids=repr)
@pytest.mark.parametrize("role", "qkv")
@pytest.mark.parametrize("method,strategy,granularity", LOADERS)
def test_invalid_scale_changes_nothing(method, strategy, granularity, role, bad, device):
    kw = dict(tp_rank=1, tp_size=2, device=device)
    live = loaded(method, strategy, make_scales(1, granularity), **kw)
    before, ids = state(live), identities(live)
    s2 = make_scales(2, granularity)
    name = f"model.layers.1.self_attn.{role}_scale"  # layer 0 would have been fine
    s2[name] = s2[name].copy()
    s2[name].reshape(-1)[-1] = bad
    with pytest.raises(ValueError) as error:
        update_attention_scales(live, s2, tp_rank=1, tp_size=2)
    message = str(error.value)
    shown = repr(float(np.float32(bad)))  # 1e-50 is 0.0 in float32
    assert "layer 1" in message and f" {role}" in message and shown in message
    assert "finite and > 0" in message and "nothing was changed" in message
    assert state(live) == before and identities(live) == ids


def _refused(live, scales, match, **kw):
    before = state(live)
    with pytest.raises(ValueError, match=match):
        update_attention_scales(live, scales, **kw)
    assert state(live) == before


def _with(scales, layer, role, value):
    out = kvcal.Scales(dict(scales), granularity=scales.granularity, observer=scales.observer)
    out[f"model.layers.{layer}.self_attn.{role}_scale"] = np.asarray(value, np.float32)
    return out


@pytest.mark.parametrize("role,n", [("k", 3), ("v", 1), ("k", 4), ("q", 3), ("q", 4), ("q", 1),
                                    ("q", 16)])
def test_wrong_head_count_is_refused(role, n):
    live = loaded("compressed-tensors", "attn_head", make_scales(1, "head"), tp_rank=1, tp_size=2)
    bad = _with(make_scales(2, "head"), 1, role, np.full((n, 1, 1), 0.1))
    _refused(live, bad, rf"layer 1 .* {role}: {n} scales", tp_rank=1, tp_size=2)


def test_wrong_shape_is_refused():
    live = loaded("compressed-tensors", "attn_head", make_scales(1, "head"))
    bad = _with(make_scales(2, "head"), 0, "q", np.full((2, 4), 0.1))
    _refused(live, bad, r"layer 0 .* q: shape \(2, 4\)", tp_rank=0, tp_size=1)


@pytest.mark.parametrize("method,strategy", [("compressed-tensors", "tensor"), ("modelopt", None),
                                             ("quark", None)])
def test_per_head_scales_for_a_per_tensor_layer_are_refused(method, strategy):
    live = loaded(method, strategy, make_scales(1, "tensor"))
    _refused(live, make_scales(2, "head"), r"layer 0 .* q: 8 per-head scales .*granularity='tensor'",
             tp_rank=0, tp_size=1)


@pytest.mark.parametrize("cache", ["auto", "bfloat16", "fp8_per_token_head"])
def test_kv_scales_for_an_unquantized_cache_are_refused_for_the_base_method(cache):
    s1 = make_scales(1, "tensor")
    live = loaded("modelopt", None, s1, kv_cache_dtype=cache)
    _refused(live, make_scales(2, "tensor"), rf"layer 0 .* k: the layer's kv_cache_dtype is '{cache}'")
    q_only = make_scales(2, "tensor", roles="q")
    update_attention_scales(live, q_only)  # q is used whatever the cache
    assert attention_layers(live)[0]._q_scale_float == float(
        q_only["model.layers.0.self_attn.q_scale"][0])


def test_doubling_past_float32_is_refused():
    live = loaded("quark", None, make_scales(1, "tensor"), fnuz=True)
    bad = _with(make_scales(2, "tensor"), 1, "v", [3e38])
    _refused(live, bad, r"layer 1 .* v = inf after vLLM doubles it", fnuz=True)
    update_attention_scales(live, bad, fnuz=False, quant_method="quark")  # fine without doubling


def test_per_tensor_broadcast_is_refused_when_the_scales_say_per_head():
    live = loaded("compressed-tensors", "attn_head", make_scales(1, "head"))
    bad = _with(make_scales(2, "head"), 0, "k", np.full((1, 1, 1), 0.1))
    _refused(live, bad, r"layer 0 .* k: 1 scales; the model has 2", tp_rank=0, tp_size=1)


def test_other_refusals():
    s1, s2 = make_scales(1, "tensor"), make_scales(2, "tensor")
    live = loaded("compressed-tensors", "tensor", s1)
    _refused(live, _with(s2, 5, "k", [0.1]), r"layers \[5\] that the model does not have")
    _refused(live, {"model.layers.0.mlp.k_scale": [0.1]}, "is not model.layers")
    _refused(live, {}, "no scales")
    _refused(live, {0: {"x": [0.1]}}, "roles are q, k, v")
    _refused(live, {**s2, "model.layers.0.self_attn.k_scale": "high"}, r"layer 0 .* k: not a number")
    _refused(live, s2, "quant_method 'awq'", quant_method="awq")
    _refused(live, s2, "loaded by CompressedTensorsKVCacheMethod", quant_method="modelopt")
    _refused(live, s2, "0 <= tp_rank < tp_size", tp_rank=2, tp_size=2)
    _refused(live, s2, "both tp_rank and tp_size", tp_rank=0)
    both = dict(s2)
    both["model.layers.0.self_attn.attn.k_scale"] = np.float32(0.2)
    _refused(live, both, "layer 0 k is given twice")
    unknown = build_model("unknown")
    _refused(unknown, s2, "cannot tell how vLLM loaded its scales .*UnknownKVCacheMethod")
    update_attention_scales(unknown, s2, quant_method="compressed-tensors")  # the caller says


def test_wrong_tensor_parallel_size_is_refused():
    live = loaded("compressed-tensors", "attn_head", make_scales(1, "head"), tp_rank=1, tp_size=2)
    _refused(live, make_scales(2, "head"), "does not fit .* over tp_size 4", tp_rank=1, tp_size=4)
    _refused(live, make_scales(2, "head"), "does not fit .* over tp_size 1", tp_rank=0, tp_size=1)


def test_a_failing_write_is_rolled_back():
    live = loaded("compressed-tensors", "attn_head", make_scales(1, "head"), tp_rank=0, tp_size=2)
    before = state(live)
    target = attention_layers(live)[1]._v_scale

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    target.copy_ = broken  # the last layer's last buffer write fails
    with pytest.raises(RuntimeError, match="device lost"):
        update_attention_scales(live, make_scales(2, "head"), tp_rank=0, tp_size=2)
    del target.copy_
    assert state(live) == before


def test_no_layers_found():
    with pytest.raises(ValueError, match="no vLLM attention layers"):
        update_attention_scales(torch.nn.Linear(2, 2), make_scales(2, "tensor"))
    with pytest.raises(ValueError, match="expected a torch model"):
        update_attention_scales(object(), make_scales(2, "tensor"))


def test_scales_for_vllm_still_names_the_loading_parameters():
    out = kvcal.vllm.scales_for_vllm(make_scales(1, "head"))
    assert out["model.layers.1.self_attn.attn.q_scale"].shape == (HEADS,)
    assert out["model.layers.1.self_attn.attn.k_scale"].shape == (KV_HEADS,)
    tensor = kvcal.vllm.scales_for_vllm(make_scales(1, "tensor"), as_torch=False)
    assert all(v.shape == () and not math.isnan(float(v)) for v in tensor.values())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kvcal.vllm.scales_for_vllm(make_scales(1, "tensor"))
