"""kvcal-calibrate's choice of setting, measured on held-out text.

Candidates (build_candidates): every requested observer x granularity as
the worker finalizes it, each with Q, K and V fake-quantized and with K and
V only; scale 1.0 for all (what vLLM uses when a checkpoint has no scales);
and llm-compressor's default KV-cache recipe computed as its default
observer does (LLMC_DEFAULT below).

Score (score): the model's mean negative log-likelihood per held-out token
with the candidate's Q/K/V fake-quantized to FP8 e4m3fn inside the model
(kvcal.torch.evaluate's quantizer: x / scale clamped to +-448, rounded,
times scale; per head with q reduced per KV group as vLLM loads it), minus
the unquantized model's on the same tokens: Delta nats/token. Its standard
error is taken over blocks of BLOCK consecutive tokens of one sample
(neighbouring tokens' losses are correlated, so a per-token standard error
would claim too much): SE = sqrt(k/(k-1) * sum_b (D_b - Delta n_b)^2) / n
over the k blocks with D_b the block's summed differences and n_b its
tokens. Two candidates are compared on their paired per-token differences
the same way.

Choice (choose): the candidate with the lowest Delta is the best; the
chosen one is the simplest candidate whose Delta is within Z standard
errors of the best's (paired). "Simpler", in this order of importance:
scale 1.0 < per tensor < per head; K/V only < Q too; then the observer:
static min-max < EMA min-max < memoryless min-max < MSE < percentile;
kvcal's own finalize before llm-compressor's recipe.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from kvcal import names

BLOCK = 32
Z = 2.0
# The observers, simplest first, and the names people read: the proto's
# observer table (kvcal.names.OBSERVER_TABLE).
OBSERVER_ORDER = tuple(row.name for row in names.OBSERVER_TABLE)
OBSERVER_LABELS = {row.name: row.label for row in names.OBSERVER_TABLE}
GRANULARITY_ORDER = ("one", "tensor", "head")
# llm-compressor 0.14's default KV-cache recipe, kv_cache_scheme
# {num_bits: 8, type: float, strategy: tensor, symmetric: true, dynamic: false}
# with no observer named: compressed_tensors' _apply_kv_cache_scheme hooks K
# and V only (no query hook without an attention scheme), and
# llmcompressor/modifiers/quantization/calibration.py initialize_observer
# gives an activation whose observer is None "minmax" (MinMaxObserver in
# llmcompressor/observers/min_max.py: an EMA of per-batch min/max,
# averaging_constant 0.01), per tensor. The checkpoint then has no q_scale:
# vLLM quantizes the query with 1.0 where its backend quantizes the query.
LLMC_DEFAULT = "llm-compressor default"
LLMC_RECIPE = ("llm-compressor 0.14's kv_cache_scheme without an observer: EMA min-max "
               "(\"minmax\", averaging constant 0.01) on K and V per tensor, no q_scale, so vLLM "
               "uses 1.0 for the query")


@dataclass
class Candidate:
    observer: Optional[str]         # None: scale 1.0
    granularity: str                # one | tensor | head
    kv_only: bool
    scales: Optional[object] = None  # kvcal.Scales (None: 1.0 everywhere)
    origin: str = "kvcal"           # kvcal | llm-compressor default | scale 1.0
    same_as: Optional["Candidate"] = None  # evaluated as that one (identical)
    evaluation: Optional[object] = None    # kvcal.torch.Evaluation
    nll: Optional[np.ndarray] = None       # per held-out token
    delta: float = math.nan
    se: float = math.nan
    chosen: bool = False
    best: bool = False
    note: str = ""

    @property
    def label(self) -> str:
        quantized = "K, V" if self.kv_only else "Q, K, V"
        if self.observer is None:
            return f"scale 1.0, {quantized}"
        if self.origin == LLMC_DEFAULT:
            return f"{LLMC_DEFAULT}, {quantized}"
        return f"{OBSERVER_LABELS.get(self.observer, self.observer)} per {self.granularity}, {quantized}"

    @property
    def key(self) -> str:
        return f"{self.origin}/{self.observer}/{self.granularity}/{'kv' if self.kv_only else 'qkv'}"

    def complexity(self) -> tuple:
        obs = OBSERVER_ORDER.index(self.observer) if self.observer in OBSERVER_ORDER else -1
        return (GRANULARITY_ORDER.index(self.granularity), 0 if self.kv_only else 1, obs,
                0 if self.origin != LLMC_DEFAULT else 1)

    @property
    def attention_error(self) -> float:
        if self.evaluation is None:
            return math.nan
        return float(np.mean(self.evaluation.attention_error))

    def to_dict(self) -> dict:
        def num(x):
            return None if x is None or (isinstance(x, float) and math.isnan(x)) else x
        return {"label": self.label, "origin": self.origin, "observer": self.observer,
                "granularity": self.granularity, "kv_only": self.kv_only,
                "delta_nll": num(self.delta), "delta_nll_se": num(self.se),
                "attention_error_mean": num(self.attention_error),
                "same_as": self.same_as.label if self.same_as else None,
                "chosen": self.chosen, "best": self.best, "note": self.note or None}


def mean_se(d: np.ndarray, blocks: np.ndarray):
    """(mean, standard error) of per-token values `d` over `blocks` (see
    the module docs)."""
    n = d.size
    if n == 0:
        return math.nan, math.nan
    sums = np.bincount(blocks, weights=d)
    counts = np.bincount(blocks).astype(np.float64)
    mean = float(sums.sum() / n)
    keep = counts > 0
    k = int(keep.sum())
    if k < 2:
        return mean, math.nan
    resid = sums[keep] - mean * counts[keep]
    return mean, float(math.sqrt(k / (k - 1) * float((resid ** 2).sum())) / n)


def ones_scales(geometry, per_role=("q", "k", "v")):
    """Scales of 1.0 per tensor for every (layer, role) in per_role."""
    from kvcal import Scales

    tensors = {f"model.layers.{l}.self_attn.{r}_scale": np.ones(1, np.float32)
               for l in range(geometry.num_layers) for r in per_role}
    return Scales(tensors, granularity="tensor", observer="scale_one",
                  metadata={"kvcal_calibrate": "scale 1.0 (vLLM's default without scales)"})


def llmc_scales(ema_tensor_scales):
    """llm-compressor's default: EMA min-max K/V per tensor; q 1.0."""
    from kvcal import Scales

    tensors = {}
    for name, value in ema_tensor_scales.items():
        tensors[name] = (np.ones(1, np.float32) if name.endswith(".q_scale")
                         else np.asarray(value, np.float32))
    meta = dict(ema_tensor_scales.metadata)
    meta["kvcal_calibrate"] = "llm-compressor default recipe: minmax (EMA) K/V per tensor, q 1.0"
    return Scales(tensors, granularity="tensor", observer="minmax", metadata=meta)


