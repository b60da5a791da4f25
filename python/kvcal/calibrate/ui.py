"""What kvcal-calibrate says while it runs: phase lines and warnings on
stderr, and progress bars (tqdm) that end at their totals."""
from __future__ import annotations

import sys
import time

PROG = "kvcal-calibrate"


class Ui:
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
    """tqdm, finished truthfully (see Ui.bar)."""

    def __init__(self, bar, ui: "Ui", estimate: bool):
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
