"""What tests/engine/vllm_probe.py reads inside the engine (LLM.apply_model
pickles the function by reference, so it lives in a module the engine's
processes import: this folder is on their PYTHONPATH)."""
import torch


def layer_record(model):
    """Per attention layer: what the loader delivered and what runs."""
    out = []
    for name, module in model.named_modules():
        if not hasattr(module, "_k_scale"):
            continue

        def values(attr):
            v = getattr(module, attr, None)
            if v is None:
                return None
            if isinstance(v, torch.Tensor):
                return v.detach().float().reshape(-1).tolist()
            return [float(v)]

        out.append({
            "name": name,
            "kv_cache_dtype": getattr(module, "kv_cache_dtype", None),
            "loaded": getattr(module, "_kvcal_loaded", None),
            "k_scale": values("_k_scale"),
            "v_scale": values("_v_scale"),
            "q_scale": values("_q_scale"),
            "k_scale_float": values("_k_scale_float"),
            "v_scale_float": values("_v_scale_float"),
            "q_scale_float": values("_q_scale_float"),
        })
    return out


def update_from_file(path, model):
    """kvcal's live update inside the engine: the scales file at `path`
    written into every attention layer by kvcal.vllm.update_attention_scales
    (kvcal is on the engine's PYTHONPATH: vllm_probe.py --kvcal). Returns the
    changes, one log line each."""
    import kvcal.vllm
    from kvcal.scales import Scales

    changes = kvcal.vllm.update_attention_scales(model, Scales.load(path))
    return [str(c) for c in changes]