def build_candidates(finalize: Callable, geometry, observers: Sequence[str],
                     granularities: Sequence[str], kv_modes: Sequence[bool],
                     llmc: bool = True) -> List[Candidate]:
    """Every candidate; `finalize(observer, granularity)` returns Scales."""
    out: List[Candidate] = []
    for kv_only in kv_modes:
        out.append(Candidate(None, "one", kv_only, ones_scales(geometry), origin="scale 1.0"))
    cache: Dict[tuple, object] = {}

    def scales_of(observer, granularity):
        if (observer, granularity) not in cache:
            cache[(observer, granularity)] = finalize(observer, granularity)
        return cache[(observer, granularity)]

    for granularity in granularities:
        for observer in observers:
            scales = scales_of(observer, granularity)
            for kv_only in kv_modes:
                if granularity == "head" and kv_only:
                    continue  # per head runs on FA3 only, which quantizes the query
                out.append(Candidate(observer, granularity, kv_only, scales))
    if llmc:
        ema = scales_of("minmax", "tensor")
        scales = llmc_scales(ema)
        for kv_only in kv_modes:
            c = Candidate("minmax", "tensor", kv_only, scales, origin=LLMC_DEFAULT)
            if kv_only:  # q is not quantized: the same as EMA per tensor K/V
                for other in out:
                    if (other.origin == "kvcal" and other.observer == "minmax"
                            and other.granularity == "tensor" and other.kv_only):
                        c.same_as = other
            out.append(c)
    return out


