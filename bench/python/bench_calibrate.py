"""kvcal-calibrate on SmolLM2-135M: where the time of one run goes, what kvcal
adds to the bare forwards, and (--table) how the scales and the held-out
loss change with the number of calibration samples.

    python bench/python/bench_calibrate.py [--model DIR] [--samples 64] [--seq-len 256]
    python bench/python/bench_calibrate.py --table [--sizes 16,64,256,512] [--holdout 16]
    python bench/python/bench_calibrate.py --holdout-table [--holdout-sizes 4,8,16,32,64]

The data set is built from text every Debian system has (the licences in
/usr/share/common-licenses and the packages' copyright files under
/usr/share/doc): paragraphs of at least 20 words, de-duplicated, one JSON
line each, written to --work (kept, so that later runs use the same file).

Timing mode runs `python -m kvcal.calibrate` (the package this Python
imports: the installed wheel or PYTHONPATH=python) with --json, then the
same calibration windows (same sampling code, same seed) through the model
without capture in this process, and prints the run's stages, the bare
forwards and the ratios. Both are timed on the same machine in the same
run; the machine's load average is printed with them (these VMs are
shared: compare ratios, not seconds, across runs).

Table mode runs kvcal-calibrate once per size N with N calibration windows
plus the same --holdout held-out windows (the held-out windows come from
the first documents of the seed's order, the calibration windows from the
documents after them, so every run is scored on the same tokens and the
windows of a smaller N are the first ones of a larger N), three observers
per tensor, and prints one markdown row per N: each observer's scale change
against the largest N (median and largest relative change over the 90
scales), Δ nats/token (± standard error) of the candidates, and the choice.
Each size's result is kept in --work (sN.json) and reused by a later run
with the same flags and data set, so that `--sizes` can grow a table.
"""
import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DEFAULT_MODEL = os.path.join(ROOT, ".venv", "smollm2-135m-instruct")
OBSERVERS = ("static_minmax", "minmax", "percentile")


