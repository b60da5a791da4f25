"""Run: the record of one kvcal-calibrate run that every step reads and
fills in (run.py calls the steps in order)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from kvcal.calibrate.data import Samples
from kvcal.calibrate.lock import RunLock
from kvcal.calibrate.options import Checked, Options
from kvcal.calibrate.worker import EmbeddedWorker


@dataclass
class Run:
    """One run: what it was asked (opts, checked), where it works, what the
    steps resolved, and how far it got."""
    opts: Options
    checked: Checked
    model: str                # the model as given (a directory or a hub name)
    directory: str            # its local directory
    gguf: Optional[str]
    out: Optional[str]
    work: str                 # the work directory (workdir.work_dir)
    text_config: dict = field(default_factory=dict)
    created: List[str] = field(default_factory=list)  # directories this run made
    uploaded: bool = False
    stage: str = "prepare"    # prepare | upload | score | patch | done
    resumed: Optional[dict] = None
    previous: Optional[dict] = None     # the interrupted run's record (--resume)
    worker: Optional[EmbeddedWorker] = None
    lock: Optional[RunLock] = None  # one run per output, the whole run
    # Resolved before the forwards:
    device: str = "cpu"
    dtype: str = "float32"
    granularities: List[str] = field(default_factory=list)
    kv_modes: List[bool] = field(default_factory=list)  # K/V only, Q/K/V
    platform: str = ""        # the granularity assumption, in words
    model_dtype: str = ""     # the dtype vLLM serves the checkpoint in
    dtype_argument: Optional[str] = None  # the serve line's --dtype, where it must be given
    sampled: Optional[Samples] = None
    pad: int = 0
    fingerprint: str = ""
    session_id: str = ""
    load_weights: Optional[Callable[[], Any]] = None
    lm: Any = None            # the loaded torch model
    timings: Dict[str, float] = field(default_factory=dict)
    warnings: List[str] = field(default_factory=list)
    t_start: float = field(default_factory=time.monotonic)

    @property
    def observers(self) -> List[str]:
        return self.checked.observers

    @property
    def formats(self) -> List[str]:
        return self.checked.formats

    @property
    def flush_batches(self) -> Optional[int]:
        return self.checked.flush_batches

    @property
    def token(self) -> Optional[str]:
        return self.checked.token
