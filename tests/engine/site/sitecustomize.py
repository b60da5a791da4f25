"""Loaded at start-up by every process of a vLLM engine that
tests/engine/vllm_probe.py starts (it puts this folder on PYTHONPATH).

With KVCAL_ENGINE_PROBE=1 it records, in each attention layer, the KV-cache
scale parameters (k_scale, v_scale, q_scale) as the engine's own weight
loader left them, just before vLLM post-processes them
(model_loader/base_loader.py calls process_weights_after_loading after
load_weights; the quantization method then turns them into _k_scale,
_k_scale_float, ... and deletes them). vLLM initializes each of them to -1.0
(quantization/kv_cache.py BaseKVCacheMethod.create_weights): -1 means the
loader never wrote it. The record is the attribute `_kvcal_loaded`, read by
the probe through LLM.apply_model. Nothing else is changed.
"""
import os

if os.environ.get("KVCAL_ENGINE_PROBE") == "1":
    try:
        from vllm.model_executor.model_loader import base_loader as _base_loader
    except Exception:  # not an engine process's interpreter
        _base_loader = None

    if _base_loader is not None:
        _original = _base_loader.process_weights_after_loading

        def _recording(model, model_config, target_device):
            for _, module in model.named_modules():
                loaded = {}
                for name in ("k_scale", "v_scale", "q_scale"):
                    value = getattr(module, name, None)
                    if value is not None and hasattr(value, "detach"):
                        loaded[name] = value.detach().float().reshape(-1).tolist()
                if loaded:
                    module._kvcal_loaded = loaded
            return _original(model, model_config, target_device)

        _base_loader.process_weights_after_loading = _recording
