"""kvcal-calibrate's failures: each a one-line message that says what to change."""
from __future__ import annotations

import os


class CalibrateError(RuntimeError):
    """A failure: the message is one line that says what to change."""


class UsageError(ValueError):
    """Bad arguments (exit 2)."""


class Interrupted(KeyboardInterrupt):
    pass


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:300]


def test_seam(stage: str) -> None:
    """KVCAL_CALIBRATE_TEST_FAIL=STAGE makes the run fail there (tests of
    the cleanup after a failure and of --resume; never set it otherwise):
    "score", or "batch-B" after forward B (0, 1, ...)."""
    if os.environ.get("KVCAL_CALIBRATE_TEST_FAIL") == stage:
        raise CalibrateError(f"test failure injected at {stage} (KVCAL_CALIBRATE_TEST_FAIL)")
