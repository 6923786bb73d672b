"""The server side of the bus: handlers run per message, typed error replies, junk counted not logged.

nats-py runs one subscription's callbacks one at a time, so each message is handed to a task
bounded by the handler's concurrency; every failure becomes a typed reply (never a hang); a
request that cannot be read costs one counter and at most one log line per cause and interval.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any

from anyio.abc import TaskGroup
from opentelemetry.trace import SpanKind, StatusCode

from gym_runtime.errors import Failure
from gym_runtime.messages import ErrorInfo, ErrorReply
from gym_runtime.observability import logs
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.transport.codec import Codec
from gym_runtime.transport.delivery import Delivery, Message
from gym_runtime.transport.headers import (
    BLOB_HEADER,
    BUSY_HEADER,
    ERROR_HEADER,
    EXPIRES_HEADER,
    PROGRESS_HEADER,
)
from gym_runtime.transport.interface import Handler, Subscription, Wire, inline
from gym_runtime.transport.rpc import Keepalives, Timings, courtesy, error_info, process_tag, traced
from gym_runtime.transport.tasks import TaskSet

_UNSET: Any = object()  # "no body decoded yet" (None is a body)
JUNK_LOG_S = 10.0  # a cause of refused requests is logged at most once per this many seconds
BACKLOG_MSGS = 512 * 1024  # messages one ``serve`` subscription holds while its slots are busy (nats-py's limit)

log = logs.get("gym.bus")


# the reply subject of the request whose handler runs in this context (``Bus.pause_caller`` tells its caller)
_REPLYING: ContextVar[str | None] = ContextVar("gym_replying", default=None)


def replying() -> str | None:
    """Where the request being handled here wants its answer (None outside a handler, or none wanted)."""
    return _REPLYING.get()


Encode = Callable[[Any, dict[str, str]], Awaitable[bytes]]
Decode = Callable[[Delivery], Awaitable[Any]]


def expired(msg: Delivery) -> bool:
    """True for a queued request whose caller stopped waiting before a worker took it (its rollout
    timed out or was cancelled): nobody reads its answer, so it is not run. Nothing is answered: by
    then the caller's own deadline has passed, and it fails the call as it always did."""
    raw = (msg.headers or {}).get(EXPIRES_HEADER)
    try:
        return raw is not None and time.time() > float(raw)
    except ValueError:
        return False


