"""Which layers to leave out of the quantized KV cache, measured.

vLLM 0.34 keeps chosen layers' KV cache in the model's dtype with the engine
argument ``--kv-cache-dtype-skip-layers`` (EngineArgs.kv_cache_dtype_skip_layers,
CacheConfig.kv_cache_dtype_skip_layers: a list of strings, argparse
``nargs="+"``, so the layers are separate words: ``--kv-cache-dtype-skip-layers
3 17``; ``3,17`` is one string that matches no layer and is silently
ignored). Attention.__init__ (model_executor/layers/attention/attention.py;
MLAAttention the same) sets the layer's cache dtype to "auto" when
``str(extract_layer_index(prefix))`` is in that list (the one integer in the
layer's module name, model.layers.3.self_attn.attn -> 3), or when the layer
has a sliding window and the list holds "sliding_window". A skipped layer
quantizes neither K, V nor the query (its query quantization follows its
cache dtype) and ignores the checkpoint's scales.

The rule (advise):

1. per layer, the candidate's held-out attention error (kvcal.torch.evaluation's
   relative RMS error of the attention output, mean over the layer's query
   heads) from the scoring run kvcal-calibrate already made;
2. outliers: layers whose error exceeds K_MEDIAN x the median layer's, the
   worst first, at most MAX_SHARE of the layers;
3. one more pass of the held-out windows with those layers' q/k/v scales
   left out (kvcal.torch.evaluation's "not quantized" for a role without a scale),
   the other layers as before;
4. advised only when that lowers the model's held-out loss measurably:
   the paired per-token gain (all quantized minus skipped) exceeds Z
   standard errors over blocks of 32 tokens (choice.mean_se).

The cost is cache bytes: a skipped layer stores its K and V in the model's
dtype (2 bytes per value for bf16/fp16) instead of 1 (FP8) or 9/16 (NVFP4:
4-bit values plus one e4m3 scale per 16, vLLM's nvfp4_kv_cache_full_dim);
``cache_ratio`` is the KV cache's bytes per token with the skip over those
with every layer quantized. vLLM may also raise the attention block size so
that one page of the quantized layers covers a page of the skipped ones
(Platform._align_heterogeneous_kv_block_size).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List

import numpy as np

from kvcal.calibrate import choice

K_MEDIAN = 3.0
MAX_SHARE = 0.25
Z = choice.Z
ARGUMENT = "--kv-cache-dtype-skip-layers"
# Bytes per cached K or V value in vLLM 0.34's cache formats.
VALUE_BYTES = {"fp8": 1.0, "nvfp4": 0.5625, "nvfp4_4over6": 0.5625}
SKIPPED_BYTES = 2.0  # bf16 / fp16, the model's dtype


@dataclass
class SkipAdvice:
    """What advise() measured. Errors are means over [layers, heads]."""
    kv_format: str
    layers: List[int]                   # advised layers ([] when no advice)
    tried: List[int]                    # the outliers re-scored ([] when none)
    layer_error: List[float]            # per layer, every layer quantized
    median: float
    k: float = K_MEDIAN
    delta: float = math.nan             # Δ nats/token, every layer quantized
    delta_se: float = math.nan
    delta_skip: float = math.nan        # Δ nats/token with `tried` unquantized
    delta_skip_se: float = math.nan
    gain: float = math.nan              # paired: delta - delta_skip
    gain_se: float = math.nan
    attention_error: float = math.nan
    attention_error_skip: float = math.nan
    worst_layer_error_skip: float = math.nan
    total_layers: int = 0
    reason: str = ""
    per_layer_skip: List[float] = field(default_factory=list)

    @property
    def advised(self) -> bool:
        return bool(self.layers)

    @property
    def cache_ratio(self) -> float:
        """KV cache bytes per token with `tried` skipped / all quantized."""
        n, s = self.total_layers, len(self.tried)
        if not n:
            return math.nan
        b = VALUE_BYTES[self.kv_format]
        return ((n - s) * b + s * SKIPPED_BYTES) / (n * b)

    @property
    def argument(self) -> str:
        """The vLLM argument ('' when nothing is advised)."""
        return argument(self.layers)

    def describe(self) -> List[str]:
        fmt = self.kv_format
        if not self.tried:
            return [f"skip layers ({fmt}): none advised: no layer's attention error exceeds "
                    f"{self.k:g} x the median layer's ({100 * self.median:.2f}%)"]
        errs = ", ".join(f"{l}: {100 * self.layer_error[l]:.2f}%" for l in self.tried)
        measured = (f"Δ {self.delta:+.4f} -> {self.delta_skip:+.4f} nats/token (gain "
                    f"{self.gain:+.4f} ± {self.gain_se:.4f}), attention error "
                    f"{100 * self.attention_error:.2f}% -> {100 * self.attention_error_skip:.2f}% "
                    f"mean, cache bytes x{self.cache_ratio:.3f}")
        if not self.advised:
            return [f"skip layers ({fmt}): none advised: the outliers ({errs}; median "
                    f"{100 * self.median:.2f}%) unquantized do not lower the held-out loss "
                    f"measurably: {measured}"]
        return [f"skip layers ({fmt}): {self.argument}",
                f"  layers whose attention error exceeds {self.k:g} x the median layer's "
                f"({100 * self.median:.2f}%): {errs}; unquantized: {measured}"]

    def to_dict(self) -> dict:
        def num(x):
            return None if x is None or (isinstance(x, float) and math.isnan(x)) else x
        return {"kv_format": self.kv_format, "advised": self.advised, "layers": self.layers,
                "argument": self.argument or None, "tried": self.tried,
                "rule": f"attention error > {self.k:g} x median layer, verified by re-scoring "
                        f"(gain > {Z:g} standard errors)",
                "median_layer_error": num(self.median),
                "layer_error": [round(float(e), 8) for e in self.layer_error],
                "delta_nll": num(self.delta), "delta_nll_se": num(self.delta_se),
                "delta_nll_skip": num(self.delta_skip), "delta_nll_skip_se": num(self.delta_skip_se),
                "gain": num(self.gain), "gain_se": num(self.gain_se),
                "attention_error_mean": num(self.attention_error),
                "attention_error_mean_skip": num(self.attention_error_skip),
                "cache_bytes_ratio": num(self.cache_ratio if self.tried else math.nan),
                "reason": self.reason}


def argument(layers) -> str:
    """vLLM 0.34's engine argument keeping `layers` unquantized."""
    if not layers:
        return ""
    return " ".join([ARGUMENT] + [str(int(l)) for l in sorted(layers)])


