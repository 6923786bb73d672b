"""``transport.protocol_reader``: what the server sends, read as nats-py's own parser reads it.

The same bytes go to both parsers, whole and cut at every byte (a socket read ends anywhere): each hands the
client the same messages (sid, subject, reply, payload, header block) and the same pings, pongs, server infos and
errors, in the same order. Odd but legal lines (tabs, runs of spaces) take nats-py's path. Through a real server,
every message of ``tests/test_header_block.py`` and the rest of the suite is read by it."""

from __future__ import annotations

from typing import Any

import pytest
from nats.errors import ProtocolError
from nats.protocol.parser import Parser

from gym_runtime.transport.protocol_reader import ProtocolReader


class Recorder:
    """What a parser hands its client (nats-py's ``Client`` methods the parser calls), in order."""

    def __init__(self) -> None:
        self.got: list[tuple[Any, ...]] = []

    async def _process_msg(self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None) -> None:
        self.got.append(("msg", sid, bytes(subject), bytes(reply), data, headers, type(data), type(headers)))

    async def _process_ping(self) -> None:
        self.got.append(("ping",))

    async def _process_pong(self) -> None:
        self.got.append(("pong",))

    async def _process_info(self, info: dict[str, Any]) -> None:
        self.got.append(("info", info))

    async def _process_err(self, err: str) -> None:
        self.got.append(("err", err))


def headed(subject: bytes, sid: int, reply: bytes, block: bytes, payload: bytes) -> bytes:
    to = reply + b" " if reply else b""
    head = b"HMSG %s %d %s%d %d\r\n" % (subject, sid, to, len(block), len(block) + len(payload))
    return head + block + payload + b"\r\n"


STREAM = b"".join(
    [
        b'INFO {"server_id":"x","max_payload":1048576}\r\n',
        b"MSG gym.a.b 1 _INBOX.r 5\r\nhello\r\n",
        b"MSG gym.a.b 12 0\r\n\r\n",
        headed(b"gym.t", 3, b"$JS.ACK.s.c.1.2.3.4.0", b"NATS/1.0\r\ntraceparent: 00-a-b-01\r\n\r\n", b"\x81\xa1a\x01"),
        headed(b"_INBOX.x.y", 4, b"", b"NATS/1.0 503\r\n\r\n", b""),
        b"PING\r\n",
        b"MSG gym.a.b 1 12345 3\r\n\r\n\r\r\n",  # a reply of digits; a payload holding CRLF
        b"+OK\r\n",
        b"MSG  gym.a.b\t1 2\r\nok\r\n",  # runs of spaces, a tab: nats-py's path
        b"PONG\r\n",
        headed(b"gym.t", 3, b"", b"NATS/1.0\r\nNats-Msg-Id: a\r\nGym-Note: x\r\n\r\n", b"{}"),
        b"-ERR 'Stale Connection'\r\n",
        b"MSG gym.a.b 2 3\r\nend\r\n",
    ]
)


async def read(parser_class: type[Parser], chunks: list[bytes]) -> list[tuple[Any, ...]]:
    nc = Recorder()
    parser = parser_class(nc)
    for chunk in chunks:
        await parser.parse(chunk)
    assert not parser.buf  # nothing left unread
    return nc.got


async def test_whole_and_cut_at_every_byte_it_hands_the_client_what_nats_py_does() -> None:
    expected = await read(Parser, [STREAM])
    assert [e[0] for e in expected] == [
        "info", "msg", "msg", "msg", "msg", "ping", "msg", "msg", "pong", "msg", "err", "msg"
    ]  # fmt: skip
    assert await read(ProtocolReader, [STREAM]) == expected
    for cut in range(1, len(STREAM)):
        assert await read(ProtocolReader, [STREAM[:cut], STREAM[cut:]]) == expected, cut
    assert await read(ProtocolReader, [STREAM[i : i + 1] for i in range(len(STREAM))]) == expected


async def test_a_burst_of_messages_read_at_once_all_arrive_in_order() -> None:
    block = b"NATS/1.0\r\nn: %d\r\n\r\n"
    burst = b"".join(headed(b"gym.t", 7, b"_INBOX.%d" % i, block % i, b"x" * i) for i in range(300))
    got = await read(ProtocolReader, [burst])
    assert got == await read(Parser, [burst])
    assert [g[3] for g in got] == [b"_INBOX.%d" % i for i in range(300)]


async def test_an_unknown_line_is_the_protocol_error_nats_py_raises() -> None:
    with pytest.raises(ProtocolError):
        await read(ProtocolReader, [b"MSG gym.a 1 2\r\nok\r\nWHAT is this\r\n"])


async def test_a_reset_while_a_message_is_handled_drops_the_rest_of_the_old_buffer() -> None:
    """A reconnect resets the parser (a fresh buffer) from inside the client: what the old connection's buffer
    still held is not read into the new one."""

    class Resetting(Recorder):
        async def _process_msg(self, *args: Any) -> None:
            await super()._process_msg(*args)
            parser.reset()

    nc = Resetting()
    parser = ProtocolReader(nc)
    await parser.parse(b"MSG a 1 1\r\nx\r\nMSG b 1 1\r\ny\r\n")
    assert [g[2] for g in nc.got] == [b"a"] and not parser.buf
    await parser.parse(b"MSG c 1 1\r\nz\r\n")
    assert [g[2] for g in nc.got] == [b"a", b"c"]


async def test_a_message_the_client_takes_at_once_is_not_handed_on_again() -> None:
    """``take_now`` (``connect.Client``'s, for inline callbacks) is asked first; what it takes never reaches
    ``_process_msg``, what it leaves does, and the order of the two together is the order read."""

    class Taking(Recorder):
        def take_now(self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None) -> bool:
            if sid % 2:
                return False
            self.got.append(("now", sid, bytes(subject), data))
            return True

    nc = Taking()
    await ProtocolReader(nc).parse(b"".join(b"MSG s.%d %d 1\r\n%d\r\n" % (i, i, i % 10) for i in range(6)))
    assert [(g[0], g[1]) for g in nc.got] == [("now", 0), ("msg", 1), ("now", 2), ("msg", 3), ("now", 4), ("msg", 5)]
