"""The bus: one NATS connection, typed request-reply, and per-message tasks.

It is written once over a ``Wire`` (``interface.Wire``: the NATS basics), the real one (``wire.NatsWire``:
nats-py, ``jetstream``, ``pull``, ``readers``) or the in-memory one (``memory.MemoryWire``). Its parts, each in a
module of its own: ``connect`` (reaching a server), ``rpc`` (a call's liveness and keepalives), ``blobs`` (large
bodies by reference: ``bus.blobs``), ``serving`` (the server side: ``bus.serving``); this module holds the client
side (calls, queued requests, acked stream publishes, discovery rounds) and the ``Bus`` that composes them.
Workers and the collector hold the ``Bus`` itself, its parts' methods bound on it, so each signature is written
once (no Protocol spells it again); on NATS it is also a ``Connection`` (what the streams' administration uses).
No part imports it.

What workers need of messages lives here, on either wire: encoding by ``Content-Type``, W3C trace context in
headers, typed error replies (a ``Gym-Error`` header flag plus an ``ErrorReply`` body, never a hang), and the
fact that a subscription's callbacks run one at a time (nats-py's, and the memory wire's), so handlers are
handed to tasks bounded by the worker's concurrency.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Self

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from opentelemetry.trace import SpanKind, StatusCode

from gym_runtime.errors import Failure, observed
from gym_runtime.messages import ErrorInfo, ErrorReply
from gym_runtime.observability import logs
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.transport import jetstream as streams
from gym_runtime.transport.blobs import Blobs, ByteBudget
from gym_runtime.transport.codec import Codec
from gym_runtime.transport.connect import JETSTREAM_ANSWER_S, check_provisioned, connect, shown_servers
from gym_runtime.transport.delivery import Delivery, Message
from gym_runtime.transport.headers import (
    BUSY_HEADER,
    EXPIRES_HEADER,
    MSG_ID_HEADER,
    OUTPUT_HEADER,
    OUTPUT_STREAMS,
    PAUSE_HEADER,
    PROGRESS_HEADER,
    REPLY_HEADER,
)
from gym_runtime.transport.interface import Connection, KeyValue, Subscription, Wire, inline
from gym_runtime.transport.jetstream import full_error
from gym_runtime.transport.limits import parse_size
from gym_runtime.transport.rpc import (
    DIRECT_ABSENT_S,
    DIRECT_BUSY_S,
    JS_ACK_TIMEOUT_S,
    AckDeadlines,
    Busy,
    NoResponders,
    Pending,
    PubAck,
    Timings,
    traced,
)
from gym_runtime.transport.serving import Serving, replying
from gym_runtime.transport.subjects import (
    SERVER_LANE,
    Subjects,
    answers,
    blob_space,
    caller,
    caller_of,
    classify,
    direct_get,
    reply,
)
from gym_runtime.transport.wire import NatsWire

log = logs.get("gym.bus")
_NO_SKIP = (0.0, "")  # a direct subject not skipped: asked (``Bus._direct_skip``)


_pub_ack = msgspec.json.Decoder(PubAck)


class Bus:
    """A worker's view of NATS: namespaced subjects, codec, tracing, request-reply.

    Requests use one wildcard reply subscription per connection and a future per
    call (cheaper than nats-py's ``request``, and under our control): when the
    connection drops, every call in flight fails at once as retryable
    ``worker_lost`` instead of hanging until its timeout. Bodies larger than the
    server's max payload go through the JetStream Object Store by reference
    (``Gym-Blob`` header), transparently for senders and receivers (``blobs``); handlers are
    served by ``serving``. Both are parts, given what they need of the bus and nothing more.
    ``conn``: a nats-py client (the real wire, ``NatsWire``), or a ``Wire`` (``memory.MemoryWire``).
    """

    def __init__(
        self, conn: NATS | Wire, *, namespace: str, telemetry: Telemetry, timings: Timings | None = None
    ) -> None:
        self._timings = timings or Timings()
        self._acks = AckDeadlines()  # stored publishes' acks still out
        self.ns = namespace
        self.subjects = Subjects(namespace)  # every name this bus publishes and subscribes with
        self.telemetry = telemetry
        self.codec = Codec()
        self._nats: NatsWire | None = None  # the real wire, when it is one (``nc``, ``js``)
        if isinstance(conn, NATS):
            conn = self._nats = NatsWire(conn, self.subjects)
        self.wire: Wire = conn
        self._replies: dict[str, Pending] = {}
        # a subject -> the process a call to it last went silent on (its keepalives' tag), and when: ``why``
        self.went_silent: dict[str, tuple[str, float]] = {}
        self._reply_prefix: str | None = None
        self._reply_seq = itertools.count()
        self.caller = caller_of(None, None)  # who this connection calls as (``subjects.caller_of``)
        self._background: set[asyncio.Future[None]] = set()  # resends after a reconnect
        # direct subject -> use the queue until (monotonic), and why ("busy", "absent")
        self._direct_skip: dict[str, tuple[float, str]] = {}
        self.store_retries = 0  # stored publishes sent again for a missing ack (``store``)
        # the parts: bodies (large ones by reference, stored with this bus's acked publish) and serving
        self.blobs = Blobs(self.wire, self.codec, self.store)
        self.serving = Serving(self.wire, self.codec, telemetry, self._timings, self.blobs.encode, self.blobs.decode)
        # what the Bus offers of its parts: their own methods, bound, not wrapped (each signature written once)
        self.encode, self.decode, self.decode_sized = self.blobs.encode, self.blobs.decode, self.blobs.decode_sized
        sv = self.serving
        self.serve, self.serve_direct, self.handle, self.reply = sv.serve, sv.serve_direct, sv.handle, sv.reply
        self.expired, self.taken, self.busy = sv.expired, sv.taken, sv.busy
        self.count_junk, self.warn_limited = sv.count_junk, sv.warn_limited
        # ... and of its wire: the streams' basics, bound as they are
        w = self.wire
        self.work_queue, self.reader, self.subject_count, self.stream_full = (
            w.work_queue,
            w.reader,
            w.subject_count,
            w.stream_full,
        )

    @classmethod
    async def connect(
        cls,
        url: str | list[str],
        *,
        namespace: str,
        telemetry: Telemetry,
        name: str,
        initial_timeout: float | None = -1.0,
        auth: Any = None,
        role: str | None = None,
        pool: str | None = None,
        jetstream: Any = None,
        timings: Timings | None = None,
    ) -> Bus:
        """Connect; with ``auth`` (a ``security.ClientAuth``) as ``role``, over TLS with that role's nkey
        (or ``pool``'s, the one config entry this connection serves, when the node holds that credential).
        ``jetstream``: the config's JetStreamConfig, applied to the streams/buckets this client creates."""
        if auth is not None and role is None:
            raise TypeError("a secured connection needs the role it acts as (role='agent', ...)")
        bus: Bus | None = None

        async def on_reconnect() -> None:
            if bus is not None:
                await bus.after_reconnect("the connection to NATS was lost and re-established")

        options = auth.connect_options(role, pool) if auth is not None and role is not None else None
        nc = await connect(url, name=name, on_reconnect=on_reconnect, initial_timeout=initial_timeout, options=options)
        bus = cls(nc, namespace=namespace, telemetry=telemetry, timings=timings)
        bus.jetstream_config = jetstream
        bus.blobs.space = blob_space(role, pool)
        # the pool's name only with the pool's credential (else the role-wide one's ``_``), as its inbox says
        bus.caller = caller(options["inbox_prefix"] + ".x") if options else caller_of(role, pool)
        if jetstream is not None:
            bus.blobs.budget.cap = parse_size(jetstream.blob_bytes_in_flight)
            bus.blobs.ttl_s = float(jetstream.blob_ttl_s)
        bus.wire.secured = auth is not None and role != "admin"
        if auth is not None and role != "admin":  # the admin provisions; every other role needs it done
            try:
                within = initial_timeout if initial_timeout is not None and initial_timeout > 0 else JETSTREAM_ANSWER_S
                await check_provisioned(
                    bus.js, namespace, shown_servers(url if isinstance(url, list) else [url]), within_s=within
                )
            except BaseException:
                await bus.close()
                raise
        return bus

    @property
    def nc(self) -> NATS:
        """The nats-py client (the streams' administration, ``Connection``); a bus in memory has none."""
        return self._real_wire().nc

    @property
    def js(self) -> JetStreamContext:
        return self._real_wire().js

    def _real_wire(self) -> NatsWire:
        if self._nats is None:
            raise AttributeError("a bus on an in-memory wire has no NATS connection")
        return self._nats

    @property
    def secured(self) -> bool:
        """A --secure bus: the admin provisioned the streams, no other role may create them."""
        return self.wire.secured

    @property
    def jetstream_config(self) -> Any:
        """JetStreamConfig (replicas, retention) for what this client creates; None = defaults."""
        return self.wire.jetstream_config

    @jetstream_config.setter
    def jetstream_config(self, config: Any) -> None:
        self.wire.jetstream_config = config

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def timings(self) -> Timings:
        """How soon each side of a call gives up on the other (the caller's liveness, the handler's keepalives)."""
        return self._timings

    @timings.setter
    def timings(self, timings: Timings) -> None:
        self._timings = self.serving.timings = timings

    # what tests and status read of the parts
    @property
    def blob_threshold(self) -> int:
        return self.blobs.threshold

    @property
    def blob_space(self) -> str:
        return self.blobs.space

    @property
    def blob_budget(self) -> ByteBudget:
        return self.blobs.budget

    @property
    def junk(self) -> dict[str, int]:
        return self.serving.junk

    # ------------------------------------------------------------------ client side

    def _headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return traced(self.telemetry, extra)

    async def _unwrap(self, msg: Message, subject: str) -> Any:
        headers = msg.headers
        if headers and not msg.data:
            if headers.get("Status") == "503":
                raise NoResponders(
                    ErrorInfo(error_class="worker_lost", message=f"no worker is serving {subject}", retryable=True)
                )
            if BUSY_HEADER in headers:
                raise Busy(ErrorInfo(error_class="busy", message=f"no free slot on {subject}", retryable=True))
        body = await self.decode(msg)
        if isinstance(body, ErrorReply):
            raise Failure(body.error)
        return body

    async def _ensure_reply_sub(self) -> str:
        if self._reply_prefix is None:
            prefix = self.wire.new_inbox()
            self._reply_prefix = prefix
            replies = self._replies

            def on_reply(msg: Message) -> None:
                headers = msg.headers
                if headers and PROGRESS_HEADER in headers:
                    call = replies.get(msg.subject)
                    if call is not None:
                        call.alive(time.monotonic())
                        call.by = headers[PROGRESS_HEADER]  # who has it (``Keepalives.tag``): ``why`` names it
                    return
                if headers and OUTPUT_HEADER in headers:  # a sign of life too
                    call = replies.get(msg.subject)
                    if call is not None and not call.fut.done():
                        call.alive(time.monotonic())
                        if call.on_output is not None:  # an author's callback: never run in the reader itself
                            stream = OUTPUT_STREAMS.get(headers[OUTPUT_HEADER], 1)
                            asyncio.get_running_loop().call_soon(call.on_output, stream, msg.data)
                    return
                if headers and PAUSE_HEADER in headers:
                    call = replies.get(msg.subject)
                    if call is not None and not call.fut.done():
                        call.paused(headers[PAUSE_HEADER])
                    return
                call = replies.pop(msg.subject, None)
                if call is not None and not call.fut.done():
                    call.fut.set_result(msg)

            await self.wire.subscribe(answers(prefix), cb=inline(on_reply))
        return self._reply_prefix

    async def after_reconnect(self, reason: str) -> None:
        """Calls in flight across a reconnect: their requests or replies may be lost.

        Core calls fail as retryable ``worker_lost``. Queued (JetStream) calls are
        published again (without their dedupe id): a reply sent while we were
        resubscribing is gone, and a model call done twice is cheaper than a
        rollout redone; whichever reply comes first is taken.
        """
        for call in list(self._replies.values()):
            if call.resend is not None and not call.fut.done():
                self._spawn(self._resend(call))
        self.fail_pending(reason)

    async def _resend(self, call: Pending) -> None:
        assert call.resend is not None
        subject, data, headers = call.resend
        try:
            await self.store(subject, data, headers)
        except Exception as e:  # the caller's timeout still bounds the call
            log.warning("queued_call.resend_failed", subject=subject, error=repr(e))

    def pause_caller(self, took: float | None) -> None:
        """Tell the caller of the request handled here that its handler waits for a sandbox lease (``None``) or
        has stopped waiting (``took`` seconds): the caller's clock stands still meanwhile (``Pending.paused``).
        Outside a handler, nothing."""
        reply_to = replying()
        if reply_to:
            value = "1" if took is None else f"{took:.6f}"
            self._spawn(self._publish_quietly(reply_to, {PAUSE_HEADER: value}))

    async def send_output(self, stream: int, data: bytes) -> None:
        """Send a part of the output of the request handled here to its caller now (its ``on_output``), before
        the reply; awaited, so parts and reply arrive in order. Outside a handler, nothing."""
        reply_to = replying()
        if reply_to and data:
            await self.wire.publish(reply_to, data, headers={OUTPUT_HEADER: str(stream)})

    async def _publish_quietly(self, subject: str, headers: dict[str, str]) -> None:
        try:
            await self.wire.publish(subject, b"", headers=headers)
        except Exception as e:  # disconnected: the call fails or ends on its own; its pause ends with it
            log.warning("pause.not_sent", subject=subject, error=repr(e))

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _went_silent(self, subject: str, by: str) -> None:
        """A core call's responder stopped answering: kept for ``why`` to name, and told the operator in one line,
        once per process (a frozen one fails every call it had)."""
        new = not any(p == by for p, _ in self.went_silent.values()) if by else True
        if by:
            self.went_silent[subject] = (by, time.monotonic())
        if new:
            _, what, component = classify(self.subjects, subject)
            log.warning(
                "worker.silent",
                component=component,
                process=by or "unknown (it never answered)",
                call=what,
                fix=f"gym-runtime why names what waits on it; look at {component}"
                + (f" process {by} (frozen? `kill -CONT`, or kill it: its peers take its work)" if by else ""),
            )

    def calls_in_flight(self) -> list[Pending]:
        """The calls this connection waits on now (read by ``why``: where each rollout is), at the time of asking."""
        return [c for c in self._replies.values() if not c.fut.done()]

    def fail_pending(self, reason: str) -> None:
        """Fail every core call in flight as retryable: its responder may never have got it."""
        for key, call in list(self._replies.items()):
            if call.resend is not None:
                continue
            del self._replies[key]
            fut = call.fut
            if not fut.done():
                fut.set_exception(Failure(ErrorInfo(error_class="worker_lost", message=reason, retryable=True)))

    async def _call(
        self,
        subject: str,
        payload: Any,
        *,
        timeout: float,
        op: str,
        queued: bool,
        msg_id: str | None,
        liveness: float | None = None,
        wait_s: float | None = None,
        on_output: Callable[[int, bytes], None] | None = None,
        by: str = "",
    ) -> Any:
        prefix = self._reply_prefix or await self._ensure_reply_sub()
        # the callee's lane: on a secured bus only the callee may answer into it
        reply_to = reply(prefix, self.subjects.callee_lane(subject), next(self._reply_seq))
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Message] = loop.create_future()
        call = Pending(fut, time.monotonic())
        call.on_output = on_output
        call.by = by  # the process the callee said it is (a session's worker), until a keepalive says
        self._replies[reply_to] = call
        headers: dict[str, str] = {}
        self.telemetry.inject(headers)
        if queued:
            # A reply subject on a stream publish would receive the stream's ack instead.
            headers[REPLY_HEADER] = reply_to
            # when this caller stops waiting for a worker: a worker taking it later does not run it
            headers[EXPIRES_HEADER] = f"{time.time() + (timeout if wait_s is None else wait_s):.3f}"
        if msg_id:
            headers[MSG_ID_HEADER] = msg_id
        # a queued request is redelivered by JetStream instead of watched for liveness; it may wait for a
        # worker up to wait_s, and its timeout runs from when a worker takes it (Serving.taken)
        if queued:
            call.watch(loop, subject, op, timeout, None, queued=timeout if wait_s is None else wait_s)
        else:
            call.watch(loop, subject, op, timeout, liveness or self.timings.liveness_s)
        try:
            try:
                data = await self.encode(payload, headers, stored=queued)  # a queued call may wait long for a worker
                if queued:
                    call.resend = (subject, data, {k: v for k, v in headers.items() if k != MSG_ID_HEADER})
                if queued:  # stored with the stream's ack: a full queue refuses it (StorageFull, never a silent
                    await self.store(subject, data, headers)  # drop); a publish lost in a leader election is retried
                else:
                    await self.wire.publish(subject, data, reply=reply_to, headers=headers)
                msg = await fut
            finally:
                call.stop()
                self._replies.pop(reply_to, None)
            return await self._unwrap(msg, subject)
        except Failure as e:  # a peer's answer, a worker lost, a clock: the runtime saw it (``Failure.observed``)
            observed(e)
            if e.info.error_class == "worker_lost" and not queued:
                self._went_silent(subject, call.by)
            raise

    async def request(
        self,
        subject: str,
        payload: Any,
        *,
        timeout: float,
        op: str,
        liveness_s: float | None = None,
        on_output: Callable[[int, bytes], None] | None = None,
        by: str = "",
    ) -> Any:
        """Core request-reply with a CLIENT span; typed errors come back as ``Failure``.

        ``liveness_s`` (default ``timings.liveness_s``): how long the responder may stay silent (no reply,
        no keepalive) before the call fails as retryable ``worker_lost``. ``on_output``: called with each part
        of output the handler sends before its reply (``send_output``: stream 1 or 2, its bytes), in order.
        ``by``: the process the callee said it is (``process_tag``), so a callee that goes silent before its
        first keepalive is named too."""
        kw: dict[str, Any] = {"liveness": liveness_s, "on_output": on_output, "by": by}
        if not self.telemetry.recording:  # no span to open or mark: the caller's context is current already
            return await self._call(subject, payload, timeout=timeout, op=op, queued=False, msg_id=None, **kw)
        with self.telemetry.span(
            f"{op} {subject}",
            kind=SpanKind.CLIENT,
            attributes={"messaging.system": "nats", "messaging.destination.name": subject},
        ) as span:
            try:
                return await self._call(subject, payload, timeout=timeout, op=op, queued=False, msg_id=None, **kw)
            except Busy:
                raise
            except Failure as e:
                span.set_status(StatusCode.ERROR, e.info.message)
                raise

    async def direct_or_queued(
        self,
        direct: str,
        queued: str,
        payload: Any,
        *,
        timeout: float,
        op: str,
        liveness_s: float | None = None,
        wait_s: float | None = None,
        on_output: Callable[[int, bytes], None] | None = None,
    ) -> Any:
        """A call to a worker with a free slot right now over core NATS, else through the work queue.

        The direct try costs one round trip and no storage; the queue keeps what it
        always had: calls that must wait (every worker busy, paused, or none
        serving direct calls) wait there, visible to autoscalers, and a worker lost
        mid-call is not a failed call — the call goes to the queue, as a
        redelivery would. Errors of the call itself come back as they are. ``timeout`` bounds the
        call once a worker has it; a queued call may wait up to ``wait_s`` for one (``queued_request``).
        ``on_output``: as ``request``'s, either way.
        """
        now = time.monotonic()
        deadline = now + timeout
        if self._direct_skip.get(direct, _NO_SKIP)[0] <= now:  # inline, not ``try_direct``: the hot path
            try:
                return await self.request(
                    direct, payload, timeout=timeout, op=op, liveness_s=liveness_s, on_output=on_output
                )
            except (Busy, NoResponders, Failure) as e:
                self._not_direct(direct, e)
        left = deadline - time.monotonic()
        if left <= 0:
            raise observed(
                Failure(
                    ErrorInfo(error_class="timeout", message=f"no reply to {op} within {timeout:g}s", retryable=True)
                )
            )
        return await self.queued_request(queued, payload, timeout=left, op=op, wait_s=wait_s, on_output=on_output)

    async def try_direct(
        self,
        direct: str,
        payload: Any,
        *,
        timeout: float,
        op: str,
        liveness_s: float | None = None,
        on_output: Callable[[int, bytes], None] | None = None,
    ) -> tuple[str, Any]:
        """One direct try (``direct_or_queued``'s first step): ``("answered", reply)``, else why not and None:
        ``busy`` (no free slot), ``absent`` (nobody serves it) or ``lost`` (its worker went silent mid-call); busy
        or absent a moment ago it is not asked again (``DIRECT_BUSY_S``, ``DIRECT_ABSENT_S``) and that is the
        answer. Errors of the call itself come back as they are."""
        until, why = self._direct_skip.get(direct, _NO_SKIP)
        if until > time.monotonic():
            return why, None
        try:
            return "answered", await self.request(
                direct, payload, timeout=timeout, op=op, liveness_s=liveness_s, on_output=on_output
            )
        except (Busy, NoResponders, Failure) as e:
            return self._not_direct(direct, e), None

    def _not_direct(self, direct: str, e: Exception) -> str:
        """Why a direct try did not answer (``busy``, ``absent``, ``lost``), the subject skipped a while where it
        was busy or absent; a failure of the call itself is raised again."""
        if isinstance(e, Busy):
            self._direct_skip[direct] = (time.monotonic() + DIRECT_BUSY_S, "busy")
            return "busy"
        if isinstance(e, NoResponders):
            self._direct_skip[direct] = (time.monotonic() + DIRECT_ABSENT_S, "absent")
            return "absent"
        if not isinstance(e, Failure) or e.info.error_class != "worker_lost":
            raise e
        log.info("direct_call.lost", subject=direct, error=e.info.message, then="queue")
        return "lost"

    async def queued_request(
        self,
        subject: str,
        payload: Any,
        *,
        timeout: float,
        op: str,
        msg_id: str | None = None,
        wait_s: float | None = None,
        on_output: Callable[[int, bytes], None] | None = None,
    ) -> Any:
        """Publish a request onto a JetStream work queue and wait for the core-NATS reply.

        ``timeout`` counts from when a worker takes the request (its ``taken``); until then the request
        may wait in the queue up to ``wait_s`` (default ``timeout``): behind other callers' work it is
        queued, not lost. A worker that takes it after that does not run it (``Serving.expired``)."""
        kw: dict[str, Any] = {"msg_id": msg_id, "wait_s": wait_s, "on_output": on_output}
        if not self.telemetry.recording:
            return await self._call(subject, payload, timeout=timeout, op=op, queued=True, **kw)
        with self.telemetry.span(
            f"publish {subject}",
            kind=SpanKind.PRODUCER,
            attributes={"messaging.system": "nats", "messaging.destination.name": subject, "gym.op": op},
        ) as span:
            try:
                return await self._call(subject, payload, timeout=timeout, op=op, queued=True, **kw)
            except Failure as e:
                span.set_status(StatusCode.ERROR, e.info.message)
                raise

    async def publish(self, subject: str, payload: Any, *, headers: dict[str, str] | None = None) -> None:
        h = self._headers(headers)
        await self.wire.publish(subject, await self.encode(payload, h), headers=h)

    async def record(self, subject: str, data: bytes, *, msg_id: str) -> None:
        """Store bytes already encoded (``Subjects.attempt``'s records) in a stream; returns after the server's
        ack, deduplicated by ``msg_id`` when a lost ack sends it again."""
        await self.store(subject, data, {MSG_ID_HEADER: msg_id})

    async def js_publish(self, subject: str, payload: Any, *, msg_id: str, keep: str | None = None) -> None:
        """Store a message in a stream (deduplicated by ``msg_id``); returns after the server's ack.

        ``keep``: a subject that stores the same body too (a batch's kept task: encoded once, and a large body's
        blob is referenced by both), after ``subject``: concurrent publishes leave in the order they were made."""
        h = self._headers({MSG_ID_HEADER: msg_id})
        data = await self.encode(payload, h, stored=True)
        await self.store(subject, data, h)
        if keep is not None:
            await self.store(keep, data, {k: v for k, v in h.items() if k != MSG_ID_HEADER})

    async def store(self, subject: str, data: bytes, headers: dict[str, str]) -> None:
        """Publish into a stream and wait for its ack, riding out a stream leader election.

        In a cluster a stream may be electing a new leader for a few seconds; a plain
        publish then is silently lost. Publishing again is safe: a msg id deduplicates.
        """
        give_up = time.monotonic() + self._timings.store_retry_s  # the whole budget, the last ack wait included
        delay = 0.1
        while True:
            try:
                await self._publish_acked(subject, data, headers, min(JS_ACK_TIMEOUT_S, give_up - time.monotonic()))
                return
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError) as e:
                if time.monotonic() + delay > give_up:
                    raise
                self.store_retries += 1
                log.info("jetstream.retry", call="publish", subject=subject, error=type(e).__name__)
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)

    async def _publish_acked(self, subject: str, data: bytes, headers: dict[str, str], ack_s: float) -> None:
        """One stream publish and its ack within ``ack_s``, through our reply subscription (nats-py's
        ``js.publish`` costs a request machinery and a PubAck object per message). Raises what ``js.publish``
        would."""
        prefix = self._reply_prefix or await self._ensure_reply_sub()
        ack_to = reply(prefix, SERVER_LANE, next(self._reply_seq))  # answered by the server itself
        fut: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._replies[ack_to] = Pending(fut, time.monotonic())
        self._acks.add(fut, max(ack_s, 0.0))
        try:
            await self.wire.publish(subject, data, reply=ack_to, headers=headers)
            msg = await fut
        except Failure:  # the connection dropped with the ack outstanding: publish again (deduplicated)
            raise nats.errors.TimeoutError from None
        finally:
            self._acks.discard(fut)
            self._replies.pop(ack_to, None)
        if msg.headers and msg.headers.get("Status") == "503":
            raise nats.js.errors.NoStreamResponseError
        ack = _pub_ack.decode(msg.data)
        if ack.error is not None:
            raise full_error(self, subject, ack.error) or nats.js.errors.APIError.from_error(ack.error)

    async def publish_raw(self, subject: str, data: bytes, *, headers: dict[str, str] | None = None) -> None:
        """A body sent as it is (no codec, no trace context): beacons, discovery answers."""
        await self.wire.publish(subject, data, headers=headers)

    async def subscribe(
        self, subject: str, cb: Callable[[Delivery], Awaitable[None]], *, queue: str = ""
    ) -> Subscription:
        """A plain subscription whose messages ``cb`` gets as ``Delivery`` (run one at a time, as nats-py does)."""

        async def on_msg(msg: Message) -> None:
            await cb(Delivery(msg))

        return await self.wire.subscribe(subject, queue=queue, cb=on_msg)

    async def ensure_results_stream(self, agent: str) -> str:
        """The stream that stores ``agent``'s results, made when missing (``jetstream.ensure_results_stream``)."""
        return await self.wire.ensure_stream("results", agent)

    async def ensure_attempts_stream(self) -> None:
        await self.wire.ensure_stream("attempts")

    async def kv(self, bucket: str, *, ttl_s: float = 0.0, direct: bool = False, msg_ttl: bool = False) -> KeyValue:
        """The KV bucket, made on first use (``jetstream.kv_bucket``; ``ttl_s``: its keys' age limit, made with
        it; ``direct``: its keys read by direct gets; ``msg_ttl``: a write may set its own age, ``Nats-TTL``), its
        calls retried as a stored publish."""
        return await self.wire.kv(
            bucket, within_s=self._timings.store_retry_s, ttl_s=ttl_s, direct=direct, msg_ttl=msg_ttl
        )

    async def last_stored(self, stream: str, subject: str) -> Delivery | None:
        """A last-by-subject direct get (``jetstream.last_message``)."""
        msg = await streams.last_message(self.wire.request, direct_get(stream, subject))
        return None if msg is None else Delivery(msg)

    async def flush(self) -> None:
        """Wait until the server has processed everything sent so far (e.g. new subscriptions)."""
        await self.wire.flush()

    async def scatter(
        self,
        subject: str,
        *,
        wait_s: float,
        until: Callable[[str, bytes], bool] | None = None,
        ask: bytes = b"",
    ) -> list[tuple[str, bytes]]:
        """Send a request (``ask``, empty by default) to every subscriber of ``subject`` and gather the raw answers
        for ``wait_s`` seconds (or until ``until(subject, data)`` says an answer was the last one needed), each with the
        subject it came on: each responder answers into its own lane under the request's reply root
        (``answer``), which on a secured bus only it may publish into."""
        root = self.wire.new_inbox()
        got: list[tuple[str, bytes]] = []
        enough = asyncio.Event()

        async def on_answer(msg: Message) -> None:
            got.append((msg.subject, msg.data))
            if until is not None and until(msg.subject, msg.data):
                enough.set()

        sub = await self.wire.subscribe(answers(root), cb=on_answer)
        try:
            await self.wire.publish(subject, ask, reply=root)
            await self.wire.flush()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(enough.wait(), wait_s)
        finally:
            await sub.unsubscribe()
        return got

    async def gather(
        self,
        subject: str,
        payload: Any,
        *,
        done: Callable[[list[Any]], bool],
        timeout: float,
        headers: dict[str, str] | None = None,
    ) -> list[Any]:
        """Publish ``payload`` to every subscriber of ``subject``; collect decoded replies until
        ``done(replies)`` or ``timeout`` (control messages acknowledged by every replica). The replies
        come in the callee's lane (``model.{model}`` for a pause), which only its replicas may answer into."""
        reply_to = reply(self.wire.new_inbox(), self.subjects.callee_lane(subject), 0)
        replies: list[Any] = []
        finished = asyncio.Event()

        async def on_reply(msg: Message) -> None:
            try:
                replies.append(await self.decode(msg))
            except Exception:  # a reply we cannot read counts as no reply
                return
            if done(replies):
                finished.set()

        sub = await self.wire.subscribe(reply_to, cb=on_reply)
        try:
            h = self._headers(headers)
            await self.wire.publish(subject, await self.encode(payload, h), reply=reply_to, headers=h)
            if not done(replies):
                try:
                    await asyncio.wait_for(finished.wait(), timeout)
                except TimeoutError:
                    pass
        finally:
            await sub.unsubscribe()
        return replies

    async def raw_request(self, subject: str, data: bytes, *, timeout: float) -> bytes:
        """A plain core request (no envelope): for the server's own API (``js_info``)."""
        return bytes((await self.wire.request(subject, data, timeout=timeout)).data)

    # ------------------------------------------------------------------ server side

    async def close(self, timeout: float = 10.0) -> None:
        """Close the wire (on NATS: drain, then close, each within ``timeout``: ``NatsWire.close``)."""
        await self.wire.close(timeout)


if TYPE_CHECKING:  # mypy holds the Bus to what the streams' administration uses of a connection
    _bus_is_a_connection: type[Connection] = Bus
