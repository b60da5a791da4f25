"""The FP8 quality table of SmolLM2-135M-Instruct (docs/quality.md):
kvcal.torch.evaluate for every observer x granularity, q per query head vs q
reduced per KV group, Q/K/V vs K/V only, against the unquantized model and
scale 1.0; then the same on the large-key variant (rescale_keys, |K| past
448), where scale 1.0 saturates.

    python tests/python/quality_table.py [--cal-batches 16] [--eval-batches 8] \\
        [--batch-size 2] [--seq 256] [--alpha 64] [--json-dir DIR]

Calibration text: GPL-3; evaluation text: GPL-2 + Apache-2.0 (smollm2.py).
Needs a built worker (KVCAL_BUILD_DIR, default build/). --json-dir writes
each evaluation as JSON (`kvcal report --eval DIR/*.json`) and each set of
scales as a scales file. test_quality.py asserts what must hold on a
smaller run of the same code."""
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kvcal  # noqa: E402
import kvcal.torch  # noqa: E402

# (observer, finalize params, label); percentile at kvcal's default 99.99
# and at 99.9, the value that clips on SmolLM2.
OBSERVERS = [
    ("static_minmax", {}, "static_minmax"),
    ("minmax", {}, "minmax (EMA)"),
    ("memoryless_minmax", {}, "memoryless_minmax"),
    ("mse", {}, "mse"),
    ("percentile", {}, "percentile 99.99"),
    ("percentile", {"percentile": 99.9}, "percentile 99.9"),
]


def smollm2_bench_inputs():
    """The bench scripts' common start (bench/python/bench_nvfp4.py,
    bench_skip_layers.py): their arguments (--cal-batches 4, --eval-batches
    2, --batch-size 2, --seq 256), SmolLM2 loaded with torch seeded 0, the
    calibration token batches (GPL-3) and the held-out ones (GPL-2,
    Apache-2.0) as kvcal-calibrate's Batch records: (args, model, cal, held)."""
    import argparse

    import smollm2
    from kvcal.calibrate.data import Batch

    ap = argparse.ArgumentParser()
    ap.add_argument("--cal-batches", type=int, default=4)
    ap.add_argument("--eval-batches", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--keys-times", type=float, default=1.0,
                    help="bench_nvfp4 only: run on the large-key variant, keys scaled by this "
                         "(kvcal.torch.rescale_keys; 64 as test_quality.py)")
    a = ap.parse_args()
    torch.manual_seed(0)
    model, tokenizer = smollm2.load()
    cal = smollm2.token_batches(tokenizer, smollm2.CALIBRATION_FILES, a.cal_batches,
                                a.batch_size, a.seq)
    ev = smollm2.token_batches(tokenizer, smollm2.EVALUATION_FILES, a.eval_batches,
                               a.batch_size, a.seq)
    held = [Batch(ids, torch.ones_like(ids), int(ids.numel())) for ids in ev]
    return a, model, cal, held


def calibrate(worker, model, batches):
    """A kvcal.Client with a session that saw `batches` through kvcal.torch.capture."""
    client = kvcal.Client(worker.target)
    client.create_session(model.config)
    with kvcal.Producer(client) as producer, kvcal.torch.capture(model, producer):
        with torch.no_grad():
            for ids in batches:
                model(ids, use_cache=False, logits_to_keep=1)
    return client


def variants(granularity, kv_only_too=True, q_per_head_too=True):
    """(kv_only, q_per_kv_group) to evaluate for one granularity: Q/K/V with q
    per KV group (vLLM's loader), per head also q per query head, and K/V only."""
    out = [(False, True)]
    if granularity == "head" and q_per_head_too:
        out.append((False, False))
    if kv_only_too:
        out.append((True, True))
    return out


def table(client, model, eval_batches, observers=OBSERVERS, granularities=("tensor", "head"),
          kv_only_too=True, q_per_head_too=True, json_dir=None, prefix=""):
    """Evaluates every (observer, granularity, variant); returns a list of
    (label, granularity, kv_only, q_per_kv_group, Evaluation)."""
    rows = []
    reference, ones = None, {}
    for observer, params, label in observers:
        for granularity in granularities:
            scales = client.finalize(observer=observer, granularity=granularity, **params)
            if json_dir:
                scales.save(os.path.join(json_dir, f"{prefix}{label.replace(' ', '_')}-"
                                                   f"{granularity}.safetensors"))
            for kv_only, q_group in variants(granularity, kv_only_too, q_per_head_too):
                result = kvcal.torch.evaluate(model, scales, eval_batches, kv_only=kv_only,
                                              q_per_kv_group=q_group, reference=reference,
                                              ones=ones.get(kv_only))
                result.label = f"{prefix}{label}"
                reference = result.runs["reference"]
                ones.setdefault(kv_only, result)
                rows.append((label, granularity, kv_only, q_group, result))
                if json_dir:
                    name = (f"{prefix}{label.replace(' ', '_')}-{granularity}"
                            f"{'-kv' if kv_only else ''}{'' if q_group else '-qhead'}.json")
                    result.to_json(os.path.join(json_dir, name))
    return rows


