"""Skip-layer advice on SmolLM2-135M-Instruct and its large-key variant
(docs/quality.md, "Which layers to leave unquantized").

    OMP_NUM_THREADS=1 PYTHONPATH=python python bench/python/bench_skip_layers.py \\
        [--cal-batches 4] [--eval-batches 2] [--batch-size 2] [--seq 256]

For the original model and the large-key variant (kvcal.torch.rescale_keys
x64, as tests/python/test_quality.py builds it): calibrates static min-max per
tensor through a CPU worker on GPL-3 (tests/python/smollm2.py's text and
model), scores on GPL-2 + Apache-2.0 with kvcal.calibrate.choice.score (what
kvcal-calibrate scores with) for FP8 Q/K/V, FP8 K/V only and NVFP4 K/V only,
and runs kvcal.calibrate.skip_layers.advise on kvcal's scales and on scale 1.0 (kvcal-calibrate's rule: attention error
above 3x the median layer's, verified by re-scoring). Where the rule finds no
outlier, the worst layer alone is re-scored unquantized anyway, to show what
skipping it would buy. Prints one table row per (variant, format): Δ
nats/token ± standard error and mean attention error with every layer
quantized and with the skip, the paired gain, and the KV cache bytes per
token with the skip over all-quantized. Needs a built worker
(KVCAL_BUILD_DIR, default build/).
"""
import os
import sys
import tempfile
import time
from types import SimpleNamespace

import numpy as np
import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))

import kvcal.torch  # noqa: E402
from kvcal.calibrate import choice as calibrate_select, skip_layers  # noqa: E402

ALPHA = 64.0
MODES = (("FP8 Q, K, V", "fp8", False), ("FP8 K, V", "fp8", True), ("NVFP4 K, V", "nvfp4", True))


def main():
    from conftest import Worker
    from quality_table import calibrate, smollm2_bench_inputs

    start = time.monotonic()
    a, model, cal, held = smollm2_bench_inputs()
    layers = model.config.num_hidden_layers
    ones = calibrate_select.ones_scales(SimpleNamespace(num_layers=layers))
    rows, per_layer, tokens = [], {}, 0
    worker = Worker(tempfile.mkdtemp(prefix="kvcal-skip-")).start()
    try:
        for variant in ("SmolLM2", f"large keys (x{ALPHA:g})"):
            if variant != "SmolLM2":
                kvcal.torch.rescale_keys(model, ALPHA)
            client = calibrate(worker, model, cal)
            static = client.finalize(observer="static_minmax", granularity="tensor")
            client.delete()
            for name, kv_format, kv_only in MODES:
                one = calibrate_select.Candidate(None, "one", kv_only, ones, origin="scale 1.0")
                cand = calibrate_select.Candidate("static_minmax", "tensor", kv_only, static)
                out = calibrate_select.score(model, held, [one, cand], kv_format=kv_format)
                tokens = out["tokens"]
                for scales, c in (("kvcal", cand), ("1.0", one)):
                    advice = skip_layers.advise(model, held, c, out["reference"], out["blocks"],
                                                kv_format)
                    forced = None
                    if not advice.tried:  # what skipping the worst layer alone would buy
                        forced = skip_layers.advise(model, held, c, out["reference"],
                                                    out["blocks"], kv_format, k=0.0,
                                                    max_share=1.0 / layers)
                    rows.append((variant, f"{name}, scale {scales}", advice, forced))
                    per_layer[(variant, f"{name}, scale {scales}")] = advice.layer_error
                    print(f"  {variant}, {name}, scale {scales}: " + " | ".join(advice.describe()),
                          flush=True)
    finally:
        worker.stop()

    print(f"\nSmolLM2-135M-Instruct, static min-max per tensor calibrated on {a.cal_batches} x "
          f"{a.batch_size} x {a.seq} tokens (GPL-3), scored on {a.eval_batches} x "
          f"{a.batch_size} x {a.seq} held out (GPL-2, Apache-2.0), {tokens} predicted tokens\n")
    print("| model | cache | worst layer / median (error) | advised | Δ nats/token all "
          "quantized | with the skip | gain ± se | attention error all / with the skip | "
          "cache bytes |")
    print("|---|---|---|---|---|---|---|---|---|")
    for variant, name, advice, forced in rows:
        e = np.asarray(advice.layer_error)
        worst = int(e.argmax())
        shown = advice if advice.tried else forced
        label = (advice.argument or "none") if advice.tried else "none (no outlier)"
        skipped = ",".join(map(str, shown.tried))
        print(f"| {variant} | {name} | {worst} / {e.max() / advice.median:.2f}x "
              f"({100 * e.max():.2f}% vs {100 * advice.median:.2f}%) | {label} | "
              f"{advice.delta:+.4f} ± {advice.delta_se:.4f} | "
              f"{shown.delta_skip:+.4f} ± {shown.delta_skip_se:.4f} (skip {skipped}) | "
              f"{shown.gain:+.4f} ± {shown.gain_se:.4f} | "
              f"{100 * shown.attention_error:.2f}% / {100 * shown.attention_error_skip:.2f}% | "
              f"x{shown.cache_ratio:.3f} |")
    print("\nAttention error per layer, every layer quantized (mean over the query heads):\n")
    keys = list(per_layer)
    print("| layer | " + " | ".join(f"{v}, {n}" for v, n in keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for layer in range(layers):
        print(f"| {layer} | " + " | ".join(f"{100 * per_layer[k][layer]:.2f}%" for k in keys)
              + " |")
    print(f"\n({time.monotonic() - start:.0f} s)")


if __name__ == "__main__":
    main()
