"""kvcal-calibrate: from a model directory and a prompt file to a checkpoint
that vLLM 0.34 loads with calibrated FP8 KV-cache (and query) scales.

    kvcal-calibrate MODEL_DIR --dataset prompts.jsonl [--out MODEL-fp8kv]
    python -m kvcal.calibrate MODEL_DIR --dataset prompts.txt
    result = kvcal.calibrate_model("MODEL_DIR", "prompts.jsonl", samples=256)

What it does (docs/calibrate.md is the user's guide; `--help-guide` prints it):
1. loads the model and tokenizer with transformers (a local directory, a
   GGUF file with --gguf-file, or a hub name where the hub is reachable);
2. reads the dataset (data.py), shuffles it with --seed, packs it
   into --samples windows of --seq-len tokens and holds back
   --holdout-samples of them (default: a tenth, and at least
   data.HOLDOUT_TOKENS tokens, at most half);
3. runs the calibration samples through the model under
   kvcal.torch.capture, streaming post-RoPE Q, K and V to a kvcal worker:
   an embedded one (worker.py) or --server workers;
4. finalizes every candidate setting and scores each on the held-out
   samples by the model's own loss with Q/K/V fake-quantized
   (choice.py), against scale 1.0 and llm-compressor's default;
   for the chosen one, which layers to leave unquantized (skip_layers.py:
   --kv-cache-dtype-skip-layers, verified by one more held-out pass); the
   other KV cache formats asked for (--kv-cache-formats, NVFP4 by default)
   scored the same way and the cheapest within --tolerance recommended
   (format_advice.py);
5. patches the checkpoint (`kvcal patch`), checks it (`kvcal inspect`),
   writes the HTML report (`kvcal report`) and prints the `vllm serve` line
   (output.py).

Resume: the embedded worker keeps its state in a durable state dir under
the work directory (MODEL/.kvcal-calibrate/ in place, OUT.kvcal-calibrate/
with --out), beside a journal of the batches sent; `--resume` after an
interrupted run (Ctrl-C, a crash, SIGKILL) restarts the worker from that
state and skips the batches the worker already has. The work directory is
removed after a successful run.

Exit codes: 0 done; 1 a failure (one line on stderr naming what to change);
2 a usage error; 130 interrupted (Ctrl-C / SIGTERM).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import Optional, Sequence

from kvcal.calibrate import choice, data, format_advice, output
from kvcal.calibrate.backends import ASSUME_BACKENDS
from kvcal.calibrate.errors import CalibrateError, Interrupted, UsageError
from kvcal.calibrate.options import DTYPES, GRANULARITIES, PACKINGS, TARGETS, Options
from kvcal.calibrate.result import CalibrationResult, inspect_summary
from kvcal.calibrate.run import calibrate_model
from kvcal.calibrate.ui import PROG
from kvcal.calibrate.worker import WorkerError

__all__ = ["main", "summary"]


# -- command line ----------------------------------------------------------------

def summary(result: CalibrationResult) -> str:
    """The text summary: every line renders result.decision (one answer)."""
    d = result.decision
    c = result.chosen
    ones = result.scale_one
    lines = [f"candidates, scored on {result.samples['holdout']} held-out windows "
             f"({result.holdout_tokens} tokens; unquantized loss {result.reference_nll:.4f} "
             f"nats/token); Δ nats/token against the unquantized model ± standard error, mean "
             f"attention error:"]
    for cand in result.candidates:
        mark = "*" if cand.chosen else " "
        if cand.same_as is not None:
            lines.append(f" {mark} {cand.label:<42} same as {cand.same_as.label}")
            continue
        lines.append(f" {mark} {cand.label:<42} {cand.delta:+.4f} ± {cand.se:.4f}   "
                     f"{100 * cand.attention_error:5.2f}%")
    lines.append(f"   ({choice.LLMC_DEFAULT}: {choice.LLMC_RECIPE})")
    lines.append(f"chosen: {c.label}, because {result.why}")
    if c.observer is None:
        lines.append("  the checkpoint gets explicit scales of 1.0: what vLLM uses without scales, "
                     "written so that inspect can check that vLLM loads them")
    else:
        lines.append(f"  against scale 1.0 ({ones.label}): {c.delta - ones.delta:+.4f} nats/token; "
                     f"attention error {100 * c.attention_error:.2f}% (scale 1.0: "
                     f"{100 * ones.attention_error:.2f}%)")
    lines.extend(d.noise.lines())
    if result.skip is not None:
        lines.extend(result.skip.describe())
    if result.formats is not None:
        lines.extend(result.formats.describe(d.sixteen_bit))
    if d.written is not c:
        lines.append(f"the checkpoint holds {d.written.label}: the per-tensor scales "
                     f"--kv-cache-dtype {d.kv_cache_dtype} was scored with")
    lines.append(f"granularity: {result.platform}")
    lines.append(result.patch.describe())
    v = inspect_summary(result.inspect)
    lines.append(f"kvcal inspect (--kv-cache-dtype {d.inspect_dtype}"
                 f"{'' if d.inspect_dtype == d.kv_cache_dtype else ', the FP8 line below'}): "
                 f"vLLM 0.34 starts: "
                 f"{v.get('starts')}, every scale used as written: {v.get('clean')}, KV cache "
                 f"{v.get('kv_cache_dtype')}")
    if result.report:
        lines.append(f"report: {result.report}")
    lines.append("serve it with:")
    lines.append(f"  {result.serve['command']}")
    lines.append(f"  attention backends: {result.serve['backends']}")
    for note in result.serve["notes"]:
        lines.append(f"  note: {note}")
    alt = result.serve.get("fp8_alternative")
    if alt:
        lines.append(f"or, accepting FP8's cost ({alt['cost']}):")
        lines.append(f"  {alt['command']}")
    t = result.timings
    lines.append("time: " + ", ".join(f"{k.replace('_', '+')} {v:.1f} s" for k, v in t.items()))
    for w in result.warnings:
        lines.append(f"warning: {w}")
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        sys.stderr.write(f"{PROG}: {message} (see {PROG} --help)\n")
        sys.exit(2)


def guide_path() -> Optional[str]:
    """The user's guide (docs/calibrate.md): the copy the package carries
    (setup.py puts it in kvcal/guide/), else the checkout's."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # kvcal/
    for path in (os.path.join(package, "guide", "calibrate.md"),
                 os.path.join(package, "..", "..", "docs", "calibrate.md")):
        if os.path.isfile(path):
            return os.path.abspath(path)
    return None


