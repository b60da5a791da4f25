"""kvcal's C++ FP8 emulation (kernels/fp8_math.h, kernels/fp8_attention.h,
driven through build/tests/kernels/kvcal_fp8_tool) against PyTorch: the
e4m3fn cast bit for bit, fake quantization value for value, and the FP8
attention error against kvcal.torch.evaluate's definitions (float32
attention, so the error figures agree to a stated tolerance, not bits)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from conftest import BUILD  # noqa: E402
from kvcal.torch.evaluation import MIN_NORMAL, SATURATED, _attention, fake_quantize

TOOL = os.path.join(BUILD, "tests", "kernels", "kvcal_fp8_tool")

pytestmark = pytest.mark.skipif(not os.path.exists(TOOL), reason=f"{TOOL} not built")


def run_tool(tmp_path, mode, payload: bytes) -> bytes:
    src, dst = tmp_path / f"{mode}.in", tmp_path / f"{mode}.out"
    src.write_bytes(payload)
    subprocess.run([TOOL, mode, str(src), str(dst)], check=True)
    return dst.read_bytes()


def torch_bits(x: torch.Tensor) -> np.ndarray:
    return x.to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def adversarial() -> torch.Tensor:
    """Every e4m3 value, the midpoints between neighbours (ties) and their
    float32 neighbours, the subnormal range, the region around 448..480,
    ±0, ±Inf, NaN and random floats over many octaves."""
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = every[torch.isfinite(every)]
    ordered = torch.unique(finite.abs())
    mids = (ordered[1:] + ordered[:-1]) / 2
    ties = torch.cat([mids, -mids])
    up = torch.from_numpy(np.nextafter(ties.numpy(), np.float32(np.inf)))
    down = torch.from_numpy(np.nextafter(ties.numpy(), np.float32(-np.inf)))
    sub = torch.linspace(0, 2 ** -6, 4097)
    big = torch.linspace(440, 500, 2401)
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), -float("nan"),
                            448.0, -448.0,
                            464.0, -464.0, 480.0, 2 ** -9, 2 ** -10, 3 * 2 ** -10,
                            float(np.nextafter(np.float32(464), np.float32(0))),
                            float(np.nextafter(np.float32(464), np.float32(1000))),
                            1e-45, 3.4e38])
    g = torch.Generator().manual_seed(13)
    rand = torch.randn(200000, generator=g) * torch.exp2(torch.randint(-20, 12, (200000,),
                                                                        generator=g).float())
    return torch.cat([finite, ties, up, down, sub, -sub, big, -big, special, rand]).float()


def test_cast_is_bit_identical_to_torch(tmp_path):
    x = adversarial()
    ours = np.frombuffer(run_tool(tmp_path, "cast", x.numpy().tobytes()), dtype=np.uint8)
    theirs = torch_bits(x)
    assert ours.shape == theirs.shape
    # NaN has two encodings by sign: torch keeps the input's sign bit, as kvcal does.
    diff = np.nonzero(ours != theirs)[0]
    assert diff.size == 0, [(float(x[i]), int(ours[i]), int(theirs[i])) for i in diff[:10]]
    # The set covers every byte torch produces.
    assert len(np.unique(theirs)) == 256


@pytest.mark.parametrize("scale", [1.0, 0.0123, 3.7, 1 / 448])
def test_fake_quantize_matches_kvcal_torch(tmp_path, scale):
    x = adversarial()
    payload = np.float32(scale).tobytes() + x.numpy().tobytes()
    ours = np.frombuffer(run_tool(tmp_path, "fake_quantize", payload), dtype=np.float32)
    theirs = fake_quantize(x, torch.tensor(scale, dtype=torch.float32)).numpy()
    np.testing.assert_array_equal(ours.view(np.uint32)[~np.isnan(theirs)],
                                  theirs.view(np.uint32)[~np.isnan(theirs)])
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(theirs))


def torch_attention_figures(q, k, v, qs, ks, vs, quantize_q):
    """kvcal.torch.evaluate's definitions on one causal sequence:
    q [tokens, heads, dim], k/v [tokens, kv, dim]; scales per head."""
    tokens, heads, dim = q.shape
    kv = k.shape[1]

    def attend(q, k, v):  # kvcal.torch.evaluate's own eager attention
        qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, h, t, d]
        mask = torch.ones(1, 1, tokens, tokens, dtype=torch.bool).tril()
        return _attention(None, qh, kh, vh, mask, dim ** -0.5, False)[0]  # [t, h, d]

    def fq(x, s):
        return fake_quantize(x, s.view(1, -1, 1))

    ref = attend(q, k, v)
    out = attend(fq(q, qs) if quantize_q else q, fq(k, ks), fq(v, vs))
    err = (out - ref).double().pow(2).sum(dim=(0, 2))
    refsq = ref.double().pow(2).sum(dim=(0, 2))
    shares = {}
    for role, x, s in (("q", q, qs), ("k", k, ks), ("v", v, vs)):
        t = (x / s.view(1, -1, 1)).abs()
        shares[role] = ((t > SATURATED).sum(dim=(0, 2)).numpy(),
                        ((t > 0) & (t < MIN_NORMAL)).sum(dim=(0, 2)).numpy())
    return err.numpy(), refsq.numpy(), shares


@pytest.mark.parametrize("tokens,heads,kv,dim,quantize_q,outlier", [
    (1, 1, 1, 1, True, False),
    (17, 4, 2, 16, True, False),
    (33, 6, 2, 32, False, False),
    (64, 8, 8, 64, True, True),
])
def test_attention_error_matches_torch(tmp_path, tokens, heads, kv, dim, quantize_q, outlier):
    g = torch.Generator().manual_seed(tokens * 1000 + heads)
    q = torch.randn(tokens, heads, dim, generator=g) * 2
    k = torch.randn(tokens, kv, dim, generator=g) * 0.3
    v = torch.randn(tokens, kv, dim, generator=g)
    k[0, 0, 0] += 1e-4  # not all zero even for one value
    if outlier:
        k[tokens // 2, 0, 3] = 200.0
    # Scales: absmax per head for most, one clipping and one tiny (subnormals).
    qs = q.abs().amax(dim=(0, 2)) / 448
    ks = k.abs().amax(dim=(0, 2)) / 448
    vs = v.abs().amax(dim=(0, 2)) / 448
    if outlier:
        ks[0] = 2.0 / 448  # clips the outlier: saturates
        vs[-1] = vs[-1] * 300  # pushes small values into subnormals
    header = np.array([tokens, heads, kv, dim, int(quantize_q)], dtype=np.uint32).tobytes()
    payload = header + b"".join(t.numpy().astype(np.float32).tobytes()
                                for t in (q, k, v, qs, ks, vs))
    ours = json.loads(run_tool(tmp_path, "attention", payload))
    err, refsq, shares = torch_attention_figures(q, k, v, qs, ks, vs, quantize_q)
    rel_theirs = np.sqrt(err / refsq)
    rel_ours = np.array(ours["relative_error"])
    # float32 attention summed in different orders: the error figures agree
    # to 1e-4 relative plus 1e-6 absolute (an FP8 error is >= 1e-3 here).
    np.testing.assert_allclose(rel_ours, rel_theirs, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(ours["reference_sq"], refsq, rtol=1e-5)
    if tokens > 1:
        assert rel_ours.min() > 1e-4  # the FP8 run really differs
    for role in "qkv":
        if role == "q" and not quantize_q:
            assert sum(ours["q"]["values"]) == 0
            continue
        np.testing.assert_array_equal(ours[role]["saturated"], shares[role][0])
        np.testing.assert_array_equal(ours[role]["subnormal"], shares[role][1])
    if outlier:
        assert ours["k"]["saturated"][0] > 0
        assert ours["v"]["subnormal"][-1] > 0
