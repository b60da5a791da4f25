"""kvcal.torch: kvcal inside a PyTorch job.

    with kvcal.Producer(client) as producer:
        with kvcal.torch.capture(model, producer):
            for input_ids in batches:
                model(input_ids)          # each forward is one calibration batch
    result = kvcal.torch.evaluate(model, scales, batches)

The rooms:
- capturing.py: `capture`, the attention inputs (post-RoPE Q, K, V) of
  transformers models, streamed to a producer;
- mla.py: `capture_mla` and `mla_geometry`, the latent cache row of
  DeepSeek-style multi-head latent attention;
- evaluation.py: `evaluate`, `fake_quantize`, `rescale_keys`: what an FP8
  or NVFP4 cache costs a model, measured by emulating it.
"""
from .capturing import UnsupportedModelError, capture
from .evaluation import Evaluation, evaluate, fake_quantize, rescale_keys
from .mla import MLA_ROLES, capture_mla, mla_geometry

__all__ = ["capture", "UnsupportedModelError", "capture_mla", "mla_geometry", "MLA_ROLES",
           "evaluate", "Evaluation", "fake_quantize", "rescale_keys"]
