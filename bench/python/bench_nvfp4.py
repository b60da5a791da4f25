"""NVFP4 vs FP8 KV cache on SmolLM2-135M-Instruct, per layer
(docs/quality.md, "NVFP4 KV cache vs FP8").

    PYTHONPATH=python python bench/python/bench_nvfp4.py [--cal-batches 4] \\
        [--eval-batches 2] [--batch-size 2] [--seq 256] [--keys-times 64]

--keys-times A runs it on the large-key variant (kvcal.torch.rescale_keys:
every key times A, the model's output unchanged).

Calibrates static min-max per tensor through a CPU worker on GPL-3
(tests/python/smollm2.py's text and model), then scores on GPL-2 +
Apache-2.0 with K and V fake-quantized (Q and P left alone: the FlashInfer
FA2 path, bf16 query) by kvcal.calibrate.choice.score, the same code
kvcal-calibrate scores with:

- FP8 e4m3 per tensor: scale 1.0 and kvcal's static min-max (amax / 448);
- NVFP4 (vLLM 0.34's store kernel, kernels/nvfp4.h) with the global scale
  from k_scale / v_scale = 1.0, = amax / 448 of the held-out text itself
  (what a ModelOpt export calibrated on exactly these tokens would hold) and
  = kvcal's static min-max (amax / 448 of the calibration text);
- nvfp4_4over6 with 1.0 and kvcal's scales.

Prints Δ nats/token ± its standard error (over blocks of 32 tokens, as
kvcal-calibrate), the mean attention error per layer for each, and the share
of V values whose NVFP4 block scale falls below e4m3's normals at scale 1.0.
Needs a built worker (KVCAL_BUILD_DIR, default build/).
"""
import os
import sys
import tempfile
import time
from types import SimpleNamespace

import numpy as np

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))

import kvcal  # noqa: E402
import kvcal.torch  # noqa: E402
from kvcal.calibrate import choice as calibrate_select  # noqa: E402


def per_tensor(amax_k, amax_v, label):
    """Scales with k/v = amax / 448 per layer (q 1.0: not quantized here)."""
    tensors = {}
    for layer, (k, v) in enumerate(zip(amax_k, amax_v)):
        tensors[f"model.layers.{layer}.self_attn.q_scale"] = np.ones(1, np.float32)
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = np.float32([k / 448])
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = np.float32([v / 448])
    return kvcal.Scales(tensors, granularity="tensor", observer=label)


def main():
    from conftest import Worker
    from quality_table import calibrate, smollm2_bench_inputs

    start = time.monotonic()
    a, model, cal, held_out = smollm2_bench_inputs()
    if a.keys_times != 1.0:
        kvcal.torch.rescale_keys(model, a.keys_times)
    layers = model.config.num_hidden_layers
    worker = Worker(tempfile.mkdtemp(prefix="kvcal-nvfp4-")).start()
    try:
        client = calibrate(worker, model, cal)
        static = client.finalize(observer="static_minmax", granularity="tensor")
        client.delete()
    finally:
        worker.stop()
    ones = calibrate_select.ones_scales(SimpleNamespace(num_layers=layers))

    def run(kv_format, named):
        cands = [calibrate_select.Candidate(None, "one", True, ones, origin="scale 1.0")]
        for label, scales in named:
            cands.append(calibrate_select.Candidate("static_minmax", "tensor", True, scales))
            cands[-1].note = label
        out = calibrate_select.score(model, held_out, cands, kv_format=kv_format)
        cands[0].note = "1.0"
        return {c.note: c for c in cands}, out

    fp8, info = run("fp8", [("kvcal static min-max", static)])
    amax = fp8["kvcal static min-max"].evaluation.absmax  # held-out |K|, |V| per head
    oracle = per_tensor(amax["k"].max(axis=1), amax["v"].max(axis=1), "held-out amax")
    nvfp4, _ = run("nvfp4", [("held-out amax / 448", oracle),
                             ("kvcal static min-max", static)])
    four, _ = run("nvfp4_4over6", [("kvcal static min-max", static)])

    columns = [("FP8 1.0", fp8["1.0"]), ("FP8 kvcal", fp8["kvcal static min-max"]),
               ("NVFP4 1.0", nvfp4["1.0"]), ("NVFP4 held-out amax/448",
                                              nvfp4["held-out amax / 448"]),
               ("NVFP4 kvcal", nvfp4["kvcal static min-max"]),
               ("4over6 1.0", four["1.0"]), ("4over6 kvcal", four["kvcal static min-max"])]
    variant = f" with keys x{a.keys_times:g}" if a.keys_times != 1.0 else ""
    print(f"SmolLM2-135M-Instruct{variant}, K/V only, calibration {a.cal_batches} x {a.batch_size} x "
          f"{a.seq} tokens (GPL-3), held out {a.eval_batches} x {a.batch_size} x {a.seq} "
          f"(GPL-2, Apache-2.0), {info['tokens']} predicted tokens, unquantized "
          f"{info['reference_nll']:.4f} nats/token\n")
    print("| K/V cache, global scale | Δ nats/token ± se | attention error mean / worst layer |")
    print("|---|---|---|")
    for name, c in columns:
        per_layer = c.evaluation.attention_error.mean(axis=1)
        print(f"| {name} | {c.delta:+.4f} ± {c.se:.4f} | {100 * per_layer.mean():.2f}% / "
              f"{100 * per_layer.max():.2f}% (layer {int(per_layer.argmax())}) |")
    print("\nAttention error per layer (mean over the 9 query heads):\n")
    print("| layer | " + " | ".join(n for n, _ in columns) + " | NVFP4 / FP8 (kvcal) |")
    print("|---" * (len(columns) + 2) + "|")
    for layer in range(layers):
        errs = [c.evaluation.attention_error[layer].mean() for _, c in columns]
        ratio = errs[4] / errs[1]
        print(f"| {layer} | " + " | ".join(f"{100 * e:.2f}%" for e in errs) + f" | {ratio:.2f} |")
    sub = nvfp4["1.0"].evaluation.subnormal
    print(f"\nNVFP4 at scale 1.0: values in blocks with a subnormal or zero e4m3 scale: V layer 0 "
          f"{100 * sub['v'][0].mean():.1f}%, V mean {100 * sub['v'].mean():.1f}%, K mean "
          f"{100 * sub['k'].mean():.1f}%; saturated: "
          f"{100 * max(nvfp4['1.0'].evaluation.saturation[r].max() for r in 'kv'):.3f}% at most")
    kmax, vmax = (448 * max(float(np.max(v)) for k, v in static.items() if k.endswith(suffix))
                  for suffix in ("k_scale", "v_scale"))
    print(f"calibration |K| max {kmax:.1f}, |V| max {vmax:.1f}")
    print(f"\n({time.monotonic() - start:.0f} s)")


if __name__ == "__main__":
    main()
