"""kvcal.torch.evaluation's NVFP4 KV cache emulation (nvfp4_fake_quantize, the
torch side of kernels/nvfp4.h) against a numpy reference written here in
another form: E2M1 by enumerating its eight magnitudes (nearest, ties to the
even code), E4M3 by a table of its finite values (nearest, ties to the even
code, 448 beyond), the reciprocal in float64 rounded to float32 with the
flushes spelled out, and the fused multiply-add exactly in rationals. The
float32 steps around them are vLLM 0.34's store kernel's (kernels/nvfp4.h).
Every E2M1 midpoint, every bf16 value, the E4M3 block scales that matter,
4over6's choice, random blocks, bit for bit; the C++ emulation
(kvcal_fp8_tool nvfp4) bit for bit on random rows; and evaluate(kv_format=)
on a tiny Llama."""
import math
import os
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from conftest import BUILD  # noqa: E402

import kvcal.torch  # noqa: E402
from kvcal.torch.evaluation import (e2m1_round, nvfp4_fake_quantize,  # noqa: E402
                            reciprocal_approximate_ftz)
from tiny_llama import tiny_llama  # noqa: E402

TOOL = os.path.join(BUILD, "tests", "kernels", "kvcal_fp8_tool")
F32 = np.float32
GRID = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float64)
TINY = 2.0 ** -126


def e4m3_table() -> np.ndarray:
    values = []
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue
            values.append(m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(values)


E4M3 = e4m3_table()


def ref_e2m1(x: np.ndarray) -> np.ndarray:
    """Values: the nearest grid magnitude, ties to the even code, 6 beyond."""
    x = np.asarray(x, dtype=np.float64)
    a = np.abs(x)
    d = np.abs(a[..., None] - GRID)
    ties = d == d.min(axis=-1, keepdims=True)
    code = np.where(ties, np.arange(8) % 2, 9).argmin(axis=-1)  # first even tie, else odd
    code = np.where(a > 6, 7, code)
    return np.copysign(GRID[code], x).astype(F32)


def ref_e4m3(v: float) -> float:
    if v >= 448:
        return 448.0
    d = np.abs(E4M3 - float(v))
    ties = np.flatnonzero(d == d.min())
    even = [i for i in ties if i % 2 == 0]
    return float(E4M3[even[0] if even else ties[0]])


def ref_rcp(a) -> F32:
    a = float(F32(a))
    if math.isnan(a):
        return F32(a)
    if abs(a) < TINY:
        return F32(math.copysign(math.inf, a))
    r = F32(1.0 / a)
    if abs(float(r)) < TINY:
        return F32(math.copysign(0.0, a))
    return r


def round_f32(q: Fraction) -> F32:
    """The float32 nearest the rational q, ties to even (finite range)."""
    guess = F32(float(q))
    best = None
    for c in (np.nextafter(guess, F32(-np.inf)), guess, np.nextafter(guess, F32(np.inf))):
        d = abs(Fraction(float(c)) - q)
        key = (d, int(np.array(c).view(np.uint32)) & 1)
        if best is None or key < best[0]:
            best = (key, c)
    return F32(best[1])


def ref_fma(a, b, c) -> F32:
    return round_f32(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)))


def ref_block(x: np.ndarray, k_scale: float, four_over_six: bool):
    """One block of 16 float32 values: (dequantized values, scale, max4)."""
    gs = F32(F32(1.0) / F32(k_scale))
    vmax = F32(max(abs(float(v)) for v in x))

    def candidate(den):
        sf = F32(ref_e4m3(gs * (vmax * ref_rcp(den))))
        return sf, (ref_rcp(sf * ref_rcp(gs)) if sf != 0 else F32(0))

    def error(out):
        dq = ref_rcp(out) if out != 0 else F32(0)
        err = F32(0)
        for i in range(0, 16, 2):
            a, b = x[i], x[i + 1]
            if out == 0:
                da, db = a, b
            else:
                da = ref_fma(ref_e2m1(a * out), dq, -a)
                db = ref_fma(ref_e2m1(b * out), dq, -b)
            err = F32(err + ref_fma(da, da, F32(db * db)))
        return err

    sf, out = candidate(6.0)
    max4 = False
    if four_over_six:
        sf4, out4 = candidate(4.0)
        if error(out4) < error(out):
            sf, out, max4 = sf4, out4, True
    q = ref_e2m1(x * out)
    return ((q * sf).astype(F32) * F32(k_scale)).astype(F32), float(sf), max4


