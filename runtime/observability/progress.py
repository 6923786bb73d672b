"""Progress for long commands (run, collect, publish, reverify): a bar on a terminal, log lines elsewhere.

On a terminal a rich bar shows done/total, rate, ETA, failures and the running
mean reward. Without one (Slurm and Kubernetes logs, a pipe) the same figures
go to stderr as one line every ``every_pct`` percent or ``interval_s`` seconds,
whichever comes first, and once at the end. ``quiet`` turns both off.

Updates are cheap (a few integer operations); the bar is redrawn at most ten
times a second, so a 10,000-rows/s collector does not pay for rendering.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

import msgspec


class ProgressOptions(msgspec.Struct, kw_only=True, frozen=True):
    quiet: bool = False
    every_pct: float = 5.0  # non-TTY: a line at every this many percent ...
    interval_s: float = 30.0  # ... or after this many seconds without one
    tty: bool | None = None  # None: decide from the stream


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The progress flags every long command shares."""
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar and no progress lines")
    p.add_argument(
        "--progress-every",
        type=_percent,
        default=5.0,
        metavar="PCT",
        help="without a terminal: print a progress line every PCT percent (default 5)",
    )
    p.add_argument(
        "--progress-interval",
        type=_seconds,
        default=30.0,
        metavar="S",
        help="without a terminal: print a progress line at least every S seconds (default 30)",
    )


def options_from(args: argparse.Namespace) -> ProgressOptions:
    return ProgressOptions(
        quiet=bool(getattr(args, "quiet", False) or getattr(args, "no_progress", False)),
        every_pct=getattr(args, "progress_every", 5.0),
        interval_s=getattr(args, "progress_interval", 30.0),
    )


def _percent(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a percentage, got {text!r}") from None
    if not 0 < value <= 100:
        raise argparse.ArgumentTypeError(f"must be in (0, 100], got {text}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


class Tracker:
    """Counts results and shows them; use as a context manager around the work.

    ``tracker(done, total)`` is the collector's ``on_progress`` callback;
    ``result(ok, reward)`` tallies failures and reward; ``advance(ok, reward)``
    does both for producers that count themselves (publish, reverify).
    """

    def __init__(
        self,
        label: str,
        options: ProgressOptions | None = None,
        *,
        total: int | None = None,
        stream: IO[str] | None = None,
        clock: Any = time.monotonic,
    ) -> None:
        self.label = label
        self.options = options or ProgressOptions()
        self.total = total
        self.done = 0
        self.failed = 0
        self.reward_sum = 0.0
        self.rewarded = 0
        self._stream = stream or sys.stderr
        self._clock = clock
        self._t0 = clock()
        self._last_line_t = self._t0
        self._last_line_pct = 0.0
        self._last_draw = 0.0
        self._bar: Any = None
        self._bar_task: Any = None
        tty = self.options.tty if self.options.tty is not None else _isatty(self._stream)
        self.mode = "off" if self.options.quiet else ("bar" if tty else "lines")

    # -- counting -------------------------------------------------------------------------------
    def __call__(self, done: int, total: int | None) -> None:
        self.done = done
        if total is not None:
            self.total = total
        self._show()

    def result(self, ok: bool, reward: float | None = None) -> None:
        if not ok:
            self.failed += 1
        elif reward is not None:
            self.reward_sum += reward
            self.rewarded += 1

    def advance(self, ok: bool = True, reward: float | None = None) -> None:
        self.result(ok, reward)
        self(self.done + 1, self.total)

    # -- figures --------------------------------------------------------------------------------
    @property
    def elapsed_s(self) -> float:
        return self._clock() - self._t0

    @property
    def rate(self) -> float:
        return self.done / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        if not self.total or not self.done or self.rate <= 0:
            return None
        return max(0.0, (self.total - self.done) / self.rate)

    @property
    def mean_reward(self) -> float | None:
        return self.reward_sum / self.rewarded if self.rewarded else None

    def line(self) -> str:
        """One progress line: ``run: 50/100 (50%) 12.3/s ETA 4s, 1 failed, mean reward 0.5000``."""
        total = self.total
        count = f"{self.done}/{total} ({100 * self.done / total:.0f}%)" if total else f"{self.done}"
        eta = self.eta_s
        parts = [f"{self.label}: {count} {self.rate:.1f}/s", f"ETA {_duration(eta)}" if eta is not None else "ETA ?"]
        text = " ".join(parts) + f", {self.failed} failed"
        if self.mean_reward is not None:
            text += f", mean reward {self.mean_reward:.4f}"
        return text + f", elapsed {_duration(self.elapsed_s)}"

    # -- output ---------------------------------------------------------------------------------
    def __enter__(self) -> Tracker:
        if self.mode == "bar":
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[rate]}"),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[extra]}"),
                console=Console(file=self._stream),
                transient=True,
            )
            self._bar.__enter__()
            self._bar_task = self._bar.add_task(self.label, total=self.total, rate="", extra="")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.mode == "bar" and self._bar is not None:
            self._bar.__exit__(*exc)
        if self.mode != "off" and self.done and exc[0] is None:
            self._print(self.line())  # the final figures stay in the log (the bar is transient)

    def _show(self) -> None:
        if self.mode == "off":
            return
        now = self._clock()
        finished = self.total is not None and self.done >= self.total
        if self.mode == "bar":
            if finished or now - self._last_draw >= 0.1:
                self._last_draw = now
                extra = f"{self.failed} failed" + (
                    f"  mean reward {self.mean_reward:.4f}" if self.mean_reward is not None else ""
                )
                self._bar.update(
                    self._bar_task, completed=self.done, total=self.total, rate=f"{self.rate:.1f}/s", extra=extra
                )
            return
        pct = 100 * self.done / self.total if self.total else 0.0
        due_pct = self.total and pct - self._last_line_pct >= self.options.every_pct
        due_time = now - self._last_line_t >= self.options.interval_s
        if (due_pct or due_time) and not finished:
            self._last_line_t, self._last_line_pct = now, pct
            self._print(self.line())

    def _print(self, text: str) -> None:
        print(text, file=self._stream, flush=True)


def _isatty(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _duration(seconds: float) -> str:
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


SLOW_STEP_S = 3.0  # a step this long without a word of its own is named (the bar: a line within 5 s)
STILL_EVERY_S = 30.0  # and said again this often while it goes on


class Heartbeat:
    """Names a step that takes long and says nothing itself (imports of a large environment, a worker's setup, a
    build): ``say(what + elapsed)`` once ``after_s`` have passed, then every ``every_s``, until the block ends. A
    quick step says nothing. A timer thread, so that it speaks while the step holds the main thread (an import);
    ``say`` None: silent (``--quiet``)."""

    def __init__(
        self,
        say: Callable[[str], None] | None,
        what: str,
        *,
        after_s: float = SLOW_STEP_S,
        every_s: float = STILL_EVERY_S,
    ) -> None:
        self.say, self.what = say, what
        self.after_s, self.every_s = after_s, every_s
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def _beat(self) -> None:
        wait = self.after_s
        while not self._done.wait(wait):
            assert self.say is not None
            self.say(f"{self.what} ({_duration(time.monotonic() - self._t0)} so far)")
            wait = self.every_s

    def __enter__(self) -> Heartbeat:
        self._t0 = time.monotonic()
        if self.say is not None:
            self._thread = threading.Thread(target=self._beat, daemon=True, name="gym-heartbeat")
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()
