"""A lean HTTP/1.1 client for plain-``http://`` model servers (vLLM, self-hosted endpoints).

Why it exists: every rollout makes its model calls over HTTP, and at 256 calls in
flight against a zero-latency server aiohttp's client spends about 130 µs of CPU
per call; this one about 30 µs (``tests/bench/instructions.py --model http``
shows the effect on a whole rollout). It does only what those calls need:

* one request at a time per connection, kept alive and reused (LIFO, so a few
  warm connections serve a light load); at most ``limit`` connections;
* responses framed by ``Content-Length``, ``Transfer-Encoding: chunked`` or the
  server closing the connection; ``1xx`` interim answers skipped; ``Connection:
  close`` and HTTP/1.0 honoured;
* a reused connection that the server closed while it sat idle (uvicorn, which
  vLLM runs on, closes idle ones after 5 s) is retried once on a new connection
  when no byte of the answer had arrived.

What it does not do: TLS, proxies, redirects, cookies, compression (it asks for
none). ``transport.PlainHTTP`` keeps aiohttp for ``https://`` URLs and proxies.
Deadlines are the caller's (``anyio.fail_after``): a call cancelled mid-answer
closes its connection, so no late bytes reach the next call.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Mapping

MAX_HEAD = 64 * 1024  # bytes of status line + headers we accept


class ProtocolError(ConnectionError):
    """The server's answer is not HTTP/1.1 we can read (or it closed mid-answer)."""


class Response:
    """An answer: status, headers (lower-case names; repeats joined by ``, ``), body."""

    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body


def encode_headers(headers: Mapping[str, str]) -> bytes:
    """``Name: value\\r\\n`` lines; a CR, LF or NUL in a name or value is refused (header injection)."""
    out = []
    for name, value in headers.items():
        if any(c in name for c in "\r\n\0:") or any(c in value for c in "\r\n\0"):
            raise ValueError(f"HTTP header {name!r} holds a forbidden character")
        out.append(f"{name}: {value}\r\n")
    return "".join(out).encode("latin-1")


_HEAD, _LENGTH, _CHUNKED, _TO_CLOSE, _DONE = range(5)