class Serving:
    """Serving requests and work-queue deliveries (``bus.serving``): handlers run per message, typed error
    replies, on the bus's wire. ``encode``/``decode``: the bus's bodies (``Blobs``), large ones by reference."""

    def __init__(
        self, wire: Wire, codec: Codec, telemetry: Telemetry, timings: Timings, encode: Encode, decode: Decode
    ) -> None:
        self.wire = wire
        self.codec = codec
        self.telemetry = telemetry
        self.timings = timings  # and the keepalives it times
        self.encode = encode
        self.decode = decode
        # requests that cannot be read or fail unexpectedly, counted per cause and logged at most once per
        # JUNK_LOG_S per cause (a flood of junk costs a counter each, not a log line or a traceback each)
        self.junk: dict[str, int] = {}
        self._junk_logged: dict[str, tuple[float, int]] = {}

    @property
    def timings(self) -> Timings:
        return self._timings

    @timings.setter
    def timings(self, timings: Timings) -> None:
        self._timings = timings
        self.keepalives = Keepalives(self.wire.publish, timings.keepalive_s, process_tag())

    async def reply(self, subject: str | None, payload: Any, *, error: bool = False) -> None:
        if not subject:
            return
        h = traced(self.telemetry, {ERROR_HEADER: "1"} if error else None)
        await self.wire.publish(subject, await self.encode(payload, h), headers=h)

    def count_junk(self, subject: str, cause: str, exc: BaseException | None = None) -> None:
        """Count a refused request under ``cause``; log the cause once per ``JUNK_LOG_S`` with how many came
        since (the first of a cause with its traceback when ``exc`` is an unexpected error)."""
        self.warn_limited("requests.refused", cause, subject=subject, exc=exc)

    def warn_limited(self, event: str, cause: str, *, subject: str, exc: BaseException | None = None) -> None:
        """Count ``cause`` and log ``event`` for it at most once per ``JUNK_LOG_S`` (with the count since)."""
        n = self.junk.get(cause, 0) + 1
        self.junk[cause] = n
        now = time.monotonic()
        last, logged_n = self._junk_logged.get(cause, (-1e18, 0))
        if now - last < JUNK_LOG_S:
            return
        self._junk_logged[cause] = (now, n)
        first = logged_n == 0
        log.warning(
            event,
            subject=subject,
            cause=cause,
            count=n - logged_n,
            total=n,
            every_s=JUNK_LOG_S,
            exc_info=exc if first and exc is not None else None,
        )

    def _reply_bad_request(self, msg: Message, exc: Exception) -> Awaitable[None] | None:
        self.count_junk(msg.subject, f"undecodable: {type(exc).__name__}")
        if msg.reply:  # a caller that made a mistake learns it at once; junk gets one small error back
            info = ErrorInfo(error_class="invalid_task", message=f"request cannot be decoded: {type(exc).__name__}")
            return self.wire.publish(msg.reply, self.codec.encode(ErrorReply(error=info)), headers={ERROR_HEADER: "1"})
        return None

    async def handle(
        self,
        msg: Delivery,
        handler: Handler,
        *,
        reply_to: str | None,
        default_error: str,
        attributes: dict[str, Any] | None = None,
        body: Any = _UNSET,
    ) -> bool:
        """Decode (unless ``body`` is given), run ``handler`` in a CONSUMER span, send its reply.
        True when it succeeded."""
        tel = self.telemetry
        parent = tel.extract(msg.headers)
        if tel.recording:
            attrs = {"messaging.system": "nats", "messaging.destination.name": msg.subject}
            if attributes:
                attrs.update(attributes)
            scope = tel.span(f"process {msg.subject}", kind=SpanKind.CONSUMER, parent=parent, attributes=attrs)
        else:  # nothing records: only the caller's context, for the messages this handler sends
            scope = tel.span("", parent=parent)
        with scope as span:
            keepalives = self.keepalives
            keepalive = keepalives.start(reply_to) if reply_to and msg.reply == reply_to else None
            try:
                if body is _UNSET:
                    body = await self.decode(msg)
                token = _REPLYING.set(reply_to)
                try:
                    result = await handler(body, msg)
                finally:
                    _REPLYING.reset(token)
            except Exception as exc:  # every failure becomes a typed reply, never a hang
                if keepalive is not None:
                    keepalives.stop(keepalive)
                info = error_info(exc, default_error)
                span.set_status(StatusCode.ERROR, info.message)
                if not isinstance(exc, Failure):  # counted, logged once per cause and interval
                    self.count_junk(msg.subject, f"handler: {type(exc).__name__}", exc)
                await self.reply(reply_to, ErrorReply(error=info), error=True)
                return False
            except BaseException:  # cancelled (the worker stops): no more "still working" for the caller,
                if keepalive is not None:  # whose liveness then sends the call elsewhere
                    keepalives.stop(keepalive)
                raise
            if keepalive is not None:
                keepalives.stop(keepalive)
            if result is not None:
                try:
                    await self.reply(reply_to, result)
                except Failure as exc:  # its body could not be stored (a full blob stream): the caller learns why
                    self.warn_limited("reply.not_stored", exc.info.message, subject=msg.subject)
                    span.set_status(StatusCode.ERROR, exc.info.message)
                    await self.reply(reply_to, ErrorReply(error=exc.info), error=True)
                    return False
            return True

    def expired(self, msg: Delivery) -> bool:
        return expired(msg)

    async def taken(self, reply_to: str | None) -> None:
        """Tell a queued request's caller that a worker has it: its timeout counts from now, not from
        when it was queued (``Bus.queued_request``)."""
        if reply_to:
            await self.wire.publish(reply_to, b"", headers={PROGRESS_HEADER: self.keepalives.tag})

    async def busy(self, msg: Delivery) -> None:
        """Answer a request at once with "no free slot" (``Busy`` at the caller); nothing ran. A connection that
        is closing sends nothing (``courtesy``): the caller's own clock ends the call."""
        if msg.reply:
            await courtesy(self.wire.publish(msg.reply, b"", headers={BUSY_HEADER: "1"}))

    async def serve_direct(
        self,
        tg: TaskGroup,
        subject: str,
        handler: Handler,
        *,
        queue: str,
        admit: Callable[[Delivery], bool],
        done: Callable[[], Awaitable[None]],
        default_error: str,
        attributes: dict[str, Any] | None = None,
    ) -> Subscription:
        """Direct calls: a message ``admit`` takes (it reserves a slot) runs ``handler`` in its own task,
        answered as ``handle`` answers, and then ``done()`` frees the slot; any other is answered ``busy``.

        Before answering busy, the running calls get one turn of the event loop: calls read
        in one burst are admitted before any of their tasks has run, so a fast handler's slots
        may be held only by work that is about to finish (measured: 65% of a fast model's calls
        went to the queue at 256 in flight, against 0% with this turn). A slow handler's slots
        are still taken after the turn, and the call is refused as before.
        """
        tasks = TaskSet()
        tg.start_soon(tasks.guard)

        async def run(delivery: Delivery) -> None:
            try:
                await self.handle(
                    delivery, handler, reply_to=delivery.reply, default_error=default_error, attributes=attributes
                )
            finally:
                await done()

        waiting: deque[Delivery] = deque()  # refused once: each gets its turn, in order, as before
        draining = False

        async def drain() -> None:
            nonlocal draining
            try:
                while waiting:
                    delivery = waiting.popleft()
                    if not admit(delivery):
                        await asyncio.sleep(0)
                        if not admit(delivery):
                            await self.busy(delivery)
                            continue
                    tasks.spawn(run, delivery)
            finally:
                draining = False

        def on_msg(msg: Message) -> None:
            nonlocal draining
            delivery = Delivery(msg)
            if not waiting and admit(delivery):
                tasks.spawn(run, delivery)
                return
            waiting.append(delivery)  # behind those refused before it, as the subscription's task kept them
            if not draining:
                draining = True
                tasks.spawn(drain)

        return await self.wire.subscribe(subject, queue=queue, cb=inline(on_msg))

    async def serve(
        self,
        tg: TaskGroup,
        subject: str,
        handler: Handler,
        *,
        queue: str = "",
        concurrency: int = 256,
        default_error: str = "internal",
    ) -> Subscription:
        """Subscribe and run each message in its own task, at most ``concurrency`` at once.

        Each message is taken as the connection reads it (``interface.inline``: no queue and task of the
        subscription's own between). When all slots are busy it waits in this subscription's backlog, not as a
        task, and the first slot freed runs the oldest; past ``BACKLOG_MSGS`` waiting (nats-py's own limit for a
        subscription's pending messages) a message is dropped and counted, as nats-py drops a slow consumer's.
        """
        tasks = TaskSet()
        tg.start_soon(tasks.guard)
        backlog: deque[tuple[Message, Any]] = deque()
        free = concurrency

        async def run_one(msg: Message, body: Any) -> None:
            nonlocal free
            try:
                await self.handle(Delivery(msg), handler, reply_to=msg.reply, default_error=default_error, body=body)
            finally:
                if backlog:  # the slot passes to the oldest waiting
                    tasks.spawn(run_one, *backlog.popleft())
                else:
                    free += 1

        def on_msg(msg: Message) -> None:
            nonlocal free
            headers = msg.headers
            body = _UNSET
            if not (headers and BLOB_HEADER in headers):  # decoded here: junk costs no task, span or slot
                try:
                    body = self.codec.decode(msg.data, headers)
                except Exception as exc:
                    sent = self._reply_bad_request(msg, exc)
                    if sent is not None:
                        tasks.spawn(_awaited, sent)
                    return
            if free:
                free -= 1
                tasks.spawn(run_one, msg, body)
            elif len(backlog) < BACKLOG_MSGS:
                backlog.append((msg, body))
            else:
                self.warn_limited("requests.dropped", "backlog full", subject=msg.subject)

        return await self.wire.subscribe(subject, queue=queue, cb=inline(on_msg))


async def _awaited(sent: Awaitable[None]) -> None:
    await sent