def outliers(layer_error, k: float = K_MEDIAN, max_share: float = MAX_SHARE) -> List[int]:
    """Layers whose error exceeds k x the median, worst first, at most
    max(1, floor(max_share x layers))."""
    e = np.asarray(layer_error, dtype=np.float64)
    if e.size == 0:
        return []
    median = float(np.median(e))
    picked = [int(l) for l in np.argsort(-e, kind="stable") if e[l] > k * median]
    return picked[:max(1, int(max_share * e.size))]


def without_layers(scales, layers) -> dict:
    """The scale tensors of `scales` less every q/k/v scale of `layers`."""
    drop = {f"model.layers.{l}.self_attn.{r}_scale" for l in layers for r in "qkv"}
    return {name: value for name, value in scales.items() if name not in drop}


def advise(model, batches: list, candidate: "choice.Candidate", reference: np.ndarray,
           blocks: np.ndarray, kv_format: str = "fp8", k: float = K_MEDIAN,
           max_share: float = MAX_SHARE) -> SkipAdvice:
    """The skip-layer advice for a scored `candidate` (choice.score
    filled its nll and evaluation on `batches`; `reference` and `blocks` are
    score's per-token unquantized loss and block ids). Runs the held-out
    batches once more when a layer is an outlier."""
    from kvcal.torch import evaluation as ev

    if candidate.evaluation is None or candidate.nll is None:
        raise ValueError("kvcal skip layers: the candidate has not been scored")
    err = np.asarray(candidate.evaluation.attention_error, dtype=np.float64)
    layer_error = err.mean(axis=1)
    median = float(np.median(layer_error))
    delta, delta_se = choice.mean_se(candidate.nll - reference, blocks)
    advice = SkipAdvice(kv_format=kv_format, layers=[], tried=[],
                        layer_error=[float(e) for e in layer_error], median=median, k=k,
                        delta=delta, delta_se=delta_se, attention_error=float(err.mean()),
                        total_layers=int(layer_error.size))
    tried = outliers(layer_error, k, max_share)
    if not tried:
        advice.reason = f"no layer's attention error exceeds {k:g} x the median layer's"
        return advice
    advice.tried = sorted(tried)
    scales = candidate.scales
    if scales is None:  # scale 1.0 candidates carry explicit ones; be safe
        from types import SimpleNamespace

        scales = choice.ones_scales(SimpleNamespace(num_layers=advice.total_layers))
    skipped = without_layers(scales, tried)
    with ev._eager(model):
        q = ev._Quantizer(model, skipped, candidate.kv_only, False, True, kv_format)
        with ev._installed(model, q):
            nll, _ = choice._token_nll(model, batches)
    _, _, err_skip = q.shares()
    advice.delta_skip, advice.delta_skip_se = choice.mean_se(nll - reference, blocks)
    advice.gain, advice.gain_se = choice.mean_se(candidate.nll - nll, blocks)
    advice.attention_error_skip = float(err_skip.mean())
    per_layer = err_skip.mean(axis=1)
    advice.per_layer_skip = [float(e) for e in per_layer]
    advice.worst_layer_error_skip = float(per_layer.max())
    if not math.isnan(advice.gain_se) and advice.gain > Z * advice.gain_se and advice.gain > 0:
        advice.layers = sorted(tried)
        advice.reason = (f"unquantized, layers {', '.join(map(str, advice.layers))} lower the "
                         f"held-out loss by {advice.gain:.4f} ± {advice.gain_se:.4f} nats/token")
    else:
        advice.reason = (f"unquantized, the outliers lower the held-out loss by {advice.gain:+.4f}"
                         f" ± {advice.gain_se:.4f} nats/token: not more than {Z:g} standard errors")
    return advice
