"""A training step's wait for its rollouts, explained and bounded: the same rule for TRL (sync, async) and verl.

A step that has waited ``say_after_s`` for rollouts logs one line naming what its slowest rollouts wait on, from
what ``gym-runtime why`` reads (``ops.why``: the workers' answers to a discovery asking ``WAITS``, the queues), and
says it again every ``say_after_s`` while it waits; at ``bound_s`` the step fails with that line (a
``ClientError``), its batches cancelled, rather than waiting forever. ``bound_s=None`` waits forever (still saying
why). The line is the step's answer to "why is the trainer waiting?": the component to look at comes first.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable, Collection
from typing import Any, Literal, TypeVar

import anyio
import msgspec

from gym_runtime.errors import ClientError
from gym_runtime.ops.why import gather
from gym_runtime.trainers.failures import _Named
from gym_runtime.transport.bus import Bus

__all__ = ["Once", "StepWait", "WaitPolicy", "explain", "line", "log_line", "wait_policy", "watched"]

# stdlib logging, as ``step_fill``'s: with no handler set up Python prints the warning's message alone on stderr
log = logging.getLogger(__name__)

T = TypeVar("T")
SHOWN = 3  # the slowest rollouts a line names


class WaitPolicy(msgspec.Struct, kw_only=True, frozen=True, metaclass=_Named):
    """How long a training step waits for its rollouts (the same object for the three adapters)."""

    say_after_s: float = 60.0  # waited this long: one line naming what the slowest rollouts wait on (then again)
    bound_s: float | None = 3600.0  # waited this long: the step fails with that line (None: wait forever)

    def __post_init__(self) -> None:
        for name in ("say_after_s", "bound_s"):
            value = getattr(self, name)
            if value is None and name == "bound_s":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ClientError(f"WaitPolicy: {name} is a number of seconds > 0, got {value!r}")
        if self.bound_s is not None and self.bound_s < self.say_after_s:
            raise ClientError(
                f"WaitPolicy: bound_s ({self.bound_s:g}) is below say_after_s ({self.say_after_s:g}): the step would "
                "fail before saying why it waits; raise bound_s"
            )


def wait_policy(value: object) -> WaitPolicy:
    """``waits=``: a ``WaitPolicy`` (None: the default one; a mapping, as a YAML config gives it, is converted)."""
    if value is None:
        return WaitPolicy()
    if isinstance(value, WaitPolicy):
        return value
    if isinstance(value, dict):
        return WaitPolicy(**{str(k): v for k, v in value.items()})
    raise ClientError(
        f"waits={value!r}: give a WaitPolicy, e.g. WaitPolicy(say_after_s=60, bound_s=3600) "
        "(from gym_runtime.trainers.waiting import WaitPolicy)"
    )


class StepWait:
    """One step's wait: when its line is due, and when it has waited past the bound (pure: the clock is given)."""

    def __init__(self, policy: WaitPolicy, *, now: float | None = None) -> None:
        self.policy = policy
        self.restart(now)

    def restart(self, now: float | None = None) -> None:
        """A new wait (the async worker: a sample was handed over)."""
        self.t0 = time.monotonic() if now is None else now
        self.said_at: float | None = None

    def waited(self, now: float | None = None) -> float:
        return (time.monotonic() if now is None else now) - self.t0

    def due(self, now: float | None = None) -> Literal["say", "fail"] | None:
        """``fail`` past the bound, ``say`` when a line is due (first at ``say_after_s``, then every as long)."""
        now = time.monotonic() if now is None else now
        waited, p = now - self.t0, self.policy
        if p.bound_s is not None and waited >= p.bound_s:
            return "fail"
        if waited >= p.say_after_s and (self.said_at is None or now - self.said_at >= p.say_after_s):
            return "say"
        return None

    def said(self, now: float | None = None) -> None:
        self.said_at = time.monotonic() if now is None else now

    def next_check(self, now: float | None = None) -> float:
        """Seconds until ``due`` can change."""
        now = time.monotonic() if now is None else now
        p = self.policy
        marks = [self.t0 + p.say_after_s if self.said_at is None else self.said_at + p.say_after_s]
        if p.bound_s is not None:
            marks.append(self.t0 + p.bound_s)
        return max(0.05, min(marks) - now)

    def failing(self, said: str) -> str:
        return f"{said}; gave up at WaitPolicy(bound_s={self.policy.bound_s:g}) (raise it to wait longer)"


