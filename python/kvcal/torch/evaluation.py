"""kvcal.torch.evaluate: what FP8 Q, K and V cost a model, measured.

    result = kvcal.torch.evaluate(model, scales, batches)       # scales: client.finalize(...)
    print(result.summary())
    result.to_json("eval.json")                                 # `kvcal report --eval eval.json`

Runs `model` over `batches` three times: unquantized (the reference), with
Q, K and V fake-quantized to FP8 e4m3fn as vLLM's FP8 attention does
(x / scale, clamped to ±448, rounded to nearest even, times scale) under the
given scales, and under scale 1.0 for all (vLLM's silent default when a
checkpoint has no scales). It reports

- per layer and head: the relative RMS error of the attention output
  (||o_fp8 − o||₂ / ||o||₂ over the unpadded tokens, the layer's own
  inputs in both), and per (layer, role, head) the share of values that
  saturate (|x / scale| > 448, beyond float32's rounding of the division:
  a static scale's own absmax does not count) and that fall into e4m3's subnormals
  (0 < |x / scale| < 2⁻⁶, where the relative rounding error grows);
- the mean negative log-likelihood per token and the perplexity of the
  three runs.

Granularity follows the scales: per tensor one scale per (layer, role); per
head k and v per KV head and q reduced per KV group by max, as vLLM's loader
does (`q_per_kv_group=False` keeps one q scale per query head, what
FlashAttention-3 could use). `kv_only=True` leaves Q unquantized (an FP8 KV
cache with a bf16 query); `quantize_probs=True` also rounds the softmax
probabilities to e4m3 before P·V, as FA3's FP8 path does.

K/V cache formats (`kv_format`): "fp8" (the above), "nvfp4" and
"nvfp4_4over6", vLLM 0.34's NVFP4 KV caches (nvfp4_fake_quantize: blocks of
16 values of a head, an e4m3 block scale e4m3(global_scale · max|x| · rcp(6))
with global_scale = 1 / k_scale (resp. v_scale), values rounded to E2M1
±{0, 0.5, 1, 1.5, 2, 3, 4, 6}; 4over6 also tries max/4 per block and keeps
the smaller squared error; the same arithmetic as kernels/nvfp4.h, bit for
bit). vLLM's store kernel reads one k_scale and one v_scale per layer, so
NVFP4 takes per-tensor K/V scales only. Q and P: vLLM 0.34 serves an NVFP4
cache with FlashInfer only. On SM100 (trtllm-gen) it quantizes the query to
FP8 with q_scale (Attention.query_quant, per tensor or per KV head; a
checkpoint without q_scale gets q_scale = k_scale from
BaseKVCacheMethod.process_weights_after_loading, not 1.0) and
writes the attention output as FP8 e4m3 with unit scale before the copy back
to bf16 (FlashInferImpl: "NVFP4 trtllm kernel only supports FP8 output";
this evaluation does not round the output); on SM80/SM90/SM120 (FlashInfer
FA2) the query stays in the model dtype (q_scale=1.0), the cache is written
by FlashInfer's own quantizer, and only "nvfp4" is offered (no 4over6). So
`kv_only=False` is the SM100 path and `kv_only=True` the FA2 path; how the
probabilities are rounded inside FlashInfer's kernels is not visible in
vLLM's source (`quantize_probs` stays the caller's choice). For NVFP4 the
shares count values, not scales: saturated = values in blocks whose scale
clipped at 448 (max|x| · global_scale > 2688), subnormal = values of
non-zero blocks whose block scale is an e4m3 subnormal or 0 (below 2⁻⁶;
at 0 the whole block reads as zeros).

The attention runs in transformers' eager form (the model's implementation
is switched to "eager" for the evaluation and back); batches are token id
tensors [batch, tokens] or dicts with input_ids and attention_mask (padding
is left out of every figure).
"""
from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass, field
from typing import Dict, Iterable, Optional

import numpy as np
import torch

from .._output import write_output_file

