"""The lean HTTP/1.1 client (``gym_runtime.models.http1``) against real sockets.

Each test starts a real asyncio TCP server that answers with exactly the bytes
the test scripts (the framings servers really use, and the ways they misbehave),
and checks what a caller of the model adapters would see.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
import pytest

from gym_runtime.errors import ModelError
from gym_runtime.models import http1
from gym_runtime.models.openai import Options, make_pool
from gym_runtime.models.openai_http import PlainHTTP
from tests.helpers import eventually

Handler = Callable[[bytes, asyncio.StreamWriter], Awaitable[bool]]  # request body -> keep the connection?


class Server:
    """A loopback HTTP server whose answers are scripted bytes; counts connections."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.open = 0
        self.most_open = 0
        self.requests: list[tuple[str, dict[str, str], bytes]] = []
        self.port = 0

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
                headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:] if line)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                self.requests.append((head[0], headers, body))
                if not await self.handler(body, writer):
                    break
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.open -= 1
            writer.close()


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Handler], Awaitable[Server]]]:
    servers: list[asyncio.Server] = []

    async def start(handler: Handler) -> Server:
        s = Server(handler)
        srv = await asyncio.start_server(s._client, "127.0.0.1", 0)
        s.port = srv.sockets[0].getsockname()[1]
        servers.append(srv)
        return s

    yield start
    for srv in servers:
        srv.close()


def echo(body: bytes) -> bytes:
    return json.dumps({"echo": body.decode()}).encode()


async def length_framed(body: bytes, w: asyncio.StreamWriter) -> bool:
    data = echo(body)
    w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
    return True


async def call(pool: http1.ConnectionPool, body: bytes = b"{}") -> http1.Response:
    return await pool.request("POST", "/v1/responses", http1.encode_headers({"Content-Type": "application/json"}), body)


async def test_keep_alive_reuses_one_connection_and_sends_host_and_length(serve) -> None:
    server = await serve(length_framed)
    pool = http1.ConnectionPool("127.0.0.1", server.port, limit=8)
    for i in range(5):
        r = await call(pool, b'{"n": %d}' % i)
        assert r.status == 200 and json.loads(r.body) == {"echo": '{"n": %d}' % i}
        assert r.headers["content-type"] == "application/json"
    assert server.connections == 1
    line, headers, _ = server.requests[0]
    assert line == "POST /v1/responses HTTP/1.1"
    assert headers["host"] == f"127.0.0.1:{server.port}" and headers["content-length"] == "8"
    await pool.aclose()
    assert pool.open_connections == 0
    await eventually(lambda: server.open == 0)  # the server saw it close


@pytest.mark.parametrize(
    "framing", ["chunked", "to-close", "connection-close", "http/1.0", "interim-100", "byte-by-byte", "no-content"]
)
async def test_every_framing_servers_use_is_read_whole(serve, framing: str) -> None:
    async def handler(body: bytes, w: asyncio.StreamWriter) -> bool:
        data = echo(body)
        if framing == "chunked":
            # two chunks, a chunk extension and a trailer
            half = len(data) // 2
            w.write(
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                + b"%x;ext=1\r\n%s\r\n" % (half, data[:half])
                + b"%x\r\n%s\r\n" % (len(data) - half, data[half:])
                + b"0\r\nX-Trailer: t\r\n\r\n"
            )
            return True
        if framing == "to-close":
            w.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + data)
            return False
        if framing == "connection-close":  # says it will close, but leaves the socket open
            w.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
            return True
        if framing == "http/1.0":
            w.write(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
            return False
        if framing == "interim-100":
            w.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await w.drain()
            return await length_framed(body, w)
        if framing == "byte-by-byte":
            raw = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(data) + data
            for i in range(len(raw)):
                w.write(raw[i : i + 1])
                await w.drain()
                await asyncio.sleep(0)
            return True
        w.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        return True

    server = await serve(handler)
    pool = http1.ConnectionPool("127.0.0.1", server.port)
    for i in range(3):
        r = await call(pool, b'"%d"' % i)
        if framing == "no-content":
            assert (r.status, r.body) == (204, b"")
        else:
            assert r.status == 200 and json.loads(r.body) == {"echo": '"%d"' % i}
    # the server said it would close (or did): a new connection each time; else one
    assert server.connections == (3 if framing in ("to-close", "connection-close", "http/1.0") else 1)
    await pool.aclose()


async def test_a_kept_connection_the_server_dropped_while_idle_is_replaced(serve) -> None:
    """The server closes the connection after answering, without saying so (an idle timeout)."""

    async def once(body: bytes, w: asyncio.StreamWriter) -> bool:
        await length_framed(body, w)
        return False

    server = await serve(once)
    pool = http1.ConnectionPool("127.0.0.1", server.port)
    for i in range(3):
        assert json.loads((await call(pool, b"%d" % i)).body) == {"echo": str(i)}
        await eventually(lambda: server.open == 0)  # the server has dropped it: idle, before the next call
    assert server.connections == 3


async def test_a_kept_connection_closed_as_the_request_goes_out_is_retried_once(serve) -> None:
    """The race behind idle timeouts: the server closes on receiving the next request, answering nothing."""
    seen = 0

    async def first_only(body: bytes, w: asyncio.StreamWriter) -> bool:
        nonlocal seen
        seen += 1
        if seen % 2 == 0:
            return False  # read the request, close without a byte
        return await length_framed(body, w)

    server = await serve(first_only)
    pool = http1.ConnectionPool("127.0.0.1", server.port)
    assert json.loads((await call(pool, b"1")).body) == {"echo": "1"}
    assert json.loads((await call(pool, b"2")).body) == {"echo": "2"}  # dropped once, retried on a new connection
    assert server.connections == 2 and seen == 3


async def test_a_fresh_connection_closed_mid_answer_is_an_error_not_a_retry(serve) -> None:
    async def cut(body: bytes, w: asyncio.StreamWriter) -> bool:
        w.write(b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"partial')
        return False

    server = await serve(cut)
    pool = http1.ConnectionPool("127.0.0.1", server.port)
    with pytest.raises(http1.ProtocolError, match="closed the connection before its answer ended"):
        await call(pool)
    assert len(server.requests) == 1
    assert pool.open_connections == 0


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP/1.x status line"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\n\r\n", "bad Content-Length"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "malformed header line"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "bad chunk size"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabcd\r\n", "does not end with CRLF"),
        (b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * (http1.MAX_HEAD + 10), "headers exceed"),
    ],
)
async def test_a_malformed_answer_is_a_clear_error_and_the_connection_is_dropped(
    serve, answer: bytes, error: str
) -> None:
    async def bad(body: bytes, w: asyncio.StreamWriter) -> bool:
        w.write(answer)
        await w.drain()
        await asyncio.sleep(1)
        return False

    server = await serve(bad)
    pool = http1.ConnectionPool("127.0.0.1", server.port)
    with pytest.raises(http1.ProtocolError, match=error):
        await call(pool)
    assert pool.open_connections == 0


