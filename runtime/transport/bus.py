"""The bus: one NATS connection, typed request-reply, and per-message tasks.

Everything NATS-specific that workers need lives here and in ``gym_runtime.transport.pull``:
encoding by ``Content-Type``, W3C trace context in headers, typed error replies
(a ``Gym-Error`` header flag plus an ``ErrorReply`` body, never a hang), and the
fact that nats-py runs one subscription's callbacks one at a time, so handlers
are handed to tasks bounded by the worker's concurrency.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import msgspec
import nats
import nats.errors
import nats.js.errors
from anyio.abc import TaskGroup
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from opentelemetry.trace import SpanKind, StatusCode

from gym_runtime.errors import AuthError, Failure, UserError
from gym_runtime.messages import ErrorInfo, ErrorReply
from gym_runtime.observability import logs
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.transport.codec import Codec
from gym_runtime.transport.delivery import Delivery
from gym_runtime.transport.jetstream import blob_stream_name, ensure_blob_stream
from gym_runtime.transport.tasks import TaskSet

ERROR_HEADER = "Gym-Error"
REPLY_HEADER = "Gym-Reply"  # where a JetStream-queued request wants its answer
MSG_ID_HEADER = "Nats-Msg-Id"
BLOB_HEADER = "Gym-Blob"  # the body is in the blob stream: "{key}.{chunks}.{sha256 hex}"
MAX_BLOB_BYTES = 256 * 1024 * 1024  # a referenced body larger than this is refused before it is read
PROGRESS_HEADER = "Gym-Progress"  # "still working": keeps a caller's liveness timer alive
BUSY_HEADER = "Gym-Busy"  # "no free slot here": a direct call goes to the work queue instead
JS_PUBLISH_RETRY_S = 20.0  # how long a stored result waits out a stream leader election
JUNK_LOG_S = 10.0  # a cause of refused requests is logged at most once per this many seconds
_UNSET: Any = object()

log = logs.get("gym.bus")

Handler = Callable[[Any, Delivery], Awaitable[Any]]


class Timings(msgspec.Struct, frozen=True, kw_only=True):
    """How soon the two ends of a core request notice each other (a value a bus is given, never patched)."""

    keepalive_s: float = 2.0  # a handler still running after this sends progress, and again every keepalive_s
    liveness_s: float = 10.0  # a core request with no reply nor progress for this long: the worker is gone


# The one typed error (gym_runtime.errors) under the names the bus has used: a
# handler raises it to answer with an error class; a caller receives it.


class NoResponders(Failure):
    """Nobody subscribes to the subject right now (a role with no worker, e.g. a pool restarting).

    Nothing was delivered, so the call is safe to repeat once a worker is back.
    """


class Busy(NoResponders):
    """The worker that took a direct call has no free slot; nothing ran, so the call may go elsewhere."""


DIRECT_ABSENT_S = 1.0  # after "nobody serves direct calls here", use the queue this long before asking again
DIRECT_BUSY_S = 0.05  # after "busy", use the queue this long: calls that wait belong in the queue


def _error_info(exc: BaseException, default_class: str) -> ErrorInfo:
    if isinstance(exc, Failure):
        return exc.info
    return ErrorInfo(error_class=default_class, message=f"{type(exc).__name__}: {exc}")  # type: ignore[arg-type]


class _Pending:
    """A call in flight: its future, and when its worker last showed signs of life.

    One timer per call watches both limits: the call's deadline and, for core
    requests, the responder's liveness (no reply nor keepalive for too long).
    """

    __slots__ = ("fut", "seen", "resend", "_timer", "_liveness", "_deadline", "_subject", "_op", "_timeout")

    def __init__(self, fut: asyncio.Future[Msg], seen: float) -> None:
        self.fut = fut
        self.seen = seen
        # queued calls: (subject, body, headers) to publish again after a reconnect
        self.resend: tuple[str, bytes, dict[str, str]] | None = None
        self._timer: asyncio.TimerHandle | None = None

    def watch(
        self, loop: asyncio.AbstractEventLoop, subject: str, op: str, timeout: float, liveness: float | None
    ) -> None:
        """Fail the call at ``timeout``, or as ``worker_lost`` after ``liveness`` seconds of silence."""
        self._subject, self._op, self._timeout = subject, op, timeout
        self._liveness = liveness
        self._deadline = self.seen + timeout
        first = timeout if liveness is None else min(timeout, liveness)
        self._timer = loop.call_later(first, self._check, loop)

    def _check(self, loop: asyncio.AbstractEventLoop) -> None:
        fut = self.fut
        if fut.done():
            return
        now = time.monotonic()
        if now >= self._deadline:
            fut.set_exception(
                Failure(
                    ErrorInfo(
                        error_class="timeout",
                        message=f"no reply to {self._op} on {self._subject} within {self._timeout:g}s",
                        retryable=True,
                    )
                )
            )
            return
        wake = self._deadline
        if self._liveness is not None:
            idle = now - self.seen
            if idle >= self._liveness:
                fut.set_exception(
                    Failure(
                        ErrorInfo(
                            error_class="worker_lost",
                            message=f"the worker serving {self._subject} stopped answering ({idle:.0f}s without progress)",
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


class _Keepalive:
    """Tells a core-request caller every ``every_s`` that its request is still being worked on."""

    __slots__ = ("_nc", "_reply_to", "_loop", "_timer", "_sending", "_every_s")

    def __init__(self, nc: NATS, reply_to: str, every_s: float) -> None:
        self._nc = nc
        self._reply_to = reply_to
        self._every_s = every_s
        self._loop = asyncio.get_running_loop()
        self._timer = self._loop.call_later(every_s, self._beat)
        self._sending: asyncio.Task[None] | None = None  # held so it is not garbage-collected

    def _beat(self) -> None:
        self._sending = self._loop.create_task(self._nc.publish(self._reply_to, b"", headers={PROGRESS_HEADER: "1"}))
        self._timer = self._loop.call_later(self._every_s, self._beat)

    def cancel(self) -> None:
        self._timer.cancel()


JS_ACK_TIMEOUT_S = 5.0  # nats-py's JetStream default: a stored message's ack not back by then is retried


class _PubAck(msgspec.Struct):
    """The part of JetStream's publish ack we read (stream, seq and duplicate are ignored)."""

    error: dict[str, Any] | None = None