QMAX = 448.0
MIN_NORMAL = 2.0 ** -6  # e4m3fn's smallest normal
SATURATED = QMAX * (1 + 2.0 ** -20)  # x / absmax * 448 may round a ulp above 448


def fake_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale clamped to ±448, rounded to e4m3fn, times scale (float32)."""
    x32 = x.float()
    return ((x32 / scale).clamp(-QMAX, QMAX).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)


KV_FORMATS = ("fp8", "nvfp4", "nvfp4_4over6")
NVFP4_BLOCK = 16
_TINY = 2.0 ** -126  # float32's smallest normal


def reciprocal_approximate_ftz(a: torch.Tensor) -> torch.Tensor:
    """vLLM's reciprocal_approximate_ftz (PTX rcp.approx.ftz.f32) as
    kernels/nvfp4.h emulates it: the correctly rounded float32 1/a, a zero or
    subnormal input read as ±0 (±Inf out), a subnormal result flushed to ±0."""
    a = a.float()
    r = 1.0 / a
    inf = torch.full_like(a, math.inf)
    r = torch.where(a.abs() < _TINY, torch.copysign(inf, a), r)
    return torch.where(r.abs() < _TINY, torch.copysign(torch.zeros_like(a), a), r)


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """cvt.rn.satfinite.e2m1x2.f32 as a value: nearest of ±{0, 0.5, 1, 1.5,
    2, 3, 4, 6}, ties to the even code, ±6 beyond (vLLM's
    round_to_nearest_e2m1)."""
    ax = x.abs()
    q = torch.full_like(ax, 6.0)
    for bound, value, inclusive in ((5.0, 4.0, True), (3.5, 3.0, False), (2.5, 2.0, True),
                                    (1.75, 1.5, False), (1.25, 1.0, True), (0.75, 0.5, False),
                                    (0.25, 0.0, True)):
        q = torch.where(ax <= bound if inclusive else ax < bound, torch.full_like(ax, value), q)
    return torch.copysign(q, x)


def _fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 fma(a, b, c), rounded once: the product is exact in float64,
    the float64 sum is made round-to-odd (TwoSum's error term decides) so the
    final rounding to float32 is correct."""
    p = a.double() * b.double()
    c = c.double()
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, torch.full_like(s, math.inf), torch.full_like(s, -math.inf))
    s = torch.where((err != 0) & even & torch.isfinite(s), torch.nextafter(s, toward), s)
    return s.float()


def _nvfp4_candidate(gs, vmax, denominator):
    sf_value = gs * (vmax * reciprocal_approximate_ftz(
        torch.tensor(denominator, dtype=torch.float32)))
    sf = sf_value.to(torch.float8_e4m3fn).float()
    out = torch.where(sf != 0, reciprocal_approximate_ftz(sf * reciprocal_approximate_ftz(gs)),
                      torch.zeros_like(sf))
    return sf, out, sf_value