def build_corpus(path):
    """Paragraphs (>= 20 words, de-duplicated) of the licence and copyright
    texts on this system, as {"text": ...} lines; returns the count."""
    if os.path.exists(path):
        with open(path) as f:
            return sum(1 for _ in f)
    files = sorted(glob.glob("/usr/share/common-licenses/*")) + sorted(glob.glob("/usr/share/doc/*/copyright"))
    seen, out = set(), []
    for name in files:
        try:
            with open(name, errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        for para in re.split(r"\n\s*\n", text):
            words = para.split()
            if len(words) < 20:
                continue
            joined = " ".join(words)
            if joined in seen:
                continue
            seen.add(joined)
            out.append(joined)
    tmp = path + ".partial"
    with open(tmp, "w") as f:
        for para in out:
            f.write(json.dumps({"text": para}) + "\n")
    os.replace(tmp, path)
    return len(out)


def load_average():
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


def run_calibrate(model, dataset, out, *extra):
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if os.path.isdir(os.path.join(ROOT, "build")):  # a checkout's binaries, unless a wheel's are found first
        env.setdefault("KVCAL_BUILD_DIR", os.path.join(ROOT, "build"))
    cmd = [sys.executable, "-m", "kvcal.calibrate", model, "--dataset", dataset, "--out", out,
           "--json", *extra]
    t = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.monotonic() - t
    if proc.returncode != 0:
        sys.exit(f"bench_calibrate: {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout), wall


def bare_forwards(model_dir, dataset, samples, seq_len, holdout, dtype):
    """The calibration windows kvcal-calibrate forwards (same sampling),
    through the model without capture: (windows, seconds)."""
    import torch
    import transformers
    from kvcal.calibrate import data

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    sampled = data.make_samples(data.read_documents(dataset), tok, path=dataset, samples=samples,
                                seq_len=seq_len, holdout=holdout, seed=0)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="sdpa").eval()
    batches = list(data.batches(sampled.calibration, 1, data.pad_id_of(tok)))
    t = time.monotonic()
    with torch.no_grad():
        for b in batches:
            model(b.input_ids, attention_mask=b.attention_mask, use_cache=False)
    return len(batches), time.monotonic() - t


def timing(args, dataset):
    out = os.path.join(args.work, f"t{args.samples}")
    _remove(out)
    load_before = load_average()
    result, wall = run_calibrate(args.model, dataset, out, "--samples", str(args.samples),
                                 "--seq-len", str(args.seq_len))
    t = result["timings"]
    holdout = result["samples"]["holdout"]
    windows, bare = bare_forwards(args.model, dataset, args.samples, args.seq_len, holdout, "float32")
    _remove(out)
    stages = [("load (tokenizer, data, model)", t["load"] + t.get("tokenize", 0.0)),
              ("forwards with capture", t["forwards"]), ("upload left after the forwards", t["upload"]),
              ("finalize + evaluate", t["finalize_evaluate"]), ("patch + inspect + report", t["patch"])]
    print(f"kvcal-calibrate --samples {args.samples} --seq-len {args.seq_len} (all observers; "
          f"{windows} calibration + {holdout} held-out windows; {len(result['candidates'])} candidates); "
          f"load average {load_before} before, {load_average()} after")
    print("| stage | seconds |")
    print("|---|---|")
    for name, sec in stages:
        print(f"| {name} | {sec:.1f} |")
    print(f"| total (kvcal-calibrate's own timer) | {t['total']:.1f} |")
    print(f"| wall time of the process (Python start, imports, exit included) | {wall:.1f} |")
    print(f"| bare forwards of the same {windows} windows, no capture | {bare:.1f} |")
    capture_added = t["forwards"] + t["upload"] - bare
    print(f"capture added/bare: {capture_added / bare:+.3f} "
          f"(forwards with capture + upload - bare forwards = {capture_added:.1f} s)")
    print(f"whole run / bare forwards: {t['total'] / bare:.2f}x "
          f"(added {t['total'] - bare:.1f} s: load, capture, scoring every candidate on the "
          f"held-out windows, patch)")
    print(f"chosen: {result['chosen']['label']}")


def table(args, dataset):
    import numpy as np

    import kvcal

    sizes = sorted(int(n) for n in args.sizes.split(","))
    rows = {}
    for n in sizes:
        out = os.path.join(args.work, f"s{n}")
        scales_dir = out + "-scales"
        flags = ["--samples", str(n + args.holdout), "--holdout-samples", str(args.holdout),
                 "--seq-len", str(args.seq_len), "--observer", ",".join(OBSERVERS)]
        saved = out + ".json"
        # A finished run of the same flags on the same data set is reused
        # (each size is a separate run; a table can be completed later).
        previous = _load_json(saved)
        if previous and previous["flags"] == flags and previous["dataset_bytes"] == os.path.getsize(dataset):
            result, wall = previous["result"], previous["wall"]
        else:
            _remove(out)
            _remove(scales_dir)
            result, wall = run_calibrate(args.model, dataset, out, *flags, "--scales-dir", scales_dir)
            _remove(out)
            with open(saved, "w") as f:
                json.dump({"flags": flags, "dataset_bytes": os.path.getsize(dataset), "result": result,
                           "wall": wall, "load_average": load_average()}, f)
        scales = {o: kvcal.Scales.load(os.path.join(scales_dir, f"kvcal-{o}-tensor.safetensors"))
                  for o in OBSERVERS}
        rows[n] = (result, wall, {o: {k: float(np.asarray(v).reshape(-1)[0]) for k, v in s.items()}
                                  for o, s in scales.items()})
        print(f"N={n}: {wall:.0f} s (load average {load_average()}); chosen {result['chosen']['label']}",
              file=sys.stderr)
    ref = rows[sizes[-1]][2]
    labels = [("static min-max per tensor, Q, K, V", "static, Q K V"),
              ("static min-max per tensor, K, V", "static, K V"),
              ("EMA min-max per tensor, Q, K, V", "EMA, Q K V"),
              ("percentile per tensor, Q, K, V", "percentile, Q K V"),
              ("llm-compressor default, K, V", "llm-compressor default, K V"),
              ("scale 1.0, Q, K, V", "scale 1.0, Q K V"),
              ("scale 1.0, K, V", "scale 1.0, K V")]
    head = ["calibration windows (tokens)"] + [f"{o} change vs N={sizes[-1]}: median / max" for o in OBSERVERS]
    head += [f"Δ {short}" for _, short in labels] + ["chosen"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for n in sizes:
        result, _, got = rows[n]
        cand = {c["label"]: c for c in result["candidates"]}
        cells = [f"{n} ({result['samples']['calibration'] * args.seq_len})"]
        for o in OBSERVERS:
            rel = np.array([abs(got[o][k] / ref[o][k] - 1) for k in ref[o]])
            cells.append(f"{100 * np.median(rel):.1f}% / {100 * rel.max():.1f}%")
        for label, _ in labels:
            c = cand[label]
            cells.append(f"{c['delta_nll']:+.4f} ± {c['delta_nll_se']:.4f}")
        cells.append(result["chosen"]["label"])
        print("| " + " | ".join(cells) + " |")
    held = rows[sizes[-1]][0]
    print(f"\nheld-out: {held['samples']['holdout']} windows, {held['holdout_tokens']} scored tokens; "
          f"Δ in nats/token against the unquantized model on them")


def holdout_table(args, dataset):
    """--holdout-table: how much the held-out set resolves as it grows. For
    each H in --holdout-sizes, one run with --holdout-samples H and the same
    --samples of calibration (H + 16 windows of --seq-len; static min-max
    only, FP8 only), and its decision's noise: 2 standard errors of the
    paired difference of scale 1.0 against the best calibrated setting, the
    gain of that setting over 1.0, whether the default --tolerance (0.02) is
    resolved, the windows the run says would resolve it, and the choice."""
    rows = []
    for h in sorted(int(x) for x in args.holdout_sizes.split(",")):
        out = os.path.join(args.work, f"h{h}")
        _remove(out)
        flags = ["--samples", str(16 + h), "--holdout-samples", str(h), "--seq-len",
                 str(args.seq_len), "--observer", "static_minmax", "--kv-cache-formats", "fp8"]
        result, wall = run_calibrate(args.model, dataset, out, *flags)
        _remove(out)
        n = result["decision"]["noise"]
        rows.append((h, n, result["chosen"]["label"], wall))
        print(f"H={h}: {wall:.0f} s (load average {load_average()})", file=sys.stderr)
    print("| held-out windows (tokens) | resolvable: 2 SE of the paired difference | pair | "
          "gain of the best calibrated over 1.0 | resolves 0.02? | windows the run asks for | "
          "chosen |")
    print("|---|---|---|---|---|---|---|")
    for h, n, chosen, _ in rows:
        asks = n["windows_needed"] or "(resolved)"
        print(f"| {h} ({n['tokens']}) | {n['resolvable_nats_per_token']:.4f} | {n['pair']} | "
              f"{n['gain_over_scale_one']:+.4f} | "
              f"{'yes' if n['resolvable_nats_per_token'] <= 0.02 else 'no'} | {asks} | {chosen} |")


def _load_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _remove(path):
    import shutil

    shutil.rmtree(path, ignore_errors=True)
    shutil.rmtree(path + ".kvcal-calibrate", ignore_errors=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="SmolLM2 directory (./run test downloads it)")
    p.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "kvcal-bench-calibrate"))
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--table", action="store_true", help="the sample-count table instead of the timing")
    p.add_argument("--sizes", default="16,64,256,512")
    p.add_argument("--holdout", type=int, default=16)
    p.add_argument("--holdout-table", action="store_true",
                   help="the held-out-size table (what each held-out size resolves)")
    p.add_argument("--holdout-sizes", default="4,8,16,32,64")
    args = p.parse_args()
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        sys.exit(f"bench_calibrate: no model in {args.model} (./run test downloads SmolLM2 there; or --model DIR)")
    os.makedirs(args.work, exist_ok=True)
    dataset = os.path.join(args.work, "corpus.jsonl")
    count = build_corpus(dataset)
    print(f"data set: {dataset}, {count} paragraphs", file=sys.stderr)
    (holdout_table if args.holdout_table else table if args.table else timing)(args, dataset)


if __name__ == "__main__":
    main()