class _Connection(asyncio.Protocol):
    """One TCP connection; parses one answer at a time into ``self.waiter``."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.waiter: asyncio.Future[Response] | None = None
        self.got_bytes = False  # any byte of the current answer arrived
        self.counted = True  # in its pool's count of open connections
        self._buf = bytearray()
        self._reset()

    def _reset(self) -> None:
        self._state = _HEAD
        self._status = 0
        self._headers: dict[str, str] = {}
        self._keep_alive = True
        self._remaining = 0
        self._chunks: list[bytes] = []

    # ------------------------------------------------------------ asyncio hooks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        if self.waiter is None or self.waiter.done():  # bytes nobody asked for: unusable
            self.close()
            return
        self._buf += data
        try:
            self._parse()
        except ProtocolError as e:
            self._fail(e)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is None or self.waiter.done():
            return
        if self._state == _TO_CLOSE and exc is None:
            self._finish(bytes(self._buf))
            return
        why = f": {exc}" if exc else ""
        self.waiter.set_exception(ProtocolError(f"the server closed the connection before its answer ended{why}"))

    # ------------------------------------------------------------------ calls

    def send(self, data: bytes) -> asyncio.Future[Response]:
        assert self.transport is not None
        self._reset()
        self.got_bytes = False
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return self.waiter

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    # ---------------------------------------------------------------- parsing

    def _parse(self) -> None:
        buf = self._buf
        while True:
            if self._state == _HEAD:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(buf) > MAX_HEAD:
                        raise ProtocolError(f"the answer's headers exceed {MAX_HEAD} bytes")
                    return
                self._read_head(bytes(buf[:end]))
                del buf[: end + 4]
                if self._state == _DONE:
                    self._finish(b"")
                    return
            elif self._state == _LENGTH:
                if len(buf) < self._remaining:
                    return
                body = bytes(buf[: self._remaining])
                del buf[: self._remaining]
                self._finish(body)
                return
            elif self._state == _CHUNKED:
                if not self._read_chunk():
                    return
                if self._state == _DONE:
                    self._finish(b"".join(self._chunks))
                    return
            else:  # _TO_CLOSE: the body is whatever arrives until the server closes
                return

    def _read_head(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or parts[0] not in ("HTTP/1.1", "HTTP/1.0") or not parts[1].isdigit():
            raise ProtocolError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        status = int(parts[1])
        if 100 <= status < 200:  # interim answer (100 Continue): the real one follows
            return
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep or not name or name != name.strip():
                raise ProtocolError(f"malformed header line {line[:80]!r}")
            name = name.lower()
            value = value.strip()
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        self._status = status
        self._headers = headers
        connection = headers.get("connection", "").lower()
        self._keep_alive = "close" not in connection if parts[0] == "HTTP/1.1" else "keep-alive" in connection
        if status in (204, 304):
            self._state = _DONE
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            self._state = _CHUNKED
            self._remaining = -1  # next: a chunk-size line
        elif "content-length" in headers:
            length = headers["content-length"]
            if not length.isdigit():
                raise ProtocolError(f"bad Content-Length {length[:40]!r}")
            self._remaining = int(length)
            self._state = _LENGTH if self._remaining else _DONE
        else:
            self._state = _TO_CLOSE
            self._keep_alive = False

    def _read_chunk(self) -> bool:
        """Consume one chunk-size line, chunk or trailer section; False when more bytes are needed."""
        buf = self._buf
        if self._remaining == -1:  # a size line
            end = buf.find(b"\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD:
                    raise ProtocolError("a chunk-size line is too long")
                return False
            size = bytes(buf[:end]).split(b";", 1)[0].strip()
            try:
                n = int(size, 16)
            except ValueError:
                raise ProtocolError(f"bad chunk size {size[:20]!r}") from None
            if n < 0:
                raise ProtocolError("negative chunk size")
            del buf[: end + 2]
            self._remaining = n if n else -2
            return True
        if self._remaining == -2:  # trailers, up to an empty line
            end = buf.find(b"\r\n")
            if end < 0:
                return False
            del buf[: end + 2]
            if end == 0:
                self._state = _DONE
            return True
        if len(buf) < self._remaining + 2:
            return False
        if buf[self._remaining : self._remaining + 2] != b"\r\n":
            raise ProtocolError("a chunk does not end with CRLF")
        self._chunks.append(bytes(buf[: self._remaining]))
        del buf[: self._remaining + 2]
        self._remaining = -1
        return True

    def _finish(self, body: bytes) -> None:
        if not self._keep_alive or self._buf:  # bytes past the answer: do not reuse
            self.close()
        assert self.waiter is not None
        self.waiter.set_result(Response(self._status, self._headers, body))

    def _fail(self, err: Exception) -> None:
        self.close()
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(err)


class ConnectionPool:
    """Keep-alive connections to one ``host:port``; ``request`` sends one call and reads its answer."""

    def __init__(self, host: str, port: int, *, limit: int = 100) -> None:
        self.host = host
        self.port = port
        self.limit = max(1, limit)
        self._idle: list[_Connection] = []
        self._open = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._host_line = f"Host: {host if ':' not in host else f'[{host}]'}:{port}\r\n".encode("latin-1")

    @property
    def open_connections(self) -> int:
        return self._open

    async def request(self, method: str, target: str, headers: bytes, body: bytes) -> Response:
        """``headers``: from ``encode_headers`` (Host and Content-Length are added here)."""
        data = b"".join(
            (
                f"{method} {target} HTTP/1.1\r\n".encode("latin-1"),
                self._host_line,
                headers,
                b"Content-Length: %d\r\n\r\n" % len(body),
                body,
            )
        )
        conn, reused = await self._checkout()
        try:
            try:
                response = await conn.send(data)
            except ProtocolError:
                if not (reused and not conn.got_bytes):
                    raise
                # The server closed this idle connection as we sent: once more on a new one.
                self._discard(conn)
                conn, reused = await self._connect(), False
                response = await conn.send(data)
        except BaseException:
            conn.close()
            self._discard(conn)
            raise
        self._checkin(conn)
        return response

    async def aclose(self) -> None:
        """Close the idle connections; a call still running keeps its connection until it ends."""
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
            self._discard(conn)

    # ------------------------------------------------------------ the pool

    async def _checkout(self) -> tuple[_Connection, bool]:
        """An idle connection (reused: True) or a new one; waits while ``limit`` are open."""
        while True:
            while self._idle:
                conn = self._idle.pop()
                if not conn.closed:
                    return conn, True
                self._discard(conn)
            if self._open < self.limit:
                return await self._connect(), False
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._wake()  # woken and cancelled: pass the turn on
                elif waiter in self._waiters:
                    self._waiters.remove(waiter)
                raise

    async def _connect(self) -> _Connection:
        self._open += 1
        try:
            _, conn = await asyncio.get_running_loop().create_connection(_Connection, self.host, self.port)
        except BaseException:
            self._open -= 1
            self._wake()
            raise
        return conn

    def _checkin(self, conn: _Connection) -> None:
        if conn.closed:
            self._discard(conn)
            return
        self._idle.append(conn)
        self._wake()

    def _discard(self, conn: _Connection) -> None:
        """Forget a connection that is closed (count it once)."""
        if not conn.counted:
            return
        conn.counted = False
        self._open -= 1
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
