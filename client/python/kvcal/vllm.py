"""kvcal.vllm: scales keyed the way vLLM's attention layers name them.

    scales = client.finalize(granularity="tensor")
    for name, value in kvcal.vllm.scales_for_vllm(scales).items():
        ...   # "model.layers.3.self_attn.attn.k_scale" -> tensor(0.0123)

vLLM's `Attention` layer of decoder layer L sits at
`model.layers.{L}.self_attn.attn` and holds `q_scale`, `k_scale`, `v_scale`
(the compressed-tensors checkpoint names `model.layers.{L}.self_attn.k_scale`
are remapped onto them when a checkpoint loads). Per-tensor scales come back
as 0-d float32 tensors (vLLM's per-tensor parameters are scalars), per-head
scales flattened to [heads] (vLLM flattens the [heads, 1, 1] checkpoint
shape). Models whose decoder sits elsewhere (a multimodal model's
`language_model.model.layers`) take `prefix=`.
"""
from __future__ import annotations

import re
from typing import Dict, Mapping

_NAME = re.compile(r"model\.layers\.(\d+)\.self_attn\.([qkv])_scale")


def scales_for_vllm(scales: Mapping, prefix: str = "model.layers", as_torch: bool = True,
                    device=None) -> Dict[str, object]:
    """{`{prefix}.{L}.self_attn.attn.{q,k,v}_scale`: tensor}; numpy arrays
    with as_torch=False."""
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
