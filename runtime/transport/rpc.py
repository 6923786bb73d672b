"""Request-reply with liveness: the pieces a call is made of.

A caller's call is a future watched by one timer for both its deadline and its responder's
liveness (``Pending``); a handler that runs long tells its caller so every ``keepalive_s``
(``Keepalives``); ``Timings`` says how soon each side gives up on the other. A call that
nobody serves right now is ``NoResponders`` (``Busy`` when a direct call found no free slot).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import socket
import time
from collections.abc import Callable, Coroutine
from contextvars import ContextVar
from typing import Any

import msgspec
import nats
import nats.errors
import nats.js.errors

from gym_runtime.errors import Failure
from gym_runtime.messages import ErrorInfo
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.transport.delivery import Message
from gym_runtime.transport.headers import (
    PROGRESS_HEADER,
)

JS_PUBLISH_RETRY_S = 20.0  # how long a stored publish is sent again for a missing ack (a stream leader election)


class Timings(msgspec.Struct, frozen=True, kw_only=True):
    """How soon the two ends of a core request notice each other, and how long a stored publish waits for its
    ack (a value a bus is given, never patched)."""

    keepalive_s: float = 2.0  # a handler still running after this sends progress, and again every keepalive_s
    liveness_s: float = 10.0  # a core request with no reply nor progress for this long: the worker is gone
    # a stored publish with no ack is sent again (same msg id: stored once) until this budget is spent
    store_retry_s: float = JS_PUBLISH_RETRY_S


class NoResponders(Failure):
    """Nobody subscribes to the subject right now (a role with no worker, e.g. a pool restarting).

    Nothing was delivered, so the call is safe to repeat once a worker is back.
    """


class Busy(NoResponders):
    """The worker that took a direct call has no free slot; nothing ran, so the call may go elsewhere."""


# A caller's clock: called with None when a handler of one of its calls starts waiting for a sandbox lease, then
# with the seconds it waited (``PAUSE_HEADER``); set by whoever runs against a clock (an agent's rollout) for
# the calls it makes. None: nobody's clock stops.
ON_PAUSE: ContextVar[Callable[[float | None], None] | None] = ContextVar("gym_on_pause", default=None)
PAUSED_CHECK_S = 1.0  # how often a paused call with no liveness watch looks again


class PausedTime:
    """The time the handlers of the calls made in a block waited for sandbox leases (their ``Gym-Paused``
    messages; overlapping waits counted once, on this side's clock): what a call's own time leaves out (a tool
    call's ``cost.tool_ms``: the wait is ``sandbox_wait_s``, not tool time). Passed on to the caller's clock."""

    __slots__ = ("outer", "waits", "since", "seconds", "_token")

    def __init__(self, outer: Callable[[float | None], None] | None) -> None:
        self.outer = outer
        self.waits = 0  # waits under way now
        self.since = 0.0
        self.seconds = 0.0  # ended stretches of waiting

    def __enter__(self) -> PausedTime:
        self._token = ON_PAUSE.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        ON_PAUSE.reset(self._token)

    def __call__(self, took: float | None) -> None:
        now = time.monotonic()
        if took is None:
            if self.waits == 0:
                self.since = now
            self.waits += 1
        elif self.waits:
            self.waits -= 1
            if self.waits == 0:
                self.seconds += now - self.since
        if self.outer is not None:
            self.outer(took)

    def total(self) -> float:
        return self.seconds + (time.monotonic() - self.since if self.waits else 0.0)


def pauses_counted() -> PausedTime:
    """Count the lease waits of the calls made in a ``with`` block (``PausedTime``), the caller's own clock told as
    before (a slotted scope, not a generator's: a tool call's four calls fewer)."""
    return PausedTime(ON_PAUSE.get())


DIRECT_ABSENT_S = 1.0  # after "nobody serves direct calls here", use the queue this long before asking again

DIRECT_BUSY_S = 0.05  # after "busy", use the queue this long: calls that wait belong in the queue


def error_info(exc: BaseException, default_class: str) -> ErrorInfo:
    if isinstance(exc, Failure):
        return exc.info
    return ErrorInfo(error_class=default_class, message=f"{type(exc).__name__}: {exc}")  # type: ignore[arg-type]


class Pending:
    """A call in flight: its future, and when its worker last showed signs of life.

    One timer per call watches both limits: the call's deadline and, for core
    requests, the responder's liveness (no reply nor keepalive for too long).
    """

    __slots__ = (
        "fut",
        "seen",
        "started",
        "by",
        "resend",
        "_timer",
        "_liveness",
        "_deadline",
        "_subject",
        "_op",
        "_timeout",
        "_queued",
        "_taken",
        "_loop",
        "on_pause",
        "on_output",
        "_pauses",
        "_paused_at",
    )

    def __init__(self, fut: asyncio.Future[Message], seen: float) -> None:
        self.fut = fut
        self.seen = seen
        self.started = seen
        self.by = ""  # the process that said it has the call (its keepalives' ``Keepalives.tag``), once one did
        self.on_pause = ON_PAUSE.get()
        self.on_output: Callable[[int, bytes], None] | None = None  # the handler's output as it comes (streamed)
        self._pauses = 0  # the handler's waits for a lease now under way
        self._paused_at = 0.0
        # queued calls: (subject, body, headers) to publish again after a reconnect
        self.resend: tuple[str, bytes, dict[str, str]] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._queued: float | None = None  # a queued call: how long it may wait for a worker to take it
        self._taken = False

    def watch(
        self,
        loop: asyncio.AbstractEventLoop,
        subject: str,
        op: str,
        timeout: float,
        liveness: float | None,
        *,
        queued: float | None = None,
    ) -> None:
        """Fail the call at ``timeout``, or as ``worker_lost`` after ``liveness`` seconds of silence.

        ``queued``: a work-queue call, which may wait this long for a worker; its ``timeout`` then
        counts from when a worker says it took the call (``alive``), so a wait behind other callers'
        work is not charged to the call itself."""
        self._subject, self._op, self._timeout, self._loop = subject, op, timeout, loop
        self._liveness = liveness
        self._queued = queued
        patience = timeout if self._queued is None else self._queued
        self._deadline = self.seen + patience
        first = patience if liveness is None else min(patience, liveness)
        self._timer = loop.call_later(first, self._check, loop)

    @property
    def subject(self) -> str:
        return self._subject

    @property
    def queued(self) -> bool:
        """A work-queue call (watched by the queue's redelivery, not by keepalives)."""
        return self._queued is not None

    @property
    def taken(self) -> bool:
        return self._taken

    @property
    def paused_now(self) -> bool:
        """Its handler waits for a sandbox lease right now."""
        return self._pauses > 0

    def alive(self, now: float) -> None:
        """A sign of life from the worker: a core call's liveness restarts; a queued call was taken
        (again, after a redelivery), and its ``timeout`` starts now."""
        self.seen = now
        if self._queued is None or self._timer is None or self.fut.done():
            return
        self._taken = True
        self._deadline = now + self._timeout
        self._timer.cancel()
        self._timer = self._loop.call_later(self._timeout, self._check, self._loop)

    def paused(self, value: str) -> None:
        """The handler started (``"1"``) or stopped (its seconds) waiting for a sandbox lease: this call's own
        deadline stands still meanwhile, and so does its caller's clock (``ON_PAUSE``)."""
        now = time.monotonic()
        if value == "1":
            self._pauses += 1
            if self._pauses == 1:
                self._paused_at = now
            if self.on_pause is not None:
                self.on_pause(None)
            return
        if self._pauses == 0:  # an end without its start (or after the call's own end): nothing is paused
            return
        try:
            took = max(0.0, float(value))
        except ValueError:
            took = now - self._paused_at
        self._end_pause(now, took)

    def _end_pause(self, now: float, took: float) -> None:
        self._pauses -= 1
        if self._pauses == 0:
            self._deadline += now - self._paused_at
        if self.on_pause is not None:
            self.on_pause(took)

    def _check(self, loop: asyncio.AbstractEventLoop) -> None:
        fut = self.fut
        if fut.done():
            return
        now = time.monotonic()
        # waiting for a lease is not the call's time: while the handler waits, only its liveness is watched
        if now >= self._deadline and not self._pauses:
            waited = self._queued is not None and not self._taken
            fut.set_exception(
                Failure(
                    ErrorInfo(
                        error_class="timeout",
                        message=(
                            f"no worker took {self._op} from {self._subject} within {self._queued:g}s"
                            if waited
                            else f"no reply to {self._op} on {self._subject} within {self._timeout:g}s"
                        ),
                        retryable=True,
                    )
                )
            )
            return
        wake = now + PAUSED_CHECK_S if self._pauses else self._deadline
        if self._liveness is not None:
            idle = now - self.seen
            if idle >= self._liveness:
                fut.set_exception(
                    Failure(
                        ErrorInfo(
                            error_class="worker_lost",
                            message=(
                                f"the worker serving {self._subject} stopped answering ({idle:.0f}s without progress)"
                            ),
                            retryable=True,
                        )
                    )
                )
                return
            wake = min(wake, self.seen + self._liveness)
        self._timer = loop.call_later(wake - now, self._check, loop)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        now = time.monotonic()
        while self._pauses:  # the call ended mid-wait (its reply overtook the wait's end, or it failed): the
            self._end_pause(now, now - self._paused_at)  # caller's clock runs again


# what a publish raises on a connection that is closing (or reconnecting with its buffer full)
_CANNOT_SEND = (
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionDrainingError,
    nats.errors.OutboundBufferLimitError,
)


async def courtesy(sent: Coroutine[Any, Any, None]) -> None:
    """Send a message no one waits on being sent (a busy answer, a keepalive) in a task of its own: one the
    connection can no longer send is dropped, as its caller's own clock ends the call, not left as a failed task
    that asyncio reports with a traceback."""
    with contextlib.suppress(*_CANNOT_SEND):
        await sent


def process_tag() -> str:
    """How a serving process names itself in its keepalives: ``node/pid``, what an operator needs to find a
    frozen one (``gym-runtime why``); read once per connection (a forked worker has its own pid)."""
    return f"{socket.gethostname()}/{os.getpid()}"


class Keepalives:
    """Tells each core-request caller whose request a server is still working on, every ``every_s`` (up to half of
    it late), that it still is: one timer for all of a server's calls, armed only while some run, where a timer
    each was made and cancelled per call (most calls end before their first beat)."""

    __slots__ = ("_publish", "every_s", "tag", "_running", "_ids", "_timer", "_sending")

    def __init__(self, publish: Callable[..., Coroutine[Any, Any, None]], every_s: float, tag: str = "1") -> None:
        self._publish = publish  # a wire's core publish
        self.every_s = every_s
        self.tag = tag  # what each beat says: the process beating (``process_tag``), so a caller can name it
        self._running: dict[int, list[Any]] = {}  # a call's key -> [its reply subject, when its next beat is due]
        self._ids = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._sending: set[asyncio.Task[None]] = set()  # held so they are not garbage-collected

    def start(self, reply_to: str) -> int:
        """Watch a call that has begun; its key, for ``stop``."""
        key = next(self._ids)
        self._running[key] = [reply_to, time.monotonic() + self.every_s]
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.every_s / 2, self._tick)
        return key

    def stop(self, key: int) -> None:
        """The call ended (answered, failed or cancelled): no beat for it from now on."""
        self._running.pop(key, None)

    def _tick(self) -> None:
        now = time.monotonic()
        loop = asyncio.get_running_loop()
        for call in self._running.values():
            if call[1] <= now:
                call[1] = now + self.every_s
                task = loop.create_task(courtesy(self._publish(call[0], b"", headers={PROGRESS_HEADER: self.tag})))
                self._sending.add(task)
                task.add_done_callback(self._sending.discard)
        self._timer = loop.call_later(self.every_s / 2, self._tick) if self._running else None


JS_ACK_TIMEOUT_S = 5.0  # nats-py's JetStream default: a stored message's ack not back by then is retried
ACK_TICK_S = 0.25  # how late a missing ack may be noticed (``AckDeadlines``)


class AckDeadlines:
    """Stored publishes' acks not back by their deadline fail as nats-py's ``TimeoutError`` (up to ``tick_s``
    late): one timer for all of a bus's, armed only while some are out, where a timer each was made and
    cancelled per stored message."""

    __slots__ = ("tick_s", "_due", "_timer")

    def __init__(self, tick_s: float = ACK_TICK_S) -> None:
        self.tick_s = tick_s
        self._due: dict[asyncio.Future[Message], float] = {}
        self._timer: asyncio.TimerHandle | None = None

    def add(self, fut: asyncio.Future[Message], within_s: float) -> None:
        self._due[fut] = time.monotonic() + within_s
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(min(self.tick_s, within_s), self._tick)

    def discard(self, fut: asyncio.Future[Message]) -> None:
        self._due.pop(fut, None)

    def _tick(self) -> None:
        now = time.monotonic()
        due = self._due
        for fut in [f for f, at in due.items() if at <= now]:
            del due[fut]
            no_ack(fut)
        self._timer = asyncio.get_running_loop().call_later(self.tick_s, self._tick) if due else None


class PubAck(msgspec.Struct):
    """The part of JetStream's publish ack we read (stream, seq and duplicate are ignored)."""

    error: dict[str, Any] | None = None


def no_ack(fut: asyncio.Future[Message]) -> None:
    if not fut.done():
        fut.set_exception(nats.errors.TimeoutError())


def traced(telemetry: Telemetry, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The headers of a message sent now: the current trace context (W3C ``traceparent``), then ``extra``."""
    h: dict[str, str] = {}
    telemetry.inject(h)
    if extra:
        h.update(extra)
    return h