def _token_nll(model, batches, blocks_from: int = 0):
    """Per-token NLL (float64) of the valid next-token predictions and the
    block id of each, in batch order."""
    import torch
    import torch.nn.functional as F

    values, blocks = [], []
    block = blocks_from
    with torch.no_grad():
        for b in batches:
            ids, mask = b.input_ids, b.attention_mask
            logits = model(ids, attention_mask=mask, use_cache=False).logits
            vocab = logits.shape[-1]
            nll = F.cross_entropy(logits[:, :-1].float().reshape(-1, vocab),
                                  ids[:, 1:].reshape(-1), reduction="none").view(ids.shape[0], -1)
            valid = (mask[:, 1:] != 0) & (mask[:, :-1] != 0)
            for row in range(ids.shape[0]):
                v = nll[row][valid[row]].double().cpu().numpy()
                values.append(v)
                blocks.append(block + np.arange(v.size) // BLOCK)
                block += max(1, -(-v.size // BLOCK))
            del logits, nll
    if not values:
        return np.zeros(0), np.zeros(0, np.int64)
    return np.concatenate(values), np.concatenate(blocks).astype(np.int64)


def score(model, batches: list, candidates: List[Candidate], progress=None,
          kv_format: str = "fp8", reference: Optional[dict] = None) -> dict:
    """Runs the reference and every candidate over the held-out `batches`;
    fills delta, se, nll and evaluation. Returns {"reference_nll", "tokens",
    "blocks", "reference"} (the last two per held-out token: block ids and the
    unquantized loss).
    `kv_format` ("fp8", "nvfp4", "nvfp4_4over6"): the K/V cache emulated
    (kvcal.torch.evaluate's; NVFP4 takes per-tensor K/V scales only).
    `reference`: a previous score()'s result on the same `batches`, whose
    unquantized pass is reused instead of run again. A scale 1.0 candidate
    with each kv_only of the others must be among `candidates` (their
    evaluations compare against it)."""
    from kvcal.torch import evaluation as ev

    with ev._eager(model):
        if reference is not None:
            ref, blocks = reference["reference"], reference["blocks"]
        else:
            ref, blocks = _token_nll(model, batches)
            if progress:
                progress()
        reference = ev.RunFigures(nll=float(ref.mean()) if ref.size else math.nan, tokens=int(ref.size))
        ones_runs: Dict[bool, tuple] = {}
        for c in sorted(candidates, key=lambda c: c.observer is not None):  # scale 1.0 first
            if c.same_as is not None:
                continue
            q = ev._Quantizer(model, None if c.observer is None else c.scales, c.kv_only,
                              False, True, kv_format)
            with ev._installed(model, q):
                nll, _ = _token_nll(model, batches)
            if progress:
                progress()
            c.nll = nll
            c.delta, c.se = mean_se(nll - ref, blocks)
            sat, sub, err = q.shares()
            if c.observer is None:
                ones_runs[c.kv_only] = (ev.RunFigures(float(nll.mean()), int(nll.size)), sat, sub, err)
            ones = ones_runs[c.kv_only]
            c.evaluation = ev.Evaluation(
                granularity="tensor" if c.granularity == "one" else c.granularity,
                observer=c.observer or "scale_one", kv_only=c.kv_only, quantize_probs=False,
                q_per_kv_group=True, attention_error=err, attention_error_ones=ones[3],
                saturation=sat, subnormal=sub, saturation_ones=ones[1], subnormal_ones=ones[2],
                absmax=q.amax,
                runs={"reference": reference,
                      "calibrated": ev.RunFigures(float(nll.mean()), int(nll.size)),
                      "ones": ones[0]},
                options=_options(c.scales), label=c.label, scales=q.applied_scales(),
                kv_format=kv_format)
        for c in candidates:
            if c.same_as is not None:
                s = c.same_as
                c.nll, c.delta, c.se, c.evaluation = s.nll, s.delta, s.se, s.evaluation
    return {"reference_nll": reference.nll, "tokens": reference.tokens, "blocks": blocks,
            "reference": ref}


def _options(scales) -> dict:
    import json

    try:
        return json.loads(getattr(scales, "metadata", {}).get("observer_options", "{}"))
    except (TypeError, ValueError):
        return {}


def choose(candidates: List[Candidate], blocks: np.ndarray) -> Candidate:
    """The simplest candidate within Z paired standard errors of the
    lowest loss; sets `chosen`, `best` and a note on each."""
    scored = [c for c in candidates if c.nll is not None and c.same_as is None]
    best = min(scored, key=lambda c: (c.delta, c.complexity()))
    best.best = True
    chosen = best
    for c in sorted(scored, key=lambda c: c.complexity()):
        if c is best:
            break
        diff, se = mean_se(c.nll - best.nll, blocks)
        c.note = f"{diff:+.4f} +- {se:.4f} nats/token vs the best"
        if not math.isnan(se) and diff <= Z * se:
            chosen = c
            break
    chosen.chosen = True
    return chosen


def why(chosen: Candidate, candidates: List[Candidate], blocks: np.ndarray) -> str:
    best = next(c for c in candidates if c.best)
    if chosen is best:
        simpler = [c for c in candidates if c.same_as is None and c.nll is not None
                   and c.complexity() < chosen.complexity()]
        if not simpler:
            return "it has the lowest held-out loss and is the simplest candidate"
        return (f"it has the lowest held-out loss, and every simpler candidate is worse by more "
                f"than {Z:g} standard errors")
    diff, se = mean_se(chosen.nll - best.nll, blocks)
    return (f"the lowest held-out loss is {best.label}'s ({best.delta:+.4f}); this simpler setting "
            f"is within the noise of it ({diff:+.4f} +- {se:.4f} nats/token, within {Z:g} "
            f"standard errors)")


@contextlib.contextmanager
def nothing():
    yield