def bits(a) -> np.ndarray:
    return np.asarray(a, dtype=F32).view(np.uint32)


def check_rows(x: np.ndarray, k_scale: float, four_over_six: bool):
    got, sf, _, max4 = nvfp4_fake_quantize(torch.from_numpy(x), k_scale, four_over_six,
                                           return_blocks=True)
    got = got.numpy().reshape(-1, 16)
    sf, max4 = sf.numpy().reshape(-1), max4.numpy().reshape(-1)
    for i, block in enumerate(x.reshape(-1, 16)):
        want, want_sf, want_max4 = ref_block(block, k_scale, four_over_six)
        assert sf[i] == want_sf, (block, k_scale)
        assert bool(max4[i]) == want_max4, (block, k_scale)
        np.testing.assert_array_equal(bits(got[i]), bits(want), err_msg=str((block, k_scale)))
    return got, max4


def block(*head) -> np.ndarray:
    b = np.zeros(16, dtype=F32)
    b[:len(head)] = head
    return b


def test_e2m1_every_midpoint_and_neighbour_and_every_bf16():
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], dtype=F32)
    around = np.concatenate([mids, np.nextafter(mids, F32(0)), np.nextafter(mids, F32(10))])
    x = np.concatenate([around, -around, [0.0, -0.0, 7.0, 1e30, np.inf, -np.inf]]).astype(F32)
    got = e2m1_round(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(bits(got), bits(ref_e2m1(x)))
    # The ties go to the even code: 0.25->0, 0.75->1, 1.25->1, 1.75->2,
    # 2.5->2, 3.5->4, 5->4.
    assert got[:7].tolist() == [0, 1, 1, 2, 2, 4, 4]
    every = (np.arange(65536, dtype=np.uint32) << 16).view(F32)
    every = every[~np.isnan(every)]
    np.testing.assert_array_equal(bits(e2m1_round(torch.from_numpy(every)).numpy()),
                                  bits(ref_e2m1(every)))


def test_reciprocal_flushes():
    a = np.array([6.0, 4.0, 0.0, -0.0, 1e-45, -2.0 ** -127, 2.0 ** 127, -2.0 ** 127,
                  2.0 ** 126, np.inf, 3.0, 1.125, 1.875], dtype=F32)
    got = reciprocal_approximate_ftz(torch.from_numpy(a)).numpy()
    np.testing.assert_array_equal(bits(got), bits([ref_rcp(v) for v in a]))
    assert got[2] == np.inf and got[3] == -np.inf and got[4] == np.inf
    assert bits(got[6]) == 0 and bits(got[7]) == 0x80000000


@pytest.mark.parametrize("four_over_six", [False, True])
def test_block_scales_zero_subnormal_normal_and_448(four_over_six):
    rows = [block(), block(0.005, -0.0025, 0.001),          # zero, below 2^-9 * 6 / 2
            block(6 * 2.0 ** -10), block(np.nextafter(F32(6 * 2.0 ** -10), F32(1)))]
    for k in range(1, 9):                                     # subnormal scales, then 2^-6
        a = 6 * k * 2.0 ** -9
        rows.append(block(a, -a / 2, a / 4, a / 5, a * 0.75))
    rows += [block(2688, -1344), block(3000, 2688, -3000, 100), block(1e6, 1)]
    x = np.stack(rows).astype(F32)
    got, max4 = check_rows(x, 1.0, four_over_six)
    assert not got[0].any()
    if four_over_six:
        # max/4 puts the scale 1.5x higher: the blocks max/6 reads as zeros
        # (max <= 6 * 2^-10) get the first subnormal scale and survive.
        assert max4[1] and max4[2] and got[1].any() and got[2].any()
    else:
        assert not got[1:3].any()        # below the smallest scale: zeros
    _, sf, sat, _ = nvfp4_fake_quantize(torch.from_numpy(x), 1.0, four_over_six, True)
    sf = sf.numpy().reshape(-1)
    assert sf[3] == 2.0 ** -9            # one ulp above the tie: the first subnormal
    if not four_over_six:
        assert sf[4:12].tolist() == [k * 2.0 ** -9 for k in range(1, 9)]
        assert got[12][0] == 2688 and got[13][0] == 2688 and got[13][2] == -2688
    assert sf[12] == 448 and not sat.numpy().reshape(-1)[12]
    assert sat.numpy().reshape(-1)[13:].all()


def test_scale_is_max_times_the_reciprocal_of_six():
    # Block maxima next to 6 x an e4m3 midpoint where max * rcp(6) and
    # max / 6 round to different block scales: the kernel's product decides.
    mids = ((E4M3[:-1] + E4M3[1:]) / 2 * 6).astype(F32)
    near = (mids.view(np.int32)[:, None] + np.arange(-64, 65)).reshape(-1).view(F32)
    times = np.array([ref_e4m3(v) for v in near * ref_rcp(6.0)])
    over = np.array([ref_e4m3(v) for v in near / F32(6)])
    differ = near[times != over]
    assert differ.size > 10
    x = np.stack([block(v) for v in differ[:200]]).astype(F32)
    check_rows(x, 1.0, False)
    _, sf, _, _ = nvfp4_fake_quantize(torch.from_numpy(x), 1.0, False, True)
    np.testing.assert_array_equal(sf.numpy().reshape(-1), times[times != over][:200])


def test_four_over_six_choice_with_fused_multiply_adds():
    x = np.stack([block(6.0), block(6.0, 4.5), block(6.0, 1.0),
                  block(-1.125, 3.5, -1.875, -0.5), block(4.0, -10.5, 5.0)]).astype(F32)
    got, max4 = check_rows(x, 1.0, True)
    # A tie keeps max/6; {6, 4.5} is exact with max/4; {6, 1} with max/6;
    # the last two differ between fused and unfused error sums.
    assert max4.tolist() == [False, True, False, False, True]
    assert got[1][:2].tolist() == [6.0, 4.5]


@pytest.mark.parametrize("four_over_six", [False, True])
def test_random_blocks_match_the_reference(four_over_six):
    rng = np.random.default_rng(26)
    for trial in range(40):
        base = 2.0 ** rng.integers(-22, 13)
        x = (rng.uniform(-1, 1, 64) * base * 2.0 ** rng.uniform(-3, 3, 64)).astype(F32)
        x[rng.random(64) < 0.05] = 0
        x = (x.view(np.uint32) & 0xFFFF0000).view(F32)  # bf16 values
        amax = float(np.abs(x).max())
        k_scale = [1.0, amax / 448 if amax else 1.0, 2.0 ** rng.uniform(-12, 6)][trial % 3]
        check_rows(x, float(F32(k_scale)), four_over_six)


@pytest.mark.skipif(not os.path.exists(TOOL), reason=f"{TOOL} not built")
@pytest.mark.parametrize("variant", [0, 1])
def test_torch_matches_the_cpp_emulation(tmp_path, variant):
    rng = np.random.default_rng(7 + variant)
    rows = []
    for _ in range(400):
        v = rng.uniform(-1, 1, 16) * 2.0 ** rng.integers(-24, 14) * 2.0 ** rng.uniform(-3, 3, 16)
        rows.append(v)
    x = (np.concatenate(rows).astype(F32).view(np.uint32) & 0xFFFF0000).view(F32)
    for k_scale in (1.0, float(F32(np.abs(x).max() / 448)), 0.037):
        src, dst = tmp_path / "in", tmp_path / "out"
        src.write_bytes(np.array([k_scale], F32).tobytes() + np.array([variant], np.uint32).tobytes()
                        + x.tobytes())
        subprocess.run([TOOL, "nvfp4", str(src), str(dst)], check=True)
        cpp = np.frombuffer(dst.read_bytes(), dtype=F32)
        got = nvfp4_fake_quantize(torch.from_numpy(x), k_scale, variant == 1).numpy()
        np.testing.assert_array_equal(bits(got), bits(cpp))


def test_refusals():
    with pytest.raises(ValueError, match="divisible by 16"):
        nvfp4_fake_quantize(torch.ones(3, 24), 1.0)
    with pytest.raises(ValueError, match="one checkpoint scale"):
        nvfp4_fake_quantize(torch.ones(3, 16), [1.0, 2.0])
    for bad in (0.0, -1.0, math.nan, math.inf, 1e-45):
        with pytest.raises(ValueError, match="checkpoint scale"):
            nvfp4_fake_quantize(torch.ones(3, 16), bad)


def test_evaluate_with_an_nvfp4_cache():
    model = tiny_llama(num_kv_heads=2)
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 128, (2, 12), generator=g) for _ in range(2)]
    ones = {f"model.layers.{i}.self_attn.{r}_scale": np.ones(1, np.float32)
            for i in range(2) for r in "qkv"}
    fp8 = kvcal.torch.evaluate(model, ones, data, kv_only=True)
    nvfp4 = kvcal.torch.evaluate(model, ones, data, kv_only=True, kv_format="nvfp4",
                                 reference=fp8.runs["reference"])
    four = kvcal.torch.evaluate(model, ones, data, kv_only=True, kv_format="nvfp4_4over6",
                                reference=fp8.runs["reference"])
    assert nvfp4.kv_format == "nvfp4" and nvfp4.to_dict()["kv_format"] == "nvfp4"
    assert "K/V nvfp4" in nvfp4.summary()
    # Four E2M1 levels per octave against FP8's eight mantissas: NVFP4's
    # attention error is larger in every layer; both are positive and small.
    assert np.all(nvfp4.attention_error > fp8.attention_error)
    assert np.all(four.attention_error > 0) and np.all(nvfp4.attention_error < 0.5)
    # Scale 1.0 and the per-tensor scales are the same here.
    np.testing.assert_array_equal(nvfp4.attention_error, nvfp4.attention_error_ones)
    for role in "kv":
        assert nvfp4.saturation[role].shape == (2, 2)
        assert np.all(nvfp4.saturation[role] == 0)
    with pytest.raises(ValueError, match="kv_format"):
        kvcal.torch.evaluate(model, ones, data, kv_format="fp4")
    per_head = dict(ones, **{"model.layers.0.self_attn.k_scale": np.array([1.0, 2.0], np.float32)})
    with pytest.raises(ValueError, match="one k_scale per layer"):
        kvcal.torch.evaluate(model, per_head, data, kv_format="nvfp4")
    with pytest.raises(ValueError, match="kv_format=nvfp4"):
        kvcal.torch.evaluate(model, ones, data, kv_only=True, ones=fp8, kv_format="nvfp4")


def test_calibrate_select_scores_an_nvfp4_cache():
    from types import SimpleNamespace

    from kvcal.calibrate import choice as calibrate_select
    from kvcal.calibrate.data import Batch

    model = tiny_llama(num_kv_heads=2)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (2, 12), generator=g)
    data = [Batch(ids, torch.ones_like(ids), 24)]
    geometry = SimpleNamespace(num_layers=2)
    deltas = {}
    for kv_format in ("fp8", "nvfp4"):
        c = calibrate_select.Candidate(None, "one", True, calibrate_select.ones_scales(geometry),
                                       origin="scale 1.0")
        calibrate_select.score(model, data, [c], kv_format=kv_format)
        assert c.evaluation.kv_format == kv_format
        deltas[kv_format] = c.evaluation.attention_error
    assert np.all(deltas["nvfp4"] > deltas["fp8"])
