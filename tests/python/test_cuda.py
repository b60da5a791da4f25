"""CUDA tensors go through pinned host memory; skipped without a GPU."""
import numpy as np
import pytest
import torch

import kvcal
from reference import observer_scales

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_tensors_match_host_computation(worker, dtype):
    client = kvcal.Client(worker.target)
    client.create_session(geometry=dict(num_layers=1, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=16))
    g = torch.Generator(device="cuda").manual_seed(0)
    batches = []
    with kvcal.Producer(client, chunk_bytes=4096) as producer:
        for b in range(3):
            producer.new_batch()
            x = {r: torch.randn((2, 4 if r == "q" else 2, 33, 16), device="cuda", generator=g,
                                dtype=dtype) * (b + 1) for r in "qkv"}
            for r, t in x.items():
                producer.put(0, r, t)
            batches.append({r: t.float().cpu().numpy() for r, t in x.items()})
    session = client.status()
    assert session.bytes_ingested == session.values_ingested * (2 if dtype == torch.bfloat16 else 4)
    scales = client.finalize(granularity="head")
    for r in "qkv":
        want = observer_scales([b[r] for b in batches], "static_minmax", "head")
        np.testing.assert_allclose(scales[f"model.layers.0.self_attn.{r}_scale"].reshape(-1), want,
                                   rtol=1e-7)
    client.delete()
