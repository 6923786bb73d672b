"""The bus: one NATS connection, typed request-reply, and per-message tasks.

Everything NATS-specific that workers need lives here and in ``runtime.pull``:
encoding by ``Content-Type``, W3C trace context in headers, typed error replies
(a ``Gym-Error`` header flag plus an ``ErrorReply`` body, never a hang), and the
fact that nats-py runs one subscription's callbacks one at a time, so handlers
are handed to tasks bounded by the worker's concurrency.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import nats
import nats.errors
from anyio.abc import TaskGroup
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from opentelemetry.trace import SpanKind, StatusCode

from runtime import logs
from runtime.codec import Codec
from runtime.messages import ErrorInfo, ErrorReply
from runtime.tracing import Telemetry

ERROR_HEADER = "Gym-Error"
REPLY_HEADER = "Gym-Reply"  # where a JetStream-queued request wants its answer
MSG_ID_HEADER = "Nats-Msg-Id"

log = logs.get("gym.bus")

Handler = Callable[[Any, Msg], Awaitable[Any]]


class RemoteError(Exception):
    """The other side answered with a typed error (or did not answer at all)."""

    def __init__(self, info: ErrorInfo) -> None:
        super().__init__(f"{info.error_class}: {info.message}")
        self.info = info


class HandlerError(Exception):
    """Raise in a handler to answer with a specific error class."""

    def __init__(self, error_class: str, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.info = ErrorInfo(error_class=error_class, message=message, retryable=retryable)  # type: ignore[arg-type]


def _error_info(exc: BaseException, default_class: str) -> ErrorInfo:
    if isinstance(exc, HandlerError):
        return exc.info
    if isinstance(exc, RemoteError):
        return exc.info
    return ErrorInfo(error_class=default_class, message=f"{type(exc).__name__}: {exc}")  # type: ignore[arg-type]


async def connect(url: str | list[str], *, name: str) -> NATS:
    """Connect with reconnect-forever: long-lived workers ride out server restarts."""

    async def on_error(e: Exception) -> None:
        log.warning("nats.error", error=str(e), client=name)

    async def on_disconnect() -> None:
        log.info("nats.disconnected", client=name)

    async def on_reconnect() -> None:
        log.info("nats.reconnected", client=name)

    servers = url if isinstance(url, list) else [url]
    return await nats.connect(
        servers=servers,
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.25,
        connect_timeout=5,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        pending_size=64 * 1024 * 1024,
    )


class Bus:
    """A worker's view of NATS: namespaced subjects, codec, tracing, request-reply."""

    def __init__(self, nc: NATS, *, namespace: str, telemetry: Telemetry) -> None:
        self.nc = nc
        self.ns = namespace
        self.telemetry = telemetry
        self.codec = Codec()
        self.js = nc.jetstream()
        self._replies: dict[str, asyncio.Future[Msg]] = {}
        self._reply_prefix: str | None = None
        self._reply_seq = itertools.count()

    @classmethod
    async def connect(
        cls, url: str | list[str], *, namespace: str, telemetry: Telemetry, name: str
    ) -> Bus:
        return cls(await connect(url, name=name), namespace=namespace, telemetry=telemetry)

    def subject(self, *parts: str) -> str:
        return ".".join((self.ns, *parts))

    # ------------------------------------------------------------------ client side

    def _headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        h: dict[str, str] = {}
        self.telemetry.inject(h)
        if extra:
            h.update(extra)
        return h

    def _unwrap(self, msg: Msg) -> Any:
        headers = msg.headers
        body = self.codec.decode(msg.data, headers)
        if isinstance(body, ErrorReply):
            raise RemoteError(body.error)
        return body

    async def request(self, subject: str, payload: Any, *, timeout: float, op: str) -> Any:
        """Core request-reply with a CLIENT span; typed errors come back as ``RemoteError``."""
        with self.telemetry.span(
            f"{op} {subject}",
            kind=SpanKind.CLIENT,
            attributes={"messaging.system": "nats", "messaging.destination.name": subject},
        ) as span:
            try:
                msg = await self.nc.request(
                    subject, self.codec.encode(payload), timeout=timeout, headers=self._headers()
                )
            except nats.errors.NoRespondersError:
                span.set_status(StatusCode.ERROR, "no responders")
                raise RemoteError(
                    ErrorInfo(
                        error_class="worker_lost",
                        message=f"no worker is serving {subject}",
                        retryable=True,
                    )
                ) from None
            except nats.errors.TimeoutError:
                span.set_status(StatusCode.ERROR, "timeout")
                raise RemoteError(
                    ErrorInfo(
                        error_class="timeout",
                        message=f"no reply from {subject} within {timeout:g}s",
                        retryable=True,
                    )
                ) from None
            return self._unwrap(msg)

    async def publish(self, subject: str, payload: Any, *, headers: dict[str, str] | None = None) -> None:
        await self.nc.publish(subject, self.codec.encode(payload), headers=self._headers(headers))

    async def _ensure_reply_sub(self) -> str:
        if self._reply_prefix is None:
            prefix = self.nc.new_inbox()
            self._reply_prefix = prefix

            async def on_reply(msg: Msg) -> None:
                fut = self._replies.pop(msg.subject, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)

            await self.nc.subscribe(prefix + ".*", cb=on_reply)
        return self._reply_prefix

    async def queued_request(
        self, subject: str, payload: Any, *, timeout: float, op: str, msg_id: str | None = None
    ) -> Any:
        """Publish a request onto a JetStream work queue and wait for the core-NATS reply.

        The reply subject travels in the ``Gym-Reply`` header: a NATS reply subject on
        a stream publish would receive the stream's publish ack instead.
        """
        prefix = await self._ensure_reply_sub()
        reply = f"{prefix}.{next(self._reply_seq)}"
        fut: asyncio.Future[Msg] = asyncio.get_running_loop().create_future()
        self._replies[reply] = fut
        with self.telemetry.span(
            f"publish {subject}",
            kind=SpanKind.PRODUCER,
            attributes={"messaging.system": "nats", "messaging.destination.name": subject, "gym.op": op},
        ) as span:
            extra = {REPLY_HEADER: reply}
            if msg_id:
                extra[MSG_ID_HEADER] = msg_id
            try:
                await self.nc.publish(subject, self.codec.encode(payload), headers=self._headers(extra))
                with anyio.fail_after(timeout):
                    msg = await fut
            except TimeoutError:
                span.set_status(StatusCode.ERROR, "timeout")
                raise RemoteError(
                    ErrorInfo(
                        error_class="timeout",
                        message=f"no reply to {op} on {subject} within {timeout:g}s",
                        retryable=True,
                    )
                ) from None
            finally:
                self._replies.pop(reply, None)
            return self._unwrap(msg)

    # ------------------------------------------------------------------ server side

    async def reply(self, subject: str | None, payload: Any, *, error: bool = False) -> None:
        if not subject:
            return
        extra = {ERROR_HEADER: "1"} if error else None
        await self.nc.publish(subject, self.codec.encode(payload), headers=self._headers(extra))

    async def handle(
        self,
        msg: Msg,
        handler: Handler,
        *,
        reply_to: str | None,
        default_error: str,
        attributes: dict[str, Any] | None = None,
    ) -> bool:
        """Decode, run ``handler`` in a CONSUMER span, send its reply. True when it succeeded."""
        parent = self.telemetry.extract(msg.headers)
        attrs = {"messaging.system": "nats", "messaging.destination.name": msg.subject}
        if attributes:
            attrs.update(attributes)
        with self.telemetry.span(
            f"process {msg.subject}", kind=SpanKind.CONSUMER, parent=parent, attributes=attrs
        ) as span:
            try:
                body = self.codec.decode(msg.data, msg.headers)
                result = await handler(body, msg)
            except Exception as exc:  # every failure becomes a typed reply, never a hang
                info = _error_info(exc, default_error)
                span.set_status(StatusCode.ERROR, info.message)
                if not isinstance(exc, (HandlerError, RemoteError)):
                    log.warning("handler.failed", subject=msg.subject, error=info.message, exc_info=exc)
                await self.reply(reply_to, ErrorReply(error=info), error=True)
                return False
            if result is not None:
                await self.reply(reply_to, result)
            return True

    async def serve(
        self,
        tg: TaskGroup,
        subject: str,
        handler: Handler,
        *,
        queue: str = "",
        concurrency: int = 256,
        default_error: str = "internal",
    ) -> Any:
        """Subscribe and run each message in its own task, at most ``concurrency`` at once."""
        limiter = anyio.Semaphore(concurrency)

        async def run_one(msg: Msg) -> None:
            try:
                await self.handle(msg, handler, reply_to=msg.reply, default_error=default_error)
            finally:
                limiter.release()

        async def on_msg(msg: Msg) -> None:
            await limiter.acquire()
            tg.start_soon(run_one, msg)

        return await self.nc.subscribe(subject, queue=queue, cb=on_msg)

    async def close(self) -> None:
        if not self.nc.is_closed:
            try:
                await self.nc.drain()
            except Exception:  # closing a dead connection is not an error worth raising
                await self.nc.close()