def markdown(rows):
    """The table as Markdown: one row per evaluation."""
    out = ["| observer | granularity | quantized | q scales | Δ nats/token | perplexity "
           "| attention error mean / worst head | saturated (max over layers·heads) "
           "| subnormal (mean) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for label, granularity, kv_only, q_group, r in rows:
        sat = max(float(r.saturation[x].max()) for x in ("kv" if kv_only else "qkv"))
        sub = np.mean([float(r.subnormal[x].mean()) for x in ("kv" if kv_only else "qkv")])
        if kv_only:
            q = "—"
        elif granularity == "tensor":
            q = "per tensor"
        else:
            q = "per KV group" if q_group else "per query head"
        out.append(f"| {label} | {granularity} | {'K, V' if kv_only else 'Q, K, V'} | {q} "
                   f"| {r.delta_nll():+.4f} | {r.runs['calibrated'].perplexity:.3f} "
                   f"| {100 * float(np.mean(r.attention_error)):.2f}% / "
                   f"{100 * float(np.max(r.attention_error)):.2f}% "
                   f"| {100 * sat:.3f}% | {100 * sub:.3f}% |")
    return "\n".join(out)


def baselines(rows):
    """Reference and scale-1.0 lines (Q/K/V and K/V only)."""
    lines = []
    seen = set()
    for _, _, kv_only, _, r in rows:
        if kv_only in seen:
            continue
        seen.add(kv_only)
        sat = max(float(r.saturation_ones[x].max()) for x in ("kv" if kv_only else "qkv"))
        sub = np.mean([float(r.subnormal_ones[x].mean()) for x in ("kv" if kv_only else "qkv")])
        lines.append(f"- scale 1.0, {'K, V' if kv_only else 'Q, K, V'}: "
                     f"{r.delta_nll('ones'):+.4f} nats/token (perplexity "
                     f"{r.runs['ones'].perplexity:.3f}), attention error "
                     f"{100 * float(np.mean(r.attention_error_ones)):.2f}% mean / "
                     f"{100 * float(np.max(r.attention_error_ones)):.2f}% worst head, "
                     f"saturated up to {100 * sat:.3f}%, subnormal {100 * sub:.3f}% mean")
    r = rows[0][4]
    lines.insert(0, f"- unquantized: perplexity {r.runs['reference'].perplexity:.3f} "
                    f"({r.runs['reference'].tokens} predicted tokens)")
    return "\n".join(lines)


def main():
    import argparse
    import tempfile
    import time

    import smollm2
    from conftest import Worker

    ap = argparse.ArgumentParser()
    ap.add_argument("--cal-batches", type=int, default=16)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--alpha", type=float, default=64.0)
    ap.add_argument("--json-dir")
    ap.add_argument("--only", choices=["original", "large-keys"],
                    help="one of the two models (default: both)")
    ap.add_argument("--large-keys-observers", default="",
                    help="comma-separated labels (e.g. 'static_minmax,mse,percentile 99.9'); "
                         "default: all")
    a = ap.parse_args()
    if a.json_dir:
        os.makedirs(a.json_dir, exist_ok=True)
    start = time.monotonic()
    model, tokenizer = smollm2.load()
    cal = smollm2.token_batches(tokenizer, smollm2.CALIBRATION_FILES, a.cal_batches,
                                a.batch_size, a.seq)
    ev = smollm2.token_batches(tokenizer, smollm2.EVALUATION_FILES, a.eval_batches,
                               a.batch_size, a.seq)
    print(f"SmolLM2-135M-Instruct: calibration {a.cal_batches} x {a.batch_size} x {a.seq} "
          f"tokens (GPL-3), evaluation {a.eval_batches} x {a.batch_size} x {a.seq} "
          f"(GPL-2, Apache-2.0)\n")
    worker = Worker(tempfile.mkdtemp(prefix="kvcal-quality-")).start()
    try:
        wanted = [v for v in ("original", "large keys")
                  if a.only is None or a.only == v.replace(" ", "-")]
        for variant in wanted:
            observers = OBSERVERS
            if variant == "large keys" and a.large_keys_observers:
                labels = a.large_keys_observers.split(",")
                observers = [o for o in OBSERVERS if o[2] in labels]
            if variant == "large keys":
                kvcal.torch.rescale_keys(model, a.alpha)
                print(f"\n## Large keys: K projection x {a.alpha:g}, Q projection / {a.alpha:g}\n")
            else:
                print("## SmolLM2-135M-Instruct\n")
            client = calibrate(worker, model, cal)
            state = client.finalize(observer="static_minmax", granularity="tensor")
            kmax = max(float(np.max(v)) * 448 for k, v in state.items() if k.endswith("k_scale"))
            print(f"calibration |K| max {kmax:.1f}\n")
            # The large-key variant: q per query head left out (its question
            # is whether scale 1.0 saturates, not q's granularity).
            rows = table(client, model, ev, observers=observers, json_dir=a.json_dir,
                         q_per_head_too=variant == "original",
                         prefix="" if variant == "original" else "large-keys ")
            client.delete()
            print(baselines(rows))
            print()
            print(markdown(rows))
            sys.stdout.flush()
    finally:
        worker.stop()
    print(f"\n({time.monotonic() - start:.0f} s)")


if __name__ == "__main__":
    main()
