"""Connecting to NATS: server lists, waiting for a server that is not up yet, and saying why not.

A long-lived worker waits for its server forever (logging why, once); a one-shot command gives
up after its timeout with one line that tells a refused connection from a name that does not
resolve, a TLS or credentials problem, or a server that never answers.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import _SUBJECT_INVALID_RE as _BAD_SUBJECT
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from gym_runtime.errors import AuthError, UserError
from gym_runtime.observability import logs
from gym_runtime.transport.header_block import HeaderBlock
from gym_runtime.transport.interface import INLINE
from gym_runtime.transport.protocol_reader import ProtocolReader
from gym_runtime.transport.subjects import Subjects

log = logs.get("gym.bus")


ATTEMPT_S = 30.0  # a service's connect attempt that has not succeeded by then starts over with a fresh client
# Pings, both ways: a client leaves a server that answers none for (PING_MAX + 1) x PING_INTERVAL_S (a frozen node
# of a cluster: the client moves to a live one), and ``EmbeddedServer`` drops a client that answers none as soon
# (a frozen worker leaves its queue groups). NATS's default, 2 min x 2, kept either for 4-6 min.
PING_INTERVAL_S = 5
PING_MAX = 3


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
                f"--nats {shown_servers([s])}: not a NATS URL (expected nats://HOST:4222"
                f"{'; http:// is the monitoring port, for health --monitor' if scheme.startswith('http') else ''})"
            )
    return servers


WARN_UNREACHABLE_S = 8.0  # a long-lived worker still without a server after this logs a warning
# then it says it is still waiting at doubling intervals (16 s, 32 s, ... after the first, at most every 10 min):
# a wait that goes on is seen to go on, and a night's wait is a handful of lines, not one per try
STILL_UNREACHABLE_MAX_S = 600.0
DEAD_BUS_FIX = "; start one (`gym-runtime server`), or give --nats the URL of a running one"  # a one-shot's line
UNREACHABLE_HINT = (
    "start one (`gym-runtime server`, or the cluster's), or point this at a running one: --nats URL, the config's "
    "`nats`, or GYM_NATS; the workers start once it answers"
)


class NotProvisioned(AuthError):
    """A secured server that does not serve the namespace (not one of its ``--namespace``, or not provisioned yet)."""


class JetStreamNotReady(UserError):
    """JetStream does not answer yet: a cluster without a meta leader (fewer than a quorum of nodes up)."""


# How long a client waits for a cluster's JetStream to answer before it says so. A node lost with the meta
# leader is noticed after NATS's lost-quorum interval (10 s), an election takes 4-9 s, and a node that rejoins
# meanwhile can call another: on a loaded 2-core machine that passed 20 s (a collector started as a node was
# killed, in CI), while the workers' rollouts, which need only their streams' leaders, went on.
JETSTREAM_ANSWER_S = 60.0


async def check_provisioned(js: Any, namespace: str, shown: str, *, within_s: float = JETSTREAM_ANSWER_S) -> None:
    """Fail clearly when the secured server was not started for ``namespace``.

    Its roles may use only the subjects of the namespaces it provisioned; anything else
    would be refused request by request, as timeouts. A cluster still electing its JetStream
    leader is waited for ``within_s`` seconds, then said in one line.
    """
    started = time.monotonic()
    give_up, warned = started + within_s, False
    while True:
        try:
            # the blob stream is provisioned last: once it is there, so is everything else
            await js.find_stream_name_by_subject(Subjects(namespace).blob_probe)
            return
        except nats.js.errors.NotFoundError:
            raise NotProvisioned(
                f"the secured server at {shown} does not serve namespace {namespace!r}: start it with "
                f"`gym-runtime server --secure DIR --namespace {namespace}` (repeatable); a cluster's servers "
                "provision it once enough nodes are up for its replicas, and say so"
            ) from None
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.js.errors.ServiceUnavailableError) as e:
            said = getattr(e, "description", None) or str(e) or type(e).__name__
            now = time.monotonic()
            if not warned and now - started >= WARN_UNREACHABLE_S:  # said once: a wait, not a hang
                log.warning("jetstream.unanswered", servers=shown, reason=said, still_trying_s=round(give_up - now))
                warned = True
            if now >= give_up:
                raise JetStreamNotReady(
                    f"JetStream at {shown} does not answer yet ({said}): a cluster answers once a quorum of its "
                    "nodes is up"
                ) from None
            await anyio.sleep(0.5)


def unanswered(exc: BaseException) -> bool:
    """True for a request that got no answer in time (e.g. one the server's permissions dropped)."""
    return isinstance(exc, nats.errors.TimeoutError)


def jetstream_unavailable(exc: BaseException) -> bool:
    """True for JetStream's own "temporarily unavailable" (a cluster without a leader for what was asked),
    still said after the call's retries: the cluster's state, not a bug of ours."""
    return isinstance(exc, nats.js.errors.ServiceUnavailableError)


class ServerUnreachable(UserError, ConnectionError):
    """No NATS server of the given URLs accepted a connection in time."""


def shown_servers(servers: list[str]) -> str:
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
        return (
            f"TLS: the server's certificate is not signed by our CA ({e.verify_message}; "
            "is --auth-dir's ca.pem this cluster's?)"
        )
    text = str(e).strip().strip("'\"") or type(e).__name__
    low = text.lower()
    if "authorization" in low or "authentication" in low:
        said = text.removeprefix("nats: ").strip(chr(39))
        return f"{said} (wrong or missing credentials: check --auth-dir / GYM_AUTH_DIR)"
    if isinstance(e, ssl.SSLError) or "tls" in low or "ssl" in low or "certificate" in low:
        return f"TLS handshake failed: {text} (is it a `server --secure` server? --auth-dir needs one)"
    return text


_QUOTED = re.compile(r'"[^"]*"')
_STATUS_AT = len(b"NATS/1.0")  # a space there: an inline status follows (``NATS/1.0 404 No Messages``)
_SPACE = ord(" ")
_LINES_AT = len(b"NATS/1.0\r\n")


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


class Client(NATS):
    """nats-py's client, where a PONG for a PING nobody waits for any more is taken quietly, and a message's
    headers are written and read by ``HeaderBlock`` (nats-py's rules, a name checked once per connection).

    ``flush`` cancels its PING's future when it is timed out or cancelled (a close that drains while a PING is
    out, a cancelled request); nats-py then sets the result of that cancelled future when the PONG comes, and
    the ``InvalidStateError`` ends its read loop with an "encountered error" traceback on stderr (a good run
    that reads as a crash, and a connection that reads nothing more). Each PONG still answers the oldest PING."""

    def __init__(self) -> None:
        super().__init__()
        self._header_block = HeaderBlock()
        self._ps = ProtocolReader(self)
        self._inline: dict[int, Callable[[Msg], None]] = {}  # by sid: callbacks called as a message is read
        self._kicked: asyncio.Future[None] | None = None  # ``_kick``
        self._heard: set[asyncio.Future[None]] = set()  # inline callbacks' errors on their way to the error callback

    async def subscribe(  # type: ignore[override]
        self, subject: str, queue: str = "", cb: Callable[[Msg], Awaitable[None]] | None = None, **kw: Any
    ) -> Subscription:
        """nats-py's, where a callback marked ``interface.inline`` is called as each message is read."""
        sub = await super().subscribe(subject, queue, cb, **kw)
        fn = getattr(cb, INLINE, None)
        if fn is not None:
            self._inline[sub._id] = fn
        return sub

    def _remove_sub(self, sid: int, max_msgs: int = 0) -> None:
        self._inline.pop(sid, None)
        super()._remove_sub(sid, max_msgs)

    def take_now(self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None) -> bool:
        """Hand a message for an inline callback to it as it is read (``ProtocolReader`` asks first): True when
        taken; False (nothing done) for any other message, or one with an inline status, for ``_process_msg``."""
        fn = self._inline.get(sid)
        if fn is None:
            return False
        if headers:
            if len(headers) <= _STATUS_AT or headers[_STATUS_AT] == _SPACE:
                return False
            read: dict[str, str] | None = self._header_block.parse(headers[_LINES_AT:]) or None
        else:
            read = None
        stats = self.stats
        stats["in_msgs"] += 1
        stats["in_bytes"] += len(data)
        msg = self.msg_class(
            subject=subject.decode(), reply=reply.decode(), data=data, headers=read, _client=self, _sid=sid
        )
        try:
            fn(msg)
        except Exception as e:  # as nats-py treats a callback's error: the connection's error callback hears it
            task: asyncio.Future[None] = asyncio.ensure_future(self._error_cb(e))
            self._heard.add(task)
            task.add_done_callback(self._heard.discard)
        return True

    async def _process_msg(self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes) -> None:
        """nats-py's, but a message for an inline callback is handed to it here, no queue and no task between."""
        fn = self._inline.get(sid)
        if fn is None:
            await super()._process_msg(sid, subject, reply, data, headers)
            return
        self.stats["in_msgs"] += 1
        self.stats["in_bytes"] += len(data)
        msg = self._build_message(sid, subject, reply, data, await self._process_headers(headers))
        try:
            fn(msg)
        except Exception as e:  # as nats-py treats a callback's error: the connection's error callback hears it
            await self._error_cb(e)

    async def publish(
        self, subject: str, payload: bytes = b"", reply: str = "", headers: dict[str, str] | None = None
    ) -> None:
        """nats-py's (2.16) in one call, where it takes ten a message (``publish``, its subject checks and state
        properties, ``_send_publish``, ``hpub_cmd``, ``_send_command``), the header block written by
        ``HeaderBlock``: the same checks in the same order, the same errors, the same bytes on the wire
        (``tests/test_header_block.py``)."""
        if not subject:
            raise nats.errors.BadSubjectError
        if not self._skip_subject_validation and (
            _BAD_SUBJECT.search(subject) or (reply and _BAD_SUBJECT.search(reply))
        ):
            raise nats.errors.BadSubjectError
        status = self._status
        if status == NATS.CLOSED:
            raise nats.errors.ConnectionClosedError
        if status == NATS.DRAINING_PUBS:
            raise nats.errors.ConnectionDrainingError
        size = len(payload)
        if status != NATS.CONNECTED and status != NATS.DRAINING_SUBS:  # reconnecting: buffered, within its limit
            if self._max_pending_size <= 0 or size + self._pending_data_size > self._max_pending_size:
                raise nats.errors.OutboundBufferLimitError
        if size > self._max_payload:
            raise nats.errors.MaxPayloadError
        if headers is None:
            cmd = f"PUB {subject} {reply} {size}\r\n".encode() + payload + b"\r\n"
        else:
            hdr = self._header_block.encode(headers)
            cmd = f"HPUB {subject} {reply} {len(hdr)} {len(hdr) + size}\r\n".encode() + hdr + payload + b"\r\n"
        stats = self.stats
        stats["out_msgs"] += 1
        stats["out_bytes"] += size
        self._pending.append(cmd)
        self._pending_data_size += len(cmd)
        if self._max_pending_size > 0 and self._pending_data_size > self._max_pending_size:
            await self._flush_pending(force_flush=True)
        queue = self._flush_queue
        if queue is not None and queue.empty():
            flusher = self._flusher_task
            if status == NATS.CONNECTED and flusher is not None and not flusher.done():
                # the flusher's wake-up: a future already done (nobody waits on it), not a new one each time
                queue.put_nowait(self._kick())
            else:  # reconnecting, or no flusher: nats-py's own way
                await self._flush_pending()

    def _kick(self) -> asyncio.Future[None]:
        """A done future for the flusher's queue, one per connection (it runs on one loop; the flusher sets a result
        only on one that is not done)."""
        kick = self._kicked
        if kick is None:
            kick = self._kicked = asyncio.get_running_loop().create_future()
            kick.set_result(None)
        return kick

    def _parse_header_lines(self, raw: bytes) -> dict[str, str]:  # type: ignore[override]
        return self._header_block.parse(raw)

    async def _process_headers(self, headers: bytes | None) -> dict[str, str] | None:
        """nats-py's, where a block without an inline status (``NATS/1.0 503``) is read in one step."""
        if not headers or len(headers) <= _STATUS_AT or headers[_STATUS_AT] == _SPACE:
            return await super()._process_headers(headers)
        return self._header_block.parse(headers[_LINES_AT:]) or None

    async def _process_pong(self) -> None:
        if self._pongs:
            future = self._pongs.pop(0)
            if not future.done():
                future.set_result(True)
            self._pongs_received += 1
            self._pings_outstanding = 0


def connect_timeout_s() -> float:
    """How long a one-shot command tries to reach its server: 10 s, or ``GYM_CONNECT_TIMEOUT_S``."""
    return float(os.environ.get("GYM_CONNECT_TIMEOUT_S", "10"))


async def wait_reachable(
    servers: list[str], timeout: float | None, on_wait: Callable[[str], None] | None = None
) -> None:
    """Wait until one server accepts TCP, so a wrong URL fails clearly instead of retrying forever.

    ``timeout=None`` waits forever (long-lived workers may start before the server). ``on_wait`` is told
    once, when the first try fails, what is being tried and for how long (a command's user, at once).
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
    next_say, every = started + WARN_UNREACHABLE_S, WARN_UNREACHABLE_S  # a service's: when, and the gap after it
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
        if on_wait is not None:
            until = "" if timeout is None else f" for up to {timeout:g}s (GYM_CONNECT_TIMEOUT_S)"
            on_wait(f"no NATS server answers at {shown_servers(servers)} yet ({reason}); trying again{until}")
            on_wait = None
        if deadline is not None and time.monotonic() >= deadline:
            raise ServerUnreachable(
                f"cannot reach a NATS server at {shown_servers(servers)}: {reason} (waited {timeout:g}s){DEAD_BUS_FIX}"
            )
        now = time.monotonic()
        if timeout is None and now >= next_say:
            # a service says it at warning well within 15 s, with what to do: a wrong URL must not look like a slow
            # start (a one-shot command ends with its own one-line error instead); then that it still waits, at
            # doubling intervals
            event = "nats.still_unreachable" if warned else "nats.unreachable"
            log.warning(
                event,
                servers=shown_servers(servers),
                reason=reason,
                waited_s=round(now - started),
                still_trying=True,
                hint=UNREACHABLE_HINT,
            )
            warned = True
            every = min(every * 2, STILL_UNREACHABLE_MAX_S)
            next_say = now + every
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
    shown = shown_servers(servers)
    throttle = _Throttle()
    state: dict[str, Any] = {"connected": False, "last": None}
    one_shot = initial_timeout is not None
    secured = bool(options and options.get("tls") is not None)

    async def on_error(e: Exception) -> None:
        if isinstance(e, nats.errors.DrainTimeoutError):  # a close that stops waiting for handlers: it goes on
            return
        if not state["connected"] and one_shot:
            state["last"] = e
            if _refusal(e):  # raised out of nats-py's first-connect loop: no retry
                raise ServerUnreachable(f"cannot connect to NATS at {shown}: {_reason(e, secured=secured)}") from e
            return  # e.g. a reset while the server closes on us: the next attempt says why
        # keyed without the subject: refusals of many subjects (a flood of requests whose replies the server
        # refuses) are one line per interval, not one per subject
        if throttle(_QUOTED.sub('"…"', str(e))):
            log.warning("nats.error", error=_reason(e, secured=secured), client=name, servers=shown)

    async def on_disconnect() -> None:
        state.setdefault("lost_at", time.monotonic())  # the first of this outage's (nats-py may say it again)
        if throttle("disconnected"):
            log.info("nats.disconnected", client=name)

    async def reconnected() -> None:
        # a warning, once per reconnect: a command at warning level showed the loss (``nats.error``) and never
        # that its connection came back
        lost_at = state.pop("lost_at", None)
        down = {} if lost_at is None else {"after_s": round(time.monotonic() - lost_at, 1)}
        log.warning("nats.reconnected", client=name, servers=shown, **down)
        if on_reconnect is not None:
            await on_reconnect()

    if initial_timeout is not None and initial_timeout < 0:  # default: 10 s, or GYM_CONNECT_TIMEOUT_S
        initial_timeout = connect_timeout_s()
    if options and options.get("tls") is not None:
        _quiet_ssl_eof()
    t0 = time.monotonic()
    await wait_reachable(servers, initial_timeout)
    while True:
        nc = Client()
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
                    # a server that answers no ping for 15-20 s is left for another of the cluster (nats-py's
                    # default, 2 min x 2, kept a client on a frozen node for 4-6 min)
                    ping_interval=PING_INTERVAL_S,
                    max_outstanding_pings=PING_MAX,
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