_pub_ack = msgspec.json.Decoder(_PubAck)


def _no_ack(fut: asyncio.Future[Msg]) -> None:
    if not fut.done():
        fut.set_exception(nats.errors.TimeoutError())


ATTEMPT_S = 30.0  # a service's connect attempt that has not succeeded by then starts over with a fresh client


def _quiet_ssl_eof() -> None:
    """asyncio warns on every TLS connection close (a harmless protocol quirk); keep stderr to real news."""
    import logging

    lg = logging.getLogger("asyncio")
    if not any(getattr(f, "gym_ssl_eof", False) for f in lg.filters):

        class _Filter(logging.Filter):
            gym_ssl_eof = True

            def filter(self, record: logging.LogRecord) -> bool:
                return "eof_received()" not in record.getMessage()

        lg.addFilter(_Filter())


NATS_SCHEMES = ("nats", "tls", "ws", "wss")


def server_list(url: str | list[str]) -> list[str]:
    """Server URLs from a list and/or comma-separated strings (``a,b`` is two servers, not one).

    A URL of another scheme (``http://host:8222`` is the monitoring port) is a ``UserError`` now: waited on,
    it looked like a server that does not answer."""
    items = url if isinstance(url, list) else [url]
    servers = [u.strip() for item in items for u in str(item).split(",") if u.strip()]
    for s in servers:
        scheme = s.split("://", 1)[0].lower() if "://" in s else "nats"
        if scheme not in NATS_SCHEMES:
            raise UserError(
                f"--nats {_shown([s])}: not a NATS URL (expected nats://HOST:4222"
                f"{'; http:// is the monitoring port, for health --monitor' if scheme.startswith('http') else ''})"
            )
    return servers


WARN_UNREACHABLE_S = 8.0  # a long-lived worker still without a server after this logs a warning


async def check_provisioned(js: Any, namespace: str, shown: str) -> None:
    """Fail clearly when the secured server was not started for ``namespace``.

    Its roles may use only the subjects of the namespaces it provisioned; anything else
    would be refused request by request, as timeouts.
    """
    try:
        await js.find_stream_name_by_subject(f"{namespace}.task.probe")
    except nats.js.errors.NotFoundError:
        raise AuthError(
            f"the secured server at {shown} does not serve namespace {namespace!r}: start it with "
            f"`gym-runtime server --secure DIR --namespace {namespace}` (repeatable)"
        ) from None


def unanswered(exc: BaseException) -> bool:
    """True for a request that got no answer in time (e.g. one the server's permissions dropped)."""
    return isinstance(exc, nats.errors.TimeoutError)


class ServerUnreachable(UserError, ConnectionError):
    """No NATS server of the given URLs accepted a connection in time."""


def _shown(servers: list[str]) -> str:
    """The URLs for messages and logs, without any user:password part."""
    from urllib.parse import urlparse

    out = []
    for s in servers:
        u = urlparse(s if "://" in s else f"nats://{s}")
        out.append(f"{u.scheme}://{u.hostname}:{u.port or 4222}" if u.username or u.password else s)
    return ", ".join(out)


def _refusal(e: BaseException) -> bool:
    """The server said no (authentication, TLS): retrying will not help a one-shot command."""
    import ssl

    low = str(e).lower()
    return isinstance(e, ssl.SSLError) or any(w in low for w in ("authorization", "authentication", "tls"))


