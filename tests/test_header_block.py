"""The runtime's header block (``transport.header_block``): the bytes nats-py would write and the dict it would
read, for the runtime's own headers and for what a peer may send, and through a real server."""

from __future__ import annotations

import asyncio
from typing import Any

import nats.errors
import pytest
from nats.aio.client import Client as NatsPy

from gym_runtime.transport.bus import Bus
from gym_runtime.transport.connect import Client
from gym_runtime.transport.header_block import NAMES_KEPT, HeaderBlock


def nats_py_block(headers: dict[str, str]) -> bytes:
    """nats-py's own header block for ``headers`` (its ``_send_publish``, through a stand-in ``_send_command``)."""
    written: list[bytes] = []
    nc = NatsPy()

    async def keep(cmd: bytes, priority: bool = False) -> None:
        written.append(cmd)

    nc._send_command = keep  # type: ignore[method-assign]
    asyncio.run(nc._send_publish("s", "", b"", 0, headers))
    cmd = written[0]
    hdr_len = int(cmd.split(b"\r\n", 1)[0].split()[-2])
    return cmd.split(b"\r\n", 1)[1][:hdr_len]


SENT = [
    {"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"},
    {"traceparent": "00-x-y-01", "Nats-Msg-Id": "r.b1.3.0.1.abc", "Gym-Reply": "_R.gym.model.9"},
    {" Padded ": "  value with spaces  ", "Gym-Control": "1"},
    {"Injected": "a\r\nPUB evil 1\r\nx", "Unicode": "café ☕"},
    {"": "skipped", "Empty-Value": ""},
]


@pytest.mark.parametrize("headers", SENT)
def test_encode_writes_what_nats_py_writes(headers: dict[str, str]) -> None:
    block = HeaderBlock()
    assert block.encode(headers) == nats_py_block(headers)
    assert block.encode(headers) == nats_py_block(headers)  # the remembered names: the same bytes again


def written(client: NatsPy, status: int, *args: Any, **kw: Any) -> tuple[list[bytes], dict[str, int], str]:
    """What ``client.publish(*args, **kw)`` queues for the socket (and its stats), or the error it raises, with
    the connection in ``status``."""
    client._status = status
    client._flush_queue = None  # no flusher: the command stays in ``_pending``
    try:
        asyncio.run(client.publish(*args, **kw))
    except Exception as e:
        return [], {}, type(e).__name__
    return list(client._pending), {k: client.stats[k] for k in ("out_msgs", "out_bytes")}, ""


PUBLISHED = [
    (("s", b"data"), {}),
    (("s", b""), {"reply": "_INBOX.r.1"}),
    (("s.x", b"body"), {"reply": "r", "headers": {"traceparent": "00-x-y-01", "Nats-Msg-Id": "m.1"}}),
    (("s", b"x"), {"headers": {}}),
    (("s", b"x"), {"headers": {"Bad Name": "v"}}),
    (("", b"x"), {}),
    (("bad subject", b"x"), {}),
    (("s", b"x"), {"reply": "bad\r\nreply"}),
    (("s", b"x" * 2_000_000), {}),
]


@pytest.mark.parametrize(("args", "kw"), PUBLISHED)
@pytest.mark.parametrize("status", [NatsPy.CONNECTED, NatsPy.RECONNECTING, NatsPy.CLOSED, NatsPy.DRAINING_PUBS])
def test_publish_queues_the_bytes_and_raises_the_errors_nats_py_does(args: tuple, kw: dict, status: int) -> None:
    """The runtime's one-call ``publish`` against nats-py's own, message by message and state by state."""
    ours, theirs = Client(), NatsPy()
    for c in (ours, theirs):
        c._max_payload = 1_048_576
    assert written(ours, status, *args, **kw) == written(theirs, status, *args, **kw)


@pytest.mark.parametrize("name", ["Bad Name", "colon:", "new\nline", "tab\tin"])
def test_encode_refuses_a_name_that_is_not_a_token(name: str) -> None:
    with pytest.raises(nats.errors.BadHeaderError):
        nats_py_block({name: "v"})
    with pytest.raises(nats.errors.BadHeaderError):
        HeaderBlock().encode({name: "v"})


READ = [
    b"traceparent: 00-aa-bb-01\r\nNats-Msg-Id: x.1\r\n\r\n",
    b"Name:Value\r\nTabbed:\tv\r\n  Spaced  :  w  \r\n",
    b"In side: dropped\r\nctl\x1cname: dropped\r\nok: kept\r\n",
    b"\xc3\xa9: non-ascii name dropped\r\nv: caf\xc3\xa9 \xff\r\nno colon line\r\n: empty name\r\n",
]


@pytest.mark.parametrize("raw", READ)
def test_parse_reads_what_nats_py_reads(raw: bytes) -> None:
    block = HeaderBlock()
    assert block.parse(raw) == NatsPy._parse_header_lines(raw)
    assert block.parse(raw) == NatsPy._parse_header_lines(raw)  # remembered names: the same dict again


def test_a_flood_of_names_is_not_remembered() -> None:
    block = HeaderBlock()
    many = {f"N{i}": str(i) for i in range(10 * NAMES_KEPT)}
    raw = block.encode(many)
    assert block.parse(raw[len(b"NATS/1.0\r\n") :]) == many
    assert len(block._sent) == len(block._read) == NAMES_KEPT


async def test_headers_cross_a_real_server_to_a_plain_nats_py_client(bus: Bus, nats_server) -> None:  # type: ignore[no-untyped-def]
    """What the runtime's client sends, a stock nats-py client reads the same, and the other way round."""
    plain = await nats.connect(nats_server.url)
    got: asyncio.Queue[dict[str, str] | None] = asyncio.Queue()

    async def on(msg) -> None:  # type: ignore[no-untyped-def]
        await got.put(msg.headers)

    try:
        await plain.subscribe("hdr.to.plain", cb=on)
        await bus.wire.subscribe("hdr.to.bus", cb=on)
        await plain.flush()
        await bus.wire.flush()
        headers = {"traceparent": "00-" + "c" * 32 + "-" + "d" * 16 + "-01", "Gym-Control": "1", "X": " é\r\n "}
        await bus.wire.publish("hdr.to.plain", b"x", headers=headers)
        from_bus = await asyncio.wait_for(got.get(), 30)
        await plain.publish("hdr.to.bus", b"x", headers=headers)
        from_plain = await asyncio.wait_for(got.get(), 30)
        assert from_bus == from_plain == {**headers, "X": "é"}
    finally:
        await plain.close()
