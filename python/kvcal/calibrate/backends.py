"""Which scale granularities a run scores: what the serving GPU's attention
backend starts with (per head: FlashAttention 3 only), from this machine's
GPU or --assume-backend."""
from __future__ import annotations

from kvcal.calibrate.errors import UsageError


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


def granularities_of(torch, target: str, granularity: str, kv_only: bool,
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
