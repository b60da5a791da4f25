"""Scales computed directly from activations, the way docs/formats.md defines
them (independent of the worker), for comparison in the tests."""
import numpy as np

QMAX = {"float8_e4m3fn": 448.0, "float8_e4m3fnuz": 240.0, "float8_e5m2": 57344.0, "int8": 127.0}
EPS = np.finfo(np.float32).eps


def _scale(mn, mx, fmt="float8_e4m3fn"):
    mn, mx = min(mn, 0.0), max(mx, 0.0)
    s = np.float32(max(abs(mn), abs(mx))) / np.float32(QMAX[fmt])
    return np.float32(s) if s > 0 else np.float32(EPS)


def per_head_minmax(batches):
    """batches: list of arrays [B, H, S, D] (one per batch). Returns
    per-head (min, max) per batch: arrays [nbatches, H]."""
    mins = np.stack([b.astype(np.float32).min(axis=(0, 2, 3)) for b in batches])
    maxs = np.stack([b.astype(np.float32).max(axis=(0, 2, 3)) for b in batches])
    return mins, maxs


def observer_scales(batches, observer="static_minmax", granularity="head", c=0.01):
    mins, maxs = per_head_minmax(batches)
    if granularity == "tensor":
        mins, maxs = mins.min(axis=1, keepdims=True), maxs.max(axis=1, keepdims=True)
    out = []
    for h in range(mins.shape[1]):
        if observer == "static_minmax":
            mn, mx = mins[:, h].min(), maxs[:, h].max()
        elif observer == "memoryless_minmax":
            mn, mx = mins[-1, h], maxs[-1, h]
        elif observer == "minmax":
            # llm-compressor's lerp in float32: state * (1 - c) + batch * c.
            keep, cf = np.float32(1.0 - c), np.float32(c)
            mn, mx = np.float32(mins[0, h]), np.float32(maxs[0, h])
            for b in range(1, mins.shape[0]):
                mn = np.float32(np.float32(mn * keep) + np.float32(np.float32(mins[b, h]) * cf))
                mx = np.float32(np.float32(mx * keep) + np.float32(np.float32(maxs[b, h]) * cf))
        else:
            raise ValueError(observer)
        out.append(_scale(float(mn), float(mx)))
    return np.array(out, dtype=np.float32)
