"""Callbacks the real wire calls as each message is read (``transport.interface.inline``, the bus's replies):
through a real server, every message in the order sent, with its headers (a no-responders status among them);
a callback that raises is heard by the connection's error callback (a log line) and the next message still
comes; after an unsubscribe nothing more does."""

from __future__ import annotations

import asyncio

import anyio

from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.transport.connect import connect
from gym_runtime.transport.interface import inline


async def test_an_inline_callback_gets_every_message_in_order_survives_its_error_and_ends(
    nats_server: EmbeddedServer,
) -> None:
    nc = await connect(nats_server.url, name="inline")
    got: list[tuple[bytes, str | None]] = []
    enough = asyncio.Event()

    def on(msg: object) -> None:
        data, headers = msg.data, msg.headers  # type: ignore[attr-defined]
        if data == b"boom":
            raise ValueError("a callback's own error")
        got.append((data, (headers or {}).get("Gym-Note")))
        if len(got) == 100:
            enough.set()

    sub = await nc.subscribe("inline.s", cb=inline(on))
    assert sub._id in nc._inline  # type: ignore[attr-defined]  # called by the reader, not queued for a task
    try:
        await nc.publish("inline.s", b"boom")
        for i in range(100):
            await nc.publish("inline.s", str(i).encode(), headers={"Gym-Note": f"n{i}"} if i % 2 else None)
        with anyio.fail_after(30):
            await enough.wait()
        assert got == [(str(i).encode(), f"n{i}" if i % 2 else None) for i in range(100)]
        assert nc.is_connected  # the error went to the connection's error callback (a log line), not its reader
        # a request nobody answers: the server's 503 status reaches an inline callback as nats-py reads it
        statuses: list[str | None] = []
        answered = asyncio.Event()

        def on_status(msg: object) -> None:
            statuses.append((msg.headers or {}).get("Status"))  # type: ignore[attr-defined]
            answered.set()

        inbox = nc.new_inbox()
        await nc.subscribe(inbox, cb=inline(on_status))
        await nc.publish("inline.nobody", b"", reply=inbox, headers={"Gym-Note": "x"})
        with anyio.fail_after(30):
            await answered.wait()
        assert statuses == ["503"]
        await sub.unsubscribe()
        await nc.publish("inline.s", b"late")
        await nc.flush()
        assert got[-1][0] == b"99" and len(got) == 100 and sub._id not in nc._inline  # type: ignore[attr-defined]
    finally:
        await nc.close()