def _reason(e: BaseException, *, secured: bool = True) -> str:
    """A connect failure in a few words, with the likely fix."""
    import ssl

    if not secured and (isinstance(e, ssl.SSLError) or "tls" in str(e).lower()):
        return "the server requires TLS and credentials (`server --secure`): pass --auth-dir DIR or set GYM_AUTH_DIR"
    if isinstance(e, ssl.SSLCertVerificationError):
        return f"TLS: the server's certificate is not signed by our CA ({e.verify_message}; is --auth-dir's ca.pem this cluster's?)"
    text = str(e).strip().strip("'\"") or type(e).__name__
    low = text.lower()
    if "authorization" in low or "authentication" in low:
        return f"{text.removeprefix('nats: ').strip(chr(39))} (wrong or missing credentials: check --auth-dir / GYM_AUTH_DIR)"
    if isinstance(e, ssl.SSLError) or "tls" in low or "ssl" in low or "certificate" in low:
        return f"TLS handshake failed: {text} (is it a `server --secure` server? --auth-dir needs one)"
    return text


class _Throttle:
    """Say the same thing once, then at most every ``every_s``: a refusing server must not flood the log."""

    def __init__(self, every_s: float = 60.0) -> None:
        self.every_s = every_s
        self._last: dict[str, float] = {}

    def __call__(self, key: str) -> bool:
        now = time.monotonic()
        if now - self._last.get(key, -1e18) < self.every_s:
            return False
        self._last[key] = now
        return True


async def wait_reachable(servers: list[str], timeout: float | None) -> None:
    """Wait until one server accepts TCP, so a wrong URL fails clearly instead of retrying forever.

    ``timeout=None`` waits forever (long-lived workers may start before the server).
    """
    from urllib.parse import urlparse

    import anyio

    addrs = []
    for s in servers:
        u = urlparse(s if "://" in s else f"nats://{s}")
        addrs.append((u.hostname or "127.0.0.1", u.port or 4222))
    started = time.monotonic()
    deadline = None if timeout is None else started + timeout
    warned = False
    why: dict[tuple[str, int], str] = {}
    while True:
        for host, port in addrs:
            try:
                with anyio.fail_after(2.0):
                    stream = await anyio.connect_tcp(host, port)
                await stream.aclose()
                return
            except (OSError, TimeoutError) as e:
                why[(host, port)] = _tcp_reason(e, host, port)
                continue
        reason = "; ".join(dict.fromkeys(why.values()))
        if deadline is not None and time.monotonic() >= deadline:
            raise ServerUnreachable(f"cannot reach a NATS server at {_shown(servers)}: {reason} (waited {timeout:g}s)")
        if timeout is None and not warned and time.monotonic() - started >= WARN_UNREACHABLE_S:
            # a service reports it once, at warning, well within 15 s: a wrong URL must not look like a
            # slow start (a one-shot command ends with its own one-line error instead)
            log.warning(
                "nats.unreachable",
                servers=_shown(servers),
                reason=reason,
                waited_s=WARN_UNREACHABLE_S,
                still_trying=True,
            )
            warned = True
        await anyio.sleep(0.5)


def _tcp_reason(e: BaseException, host: str, port: int) -> str:
    """Why a TCP connect failed, in the words a user acts on: a name that does not resolve, a port nothing
    listens on, or no answer at all (a firewall, a wrong address)."""
    import socket

    cause = e.__cause__  # anyio: "All connection attempts failed", from the attempts' own errors
    if isinstance(cause, BaseExceptionGroup) and cause.exceptions:
        e = cause.exceptions[0]
    elif isinstance(cause, OSError):
        e = cause
    if isinstance(e, socket.gaierror) or "name or service not known" in str(e).lower():
        return f"the name {host!r} does not resolve"
    if isinstance(e, ConnectionRefusedError) or "refused" in str(e).lower():
        return f"connection refused, no server listens on {host}:{port}"
    if isinstance(e, TimeoutError):
        return f"no answer from {host}:{port} within 2s, a firewall or a wrong address"
    return f"{host}:{port}: {e.strerror if isinstance(e, OSError) and e.strerror else e}"


