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
from typing import Dict, Iterable, List, Optional

import numpy as np
import torch

from ._output import write_output_file

QMAX = 448.0
MIN_NORMAL = 2.0 ** -6  # e4m3fn's smallest normal
SATURATED = QMAX * (1 + 2.0 ** -20)  # x / absmax * 448 may round a ulp above 448


def fake_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale clamped to ±448, rounded to e4m3fn, times scale (float32)."""
    x32 = x.float()
    return ((x32 / scale).clamp(-QMAX, QMAX).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)


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
        raise ValueError(f"kvcal.evaluate: {name} has {s.numel()} values, the layer {heads} heads")
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

    def delta_nll(self, run: str = "calibrated") -> float:
        return self.runs[run].nll - self.runs["reference"].nll

    def summary(self) -> str:
        r = self.runs
        lines = [f"{self.observer} per {self.granularity}"
                 f"{', K/V only' if self.kv_only else ''}"
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
            "options": self.options, "label": self.label,
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

    def __init__(self, model, scales, kv_only, quantize_probs, q_per_kv_group):
        from kvcal.client import check_attention

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
             ones: Optional["Evaluation"] = None) -> Evaluation:
    """Measures FP8 Q/K/V under `scales` (a kvcal.Scales or any mapping of
    checkpoint scale names to arrays) on `batches`; see the module docs.
    Pass `reference` (a previous result's runs["reference"]) to skip the
    unquantized run on the same batches, and `ones` (a previous result on the
    same batches with the same kv_only and quantize_probs) to reuse its
    scale-1.0 run."""
    batches = list(batches)
    if ones is not None and (ones.kv_only, ones.quantize_probs) != (kv_only, quantize_probs):
        raise ValueError(f"kvcal.evaluate: `ones` was measured with kv_only={ones.kv_only}, "
                         f"quantize_probs={ones.quantize_probs}; this run has kv_only={kv_only}, "
                         f"quantize_probs={quantize_probs}")
    runs: Dict[str, RunFigures] = {}
    with _eager(model):
        if reference is None:
            reference = _nll(model, batches)
        runs["reference"] = reference
        calibrated = _Quantizer(model, scales, kv_only, quantize_probs, q_per_kv_group)
        with _installed(model, calibrated):
            runs["calibrated"] = _nll(model, batches)
        if ones is None:
            at_one = _Quantizer(model, None, kv_only, quantize_probs, q_per_kv_group)
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
        options=options, scales=calibrated.applied_scales())


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
