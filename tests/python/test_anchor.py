"""Anchor check: on the same activations, kvcal's scales equal those of
llm-compressor's observers (the library users calibrate with today), per
tensor and per head. Static, EMA and memoryless min-max agree to float32
rounding; MSE (llm-compressor searches each batch's raw values, kvcal the
exact top values plus the histogram of all data) is compared on one batch
and agrees within one step of the search grid (1%)."""
import numpy as np
import pytest
import torch

import kvcal

llmcompressor_observers = pytest.importorskip("llmcompressor.observers")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402

HEADS, KV_HEADS, DIM = 4, 2, 16


def activations(nbatches, seed):
    g = torch.Generator().manual_seed(seed)
    batches = []
    for b in range(nbatches):
        # Heavy tails and a different scale per head and per batch.
        head_scale = torch.tensor([0.5, 1.0, 3.0, 8.0])[:KV_HEADS].view(1, KV_HEADS, 1, 1)
        x = torch.distributions.StudentT(3.0).sample((2, KV_HEADS, 64, DIM)) * head_scale * (1 + b)
        batches.append(x + 0.1 * torch.randn(x.shape, generator=g))
    return batches


def llmcompressor_scales(batches, observer, strategy, **kwargs):
    args = QuantizationArgs(num_bits=8, type="float", symmetric=True, dynamic=False,
                            strategy=strategy, observer=observer)
    obs = llmcompressor_observers.Observer.load_from_registry(observer, base_name="k", args=args, **kwargs)
    for x in batches:
        obs(x)
    return obs.get_qparams()["scale"].float().reshape(-1).numpy()


def kvcal_scales(worker, batches, observer, granularity):
    client = kvcal.Client(worker.target)
    client.create_session(geometry=dict(num_layers=1, num_attention_heads=HEADS,
                                        num_key_value_heads=KV_HEADS, head_dim=DIM), roles=["k"])
    with kvcal.Producer(client) as producer:
        for b, x in enumerate(batches):
            producer.put(0, "k", x, batch=b)
    scales = client.finalize(observer=observer, granularity=granularity)
    client.delete()
    return scales["model.layers.0.self_attn.k_scale"].reshape(-1)


@pytest.mark.parametrize("observer", ["static_minmax", "minmax", "memoryless_minmax"])
@pytest.mark.parametrize("granularity,strategy", [("tensor", "tensor"), ("head", "attn_head")])
def test_minmax_observers_equal_llmcompressor(worker, observer, granularity, strategy):
    batches = activations(5, seed=1)
    want = llmcompressor_scales(batches, observer, strategy)
    got = kvcal_scales(worker, batches, observer, granularity)
    np.testing.assert_allclose(got, want, rtol=2e-7 if observer != "minmax" else 1e-6)


@pytest.mark.parametrize("granularity,strategy", [("tensor", "tensor"), ("head", "attn_head")])
def test_mse_within_grid_step_of_llmcompressor(worker, granularity, strategy):
    batches = activations(1, seed=2)
    want = llmcompressor_scales(batches, "mse", strategy)
    got = kvcal_scales(worker, batches, "mse", granularity)
    np.testing.assert_allclose(got, want, rtol=0.0101)