class Once:
    """At most one line per ``every_s`` among many waits of one process (verl: every agent loop of an actor waits
    for the same step; one line says it, not one per loop)."""

    def __init__(self) -> None:
        self.at: float | None = None

    def take(self, every_s: float, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        if self.at is not None and now - self.at < every_s:
            return False
        self.at = now
        return True


def line(report: dict[str, Any], batches: Collection[str] | None, waited: float) -> str:
    """The one line: what the step's slowest rollouts wait on, the components to look at first (pure: from
    ``why``'s report; ``batches`` None: every rollout of the namespace)."""
    mine = [e for e in report["rollouts"] if batches is None or e.get("batch") in batches]
    late = [e for e in mine if e.get("late")]
    head = f"the training step has waited {waited:.0f}s for its rollouts"
    look = sorted({e["look_at"] for e in late if e.get("look_at")} | {p for p in report["look_at"] if " process " in p})
    parts = []
    if look:
        parts.append("look at " + ", ".join(look))
    if mine:
        shown, reasons = [], []
        for e in mine[:SHOWN]:
            where = e["what"] + (f" on {e['on']}" if e.get("on") else (f" by {e['by']}" if e.get("by") else ""))
            shown.append(f"{e['batch']} task {e['task_index']} #{e['rollout_index']} {where} for {e['for_s']:g}s")
            if e.get("late") and e["late"] not in reasons:
                reasons.append(e["late"])
        slowest = ", ".join(shown) + (f" ({'; '.join(reasons)})" if reasons else "")
        parts.append(f"{len(mine)} in flight ({len(late)} past their bound), the slowest: {slowest}")
    else:
        parts.append("none of them is running on an agent worker that answers")
    parts.extend(report["unanswered"] + report["queues"] + report["silent"])
    return f"{head}: " + "; ".join(parts)


def log_line(said: str) -> None:
    log.warning("gym-runtime: %s", said)


async def explain(bus: Bus, batches: Collection[str] | None, waited: float) -> str:
    """The line, from what ``why`` reads now (about a second: the discovery's wait)."""
    try:
        report = await gather(bus, wait_s=1.0)
    except Exception as e:  # the bus itself: the line says so rather than hiding the wait
        return f"the training step has waited {waited:.0f}s for its rollouts; where they wait cannot be read ({e})"
    return line(report, batches, waited)


async def watched(
    work: Callable[[], Awaitable[T]],
    *,
    bus: Bus,
    watch: StepWait,
    batches: Callable[[], Collection[str] | None],
    cancel: Callable[[], Awaitable[None]] | None = None,
    once: Once | None = None,
) -> T:
    """``work()`` awaited while ``watch`` says why it waits when due (``once``: shared with other waits, which
    say it for all); past its bound, ``cancel()`` and a ``ClientError`` with the line instead of the result."""
    result: list[T] = []
    raised: list[BaseException] = []
    failed: list[str] = []

    async def watcher() -> None:
        while True:
            await anyio.sleep(watch.next_check())
            due = watch.due()
            if due is None:
                continue
            if due == "say" and once is not None and not once.take(watch.policy.say_after_s):
                watch.said()
                continue
            said = await explain(bus, batches(), watch.waited())
            if due == "fail":
                failed.append(watch.failing(said))
                return
            log_line(said)
            watch.said()

    async with anyio.create_task_group() as tg:

        async def main() -> None:
            try:
                result.append(await work())
            except Exception as e:  # raised as itself below, not inside the task group's ExceptionGroup
                raised.append(e)
            tg.cancel_scope.cancel()

        tg.start_soon(main)
        await watcher()
        tg.cancel_scope.cancel()
    if failed:
        log_line(failed[0])
        if cancel is not None:
            with anyio.CancelScope(shield=True):
                await cancel()
        raise ClientError(failed[0])
    if raised:
        raise raised[0]
    return result[0]