async def connect(
    url: str | list[str],
    *,
    name: str,
    on_reconnect: Callable[[], Awaitable[None]] | None = None,
    initial_timeout: float | None = -1.0,
    options: dict[str, Any] | None = None,
) -> NATS:
    """Connect with reconnect-forever: long-lived workers ride out server restarts.

    With ``initial_timeout`` (one-shot commands) the first connection must
    succeed within it: a refusal (authentication, TLS) ends it at once as
    ``ServerUnreachable`` naming the URL and the reason. With ``None`` (services)
    it retries forever, logging each distinct reason once and then every 60 s.
    ``options`` are extra ``nats.connect`` arguments (TLS context, nkey seed, inbox
    prefix: see ``gym_runtime.ops.security.ClientAuth``).
    """
    import anyio

    servers = server_list(url)
    shown = _shown(servers)
    throttle = _Throttle()
    state: dict[str, Any] = {"connected": False, "last": None}
    one_shot = initial_timeout is not None
    secured = bool(options and options.get("tls") is not None)

    async def on_error(e: Exception) -> None:
        if not state["connected"] and one_shot:
            state["last"] = e
            if _refusal(e):  # raised out of nats-py's first-connect loop: no retry
                raise ServerUnreachable(f"cannot connect to NATS at {shown}: {_reason(e, secured=secured)}") from e
            return  # e.g. a reset while the server closes on us: the next attempt says why
        if throttle(str(e)):
            log.warning("nats.error", error=_reason(e, secured=secured), client=name, servers=shown)

    async def on_disconnect() -> None:
        if throttle("disconnected"):
            log.info("nats.disconnected", client=name)

    async def reconnected() -> None:
        log.info("nats.reconnected", client=name)
        if on_reconnect is not None:
            await on_reconnect()

    if initial_timeout is not None and initial_timeout < 0:  # default: 10 s, or GYM_CONNECT_TIMEOUT_S
        initial_timeout = float(os.environ.get("GYM_CONNECT_TIMEOUT_S", "10"))
    if options and options.get("tls") is not None:
        _quiet_ssl_eof()
    t0 = time.monotonic()
    await wait_reachable(servers, initial_timeout)
    while True:
        nc = NATS()
        # nats-py can stall for good after a failed TLS handshake (it waits for a socket that never
        # closes): a one-shot command gives up at its deadline, a service starts a fresh client
        limit = ATTEMPT_S if initial_timeout is None else max(3.0, initial_timeout - (time.monotonic() - t0))
        try:
            with anyio.fail_after(limit):
                await nc.connect(
                    servers=servers,
                    name=name,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=0.25,  # type: ignore[arg-type]  # annotated int; sleeps a float
                    connect_timeout=5,
                    error_cb=on_error,
                    disconnected_cb=on_disconnect,
                    reconnected_cb=reconnected,
                    pending_size=64 * 1024 * 1024,
                    **(options or {}),
                )
            break
        except TimeoutError:
            with anyio.move_on_after(1.0, shield=True):
                await nc.close()
            if initial_timeout is not None:
                why = (
                    _reason(state["last"], secured=secured)
                    if state["last"]
                    else f"no NATS handshake within {limit:.0f}s"
                )
                raise ServerUnreachable(f"cannot connect to NATS at {shown}: {why}") from None
        except BaseException:
            with anyio.move_on_after(1.0, shield=True):
                await nc.close()
            raise
    state["connected"] = True
    return nc


