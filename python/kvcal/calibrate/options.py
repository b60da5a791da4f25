"""calibrate_model's options, typed (Options: one field per keyword, the
flags of kvcal-calibrate), and their checks: every value in its range
before anything is read or written (UsageError naming the flag)."""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import List, Optional, Sequence

from kvcal import _ranges
from kvcal.calibrate import choice, data, format_advice
from kvcal.calibrate.backends import ASSUME_BACKENDS
from kvcal.calibrate.errors import CalibrateError, UsageError

TARGETS = ("compressed-tensors", "modelopt", "quark")
GRANULARITIES = ("auto", "tensor", "head")
DTYPES = ("auto", "bfloat16", "float16", "float32")
PACKINGS = ("pack", "truncate")
# --flush-batches: as kvcal.Producer's flush_batches.
FLUSH_BATCHES = _ranges.IntRange(1, None)


@dataclass
class Options:
    """What a run is asked to do: calibrate_model's keyword arguments, each
    the kvcal-calibrate flag of the same name (docs/calibrate.md)."""
    samples: int = 512
    seq_len: int = 2048
    batch_size: int = 1
    holdout_samples: Optional[int] = None     # default: data.default_holdout
    server: Optional[Sequence[str]] = None    # default: an embedded worker
    out: Optional[str] = None                 # default: patch in place
    observer: str = "auto"
    granularity: str = "auto"
    target: str = "compressed-tensors"
    kv_only: bool = False
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    session: Optional[str] = None
    resume: bool = False
    report: Optional[str] = None
    gguf_file: Optional[str] = None
    lock_timeout: Optional[float] = None
    packing: str = "pack"
    auth_token_file: Optional[str] = None
    keep_session: bool = False
    scales_dir: Optional[str] = None
    quiet: bool = False
    kv_cache_formats: str = "fp8,nvfp4"
    tolerance: float = format_advice.DEFAULT_TOLERANCE
    local_statistics: bool = False
    flush_batches: Optional[int] = None
    assume_backend: str = "auto"

    @classmethod
    def of(cls, keywords: dict) -> "Options":
        """Options from calibrate_model's keywords; TypeError naming an
        unknown one."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(keywords) - names)
        if unknown:
            raise TypeError(f"calibrate_model() got unexpected keyword argument(s) "
                            f"{', '.join(unknown)}; the options are {', '.join(sorted(names))}")
        return cls(**keywords)


@dataclass
class Checked:
    """What the checks of Options resolved."""
    observers: List[str]            # the observers to score, in the simpler-first order
    formats: List[str]              # the KV cache formats to score
    flush_batches: Optional[int]    # batches per flush with --local-statistics, else None
    holdout: int                    # held-out windows
    token: Optional[str]            # --auth-token-file's token


def check(o: Options) -> Checked:
    """Every option in its range (UsageError naming the first one that is
    not), then what they resolve to."""
    check_arguments(o)
    return Checked(observers=resolve_observers(o.observer),
                   formats=check_formats(o.kv_cache_formats, o.tolerance),
                   flush_batches=check_local_statistics(o.local_statistics, o.flush_batches),
                   holdout=holdout_windows(o.samples, o.seq_len, o.holdout_samples),
                   token=read_token(o.auth_token_file))


def check_arguments(o: Options) -> None:
    """UsageError naming the first argument out of its range."""
    for name, value, low in (("--samples", o.samples, 1), ("--seq-len", o.seq_len, 2),
                             ("--batch-size", o.batch_size, 1)):
        if not isinstance(value, int) or value < low:
            raise UsageError(f"{name} must be an integer >= {low}, got {value}")
    if o.holdout_samples is not None and (o.holdout_samples < 2 or o.holdout_samples >= o.samples):
        raise UsageError(f"--holdout-samples must be at least 2 and below --samples ({o.samples}), "
                         f"got {o.holdout_samples}")
    for flag, value, allowed in (("--target", o.target, TARGETS),
                                 ("--granularity", o.granularity, GRANULARITIES),
                                 ("--dtype", o.dtype, DTYPES), ("--packing", o.packing, PACKINGS),
                                 ("--assume-backend", o.assume_backend, ASSUME_BACKENDS)):
        if value not in allowed:
            raise UsageError(f"{flag} {value}: not one of {', '.join(allowed)}")
    if o.device not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:\d+", o.device):
        raise UsageError(f"--device {o.device}: not auto, cpu or cuda")
    if o.resume and o.session is None and o.server:
        raise UsageError("--resume with --server needs --session ID (the session to continue)")
    if o.lock_timeout is not None and o.lock_timeout < 0:
        raise UsageError("--lock-timeout must be >= 0")


def resolve_observers(spec: str) -> List[str]:
    from kvcal.names import resolve_observer

    if spec.strip().lower() == "auto":
        return list(choice.OBSERVER_ORDER)
    out = []
    for part in spec.split(","):
        if not part.strip():
            continue
        try:
            name = resolve_observer(part.strip())
        except ValueError:
            raise UsageError(f"--observer {part.strip()}: not one of auto, "
                             f"{', '.join(choice.OBSERVER_ORDER)}") from None
        if name == "auto":
            return list(choice.OBSERVER_ORDER)
        if name not in out:
            out.append(name)
    if not out:
        raise UsageError("--observer is empty")
    return out


def check_formats(spec: str, tolerance: float) -> List[str]:
    """--kv-cache-formats as a list; UsageError naming what is wrong."""
    try:
        formats = format_advice.parse_formats(spec)
    except ValueError as e:
        raise UsageError(f"--kv-cache-formats {spec}: {e}") from None
    if not isinstance(tolerance, (int, float)) or not math.isfinite(tolerance) or tolerance < 0:
        raise UsageError(f"--tolerance must be a finite number of nats/token >= 0, got {tolerance}")
    return formats


def check_local_statistics(local_statistics: bool,
                            flush_batches: Optional[int]) -> Optional[int]:
    """--flush-batches only with --local-statistics, and 1 or more; returns
    the batches per flush (kvcal.Producer's default when not given), None
    without --local-statistics."""
    if flush_batches is None:
        if not local_statistics:
            return None
        from kvcal.producer.local import DEFAULT_FLUSH_BATCHES

        return DEFAULT_FLUSH_BATCHES
    if not local_statistics:
        raise UsageError(f"--flush-batches {flush_batches}: only with --local-statistics (it "
                         f"says how many batches of statistics are accumulated before they are "
                         f"sent); add --local-statistics or drop --flush-batches")
    try:
        return _ranges.check_int("", "--flush-batches", flush_batches, FLUSH_BATCHES)
    except (TypeError, ValueError) as e:
        raise UsageError(str(e).replace("kvcal: ", "", 1)) from None


def holdout_windows(samples: int, seq_len: int, holdout_samples: Optional[int]) -> int:
    """The held-out windows asked for (data.default_holdout when
    --holdout-samples is not given); UsageError when none are left."""
    holdout = (holdout_samples if holdout_samples is not None
               else data.default_holdout(samples, seq_len))
    if holdout >= samples:
        raise UsageError(f"--samples {samples} leaves nothing to calibrate on after {holdout} "
                         f"held-out samples; ask for at least {holdout + 1}")
    return holdout


def read_token(auth_token_file: Optional[str]) -> Optional[str]:
    if not auth_token_file:
        return None
    try:
        with open(auth_token_file) as f:
            return f.read().strip()
    except OSError as e:
        raise CalibrateError(f"--auth-token-file {auth_token_file}: {e.strerror}") from None