async def test_a_call_cancelled_mid_answer_leaves_no_late_bytes_for_the_next(serve) -> None:
    async def slow_first(body: bytes, w: asyncio.StreamWriter) -> bool:
        if body == b'"slow"':
            await asyncio.sleep(0.3)
        return await length_framed(body, w)

    server = await serve(slow_first)
    pool = http1.ConnectionPool("127.0.0.1", server.port, limit=1)
    with pytest.raises(TimeoutError):
        with anyio.fail_after(0.1):
            await call(pool, b'"slow"')
    # at once: on the same connection the late answer to "slow" would come first
    assert json.loads((await call(pool, b'"next"')).body) == {"echo": '"next"'}
    assert pool.open_connections == 1 and server.connections == 2


def delayed(seconds: float) -> Handler:
    """A length-framed echo that answers after ``seconds``."""

    async def slow(body: bytes, w: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(seconds)
        return await length_framed(body, w)

    return slow


async def test_limit_bounds_connections_and_every_call_is_answered(serve) -> None:
    server = await serve(delayed(0.02))
    pool = http1.ConnectionPool("127.0.0.1", server.port, limit=3)
    answers = await asyncio.gather(*(call(pool, b"%d" % i) for i in range(30)))
    assert [json.loads(r.body)["echo"] for r in answers] == [str(i) for i in range(30)]
    assert server.most_open == 3 and server.connections == 3


async def test_a_waiter_cancelled_while_the_pool_is_full_does_not_block_the_rest(serve) -> None:
    server = await serve(delayed(0.2))
    pool = http1.ConnectionPool("127.0.0.1", server.port, limit=1)
    first = asyncio.ensure_future(call(pool, b"1"))
    await eventually(lambda: len(server.requests) == 1)  # "1" holds the only connection
    with pytest.raises(TimeoutError):
        with anyio.fail_after(0.05):
            await call(pool, b"2")  # waits for the only connection, gives up
    third = await call(pool, b"3")
    assert json.loads((await first).body) == {"echo": "1"} and json.loads(third.body) == {"echo": "3"}


def test_headers_with_line_breaks_are_refused() -> None:
    with pytest.raises(ValueError, match="forbidden character"):
        http1.encode_headers({"Authorization": "Bearer x\r\nX-Admin: 1"})
    with pytest.raises(ValueError, match="forbidden character"):
        http1.encode_headers({"X-A\nB": "1"})
    assert http1.encode_headers({"A": "1", "B": "2"}) == b"A: 1\r\nB: 2\r\n"


async def test_https_and_proxied_urls_keep_aiohttp(monkeypatch) -> None:
    assert PlainHTTP("http://127.0.0.1:8000/v1", limit=4, timeout_s=5)._lean is not None
    assert PlainHTTP("https://example.com/v1", limit=4, timeout_s=5)._lean is None
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.internal:3128")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    assert PlainHTTP("http://vllm.internal:8000/v1", limit=4, timeout_s=5)._lean is None


async def test_the_adapter_sees_status_headers_and_failures_through_it(serve) -> None:
    """Through the ``openai`` adapter's endpoint pool: a 429 with Retry-After, then success;
    a server that refuses connections is a retryable ModelError naming the endpoint."""
    calls = 0

    async def limited(body: bytes, w: asyncio.StreamWriter) -> bool:
        nonlocal calls
        calls += 1
        if calls == 1:
            data = b'{"error": {"message": "slow down"}}'
            w.write(
                b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 0.05\r\nContent-Length: %d\r\n\r\n" % len(data) + data
            )
            return True
        return await length_framed(body, w)

    server = await serve(limited)
    pool = make_pool(
        Options(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="sk-secret", retry_backoff_s=0.01), concurrency=4
    )
    answer = await pool.run(lambda ep: ep.post("/responses", {"input": "hi"}))
    assert answer == {"echo": '{"input":"hi"}'} and calls == 2
    assert server.requests[0][1]["authorization"] == "Bearer sk-secret"
    await pool.aclose()

    port = closed_port()
    pool = make_pool(
        Options(base_url=f"http://127.0.0.1:{port}/v1", max_retries=1, retry_backoff_s=0.01), concurrency=4
    )
    with pytest.raises(ModelError, match=f"cannot reach http://127.0.0.1:{port}/v1") as err:
        await pool.run(lambda ep: ep.post("/responses", {}))
    assert err.value.retryable and "gave up after 2 attempts" in str(err.value)
    await pool.aclose()


def closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