class Bus:
    """A worker's view of NATS: namespaced subjects, codec, tracing, request-reply.

    Requests use one wildcard reply subscription per connection and a future per
    call (cheaper than nats-py's ``request``, and under our control): when the
    connection drops, every call in flight fails at once as retryable
    ``worker_lost`` instead of hanging until its timeout. Bodies larger than the
    server's max payload go through the JetStream Object Store by reference
    (``Gym-Blob`` header), transparently for senders and receivers.
    """

    def __init__(self, nc: NATS, *, namespace: str, telemetry: Telemetry, timings: Timings | None = None) -> None:
        self.nc = nc
        self.timings = timings or Timings()
        self.ns = namespace
        self.telemetry = telemetry
        self.codec = Codec()
        self.js = nc.jetstream()
        self._replies: dict[str, _Pending] = {}
        self._reply_prefix: str | None = None
        self._reply_seq = itertools.count()
        self._blobs_ready = False  # the blob stream exists (provisioned, or created on first use)
        self.secured = False  # a --secure bus: the admin provisioned the streams, no other role may create them
        self.max_blob_bytes = MAX_BLOB_BYTES
        # JetStreamConfig (replicas, retention) for what this client creates; None = defaults
        self.jetstream_config: Any = None
        self._background: set[asyncio.Future[None]] = set()  # resends after a reconnect
        self._direct_skip: dict[str, float] = {}  # direct subject -> use the queue until (monotonic)
        # requests that cannot be read or fail unexpectedly, counted per cause and logged at most once per
        # JUNK_LOG_S per cause (a flood of junk costs a counter each, not a log line or a traceback each)
        self.junk: dict[str, int] = {}
        self._junk_logged: dict[str, tuple[float, int]] = {}

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
        bus.secured = auth is not None and role != "admin"
        if auth is not None and role != "admin":  # the admin provisions; every other role needs it done
            try:
                await check_provisioned(bus.js, namespace, _shown(url if isinstance(url, list) else [url]))
            except BaseException:
                await bus.close()
                raise
        return bus

    def subject(self, *parts: str) -> str:
        return ".".join((self.ns, *parts))

    # ------------------------------------------------------------------ bodies

    @property
    def blob_threshold(self) -> int:
        return max(64 * 1024, (self.nc.max_payload or 1024 * 1024) - 64 * 1024)

    def _blob_subject(self, key: str, chunk: int) -> str:
        return f"{self.ns}.blob.{key}.{chunk}"

    async def _put_blob(self, data: bytes) -> str:
        """Store ``data`` as write-once chunks under a fresh key; returns the ``Gym-Blob`` header value.

        The header carries the chunk count and the body's SHA-256, so a reader checks
        that what it read is what the sender stored (a swapped body is refused).
        """
        if not self._blobs_ready:
            if not self.secured:
                await ensure_blob_stream(self)
            self._blobs_ready = True
        key = uuid.uuid4().hex
        size = self.blob_threshold
        chunks = [data[i : i + size] for i in range(0, len(data), size)] or [b""]

        async def put(i: int, chunk: bytes) -> None:
            subject = self._blob_subject(key, i)
            await self._store(subject, chunk, {MSG_ID_HEADER: subject})

        await asyncio.gather(*(put(i, c) for i, c in enumerate(chunks)))
        return f"{key}.{len(chunks)}.{hashlib.sha256(data).hexdigest()}"

    async def _get_blob(self, ref: str) -> bytes:
        """The body a ``Gym-Blob`` header refers to, checked against its digest (``integrity`` error if not)."""
        key, _, rest = ref.partition(".")
        n_text, _, digest = rest.partition(".")
        if not (key.isalnum() and n_text.isdigit() and len(digest) == 64):
            raise Failure("integrity", f"malformed {BLOB_HEADER} header")
        n = int(n_text)
        if n < 1 or (n - 1) * 64 * 1024 > self.max_blob_bytes:
            raise Failure("integrity", f"a referenced body of {n} chunks is over the {self.max_blob_bytes} B limit")
        api = f"$JS.API.DIRECT.GET.{blob_stream_name(self.ns)}."

        async def get(i: int) -> bytes:
            msg = await self.nc.request(api + self._blob_subject(key, i), b"", timeout=JS_ACK_TIMEOUT_S)
            if msg.headers and msg.headers.get("Status"):
                raise Failure("integrity", f"a referenced body's chunk {i} is missing (expired or never stored)")
            return msg.data

        parts = await asyncio.gather(*(get(i) for i in range(n)))
        data = b"".join(parts)
        if len(data) > self.max_blob_bytes:
            raise Failure("integrity", f"a referenced body of {len(data)} B is over the {self.max_blob_bytes} B limit")
        if hashlib.sha256(data).hexdigest() != digest:
            raise Failure("integrity", "a referenced body does not match the digest its message carries (tampered)")
        return data

    async def encode(self, payload: Any, headers: dict[str, str]) -> bytes:
        """Encode ``payload``; a body over the max payload is stored as a blob and referenced."""
        data = self.codec.encode(payload)
        if len(data) > self.blob_threshold:
            headers[BLOB_HEADER] = await self._put_blob(data)
            return b""
        return data

    async def decode(self, msg: Msg | Delivery) -> Any:
        headers = msg.headers
        if headers and BLOB_HEADER in headers:
            return self.codec.decode(await self._get_blob(headers[BLOB_HEADER]), headers)
        return self.codec.decode(msg.data, headers)

    # ------------------------------------------------------------------ client side

    def _headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        h: dict[str, str] = {}
        self.telemetry.inject(h)
        if extra:
            h.update(extra)
        return h

    async def _unwrap(self, msg: Msg, subject: str) -> Any:
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
            prefix = self.nc.new_inbox()
            self._reply_prefix = prefix
            replies = self._replies

            async def on_reply(msg: Msg) -> None:
                headers = msg.headers
                if headers and PROGRESS_HEADER in headers:
                    call = replies.get(msg.subject)
                    if call is not None:
                        call.seen = time.monotonic()
                    return
                call = replies.pop(msg.subject, None)
                if call is not None and not call.fut.done():
                    call.fut.set_result(msg)

            await self.nc.subscribe(prefix + ".>", cb=on_reply)
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

    def _clustered(self) -> bool:
        """Connected to a NATS cluster (replicated streams elect leaders), per config or server INFO."""
        if getattr(self.jetstream_config, "replicas", 1) > 1:
            return True
        info = getattr(self.nc, "_server_info", None) or {}  # nats-py keeps INFO here (no public accessor)
        return bool(info.get("cluster"))

    async def _resend(self, call: _Pending) -> None:
        assert call.resend is not None
        subject, data, headers = call.resend
        try:
            await self._store(subject, data, headers)
        except Exception as e:  # the caller's timeout still bounds the call
            log.warning("queued_call.resend_failed", subject=subject, error=repr(e))

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def fail_pending(self, reason: str) -> None:
        """Fail every core call in flight as retryable: its responder may never have got it."""
        for key, call in list(self._replies.items()):
            if call.resend is not None:
                continue
            del self._replies[key]
            fut = call.fut
            if not fut.done():
                fut.set_exception(Failure(ErrorInfo(error_class="worker_lost", message=reason, retryable=True)))

    def _lane(self, subject: str) -> str:
        """Which callee a reply subject is for (``res.{resource}`` or ``model.{model}``): on a secured bus a
        responder may publish only into its own lane, so no other node can answer this call."""
        t = subject.split(".", 5)
        if len(t) > 3 and t[0] == self.ns and t[1] in ("call", "ctl"):
            return f"{t[2]}.{t[3]}"  # {ns}.call.model.{m}, {ns}.ctl.model.{m}.pause
        if len(t) > 2 and t[0] == self.ns:
            return f"{t[1]}.{t[2]}"  # {ns}.model.{m}, {ns}.res.{r}.seed, {ns}.res.{r}.{worker}.{op}
        return "x.x"

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
    ) -> Any:
        prefix = self._reply_prefix or await self._ensure_reply_sub()
        reply = f"{prefix}.{self._lane(subject)}.{next(self._reply_seq)}"
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Msg] = loop.create_future()
        call = _Pending(fut, time.monotonic())
        self._replies[reply] = call
        headers: dict[str, str] = {}
        self.telemetry.inject(headers)
        if queued:
            # A reply subject on a stream publish would receive the stream's ack instead.
            headers[REPLY_HEADER] = reply
        if msg_id:
            headers[MSG_ID_HEADER] = msg_id
        # a queued request is redelivered by JetStream instead of watched for liveness
        call.watch(loop, subject, op, timeout, None if queued else (liveness or self.timings.liveness_s))
        try:
            data = await self.encode(payload, headers)
            if queued:
                call.resend = (subject, data, {k: v for k, v in headers.items() if k != MSG_ID_HEADER})
            if queued and self._clustered():  # stored with the stream's ack: a publish lost in a
                await self._store(subject, data, headers)  # leader election is retried
            elif queued:  # one server: nothing to elect; a restart is covered by after_reconnect
                await self.nc.publish(subject, data, headers=headers)
            else:
                await self.nc.publish(subject, data, reply=reply, headers=headers)
            msg = await fut
        finally:
            call.stop()
            self._replies.pop(reply, None)
        return await self._unwrap(msg, subject)

    async def request(
        self, subject: str, payload: Any, *, timeout: float, op: str, liveness_s: float | None = None
    ) -> Any:
        """Core request-reply with a CLIENT span; typed errors come back as ``Failure``.

        ``liveness_s`` (default ``timings.liveness_s``): how long the responder may stay silent (no reply,
        no keepalive) before the call fails as retryable ``worker_lost``."""
        if not self.telemetry.recording:  # no span to open or mark: the caller's context is current already
            return await self._call(
                subject, payload, timeout=timeout, op=op, queued=False, msg_id=None, liveness=liveness_s
            )
        with self.telemetry.span(
            f"{op} {subject}",
            kind=SpanKind.CLIENT,
            attributes={"messaging.system": "nats", "messaging.destination.name": subject},
        ) as span:
            try:
                return await self._call(
                    subject, payload, timeout=timeout, op=op, queued=False, msg_id=None, liveness=liveness_s
                )
            except Busy:
                raise
            except Failure as e:
                span.set_status(StatusCode.ERROR, e.info.message)
                raise

    async def direct_or_queued(
        self, direct: str, queued: str, payload: Any, *, timeout: float, op: str, liveness_s: float | None = None
    ) -> Any:
        """A call to a worker with a free slot right now over core NATS, else through the work queue.

        The direct try costs one round trip and no storage; the queue keeps what it
        always had: calls that must wait (every worker busy, paused, or none
        serving direct calls) wait there, visible to autoscalers, and a worker lost
        mid-call is not a failed call — the call goes to the queue, as a
        redelivery would. Errors of the call itself come back as they are.
        """
        now = time.monotonic()
        deadline = now + timeout
        if self._direct_skip.get(direct, 0.0) <= now:
            try:
                return await self.request(direct, payload, timeout=timeout, op=op, liveness_s=liveness_s)
            except Busy:
                self._direct_skip[direct] = time.monotonic() + DIRECT_BUSY_S
            except NoResponders:
                self._direct_skip[direct] = time.monotonic() + DIRECT_ABSENT_S
            except Failure as e:
                if e.info.error_class != "worker_lost":
                    raise
                log.info("direct_call.lost", subject=direct, error=e.info.message, then="queue")
        left = deadline - time.monotonic()
        if left <= 0:
            raise Failure(
                ErrorInfo(error_class="timeout", message=f"no reply to {op} within {timeout:g}s", retryable=True)
            )
        return await self.queued_request(queued, payload, timeout=left, op=op)

    async def queued_request(
        self, subject: str, payload: Any, *, timeout: float, op: str, msg_id: str | None = None
    ) -> Any:
        """Publish a request onto a JetStream work queue and wait for the core-NATS reply."""
        if not self.telemetry.recording:
            return await self._call(subject, payload, timeout=timeout, op=op, queued=True, msg_id=msg_id)
        with self.telemetry.span(
            f"publish {subject}",
            kind=SpanKind.PRODUCER,
            attributes={"messaging.system": "nats", "messaging.destination.name": subject, "gym.op": op},
        ) as span:
            try:
                return await self._call(subject, payload, timeout=timeout, op=op, queued=True, msg_id=msg_id)
            except Failure as e:
                span.set_status(StatusCode.ERROR, e.info.message)
                raise

    async def publish(self, subject: str, payload: Any, *, headers: dict[str, str] | None = None) -> None:
        h = self._headers(headers)
        await self.nc.publish(subject, await self.encode(payload, h), headers=h)

    async def js_publish(self, subject: str, payload: Any, *, msg_id: str) -> None:
        """Store a message in a stream (deduplicated by ``msg_id``); returns after the server's ack."""
        h = self._headers({MSG_ID_HEADER: msg_id})
        await self._store(subject, await self.encode(payload, h), h)

    async def _store(self, subject: str, data: bytes, headers: dict[str, str]) -> None:
        """Publish into a stream and wait for its ack, riding out a stream leader election.

        In a cluster a stream may be electing a new leader for a few seconds; a plain
        publish then is silently lost. Publishing again is safe: a msg id deduplicates.
        """
        give_up = time.monotonic() + JS_PUBLISH_RETRY_S
        delay = 0.1
        while True:
            try:
                await self._publish_acked(subject, data, headers)
                return
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError):
                if time.monotonic() + delay > give_up:
                    raise
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)

    async def _publish_acked(self, subject: str, data: bytes, headers: dict[str, str]) -> None:
        """One stream publish and its ack, through our reply subscription (nats-py's ``js.publish``
        costs a request machinery and a PubAck object per message). Raises what ``js.publish`` would."""
        prefix = self._reply_prefix or await self._ensure_reply_sub()
        reply = f"{prefix}.js.ack.{next(self._reply_seq)}"  # answered by the server itself
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Msg] = loop.create_future()
        self._replies[reply] = _Pending(fut, time.monotonic())
        timer = loop.call_later(JS_ACK_TIMEOUT_S, _no_ack, fut)
        try:
            await self.nc.publish(subject, data, reply=reply, headers=headers)
            msg = await fut
        except Failure:  # the connection dropped with the ack outstanding: publish again (deduplicated)
            raise nats.errors.TimeoutError from None
        finally:
            timer.cancel()
            self._replies.pop(reply, None)
        if msg.headers and msg.headers.get("Status") == "503":
            raise nats.js.errors.NoStreamResponseError
        ack = _pub_ack.decode(msg.data)
        if ack.error is not None:
            raise nats.js.errors.APIError.from_error(ack.error)

    async def flush(self) -> None:
        """Wait until the server has processed everything sent so far (e.g. new subscriptions)."""
        await self.nc.flush()

    async def scatter(self, subject: str, *, wait_s: float) -> list[bytes]:
        """Send an empty request to ``subject`` and gather every raw reply for ``wait_s`` seconds."""
        inbox = self.nc.new_inbox()
        replies: list[bytes] = []

        async def on_reply(msg: Msg) -> None:
            replies.append(msg.data)

        sub = await self.nc.subscribe(inbox, cb=on_reply)
        await self.nc.publish(subject, b"", reply=inbox)
        await self.nc.flush()
        await asyncio.sleep(wait_s)
        await sub.unsubscribe()
        return replies

    async def gather(
        self,
        subject: str,
        payload: Any,
        *,
        done: Callable[[list[Any]], bool],
        timeout: float,
    ) -> list[Any]:
        """Publish ``payload`` to every subscriber of ``subject``; collect decoded replies until
        ``done(replies)`` or ``timeout`` (control messages acknowledged by every replica)."""
        inbox = self.nc.new_inbox()
        replies: list[Any] = []
        finished = asyncio.Event()

        async def on_reply(msg: Msg) -> None:
            try:
                replies.append(await self.decode(msg))
            except Exception:  # a reply we cannot read counts as no reply
                return
            if done(replies):
                finished.set()

        sub = await self.nc.subscribe(inbox, cb=on_reply)
        try:
            h = self._headers()
            await self.nc.publish(subject, await self.encode(payload, h), reply=inbox, headers=h)
            if not done(replies):
                try:
                    await asyncio.wait_for(finished.wait(), timeout)
                except TimeoutError:
                    pass
        finally:
            await sub.unsubscribe()
        return replies

    async def raw_request(self, subject: str, data: bytes, *, timeout: float) -> bytes:
        """A plain core request (no envelope): for ``$SRV`` endpoints and other non-runtime peers."""
        return bytes((await self.nc.request(subject, data, timeout=timeout)).data)

    async def add_service(self, config: Any) -> Any:
        """Register a ``nats.micro`` service (discovery through ``$SRV.*``); returns it."""
        import nats.micro

        return await nats.micro.add_service(self.nc, config)

    # ------------------------------------------------------------------ server side

    async def reply(self, subject: str | None, payload: Any, *, error: bool = False) -> None:
        if not subject:
            return
        h = self._headers({ERROR_HEADER: "1"} if error else None)
        await self.nc.publish(subject, await self.encode(payload, h), headers=h)

    def count_junk(self, subject: str, cause: str, exc: BaseException | None = None) -> None:
        """Count a refused request under ``cause``; log the cause once per ``JUNK_LOG_S`` with how many came
        since (the first of a cause with its traceback when ``exc`` is an unexpected error)."""
        n = self.junk.get(cause, 0) + 1
        self.junk[cause] = n
        now = time.monotonic()
        last, logged_n = self._junk_logged.get(cause, (-1e18, 0))
        if now - last < JUNK_LOG_S:
            return
        self._junk_logged[cause] = (now, n)
        first = logged_n == 0
        log.warning(
            "requests.refused",
            subject=subject,
            cause=cause,
            count=n - logged_n,
            total=n,
            every_s=JUNK_LOG_S,
            exc_info=exc if first and exc is not None else None,
        )

    def _reply_bad_request(self, msg: Msg, exc: Exception) -> Awaitable[None] | None:
        self.count_junk(msg.subject, f"undecodable: {type(exc).__name__}")
        if msg.reply:  # a caller that made a mistake learns it at once; junk gets one small error back
            info = ErrorInfo(error_class="invalid_task", message=f"request cannot be decoded: {type(exc).__name__}")
            return self.nc.publish(msg.reply, self.codec.encode(ErrorReply(error=info)), headers={ERROR_HEADER: "1"})
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
            keepalive = (
                _Keepalive(self.nc, reply_to, self.timings.keepalive_s) if reply_to and msg.reply == reply_to else None
            )
            try:
                if body is _UNSET:
                    body = await self.decode(msg)
                result = await handler(body, msg)
            except Exception as exc:  # every failure becomes a typed reply, never a hang
                if keepalive:
                    keepalive.cancel()
                info = _error_info(exc, default_error)
                span.set_status(StatusCode.ERROR, info.message)
                if not isinstance(exc, Failure):  # counted, logged once per cause and interval
                    self.count_junk(msg.subject, f"handler: {type(exc).__name__}", exc)
                await self.reply(reply_to, ErrorReply(error=info), error=True)
                return False
            except BaseException:  # cancelled (the worker stops): no more "still working" for the caller,
                if keepalive:  # whose liveness then sends the call elsewhere
                    keepalive.cancel()
                raise
            if keepalive:
                keepalive.cancel()
            if result is not None:
                await self.reply(reply_to, result)
            return True

    async def busy(self, msg: Delivery) -> None:
        """Answer a request at once with "no free slot" (``Busy`` at the caller); nothing ran."""
        if msg.reply:
            await self.nc.publish(msg.reply, b"", headers={BUSY_HEADER: "1"})

    async def serve_direct(
        self,
        tg: TaskGroup,
        subject: str,
        *,
        queue: str,
        admit: Callable[[Delivery], bool],
        run: Callable[[Delivery], Coroutine[Any, Any, None]],
    ) -> Any:
        """Direct calls: a message ``admit`` takes (it reserves a slot) runs in its own task
        (``run`` answers it and frees the slot); any other is answered ``busy``.

        Before answering busy, the running calls get one turn of the event loop: calls read
        in one burst are admitted before any of their tasks has run, so a fast handler's slots
        may be held only by work that is about to finish (measured: 65% of a fast model's calls
        went to the queue at 256 in flight, against 0% with this turn). A slow handler's slots
        are still taken after the turn, and the call is refused as before.
        """
        tasks = TaskSet()
        tg.start_soon(tasks.guard)

        async def on_msg(msg: Msg) -> None:
            delivery = Delivery(msg)
            if not admit(delivery):
                await asyncio.sleep(0)
                if not admit(delivery):
                    await self.busy(delivery)
                    return
            tasks.spawn(run, delivery)

        return await self.nc.subscribe(subject, queue=queue, cb=on_msg)

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
        """Subscribe and run each message in its own task, at most ``concurrency`` at once.

        When all slots are busy the subscription's callback waits, so messages queue
        in the client (and, past its pending limits, the server) instead of piling up
        as tasks.
        """
        limiter = asyncio.Semaphore(concurrency)
        tasks = TaskSet()
        tg.start_soon(tasks.guard)

        async def run_one(msg: Msg, body: Any) -> None:
            try:
                await self.handle(Delivery(msg), handler, reply_to=msg.reply, default_error=default_error, body=body)
            finally:
                limiter.release()

        async def on_msg(msg: Msg) -> None:
            headers = msg.headers
            body = _UNSET
            if not (headers and BLOB_HEADER in headers):  # decoded here: junk costs no task, span or slot
                try:
                    body = self.codec.decode(msg.data, headers)
                except Exception as exc:
                    sent = self._reply_bad_request(msg, exc)
                    if sent is not None:
                        await sent
                    return
            await limiter.acquire()
            tasks.spawn(run_one, msg, body)

        return await self.nc.subscribe(subject, queue=queue, cb=on_msg)

    async def close(self) -> None:
        if not self.nc.is_closed:
            try:
                await self.nc.drain()
            except Exception:  # closing a dead connection is not an error worth raising
                await self.nc.close()