def _nvfp4_error(b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """nvfp4_reconstruction_error per block [n, 16] with nvcc's fused
    multiply-adds, pairs summed in order."""
    o = out[:, None]
    dq = torch.where(out != 0, reciprocal_approximate_ftz(out), torch.zeros_like(out))[:, None]
    q = e2m1_round(b * o)
    d = _fma32(q, dq.expand_as(q), -b)
    zero = (out == 0)[:, None]
    d = torch.where(zero, b, d)  # a zero scale sums x² (fma(x0, x0, x1 * x1))
    error = torch.zeros_like(out)
    for i in range(0, NVFP4_BLOCK, 2):
        d0, d1 = d[:, i], d[:, i + 1]
        error = error + _fma32(d0, d0, d1 * d1)
    return error


def nvfp4_fake_quantize(x: torch.Tensor, scale, four_over_six: bool = False,
                        return_blocks: bool = False):
    """What vLLM 0.34's NVFP4 KV cache reads back for `x` (last dimension a
    multiple of 16, blocks of 16 along it) under the checkpoint scale `scale`
    (k_scale or v_scale, one float): e2m1 · e4m3 block scale · scale, float32,
    returned in x's dtype. `return_blocks` also returns per block [..., dim/16]
    the block scale (float), whether it saturated and whether 4over6 chose
    max/4."""
    if x.shape[-1] % NVFP4_BLOCK:
        raise ValueError(f"kvcal.torch.evaluation: NVFP4 needs a last dimension divisible by 16 "
                         f"(vLLM requires head_size % 16 == 0), got {x.shape[-1]}")
    k_scale = torch.as_tensor(scale, dtype=torch.float32).reshape(-1)
    if k_scale.numel() != 1:
        raise ValueError("kvcal.torch.evaluation: NVFP4 takes one checkpoint scale per tensor, got "
                         f"{k_scale.numel()}")
    k_scale = k_scale[0].to(x.device)
    gs = 1.0 / k_scale
    if not (math.isfinite(float(k_scale)) and float(k_scale) > 0 and math.isfinite(float(gs))):
        raise ValueError(f"kvcal.torch.evaluation: NVFP4 checkpoint scale {float(k_scale)} is not finite "
                         "and > 0 with a finite reciprocal")
    b = x.float().reshape(-1, NVFP4_BLOCK)
    vmax = b.abs().nan_to_num(nan=0.0, posinf=math.inf).amax(dim=1)
    sf, out, sf_value = _nvfp4_candidate(gs, vmax, 6.0)
    max4 = torch.zeros_like(vmax, dtype=torch.bool)
    if four_over_six:
        sf4, out4, sf_value4 = _nvfp4_candidate(gs, vmax, 4.0)
        max4 = _nvfp4_error(b, out4) < _nvfp4_error(b, out)
        sf, out = torch.where(max4, sf4, sf), torch.where(max4, out4, out)
        sf_value = torch.where(max4, sf_value4, sf_value)
    q = e2m1_round(b * out[:, None])
    y = ((q * sf[:, None]) * k_scale).reshape(x.shape).to(x.dtype)
    if not return_blocks:
        return y
    shape = x.shape[:-1] + (x.shape[-1] // NVFP4_BLOCK,)
    return y, sf.reshape(shape), (sf_value > QMAX).reshape(shape), max4.reshape(shape)


def _head_scales(scales, layer: int, role: str, heads: int, kv_heads: int,
                 q_per_kv_group: bool) -> Optional[torch.Tensor]:
    """[1, heads, 1, 1] float32 scales of (layer, role), or None (absent)."""
    if scales is None:
        return torch.ones(1, heads, 1, 1)
    name = f"model.layers.{layer}.self_attn.{role}_scale"
    if name not in scales:
        return None
    s = torch.as_tensor(np.asarray(scales[name], dtype=np.float32)).reshape(-1)
    if s.numel() == 1:
        s = s.expand(heads)
    elif role == "q" and s.numel() == kv_heads and heads != kv_heads:
        s = s.repeat_interleave(heads // kv_heads)
    elif role == "q" and q_per_kv_group and heads != kv_heads:
        s = s.view(kv_heads, -1).amax(dim=1).repeat_interleave(heads // kv_heads)
    if s.numel() != heads:
        raise ValueError(f"kvcal.torch.evaluation: {name} has {s.numel()} values, the layer {heads} heads")
    return s.reshape(1, heads, 1, 1).clone()


def _attention(module, q, k, v, mask, scaling, quantize_probs):
    """Eager attention: softmax(q kᵀ · scaling + mask) · v, in float32.
    Returns [batch, tokens, heads, dim]."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    w = torch.matmul(q.float(), k.float().transpose(2, 3)) * scaling
    if mask is not None:
        m = mask[:, :, :, : k.shape[-2]]
        w = w.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else w + m.float()
    p = torch.softmax(w, dim=-1)
    if quantize_probs:
        p = p.to(torch.float8_e4m3fn).float()
    return torch.matmul(p, v.float()).transpose(1, 2).contiguous()


@dataclass
class RunFigures:
    nll: float            # mean negative log-likelihood per predicted token (nats)
    tokens: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll)


@dataclass
class Evaluation:
    """What evaluate() measured; arrays are [layers, heads] (q: query heads,
    k/v: KV heads; attention_error: query heads)."""
    granularity: str
    observer: str
    kv_only: bool
    quantize_probs: bool
    q_per_kv_group: bool
    attention_error: np.ndarray
    attention_error_ones: np.ndarray
    saturation: Dict[str, np.ndarray]
    subnormal: Dict[str, np.ndarray]
    saturation_ones: Dict[str, np.ndarray]
    subnormal_ones: Dict[str, np.ndarray]
    absmax: Dict[str, np.ndarray]
    runs: Dict[str, RunFigures] = field(default_factory=dict)
    # The finalize options the scales were made with (Scales.metadata's
    # observer_options: percentile, margin, ...), and a free label.
    options: Dict[str, object] = field(default_factory=dict)
    label: str = ""
    # The scales applied, per role [layers, heads] (q per query head, after
    # any reduction per KV group); NaN where a role had no scale.
    scales: Dict[str, np.ndarray] = field(default_factory=dict)
    # The K/V cache format emulated: fp8, nvfp4 or nvfp4_4over6 (Q, when
    # quantized, is FP8 in all three).
    kv_format: str = "fp8"

    def delta_nll(self, run: str = "calibrated") -> float:
        return self.runs[run].nll - self.runs["reference"].nll

    def summary(self) -> str:
        r = self.runs
        lines = [f"{self.observer} per {self.granularity}"
                 f"{', K/V only' if self.kv_only else ''}"
                 f"{', K/V ' + self.kv_format if self.kv_format != 'fp8' else ''}"
                 f"{', FP8 probabilities' if self.quantize_probs else ''}: "
                 f"attention error {100 * float(np.mean(self.attention_error)):.2f}% mean, "
                 f"{100 * float(np.max(self.attention_error)):.2f}% worst head; "
                 f"scale 1.0: {100 * float(np.mean(self.attention_error_ones)):.2f}% mean"]
        lines.append(f"perplexity: reference {r['reference'].perplexity:.4f}, calibrated "
                     f"{r['calibrated'].perplexity:.4f} ({self.delta_nll():+.4f} nats/token), "
                     f"scale 1.0 {r['ones'].perplexity:.4f} ({self.delta_nll('ones'):+.4f})")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        def arr(a):
            return np.asarray(a, dtype=np.float64).round(8).tolist()
        return {
            "kvcal_evaluation_version": 1,
            "granularity": self.granularity, "observer": self.observer,
            "kv_only": self.kv_only, "quantize_probs": self.quantize_probs,
            "q_per_kv_group": self.q_per_kv_group,
            "options": self.options,
            "label": self.label or (f"{self.observer}, K/V {self.kv_format}"
                                    if self.kv_format != "fp8" else ""),
            "kv_format": self.kv_format,
            "attention_error": arr(self.attention_error),
            "attention_error_ones": arr(self.attention_error_ones),
            "saturation": {k: arr(v) for k, v in self.saturation.items()},
            "subnormal": {k: arr(v) for k, v in self.subnormal.items()},
            "saturation_ones": {k: arr(v) for k, v in self.saturation_ones.items()},
            "subnormal_ones": {k: arr(v) for k, v in self.subnormal_ones.items()},
            "absmax": {k: arr(v) for k, v in self.absmax.items()},
            "scales": {k: [[None if math.isnan(x) else float(x) for x in row] for row in v]
                       for k, v in self.scales.items()},
            "runs": {k: {"nll": v.nll, "perplexity": v.perplexity, "tokens": v.tokens}
                     for k, v in self.runs.items()},
        }

    def to_json(self, path: str) -> None:
        """Writes what ``kvcal report --eval`` reads (kvcal/_output.py: a
        temporary file beside ``path``, then rename; a link written through,
        a directory, device or FIFO refused)."""
        write_output_file(path, json.dumps(self.to_dict()).encode())


class _Quantizer:
    """Replaces the eager attention of every layer while active: fake-quantizes
    q/k/v with per-head scales and accumulates the error figures."""

    def __init__(self, model, scales, kv_only, quantize_probs, q_per_kv_group,
                 kv_format="fp8"):
        from kvcal.client import check_attention

        if kv_format not in KV_FORMATS:
            raise ValueError(f"kvcal.torch.evaluation: kv_format {kv_format!r} is not one of "
                             f"{', '.join(KV_FORMATS)}")
        self.kv_format = kv_format

        check_attention(model.config)  # ValueError naming the config key
        c = model.config
        self.layers = c.num_hidden_layers
        self.heads = c.num_attention_heads
        self.kv_heads = c.num_key_value_heads
        self.scales = {}
        for layer in range(self.layers):
            for role in "qkv":
                n = self.heads if role == "q" else self.kv_heads
                self.scales[(layer, role)] = _head_scales(scales, layer, role, n, self.kv_heads,
                                                          q_per_kv_group)
        if kv_format != "fp8":
            for (layer, role), sc in self.scales.items():
                if role != "q" and sc is not None and bool((sc != sc.reshape(-1)[0]).any()):
                    raise ValueError(
                        f"kvcal.torch.evaluation: {kv_format} takes one {role}_scale per layer (vLLM "
                        f"0.34's NVFP4 store kernel reads a single value); layer {layer} has "
                        "different scales per head")
        self.kv_only = kv_only
        self.quantize_probs = quantize_probs
        self.mask2d = None
        self.err = np.zeros((self.layers, self.heads))
        self.ref = np.zeros((self.layers, self.heads))
        z = lambda n: np.zeros((self.layers, n))  # noqa: E731
        self.count = {r: z(self.heads if r == "q" else self.kv_heads) for r in "qkv"}
        self.sat = {r: z(self.heads if r == "q" else self.kv_heads) for r in "qkv"}
        self.sub = {r: z(self.heads if r == "q" else self.kv_heads) for r in "qkv"}
        self.amax = {r: z(self.heads if r == "q" else self.kv_heads) for r in "qkv"}

    def _keep(self, batch, tokens, device=None):
        if self.mask2d is None:
            return torch.ones(batch, tokens, dtype=torch.bool, device=device)
        return (self.mask2d[:, -tokens:] != 0).to(device)

    def attention(self, module, q, k, v, mask, scaling=None, dropout=0.0, **kwargs):
        layer = module.layer_idx
        scaling = module.scaling if scaling is None else scaling
        keep = self._keep(q.shape[0], q.shape[2], q.device)  # [batch, tokens]
        quantized = {}
        for role, x in (("q", q), ("k", k), ("v", v)):
            s = self.scales[(layer, role)]
            if s is None or (role == "q" and self.kv_only):
                quantized[role] = x
                continue
            s = s.to(x.device)  # the model may run on a GPU
            if role != "q" and self.kv_format != "fp8":
                y, sf, sat, _ = nvfp4_fake_quantize(x, s.reshape(-1)[:1],
                                                    self.kv_format == "nvfp4_4over6",
                                                    return_blocks=True)
                # Per block [batch, heads, tokens, dim / 16] -> kept tokens.
                live = x.float().abs().reshape(sf.shape + (NVFP4_BLOCK,)).amax(-1) > 0
                pick = lambda t: t[:, :, -q.shape[2]:].transpose(1, 2)[keep]  # noqa: E731
                sf, sat, live = pick(sf), pick(sat), pick(live)  # [n, heads, blocks]
                self.count[role][layer] += sf.shape[0] * sf.shape[2] * NVFP4_BLOCK
                self.sat[role][layer] += NVFP4_BLOCK * sat.sum(dim=(0, 2)).cpu().numpy()
                self.sub[role][layer] += NVFP4_BLOCK * (live & (sf < MIN_NORMAL)).sum(
                    dim=(0, 2)).cpu().numpy()
                self.amax[role][layer] = np.maximum(
                    self.amax[role][layer], pick(x.float().abs()).amax(dim=(0, 2)).cpu().numpy()
                    if sf.shape[0] else 0.0)
                quantized[role] = y
                continue
            t = (x.float() / s).abs()[:, :, -q.shape[2]:].transpose(1, 2)[keep]  # [n, heads, dim]
            self.count[role][layer] += t.shape[0] * t.shape[2]
            self.sat[role][layer] += (t > SATURATED).sum(dim=(0, 2)).cpu().numpy()
            self.sub[role][layer] += ((t > 0) & (t < MIN_NORMAL)).sum(dim=(0, 2)).cpu().numpy()
            self.amax[role][layer] = np.maximum(
                self.amax[role][layer], x.float().abs()[:, :, -q.shape[2]:].transpose(1, 2)[keep]
                .amax(dim=(0, 2)).cpu().numpy() if t.shape[0] else 0.0)
            quantized[role] = fake_quantize(x, s)
        ref = _attention(module, q, k, v, mask, scaling, False)
        out = _attention(module, quantized["q"], quantized["k"], quantized["v"], mask, scaling,
                         self.quantize_probs)
        d = (out - ref)[keep]  # [n, heads, dim]
        self.err[layer] += d.pow(2).sum(dim=(0, 2)).double().cpu().numpy()
        self.ref[layer] += ref[keep].pow(2).sum(dim=(0, 2)).double().cpu().numpy()
        return out.to(q.dtype), None

    def applied_scales(self):
        out = {}
        for role in "qkv":
            rows = []
            for layer in range(self.layers):
                s = self.scales[(layer, role)]
                n = self.heads if role == "q" else self.kv_heads
                rows.append(np.full(n, np.nan) if s is None else s.reshape(-1).double().numpy())
            out[role] = np.stack(rows)
        return out

    def shares(self):
        sat = {r: self.sat[r] / np.maximum(self.count[r], 1) for r in "qkv"}
        sub = {r: self.sub[r] / np.maximum(self.count[r], 1) for r in "qkv"}
        return sat, sub, np.sqrt(self.err / np.maximum(self.ref, 1e-30))


@contextlib.contextmanager
def _eager(model):
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


@contextlib.contextmanager
def _installed(model, quantizer):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    mapping = type(ALL_ATTENTION_FUNCTIONS)._global_mapping
    had = "eager" in mapping
    old = mapping.get("eager")

    def hook(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if mask is None and len(args) > 1:
            mask = args[1]
        quantizer.mask2d = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None

    mapping["eager"] = quantizer.attention
    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()
        if had:
            mapping["eager"] = old
        else:
            mapping.pop("eager", None)


def _as_inputs(batch):
    if isinstance(batch, dict):
        ids = batch["input_ids"]
        return ids, batch.get("attention_mask")
    return batch, None


def _nll(model, batches) -> RunFigures:
    total, count = 0.0, 0
    for batch in batches:
        ids, mask = _as_inputs(batch)
        kwargs = {"use_cache": False}
        if mask is not None:
            kwargs["attention_mask"] = mask
        with torch.no_grad():
            logits = model(ids, **kwargs).logits.float()
        logp = torch.log_softmax(logits[:, :-1], dim=-1)
        target = ids[:, 1:]
        picked = logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        valid = torch.ones_like(target, dtype=torch.bool)
        if mask is not None:
            valid = (mask[:, 1:] != 0) & (mask[:, :-1] != 0)
        total -= float(picked[valid].double().sum())
        count += int(valid.sum())
    return RunFigures(nll=total / max(count, 1), tokens=count)


def evaluate(model, scales, batches: Iterable, *, kv_only: bool = False,
             quantize_probs: bool = False, q_per_kv_group: bool = True,
             reference: Optional[RunFigures] = None,
             ones: Optional["Evaluation"] = None, kv_format: str = "fp8") -> Evaluation:
    """Measures FP8 Q/K/V under `scales` (a kvcal.Scales or any mapping of
    checkpoint scale names to arrays) on `batches`; see the module docs.
    Pass `reference` (a previous result's runs["reference"]) to skip the
    unquantized run on the same batches, and `ones` (a previous result on the
    same batches with the same kv_only, quantize_probs and kv_format) to reuse
    its scale-1.0 run. `kv_format`: "fp8", "nvfp4" or "nvfp4_4over6" for K
    and V (module docs)."""
    batches = list(batches)
    if kv_format not in KV_FORMATS:
        raise ValueError(f"kvcal.torch.evaluation: kv_format {kv_format!r} is not one of "
                         f"{', '.join(KV_FORMATS)}")
    if ones is not None and (ones.kv_only, ones.quantize_probs, ones.kv_format) != (
            kv_only, quantize_probs, kv_format):
        raise ValueError(f"kvcal.torch.evaluation: `ones` was measured with kv_only={ones.kv_only}, "
                         f"quantize_probs={ones.quantize_probs}, kv_format={ones.kv_format}; "
                         f"this run has kv_only={kv_only}, quantize_probs={quantize_probs}, "
                         f"kv_format={kv_format}")
    runs: Dict[str, RunFigures] = {}
    with _eager(model):
        if reference is None:
            reference = _nll(model, batches)
        runs["reference"] = reference
        calibrated = _Quantizer(model, scales, kv_only, quantize_probs, q_per_kv_group,
                                kv_format)
        with _installed(model, calibrated):
            runs["calibrated"] = _nll(model, batches)
        if ones is None:
            at_one = _Quantizer(model, None, kv_only, quantize_probs, q_per_kv_group,
                                kv_format)
            with _installed(model, at_one):
                runs["ones"] = _nll(model, batches)
            sat1, sub1, err1 = at_one.shares()
        else:
            runs["ones"] = ones.runs["ones"]
            sat1, sub1, err1 = ones.saturation_ones, ones.subnormal_ones, ones.attention_error_ones
    sat, sub, err = calibrated.shares()
    try:
        options = json.loads(getattr(scales, "metadata", {}).get("observer_options", "{}"))
    except (TypeError, ValueError):
        options = {}
    return Evaluation(
        granularity=getattr(scales, "granularity", "tensor"),
        observer=getattr(scales, "observer", "?"), kv_only=kv_only,
        quantize_probs=quantize_probs, q_per_kv_group=q_per_kv_group,
        attention_error=err, attention_error_ones=err1, saturation=sat, subnormal=sub,
        saturation_ones=sat1, subnormal_ones=sub1, absmax=calibrated.amax, runs=runs,
        options=options, scales=calibrated.applied_scales(), kv_format=kv_format)


def rescale_keys(model, alpha: float):
    """Multiplies every attention layer's K projection by `alpha` and divides
    its Q projection by `alpha`, in place: q·k (RoPE is a rotation, linear)
    and so the model's function are unchanged in exact arithmetic, while |K|
    grows by alpha. With alpha large enough that |K| passes 448, scale 1.0
    saturates the FP8 KV cache and calibration decides the result."""
    with torch.no_grad():
        for module in model.modules():
            if not type(module).__name__.endswith("Attention"):
                continue
            if not (hasattr(module, "k_proj") and hasattr(module, "q_proj")):
                continue
            module.k_proj.weight.mul_(alpha)
            module.q_proj.weight.div_(alpha)
            if getattr(module.k_proj, "bias", None) is not None:
                module.k_proj.bias.mul_(alpha)
            if getattr(module.q_proj, "bias", None) is not None:
                module.q_proj.bias.div_(alpha)
    return model
