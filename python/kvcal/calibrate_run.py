"""kvcal-calibrate's run: calibrate_model() and its steps (the command
line is kvcal/calibrate.py, whose docstring describes the whole).

Why this file is over 600 lines: it holds the run's steps in order
(argument checks, prepare, connect, forwards, score, patch and report,
cleanup), each a function under 80 lines sharing the _Run record; the
data set, the embedded worker, the choice and the output already live in
their own modules (calibrate_data, calibrate_worker, calibrate_select,
calibrate_output).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence

from kvcal import calibrate_data as data
from kvcal import calibrate_lock
from kvcal import calibrate_output as output
from kvcal import calibrate_select as select
from kvcal import _args
from kvcal import format_advice
from kvcal import skip_layers
from kvcal.calibrate_decision import Decision, decide
from kvcal.calibrate_worker import EmbeddedWorker, WorkerError

PROG = "kvcal-calibrate"
PRODUCER = "kvcal-calibrate"
TARGETS = ("compressed-tensors", "modelopt", "quark")
# --flush-batches: as kvcal.Producer's flush_batches.
FLUSH_BATCHES = _args.IntRange(1, None)


class CalibrateError(RuntimeError):
    """A failure: the message is one line that says what to change."""


class UsageError(ValueError):
    """Bad arguments (exit 2)."""


class Interrupted(KeyboardInterrupt):
    pass


@dataclass
class CalibrationResult:
    """A finished run: `decision` is the one answer (calibrate_decision.py)
    that the summary, to_dict() (`--json`), the report and the checkpoint
    all render."""
    checkpoint: str                       # the patched checkpoint directory
    report: Optional[str]
    decision: Decision
    inspect: dict
    patch: output.PatchInfo
    session: str
    samples: dict
    platform: str
    timings: Dict[str, float] = field(default_factory=dict)
    warnings: List[str] = field(default_factory=list)
    reference_nll: float = math.nan
    resumed: Optional[dict] = None        # {"skipped_batches", "batches"} after --resume

    @property
    def chosen(self) -> select.Candidate:
        return self.decision.chosen

    @property
    def candidates(self) -> List[select.Candidate]:
        return self.decision.candidates

    @property
    def serve(self) -> dict:
        return self.decision.serve

    @property
    def why(self) -> str:
        return self.decision.why

    @property
    def skip(self) -> Optional[skip_layers.SkipAdvice]:
        return self.decision.skip

    @property
    def formats(self) -> Optional[format_advice.FormatAdvice]:
        return self.decision.formats

    @property
    def holdout_tokens(self) -> int:
        return self.decision.noise.tokens

    @property
    def scale_one(self) -> select.Candidate:
        return next(c for c in self.candidates
                    if c.observer is None and c.kv_only == self.chosen.kv_only)

    def to_dict(self) -> dict:
        ones = self.scale_one
        out = {
            "ok": True, "checkpoint": self.checkpoint, "report": self.report,
            "session": self.session, "chosen": self.chosen.to_dict(),
            "why": self.why,
            "versus_scale_one": {"delta_nll": _num(self.chosen.delta - ones.delta),
                                 "attention_error": _num(self.chosen.attention_error),
                                 "attention_error_scale_one": _num(ones.attention_error)},
            "serve": self.serve, "platform": self.platform,
            "patch": vars(self.patch), "inspect": _inspect_summary(self.inspect),
            "samples": self.samples, "timings": {k: round(v, 3) for k, v in self.timings.items()},
            "warnings": self.warnings, "resumed": self.resumed,
        }
        out.update(self.decision.view(self.reference_nll))
        return out


def _num(x):
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


def _inspect_summary(report: dict) -> dict:
    v = report.get("vllm", report) if isinstance(report, dict) else {}
    return {k: v.get(k) for k in ("starts", "clean", "kv_cache_dtype", "per_head", "backends",
                                  "refusals", "silent", "notes") if k in v}


# -- progress ------------------------------------------------------------------

class _Ui:
    def __init__(self, quiet: bool):
        self.quiet = quiet

    def say(self, text: str) -> None:
        if not self.quiet:
            print(f"{PROG}: {text}", file=sys.stderr, flush=True)

    def warn(self, text: str) -> None:
        """A warning: on stderr even with --json."""
        print(f"{PROG}: warning: {text}", file=sys.stderr, flush=True)

    def bar(self, total=None, desc="", unit="it", estimate=False):
        """A progress bar that ends at its total: when the step finishes, the
        bar is completed (an `estimate` total becomes the count reached) and
        replaced by one finished line. Nothing for an empty step."""
        try:
            from tqdm.auto import tqdm
        except ImportError:  # pragma: no cover - tqdm is in the [torch] extra
            tqdm = None
        if self.quiet or tqdm is None or total == 0:
            return _NoBar()
        return _Bar(tqdm(total=total, desc=desc, unit=unit, file=sys.stderr,
                         dynamic_ncols=True, leave=False, mininterval=0.5), self, estimate)


class _NoBar:
    def update(self, n=1):
        pass

    def set_postfix_str(self, s):
        pass

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


class _Bar:
    """tqdm, finished truthfully (see _Ui.bar)."""

    def __init__(self, bar, ui: "_Ui", estimate: bool):
        self._bar, self._ui, self._estimate = bar, ui, estimate
        self._start = time.monotonic()

    def update(self, n=1):
        self._bar.update(n)

    def set_postfix_str(self, s):
        self._bar.set_postfix_str(s)

    def close(self, finished: bool = True):
        bar = self._bar
        if finished and bar.total is not None:
            if self._estimate:
                bar.total = bar.n
            else:
                bar.n = bar.total
            bar.refresh()
        bar.close()
        if finished:
            self._ui.say(f"{bar.desc}: done, {bar.n:,} {bar.unit}"
                         f"{'' if bar.n == 1 else 's'} in {time.monotonic() - self._start:.1f} s")

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        self.close(finished=exc_type is None)


# -- model ---------------------------------------------------------------------

_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def _resolve_model(model: str, gguf_file: Optional[str]):
    """(directory, is_hub, gguf path or None)."""
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        if gguf_file:
            g = gguf_file if os.path.isabs(gguf_file) else os.path.join(path, gguf_file)
            if not os.path.isfile(g):
                raise CalibrateError(f"--gguf-file {gguf_file}: no such file in {path}")
            return os.path.abspath(path), False, os.path.abspath(g)
        if not os.path.isfile(os.path.join(path, "config.json")):
            ggufs = [f for f in os.listdir(path) if f.endswith(".gguf")]
            hint = (f"; for a GGUF model pass --gguf-file {ggufs[0]}" if ggufs else "")
            raise CalibrateError(f"{path} has no config.json: not a Hugging Face model "
                                 f"directory{hint}")
        return os.path.abspath(path), False, None
    if os.path.exists(path):
        if path.endswith(".gguf"):
            raise CalibrateError(f"{model} is a GGUF file: pass its directory and --gguf-file "
                                 f"{os.path.basename(path)}")
        raise CalibrateError(f"{model} is a file, not a model directory")
    first = path.split("/", 1)[0]
    if (_HUB_NAME.fullmatch(model) and not model.startswith((".", "/", "~"))
            and not os.path.isdir(first)):
        return model, True, None
    raise CalibrateError(f"model directory {model} does not exist")


def _fetch_hub(name: str) -> str:
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(name, allow_patterns=[
            "*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja", "*.tiktoken"])
    except Exception as e:  # noqa: BLE001 - offline, unknown repo, no access
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CalibrateError(
            f"{name} is not a local directory, and the Hugging Face hub did not give it "
            f"({type(e).__name__}: {why[:160]}); download it where the hub is reachable "
            f"(huggingface-cli download {name} --local-dir DIR) and pass DIR") from None


def _config_dict(directory: str, gguf: Optional[str]) -> dict:
    if gguf:
        import transformers

        try:
            config = transformers.AutoConfig.from_pretrained(
                directory, gguf_file=os.path.basename(gguf))
        except Exception as e:  # noqa: BLE001
            raise CalibrateError(f"cannot read {gguf}: {e}") from None
        return config.to_dict()
    path = os.path.join(directory, "config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError as e:
        raise CalibrateError(f"{path} is not valid JSON ({e})") from None


def check_config(config: dict, where: str) -> dict:
    """MLA and models without attention are refused; returns the text config."""
    text = config
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
        text = config["text_config"]
    if text.get("kv_lora_rank"):
        raise CalibrateError(
            f"{where} uses multi-head latent attention (kv_lora_rank {text['kv_lora_rank']}, "
            f"model_type {text.get('model_type', '?')}): vLLM 0.34 caches one compressed latent "
            f"per token, and its weight loader drops every calibrated MLA scale whatever the "
            f"checkpoint calls it ('not loaded', then 1.0), so there is nothing to patch")
    heads = text.get("num_attention_heads")
    layers = text.get("num_hidden_layers", text.get("n_layer"))
    if not heads or not layers:
        kind = text.get("model_type", "this model")
        raise CalibrateError(
            f"{where} has no attention layers to calibrate ({kind}: config has no "
            f"{'num_attention_heads' if not heads else 'num_hidden_layers'}); kvcal calibrates "
            f"the KV cache of attention layers")
    from kvcal.client import attention_problem

    problem = attention_problem(text)
    if problem:
        raise CalibrateError(f"{where} cannot be calibrated: {problem}")
    return text


def _load_model(directory: str, gguf: Optional[str], device: str, dtype, ui: _Ui):
    import transformers

    if ui.quiet:
        transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    kwargs = {"gguf_file": os.path.basename(gguf)} if gguf else {}
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory, **kwargs)
    except Exception as e:  # noqa: BLE001
        raise CalibrateError(f"cannot load the tokenizer of {directory}: {_first_line(e)}") from None
    return tokenizer, (lambda: _load_weights(transformers, directory, kwargs, device, dtype))


def _load_weights(transformers, directory, kwargs, device, dtype):
    try:
        config = transformers.AutoConfig.from_pretrained(directory, **kwargs)
        _without_kv_scheme(config)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            directory, config=config, dtype=dtype, attn_implementation="sdpa", **kwargs)
    except Exception as e:  # noqa: BLE001
        raise CalibrateError(f"cannot load the model in {directory}: {_first_line(e)}") from None
    return model.to(device).eval()


def _without_kv_scheme(config) -> None:
    """A checkpoint calibrated before (kv_cache_scheme in its compressed-
    tensors config) must load unquantized: transformers would otherwise hook
    the FP8 KV quantization into the forwards that are being measured. A
    config that only kvcal wrote (no config_groups) is dropped; otherwise
    only its kv_cache_scheme."""
    q = getattr(config, "quantization_config", None)
    if q is None:
        return
    d = q if isinstance(q, dict) else (q.to_dict() if hasattr(q, "to_dict") else None)
    if not isinstance(d, dict) or d.get("kv_cache_scheme") is None:
        return
    if d.get("quant_method") == "compressed-tensors" and not d.get("config_groups"):
        del config.quantization_config
        return
    d = dict(d)
    d["kv_cache_scheme"] = None
    config.quantization_config = d


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:300]


# -- the run -------------------------------------------------------------------

@dataclass
class _Run:
    """Paths and state of one run."""
    model: str
    directory: str
    gguf: Optional[str]
    out: Optional[str]
    work: str
    created: List[str] = field(default_factory=list)  # directories this run made
    uploaded: bool = False
    stage: str = "prepare"    # prepare | upload | score | patch | done
    resumed: Optional[dict] = None
    worker: Optional[EmbeddedWorker] = None
    lock: Optional[calibrate_lock.RunLock] = None  # one run per output, the whole run
    o: SimpleNamespace = field(default_factory=SimpleNamespace)  # the run's options


def _work_dir(directory: str, out: Optional[str]) -> str:
    if out:
        return os.path.abspath(out).rstrip("/") + ".kvcal-calibrate"
    return os.path.join(directory, ".kvcal-calibrate")


def _makedirs(path: str, created: List[str]) -> None:
    missing = []
    p = os.path.abspath(path)
    while not os.path.exists(p):
        missing.append(p)
        p = os.path.dirname(p)
    for d in reversed(missing):
        os.mkdir(d)
        created.append(d)


def _remove_created(created: List[str]) -> None:
    for d in reversed(created):
        shutil.rmtree(d, ignore_errors=True)
    del created[:]


def _check_out(out: str) -> None:
    """--out must be new (or an empty directory) and creatable; probed by
    creating and removing a directory, nothing is left."""
    out = os.path.abspath(out)
    if os.path.exists(out):
        if not os.path.isdir(out):
            raise CalibrateError(f"--out {out} exists and is not a directory")
        if os.listdir(out):
            raise CalibrateError(f"--out {out} exists and is not empty; name a new directory")
    created: List[str] = []
    probe = out.rstrip("/") + f".kvcal-probe-{os.getpid()}"
    try:
        _makedirs(probe, created)
    except OSError as e:
        raise CalibrateError(f"cannot write --out {out}: {e.strerror} "
                             f"({e.filename or os.path.dirname(out)}); choose a writable "
                             f"directory") from None
    finally:
        _remove_created(created)


def _inside(path: str, directory: str) -> bool:
    path, directory = os.path.realpath(path), os.path.realpath(directory)
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def _check_in_place(directory: str) -> None:
    probe = os.path.join(directory, f".kvcal-probe-{os.getpid()}")
    try:
        os.mkdir(probe)
        os.rmdir(probe)
    except OSError as e:
        raise CalibrateError(f"cannot write into {directory} to patch it in place ({e.strerror}); "
                             f"pass --out DIR for a patched copy") from None


def _check_quant_method(config: dict, target: str, where: str) -> None:
    method = (config.get("quantization_config") or {}).get("quant_method")
    if target in ("modelopt", "quark") and method != target:
        raise CalibrateError(f"--target {target} patches {target} checkpoints only; {where} has "
                             f"quant_method {method or 'none'} (use --target compressed-tensors)")


def _fingerprint(samples: data.Samples, config: dict, options: dict) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({k: config.get(k) for k in sorted(config) if k != "quantization_config"},
                        sort_keys=True, default=str).encode())
    h.update(json.dumps(options, sort_keys=True).encode())
    for part in (samples.holdout, samples.calibration):
        h.update(b"|")
        for w in part:
            h.update(len(w).to_bytes(4, "little"))
            h.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in w))
    return h.hexdigest()


class _Journal:
    """RUN.json (what the run is) and batches.jsonl (after each forward:
    the batch and the producer's last chunk sequence)."""

    def __init__(self, work: str):
        self.run_path = os.path.join(work, "run.json")
        self.batches_path = os.path.join(work, "batches.jsonl")

    def read_run(self) -> Optional[dict]:
        try:
            with open(self.run_path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def write_run(self, run: dict) -> None:
        tmp = self.run_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(run, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.run_path)

    def batches(self) -> Dict[int, int]:
        out: Dict[int, int] = {}
        try:
            with open(self.batches_path) as f:
                for line in f:
                    try:
                        entry = json.loads(line)
                        out[int(entry["batch"])] = int(entry["sequence"])
                    except (ValueError, KeyError, TypeError):
                        break  # a torn last line
        except OSError:
            pass
        return out

    def add(self, f, batch: int, sequence: int) -> None:
        f.write(json.dumps({"batch": batch, "sequence": sequence}) + "\n")
        f.flush()


def _resolve_observers(spec: str) -> List[str]:
    from kvcal.names import resolve_observer

    if spec.strip().lower() == "auto":
        return list(select.OBSERVER_ORDER)
    out = []
    for part in spec.split(","):
        if not part.strip():
            continue
        try:
            name = resolve_observer(part.strip())
        except ValueError:
            raise UsageError(f"--observer {part.strip()}: not one of auto, "
                             f"{', '.join(select.OBSERVER_ORDER)}") from None
        if name == "auto":
            return list(select.OBSERVER_ORDER)
        if name not in out:
            out.append(name)
    if not out:
        raise UsageError("--observer is empty")
    return out


ASSUME_BACKENDS = ("auto", "fa3")


def _hopper(torch) -> str:
    """The name of this machine's Hopper-class (or newer) CUDA GPU, or ''."""
    if (torch.cuda.is_available() and torch.version.hip is None
            and torch.cuda.get_device_capability(0) >= (9, 0)):
        return torch.cuda.get_device_name(0)
    return ""


def _this_machine(torch) -> str:
    if not torch.cuda.is_available():
        return "this machine has no GPU"
    major, minor = torch.cuda.get_device_capability(0)
    return (f"this machine's GPU ({torch.cuda.get_device_name(0)}, compute capability "
            f"{major}.{minor}) cannot run it")


def _platform(torch, target: str, granularity: str, kv_only: bool,
              assume_backend: str = "auto"):
    """(granularities to try, the platform assumption in words). Per head
    is scored only where it can start: FlashAttention 3, on this machine's
    GPU or with --assume-backend fa3; asked for elsewhere, it is refused."""
    if target != "compressed-tensors":
        if granularity == "head":
            raise UsageError(f"--granularity head: --target {target} takes per-tensor scales only")
        return ["tensor"], f"per tensor only: {target} checkpoints carry one scale per tensor"
    if granularity == "tensor":
        return ["tensor"], "per tensor only (--granularity tensor): every FP8 attention backend"
    gpu = _hopper(torch)
    fa3 = assume_backend == "fa3" or bool(gpu)
    where = ("assumed with --assume-backend fa3" if assume_backend == "fa3"
             else f"this machine's GPU ({gpu}) is Hopper-class, assumed to be the serving GPU")
    if granularity == "head":
        if kv_only:
            raise UsageError("--granularity head with --kv-only: per-head scales run on "
                             "FlashAttention 3 only, which quantizes the query too")
        if not fa3:
            raise UsageError(f"--granularity head: per-head scales start only on FlashAttention "
                             f"3 (Hopper or newer) and {_this_machine(torch)}; pass "
                             f"--assume-backend fa3 if you serve on Hopper or newer, or use "
                             f"--granularity tensor")
        return ["head"], (f"per head only (--granularity head): FlashAttention 3 ({where}); "
                          f"it quantizes the query, so only Q, K, V settings are scored")
    if fa3 and not kv_only:
        return ["tensor", "head"], (
            f"per tensor and per head: FlashAttention 3 ({where}; per head starts only there)")
    return ["tensor"], ("per tensor only: per-head scales start only on FlashAttention 3 "
                        "(Hopper or newer) and this machine has no such GPU, so an A100, L40S or "
                        "MI300 is assumed; pass --assume-backend fa3 to score per head too")


def calibrate_model(model: str, dataset: str, *, samples: int = 512, seq_len: int = 2048,
                    batch_size: int = 1, holdout_samples: Optional[int] = None,
                    server: Optional[Sequence[str]] = None, out: Optional[str] = None,
                    observer: str = "auto", granularity: str = "auto",
                    target: str = "compressed-tensors", kv_only: bool = False,
                    device: str = "auto", dtype: str = "auto", seed: int = 0,
                    session: Optional[str] = None, resume: bool = False,
                    report: Optional[str] = None, gguf_file: Optional[str] = None,
                    lock_timeout: Optional[float] = None, packing: str = "pack",
                    auth_token_file: Optional[str] = None, keep_session: bool = False,
                    scales_dir: Optional[str] = None, quiet: bool = False,
                    kv_cache_formats: str = "fp8,nvfp4",
                    tolerance: float = format_advice.DEFAULT_TOLERANCE,
                    local_statistics: bool = False,
                    flush_batches: Optional[int] = None,
                    assume_backend: str = "auto") -> CalibrationResult:
    """Calibrates `model` on `dataset` and patches it; see the module docs.
    Raises CalibrateError (with a one-line message) or UsageError."""
    ui = _Ui(quiet)
    t_start = time.monotonic()
    timings: Dict[str, float] = {}
    warnings: List[str] = []
    _check_arguments(samples, seq_len, batch_size, holdout_samples, target, granularity, device,
                     dtype, packing, resume, session, server, lock_timeout, assume_backend)
    observers = _resolve_observers(observer)
    formats = _check_formats(kv_cache_formats, tolerance)
    flush_batches = _check_local_statistics(local_statistics, flush_batches)
    holdout_given = holdout_samples is not None
    holdout = _holdout(samples, seq_len, holdout_samples)
    token = _read_token(auth_token_file)
    # Model, config, dataset, output: checked before anything is written.
    run, documents, text_config, previous = _prepare(model, dataset, out, gguf_file, target,
                                                     resume, server, ui)
    try:
        _check_context(seq_len, text_config, model)

        import torch

        device, dtype = _device_and_dtype(torch, device, dtype)
        granularities, platform = _platform(torch, target, granularity, kv_only, assume_backend)
        # FlashAttention 3 alone (per head only) quantizes the query: no K/V-only setting.
        kv_modes = [True] if kv_only else [False] if granularities == ["head"] else [True, False]

        t = time.monotonic()
        ui.say(f"loading the tokenizer of {model}")
        tokenizer, load_weights = _load_model(run.directory, run.gguf, device, getattr(torch, dtype), ui)
        timings["load"] = time.monotonic() - t

        t = time.monotonic()
        sampled = _tokenize(documents, tokenizer, dataset, samples, seq_len, holdout,
                            holdout_given, seed, packing, ui, warnings)
        del documents
        timings["tokenize"] = time.monotonic() - t
        options = {"seq_len": seq_len, "batch_size": batch_size, "dtype": dtype,
                   "device": device.split(":")[0], "packing": packing, "seed": seed}
        fingerprint = _fingerprint(sampled, text_config, options)
        session_id = _session_of(run, previous, session, fingerprint)
        _check_resume_mode(run, previous, local_statistics, flush_batches)
        _make_work_dir(run)
        try:
            for name, value in dict(
                    previous=previous, resume=resume, fingerprint=fingerprint, session_id=session_id,
                    server=server, token=token, token_file=auth_token_file, load_weights=load_weights,
                    text_config=text_config, sampled=sampled, pad=data.pad_id_of(tokenizer),
                    device=device, batch_size=batch_size, observers=observers,
                    granularities=granularities, kv_modes=kv_modes, platform=platform, target=target,
                    report=report, lock_timeout=lock_timeout, keep_session=keep_session,
                    timings=timings, warnings=warnings, t_start=t_start, dtype=dtype, seq_len=seq_len,
                    scales_dir=scales_dir, formats=formats, tolerance=tolerance,
                    local_statistics=bool(local_statistics), flush_batches=flush_batches,
                    model_dtype=_served_dtype(text_config, run.gguf),
                    dtype_argument=GGUF_EXPORT_DTYPE if run.gguf else None).items():
                setattr(run.o, name, value)
            return _calibrate(run, _Journal(run.work), ui)
        except BaseException as e:
            _raise_after_cleanup(run, e, previous)
    finally:
        run.lock.release()  # after the cleanup: the lock covers the whole run


def _make_work_dir(run: "_Run") -> None:
    try:
        _makedirs(run.work, run.created)
    except OSError as e:
        raise CalibrateError(f"cannot create {run.work}: {e.strerror}") from None


def _holdout(samples: int, seq_len: int, holdout_samples: Optional[int]) -> int:
    """The held-out windows asked for (calibrate_data.default_holdout when
    --holdout-samples is not given); UsageError when none are left."""
    holdout = (holdout_samples if holdout_samples is not None
               else data.default_holdout(samples, seq_len))
    if holdout >= samples:
        raise UsageError(f"--samples {samples} leaves nothing to calibrate on after {holdout} "
                         f"held-out samples; ask for at least {holdout + 1}")
    return holdout


def _tokenize(documents, tokenizer, dataset, samples, seq_len, holdout, holdout_given, seed,
              packing, ui, warnings) -> data.Samples:
    """The windows (calibration and held out), with a progress bar and a
    warning when the data set is shorter than asked for."""
    with ui.bar(total=samples * seq_len, desc="tokenizing", unit="token", estimate=True) as bar:
        sampled = data.make_samples(documents, tokenizer, path=dataset, samples=samples,
                                    seq_len=seq_len, holdout=holdout, seed=seed, packing=packing,
                                    holdout_given=holdout_given, progress=bar.update)
    if sampled.short:
        warnings.append(
            f"{dataset} gives {sampled.count} samples of up to {seq_len} tokens ({sampled.tokens} "
            f"tokens from {sampled.documents} documents); asked for {samples}: calibrating on "
            f"{len(sampled.calibration)} and holding out {len(sampled.holdout)}")
        ui.warn(warnings[-1])
    return sampled


# The dtype a GGUF model's conversion is written in (its quantized weights
# have no torch dtype of their own), and the --dtype the serve line passes.
GGUF_EXPORT_DTYPE = "bfloat16"


def _served_dtype(text_config: dict, gguf: Optional[str]) -> str:
    """The dtype vLLM serves the checkpoint in (--dtype auto reads the
    config's torch_dtype / dtype)."""
    if gguf:
        return GGUF_EXPORT_DTYPE
    value = text_config.get("torch_dtype") or text_config.get("dtype") or "bfloat16"
    return str(value).replace("torch.", "")


def _check_arguments(samples, seq_len, batch_size, holdout_samples, target, granularity, device,
                     dtype, packing, resume, session, server, lock_timeout,
                     assume_backend="auto") -> None:
    """UsageError naming the first argument out of its range."""
    for name, value, low in (("--samples", samples, 1), ("--seq-len", seq_len, 2),
                             ("--batch-size", batch_size, 1)):
        if not isinstance(value, int) or value < low:
            raise UsageError(f"{name} must be an integer >= {low}, got {value}")
    if holdout_samples is not None and (holdout_samples < 2 or holdout_samples >= samples):
        raise UsageError(f"--holdout-samples must be at least 2 and below --samples ({samples}), "
                         f"got {holdout_samples}")
    if target not in TARGETS:
        raise UsageError(f"--target {target}: not one of {', '.join(TARGETS)}")
    if granularity not in ("auto", "tensor", "head"):
        raise UsageError(f"--granularity {granularity}: not auto, tensor or head")
    if device not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:\d+", device):
        raise UsageError(f"--device {device}: not auto, cpu or cuda")
    if dtype not in ("auto", "bfloat16", "float16", "float32"):
        raise UsageError(f"--dtype {dtype}: not auto, bfloat16, float16 or float32")
    if packing not in ("pack", "truncate"):
        raise UsageError(f"--packing {packing}: not pack or truncate")
    if resume and session is None and server:
        raise UsageError("--resume with --server needs --session ID (the session to continue)")
    if lock_timeout is not None and lock_timeout < 0:
        raise UsageError("--lock-timeout must be >= 0")
    if assume_backend not in ASSUME_BACKENDS:
        raise UsageError(f"--assume-backend {assume_backend}: not one of "
                         f"{', '.join(ASSUME_BACKENDS)}")


def _check_context(seq_len: int, text_config: dict, model: str) -> None:
    """--seq-len within the model's context (max_position_embeddings): past
    it the positions are ones the model never saw, and the scales would
    calibrate RoPE angles it is never served with."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        limit = text_config.get(key)
        if isinstance(limit, int) and limit > 0:
            if seq_len > limit:
                raise UsageError(f"--seq-len {seq_len} is longer than {model}'s context "
                                 f"({key} {limit}); use --seq-len {limit} or less")
            return


def _check_local_statistics(local_statistics: bool,
                            flush_batches: Optional[int]) -> Optional[int]:
    """--flush-batches only with --local-statistics, and 1 or more; returns
    the batches per flush (kvcal.Producer's default when not given), None
    without --local-statistics."""
    if flush_batches is None:
        if not local_statistics:
            return None
        from kvcal.local_producer import DEFAULT_FLUSH_BATCHES

        return DEFAULT_FLUSH_BATCHES
    if not local_statistics:
        raise UsageError(f"--flush-batches {flush_batches}: only with --local-statistics (it "
                         f"says how many batches of statistics are accumulated before they are "
                         f"sent); add --local-statistics or drop --flush-batches")
    try:
        return _args.check_int("", "--flush-batches", flush_batches, FLUSH_BATCHES)
    except (TypeError, ValueError) as e:
        raise UsageError(str(e).replace("kvcal: ", "", 1)) from None


def _check_resume_mode(run: "_Run", previous: Optional[dict], local_statistics: bool,
                       flush_batches: Optional[int]) -> None:
    """--resume continues in the mode the interrupted run streamed in: its
    watermark counts chunks in-band and flushes of --flush-batches batches
    with --local-statistics, so another mode or another N would skip the
    wrong batches."""
    if not previous:
        return
    before = bool(previous.get("local_statistics", False))
    if before != bool(local_statistics):
        raise CalibrateError(
            f"--resume: the interrupted run in {run.work} ran "
            f"{'with' if before else 'without'} --local-statistics; rerun it the same way, or "
            f"delete that directory to start over")
    if before and previous.get("flush_batches") != flush_batches:
        raise CalibrateError(
            f"--resume: the interrupted run in {run.work} flushed every "
            f"{previous.get('flush_batches')} batches, not {flush_batches}; rerun it with "
            f"--flush-batches {previous.get('flush_batches')}, or delete that directory to start "
            f"over")


def _check_formats(spec: str, tolerance: float) -> List[str]:
    """--kv-cache-formats as a list; UsageError naming what is wrong."""
    try:
        formats = format_advice.parse_formats(spec)
    except ValueError as e:
        raise UsageError(f"--kv-cache-formats {spec}: {e}") from None
    if not isinstance(tolerance, (int, float)) or not math.isfinite(tolerance) or tolerance < 0:
        raise UsageError(f"--tolerance must be a finite number of nats/token >= 0, got {tolerance}")
    return formats


def _read_token(auth_token_file: Optional[str]) -> Optional[str]:
    if not auth_token_file:
        return None
    try:
        with open(auth_token_file) as f:
            return f.read().strip()
    except OSError as e:
        raise CalibrateError(f"--auth-token-file {auth_token_file}: {e.strerror}") from None


def _prepare(model, dataset, out, gguf_file, target, resume, server, ui):
    """The model directory, its config and the dataset's documents, checked,
    and the run's work directory with what an interrupted run left there:
    (run, documents, text_config, previous run record or None)."""
    directory, is_hub, gguf = _resolve_model(model, gguf_file)
    if (is_hub or gguf) and not out:
        raise CalibrateError(f"{model}: {'a hub model' if is_hub else 'a GGUF model'} is not "
                             f"patched in place; pass --out DIR for the patched checkpoint")
    data.check_dataset(dataset)
    documents = data.read_documents(dataset)
    if not documents:
        raise data.DataError(f"{dataset} has no usable text (no non-empty documents)")
    if out:
        _check_out(out)
        if not is_hub and _inside(out, directory):
            raise CalibrateError(f"--out {out} is inside the model directory {directory}; "
                                 f"name a directory outside it")
    if is_hub:
        ui.say(f"fetching {model} from the Hugging Face hub")
        directory = _fetch_hub(model)
    config = _config_dict(directory, gguf)
    text_config = check_config(config, model)
    _check_quant_method(config, target, model)
    if not out:
        _check_in_place(directory)
    run = _Run(model, directory, gguf, os.path.abspath(out) if out else None,
               _work_dir(directory, out))
    # One run per output, until calibrate_model returns or raises: the work
    # directory (journal, worker state, staging) is this run's alone.
    try:
        run.lock = calibrate_lock.run_lock(directory, out)
    except calibrate_lock.LockError as e:
        raise CalibrateError(str(e)) from None
    try:
        if out:
            _check_out(out)  # again under the lock: its last holder may just have written OUT
        previous = _Journal(run.work).read_run()
        if previous and not resume:
            raise CalibrateError(f"an interrupted run left its state in {run.work} (session "
                                 f"{previous.get('session')}); add --resume to continue it, or "
                                 f"delete that directory to start over")
        if resume and not previous and not server:
            raise CalibrateError(f"nothing to resume: {run.work} holds no interrupted run of "
                                 f"{model}{' into ' + out if out else ''}")
    except BaseException:
        run.lock.release()
        raise
    return run, documents, text_config, previous


def _device_and_dtype(torch, device: str, dtype: str):
    """`auto` resolved: CUDA in bfloat16 where torch sees a GPU, else CPU in
    float32."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise CalibrateError("--device cuda: torch sees no CUDA device; use --device cpu")
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    return device, dtype


def _session_of(run, previous, session, fingerprint) -> str:
    """The session id: the interrupted run's (which must have the same
    samples), --session, or one named after the samples' fingerprint."""
    if previous and previous.get("fingerprint") != fingerprint:
        raise CalibrateError(f"--resume: the samples differ from the interrupted run's in "
                             f"{run.work} (another dataset, --samples, --seq-len, --seed, "
                             f"--batch-size, --dtype or device); rerun it the same way, or delete "
                             f"that directory to start over")
    if previous and session and previous.get("session") != session:
        raise CalibrateError(f"--session {session}: the interrupted run in {run.work} used "
                             f"session {previous.get('session')}")
    if previous:
        return previous["session"]
    return session or f"kvcal-calibrate-{fingerprint[:16]}"


def _raise_after_cleanup(run: "_Run", e: BaseException, previous) -> None:
    """Stops the embedded worker; removes what the run created when nothing
    worth resuming was sent; re-raises `e`, saying where the state is kept."""
    if run.worker is not None:
        run.worker.stop()
    kept = run.uploaded or bool(previous)
    if not kept:
        _remove_created(run.created)  # nothing worth resuming: leave no trace
    if isinstance(e, KeyboardInterrupt):
        if run.stage == "done":
            raise Interrupted("interrupted after the patch committed: the checkpoint is "
                              "patched; the summary and cleanup were skipped") from None
        where = (f"; its state is kept in {run.work}: rerun with --resume to continue"
                 if kept else "")
        raise Interrupted(f"interrupted; the checkpoint is unchanged{where}") from None
    if kept and isinstance(e, (CalibrateError, data.DataError, WorkerError,
                               output.OutputError)) and run.stage != "done":
        raise type(e)(f"{e} (the run's state is kept in {run.work}: rerun with --resume "
                      f"after fixing this)") from None
    raise e


def _calibrate(run: "_Run", journal: "_Journal", ui: _Ui) -> CalibrationResult:
    """The run after its checks: worker and session, forwards, scoring,
    patch and report, then cleanup."""
    o = run.o
    client, existing = _connect(run, ui)
    geometry = _load_and_open_session(run, journal, client, existing, ui)
    _forwards(run, journal, client, existing, ui)

    run.stage = "score"
    _test_seam("score")
    t = time.monotonic()
    scoring = _score(run, client, geometry, ui)
    o.timings["finalize_evaluate"] = time.monotonic() - t

    t = time.monotonic()
    written = _patch_and_report(run, scoring)
    o.timings["patch"] = time.monotonic() - t

    if not o.keep_session:
        import kvcal

        try:
            client.delete(o.session_id)
        except kvcal.KvcalError:
            pass
    client.close()
    if run.worker is not None:
        run.worker.stop()
        run.worker = None
    shutil.rmtree(run.work, ignore_errors=True)
    o.timings["total"] = time.monotonic() - o.t_start
    return CalibrationResult(
        checkpoint=written.checkpoint, report=written.report, decision=scoring.decision,
        inspect=written.inspected, patch=written.patch, session=o.session_id,
        samples={"calibration": len(o.sampled.calibration), "holdout": len(o.sampled.holdout),
                 "tokens": o.sampled.tokens, "seq_len": o.seq_len, "batch_size": o.batch_size,
                 "documents": o.sampled.documents, "requested": o.sampled.requested},
        platform=o.platform, timings=o.timings, warnings=o.warnings,
        reference_nll=scoring.scored["reference_nll"], resumed=run.resumed)


def _connect(run: "_Run", ui: _Ui):
    """The embedded worker (or --server's) and the session's status there,
    checked before the model loads (fail fast): (client, status or None)."""
    import kvcal

    o = run.o
    if not o.server:
        run.worker = EmbeddedWorker(run.work)
        run.worker.start()
        target_addr = run.worker.target
        ui.say(f"started a local kvcal-worker on {target_addr} (state in {run.worker.state_dir})")
    else:
        target_addr = list(o.server)
    try:
        client = kvcal.Client(target_addr, token=o.token)
    except ValueError as e:
        raise CalibrateError(str(e)) from None
    existing = None
    try:
        existing = client.status(o.session_id)
    except kvcal.KvcalError as e:
        if "NOT_FOUND" not in str(e):
            raise CalibrateError(f"cannot reach the kvcal worker(s) {client.target}: "
                                 f"{_first_line(e)}") from None
    except ValueError as e:
        raise CalibrateError(_first_line(e)) from None
    if existing is None and o.previous and not o.server:
        raise CalibrateError(f"--resume: the worker state in {run.work} has no session "
                             f"{o.session_id} (it was lost); delete {run.work} to start over")
    if existing is not None and not o.resume:
        raise CalibrateError(f"session {o.session_id} already exists on {client.target}; "
                             f"add --resume to continue it, or pass another --session")
    return client, existing


def _load_and_open_session(run: "_Run", journal: "_Journal", client, existing, ui: _Ui):
    """Loads the model (run.o.model) and creates or attaches the session;
    from then on the work directory is worth keeping. Returns the geometry."""
    import kvcal
    import kvcal.torch as kvtorch

    o = run.o
    geometry = kvcal.Geometry.from_config(o.text_config)
    t = time.monotonic()
    ui.say(f"loading {run.model} ({o.dtype} on {o.device})")
    o.model = o.load_weights()
    if not kvtorch._attention_modules(o.model):
        raise CalibrateError(f"{run.model} ({type(o.model).__name__}) has no attention layers "
                             f"that kvcal can capture")
    o.timings["load"] += time.monotonic() - t
    try:
        if existing is None:
            client.create_session(geometry=geometry, session_id=o.session_id)
        else:
            client.attach(o.session_id)
    except (kvcal.KvcalError, ValueError) as e:
        raise CalibrateError(f"session {o.session_id} on {client.target}: {_first_line(e)}") from None
    journal.write_run({"fingerprint": o.fingerprint, "session": o.session_id,
                       "server": list(o.server) if o.server else None, "model": run.model,
                       "local_statistics": o.local_statistics,
                       "flush_batches": o.flush_batches})
    run.uploaded = True
    run.stage = "upload"
    return geometry


def _resume_point(journal: "_Journal", client, existing, nbatches: int):
    """(batches already on the worker, the sequence to start at or None)."""
    if existing is None:
        return 0, None
    if client.workers is not None:
        return 0, 1  # several workers: resend all, the watermarks drop duplicates
    applied = _applied(existing)
    skip, start_sequence = 0, None
    done = journal.batches()
    for b in range(nbatches):
        if b in done and done[b] <= applied:
            skip, start_sequence = b + 1, done[b] + 1
        else:
            break
    return skip, start_sequence or 1


def _local_resume_point(client, existing, nbatches: int, flush_batches: int):
    """_resume_point of --local-statistics: (batches already on the worker,
    the sequence to start at or None). Flush n is the producer's message n
    and covers batches [(n-1) N, n N) (N = --flush-batches; the batches are
    numbered 0, 1, ... with data in each, nothing is held out, no flush()
    or time-based flush in between, the last flush at close), so a
    watermark of w means the first w N batches are on the worker."""
    if existing is None:
        return 0, None
    if client.workers is not None:
        return 0, 1  # several workers: resend all, each drops the flushes it has
    applied = _applied(existing)
    return min(nbatches, applied * flush_batches), applied + 1


def _applied(existing) -> int:
    """The watermark of kvcal-calibrate's producer in the session (0 when
    it has none)."""
    applied = 0
    for p in existing.producers:
        if p.producer_id == PRODUCER:
            applied = p.sequence
    return applied


def _forwards(run: "_Run", journal: "_Journal", client, existing, ui: _Ui) -> None:
    """The calibration windows through the model under capture, streamed to
    the worker; each batch's last chunk sequence journaled for --resume."""
    import torch

    import kvcal
    import kvcal.torch as kvtorch
    from kvcal.torch import UnsupportedModelError

    o = run.o
    cal = o.sampled.calibration
    nbatches = -(-len(cal) // o.batch_size)
    if o.local_statistics:
        skip, start_sequence = _local_resume_point(client, existing, nbatches, o.flush_batches)
    else:
        skip, start_sequence = _resume_point(journal, client, existing, nbatches)
    if existing is not None:
        ui.say(f"resuming session {o.session_id}: {skip} of {nbatches} batches are on the worker")
    run.resumed = {"skipped_batches": skip, "batches": nbatches} if existing is not None else None
    kwargs = {"start_sequence": start_sequence} if start_sequence else {}
    if not o.server:
        # Its chunks are safe once applied (the worker writes its state when
        # stopped), and it does not come back after a crash: fail fast.
        kwargs.update(keep_until_durable=False, reconnect_timeout=10.0,
                      shared_memory=not o.local_statistics)
    if o.local_statistics:
        # Batches are accumulated here and sent as statistics every
        # --flush-batches and at close (docs/local-statistics.md), each
        # flush one message of the producer's sequence; no held-out window
        # goes through this producer (scoring runs here). local_async: the
        # engine runs on the producer's thread beside the forwards
        # (bench_capture.py's "kvcal local async" row).
        kwargs.update(local_statistics=True, flush_batches=o.flush_batches, local_async=True)
    t = time.monotonic()
    producer = kvcal.Producer(client, producer_id=PRODUCER, **kwargs)
    for _ in range(skip):
        producer.new_batch()
    done_before = journal.batches() if skip else {}
    try:
        with open(journal.batches_path, "w") as jf:
            for b in range(0 if o.local_statistics else skip):  # (local: none journaled)
                journal.add(jf, b, done_before[b])
            with ui.bar(total=len(cal), desc="forwards", unit="sample") as bar:
                bar.update(min(len(cal), skip * o.batch_size))
                with kvtorch.capture(o.model, producer), torch.no_grad():
                    for b, batch in enumerate(data.batches(cal, o.batch_size, o.pad, o.device)):
                        if b < skip:
                            continue
                        o.model(batch.input_ids, attention_mask=batch.attention_mask,
                                use_cache=False)
                        if client.workers is None and not o.local_statistics:
                            # (local statistics: the watermark alone says
                            # which batches are flushed; none is journaled)
                            journal.add(jf, b, producer.last_sequence)
                        bar.update(batch.input_ids.shape[0])
                        _test_seam(f"batch-{b}")
            o.timings["forwards"] = time.monotonic() - t
            t = time.monotonic()
            _close_with_bar(producer, ui)
            o.timings["upload"] = time.monotonic() - t
    except UnsupportedModelError as e:
        producer.__exit__(type(e), e, None)
        raise CalibrateError(_first_line(e)) from None
    except kvcal.ProducerError as e:
        producer.__exit__(type(e), e, None)
        if run.worker is not None and not run.worker.running():
            raise CalibrateError(f"the embedded kvcal-worker died (exit {run.worker.proc.returncode}"
                                 f"; its log: {run.worker.log_path})") from None
        raise CalibrateError(f"streaming to {client.target} failed: {_first_line(e)}") from None
    except BaseException as e:
        producer.__exit__(type(e), e, None)
        raise


def _score(run: "_Run", client, geometry, ui: _Ui) -> SimpleNamespace:
    """Every candidate finalized and scored on the held-out windows, the
    choice and the skip-layer advice for it."""
    import kvcal

    o = run.o

    def finalize(obs, gran):
        try:
            return client.finalize(observer=obs, granularity=gran)
        except kvcal.KvcalError as e:
            raise CalibrateError(f"finalize {obs} per {gran}: {_first_line(e)}") from None

    candidates = select.build_candidates(finalize, geometry, o.observers, o.granularities, o.kv_modes)
    held = list(data.batches(o.sampled.holdout, o.batch_size, o.pad, o.device))
    runs = 1 + sum(1 for c in candidates if c.same_as is None)
    with ui.bar(total=runs, desc="scoring on held-out", unit="run") as bar:
        scored = select.score(o.model, held, candidates, progress=lambda: bar.update(1))
    chosen = select.choose(candidates, scored["blocks"])
    # Skip-layer advice for the chosen setting: one more held-out pass when
    # a layer's attention error is an outlier (kvcal/skip_layers.py).
    skip = skip_layers.advise(o.model, held, chosen, scored["reference"], scored["blocks"])
    others = [f for f in o.formats if f != "fp8"]
    with ui.bar(total=len(others), desc="scoring cache formats", unit="format") as bar:
        formats = format_advice.compare(o.model, held, chosen, candidates, scored, skip,
                                        o.formats, o.tolerance, progress=lambda: bar.update(1))
    if o.scales_dir:
        _save_candidates(o.scales_dir, candidates)
    decision = decide(
        chosen, candidates, scored["blocks"], select.why(chosen, candidates, scored["blocks"]),
        skip, formats, checkpoint=run.out or run.directory, target=o.target,
        model_dtype=o.model_dtype, windows=len(o.sampled.holdout), tokens=scored["tokens"],
        tolerance=o.tolerance, dtype_argument=o.dtype_argument)
    return SimpleNamespace(candidates=candidates, scored=scored, chosen=chosen, skip=skip,
                           formats=formats, decision=decision)


def _patch_and_report(run: "_Run", scoring: SimpleNamespace) -> SimpleNamespace:
    """The decision's scales patched into the checkpoint (in place or
    --out), inspected for the cache dtype the serve line names, and the HTML
    report written from the same decision (kvcal report --decision)."""
    o = run.o
    decision: Decision = scoring.decision
    written = decision.written
    scales_path = os.path.join(run.work, "scales.safetensors")
    written.scales.metadata["kvcal_calibrate_choice"] = written.label
    written.scales.save(scales_path)
    export = _gguf_exporter(o.model, run) if run.gguf else None
    run.stage = "patch"
    patch = output.patch_checkpoint(run.directory, scales_path, out=run.out,
                                    staging=os.path.join(run.work, "checkpoint"), target=o.target,
                                    lock_timeout=o.lock_timeout, export=export,
                                    committed=lambda: setattr(run, "stage", "done"))
    checkpoint = patch.output_dir
    inspected = output.inspect(checkpoint, o.target, decision.inspect_dtype)
    report_path = os.path.abspath(o.report) if o.report else os.path.join(checkpoint, "kvcal-report.html")
    evals = []
    for c in scoring.candidates:
        if c.same_as is not None or c.evaluation is None:
            continue
        path = os.path.join(run.work, f"eval-{len(evals)}.json")
        c.evaluation.to_json(path)
        evals.append(path)
    # The other cache formats' runs: the report's "Cache format" section.
    for f in scoring.formats.figures if scoring.formats is not None else []:
        if f.evaluation is not None:
            path = os.path.join(run.work, f"eval-{len(evals)}-{f.kv_format}.json")
            f.evaluation.to_json(path)
            evals.append(path)
    decision_path = os.path.join(run.work, "decision.json")
    with open(decision_path, "w") as f:
        json.dump(decision.view(scoring.scored["reference_nll"]), f)
    rep_target = ",".join(o.server) if o.server else run.worker.target
    try:
        output.write_report(report_path, rep_target, o.session_id, evals, o.token_file,
                            scales=scales_path, decision=decision_path)
    except output.OutputError as e:
        o.warnings.append(f"no report: {e}")
        report_path = None
    return SimpleNamespace(patch=patch, checkpoint=checkpoint, inspected=inspected,
                           report=report_path)


def _test_seam(stage: str) -> None:
    """KVCAL_CALIBRATE_TEST_FAIL=STAGE makes the run fail there (tests of
    the cleanup after a failure and of --resume; never set it otherwise):
    "score", or "batch-B" after forward B (0, 1, ...)."""
    if os.environ.get("KVCAL_CALIBRATE_TEST_FAIL") == stage:
        raise CalibrateError(f"test failure injected at {stage} (KVCAL_CALIBRATE_TEST_FAIL)")


def _save_candidates(directory: str, candidates) -> None:
    """Every distinct candidate's scales file into `directory`."""
    os.makedirs(directory, exist_ok=True)
    seen = set()
    for c in candidates:
        name = (f"{c.origin.replace(' ', '-')}-{c.observer or 'one'}-{c.granularity}"
                f".safetensors").replace("scale-1.0-one-one", "scale-1.0")
        if c.scales is None or name in seen:
            continue
        seen.add(name)
        c.scales.save(os.path.join(directory, name))


def _close_with_bar(producer, ui: _Ui) -> None:
    """producer.close(), with a bar of the chunks acknowledged meanwhile."""
    import threading

    error: list = []

    def close():
        try:
            producer.close()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            error.append(e)

    thread = threading.Thread(target=close, name="kvcal-calibrate-close", daemon=True)
    thread.start()
    stats = producer.stats()
    total = max(1, stats.get("last_sequence", 0))
    with ui.bar(total=total, desc="upload", unit="chunk") as bar:
        shown = stats.get("acknowledged", 0)
        bar.update(min(shown, total))
        while thread.is_alive():
            thread.join(0.2)
            now = producer.stats().get("acknowledged", shown)
            if now > shown:
                bar.update(min(now, total) - min(shown, total))
                shown = now
    if error:
        raise error[0]


def _gguf_exporter(model, run):
    """export(dir): the GGUF model's de-quantized weights as an ordinary
    safetensors checkpoint in GGUF_EXPORT_DTYPE (a model built from the
    config without GGUF's quantization_config, holding the loaded weights;
    its config's dtype says so, and the serve line passes --dtype), with its
    tokenizer."""
    def export(directory: str) -> int:
        import copy

        import torch
        import transformers

        dtype = getattr(torch, GGUF_EXPORT_DTYPE)
        config = copy.deepcopy(model.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.torch_dtype = dtype
        plain = type(model)(config).to(dtype=dtype)
        plain.load_state_dict({k: v.to("cpu") for k, v in model.state_dict().items()})
        with _transformers_quiet(transformers):
            plain.save_pretrained(directory)
        del plain
        transformers.AutoTokenizer.from_pretrained(
            run.directory, gguf_file=os.path.basename(run.gguf)).save_pretrained(directory)
        return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(directory)
                   for f in fs)
    return export


@contextlib.contextmanager
def _transformers_quiet(transformers):
    """transformers' own progress bars off for a step whose phase line is
    kvcal-calibrate's (save_pretrained's "Writing model shards")."""
    logging = transformers.utils.logging
    was = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            logging.enable_progress_bar()