def version_line() -> str:
    """`kvcal-calibrate --version`: the package's version, and the kvcal
    binary's own --version line (the same VERSION file) when it is found."""
    import subprocess

    import kvcal
    from kvcal.calibrate.worker import WorkerError, find_binary

    line = f"{PROG} {kvcal.__version__}"
    try:
        out = subprocess.run([find_binary("kvcal"), "--version"], capture_output=True,
                             text=True, timeout=30).stdout.strip()
    except (WorkerError, OSError, subprocess.SubprocessError):
        out = ""
    return f"{line} ({out})" if out else f"{line} (no kvcal binary found)"


class _Guide(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        path = guide_path()
        if path is None:
            parser.exit(1, f"{PROG}: the guide (calibrate.md) is not in this installation\n")
        with open(path, encoding="utf-8") as f:
            sys.stdout.write(f.read())
        parser.exit(0)


class _Version(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line())
        parser.exit(0)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=(
        "Calibrate the FP8 KV-cache (and query) scales of a Hugging Face model on a prompt "
        "file, choose the setting on held-out text, and patch the checkpoint so vLLM loads "
        "them. The guide: kvcal-calibrate --help-guide."))
    p.add_argument("--version", action=_Version, help="print the version and exit")
    p.add_argument("--help-guide", action=_Guide,
                   help="print the user's guide (docs/calibrate.md) and exit")
    p.add_argument("model", metavar="MODEL_DIR", help="model directory (or a hub name)")
    p.add_argument("--dataset", required=True, metavar="FILE",
                   help=".txt (blank-line separated documents), .jsonl (text or messages), "
                        ".parquet/.arrow (with the datasets package)")
    p.add_argument("--samples", type=int, default=512, help="samples in all (default 512)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sample (default 2048)")
    p.add_argument("--batch-size", type=int, default=1,
                   help="samples per forward (default 1, as llm-compressor)")
    p.add_argument("--holdout-samples", type=int, default=None,
                   help="samples held out to choose the setting on (default: a tenth of them, "
                        f"and at least {data.HOLDOUT_TOKENS} tokens' worth, at most half)")
    p.add_argument("--packing", choices=PACKINGS, default="pack",
                   help="pack documents into full windows (default) or one sample per document")
    p.add_argument("--server", action="append", metavar="ADDR",
                   help="remote kvcal worker(s) (host:port, a,b, dns:///..., file:...); "
                        "default: an embedded local worker")
    p.add_argument("--auth-token-file", help="bearer token for --server workers")
    p.add_argument("--out", metavar="DIR", help="write the patched copy here (default: in place)")
    p.add_argument("--observer", default="auto",
                   help="auto (every observer) or a comma list of "
                        f"{', '.join(choice.OBSERVER_ORDER)}")
    p.add_argument("--granularity", default="auto", choices=GRANULARITIES,
                   help="auto: per tensor, and per head too where FlashAttention 3 runs (this "
                        "machine's GPU is Hopper or newer, or --assume-backend fa3)")
    p.add_argument("--assume-backend", default="auto", choices=ASSUME_BACKENDS,
                   help="fa3: you serve on FlashAttention 3 (Hopper or newer) though this "
                        "machine has no such GPU, so per-head scales are scored (default auto: "
                        "what this machine has)")
    p.add_argument("--target", default="compressed-tensors", choices=TARGETS)
    p.add_argument("--kv-only", action="store_true",
                   help="score K and V only (your vLLM backend keeps the query in 16 bits)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    p.add_argument("--dtype", default="auto", choices=DTYPES)
    p.add_argument("--seed", type=int, default=0, help="shuffling seed (default 0)")
    p.add_argument("--session", help="session id (default: derived from the data)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run")
    p.add_argument("--keep-session", action="store_true",
                   help="leave the session on the worker at the end")
    p.add_argument("--report", metavar="FILE.html",
                   help="HTML report (default: kvcal-report.html in the patched checkpoint)")
    p.add_argument("--scales-dir", metavar="DIR",
                   help="also write every candidate's scales file (kvcal patch's format) here")
    p.add_argument("--gguf-file", metavar="F", help="load MODEL_DIR/F (a GGUF file); needs --out")
    p.add_argument("--lock-timeout", type=float, default=None, metavar="SECONDS",
                   help="passed to kvcal patch: how long to wait for the checkpoint lock")
    p.add_argument("--kv-cache-formats", default="fp8,nvfp4", metavar="LIST",
                   help="KV cache formats to score on the held-out samples and recommend from "
                        "(fp8, nvfp4, nvfp4_4over6; default fp8,nvfp4)")
    p.add_argument("--tolerance", type=float, default=format_advice.DEFAULT_TOLERANCE,
                   metavar="NATS", help="the held-out loss a recommended cache format may add, "
                   f"in nats/token (default {format_advice.DEFAULT_TOLERANCE:g})")
    p.add_argument("--local-statistics", action="store_true",
                   help="accumulate the statistics in this process with the worker's engine and "
                        "send them to the worker instead of the activations (the same scales; "
                        "docs/local-statistics.md)")
    p.add_argument("--flush-batches", type=int, default=None, metavar="N",
                   help="with --local-statistics: send the accumulated statistics every N "
                        "batches (1 or more; default 64) and at the end")
    p.add_argument("--json", action="store_true", help="no progress; print one JSON object")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    tqdm_disable = os.environ.get("TQDM_DISABLE")
    if args.json:  # quiet: no bar from the libraries either (tqdm reads TQDM_DISABLE)
        os.environ["TQDM_DISABLE"] = "1"

    def on_term(signum, frame):
        raise Interrupted()

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        result = calibrate_model(args.model, args.dataset, **_options(args))
    except UsageError as e:
        return _fail(args, str(e), 2)
    except (CalibrateError, data.DataError, WorkerError, output.OutputError) as e:
        return _fail(args, str(e), 1)
    except Interrupted as e:
        return _fail(args, str(e) or "interrupted", 130)
    except KeyboardInterrupt:
        return _fail(args, "interrupted before anything was written", 130)
    except Exception as e:  # noqa: BLE001 - one line, not a traceback (KVCAL_DEBUG=1: both)
        if os.environ.get("KVCAL_DEBUG") == "1":
            raise
        return _fail(args, f"{type(e).__name__}: {e} (unexpected; KVCAL_DEBUG=1 shows where)", 1)
    finally:
        signal.signal(signal.SIGTERM, previous)
        if tqdm_disable is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = tqdm_disable
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(summary(result))
    return 0


def _options(args) -> dict:
    """calibrate_model's options from the parsed flags (each flag is the
    Options field of its name; --json is quiet)."""
    fields = {f for f in Options.__dataclass_fields__ if f != "quiet"}
    return dict({f: getattr(args, f) for f in fields}, quiet=args.json)


def _fail(args, message: str, code: int) -> int:
    message = " ".join(str(message).split())
    sys.stderr.write(f"{PROG}: {message}\n")
    if getattr(args, "json", False):
        print(json.dumps({"ok": False, "error": message, "exit": code}))
    return code


if __name__ == "__main__":
    sys.exit(main())
