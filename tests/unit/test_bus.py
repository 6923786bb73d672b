"""The ``Bus`` on the in-memory wire (``transport.memory.MemoryWire``): the same code that runs on NATS.

What a caller of the bus relies on, each test well under a few seconds and waiting on events: a direct call that
finds no free slot goes through the work queue and comes back; a handler's output parts reach the caller in
order before its reply; a handler that falls silent fails its call as retryable ``worker_lost`` after the
liveness window, while one that runs long but sends keepalives is waited for; a control message gathers every
replica's answer; a stored publish is acked and deduplicated by its id. The same paths on a real server:
``tests/test_rpc.py``, ``tests/test_model_calls.py``.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from gym_runtime.errors import Failure
from gym_runtime.messages import ToolCall, ToolReply
from gym_runtime.testing import MemoryBroker, MemoryTransport
from gym_runtime.transport.delivery import Delivery
from gym_runtime.transport.headers import REPLY_HEADER
from gym_runtime.transport.rpc import Timings

CALL = ToolCall(session="s", name="x", arguments="{}")


async def test_a_direct_call_without_a_free_slot_goes_through_the_work_queue_and_comes_back() -> None:
    async with MemoryTransport() as bus:
        direct, queued = bus.subjects.model_direct("m"), bus.subjects.model_queue("m")
        ways: list[str] = []

        async def tool(call: ToolCall, msg: Delivery) -> ToolReply:
            ways.append("queue" if msg.stream_seq else "direct")  # a stored message has a stream sequence
            return ToolReply(output=f"ran {call.name}")

        async def from_queue(msg: Delivery) -> None:
            reply_to = (msg.headers or {})[REPLY_HEADER]
            await bus.taken(reply_to)
            await bus.handle(msg, tool, reply_to=reply_to, default_error="internal")
            await msg.ack()

        async def nothing() -> None:
            return None

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                await bus.serve_direct(
                    tg, direct, tool, queue="m", admit=lambda _: False, done=nothing, default_error="internal"
                )
                puller = await bus.work_queue("model", "m", slots=1, ack_wait=30, handle=from_queue)
                tg.start_soon(puller.run)
                reply = await bus.direct_or_queued(direct, queued, CALL, timeout=5, op="generate m")
                tg.cancel_scope.cancel()
        assert reply.output == "ran x" and ways == ["queue"]
        assert not bus.broker.messages(queued)  # acked: the queue holds nothing


async def test_a_handlers_output_reaches_the_caller_in_order_before_its_reply() -> None:
    async with MemoryTransport() as bus:

        async def tool(call: ToolCall, _: Delivery) -> ToolReply:
            for part in (b"one ", b"two ", b"three"):
                await bus.send_output(1, part)
            await bus.send_output(2, b"warning")
            return ToolReply(output="done")

        got: list[tuple[int, bytes]] = []
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                await bus.serve(tg, "gym.tool", tool)
                reply = await bus.request(
                    "gym.tool", CALL, timeout=5, op="tool", on_output=lambda s, b: got.append((s, b))
                )
                tg.cancel_scope.cancel()
        assert reply.output == "done"
        assert got == [(1, b"one "), (1, b"two "), (1, b"three"), (2, b"warning")]


async def test_a_silent_handler_is_a_lost_worker_and_one_that_keeps_alive_is_waited_for() -> None:
    timings = Timings(keepalive_s=0.05, liveness_s=0.5)
    async with MemoryTransport(timings=timings) as bus:

        async def slow(call: ToolCall, _: Delivery) -> ToolReply:
            await anyio.sleep(1.0)  # twice the liveness window, with a keepalive every 50 ms
            return ToolReply(output="slow but alive")

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                # a worker that took the call and went silent: no reply, no keepalive
                sub = await bus.subscribe("gym.silent", lambda msg: anyio.sleep(0))
                await bus.serve(tg, "gym.slow", slow)
                with pytest.raises(Failure) as e:
                    await bus.request("gym.silent", CALL, timeout=10, op="tool")
                assert e.value.info.error_class == "worker_lost" and e.value.info.retryable
                assert (await bus.request("gym.slow", CALL, timeout=10, op="tool")).output == "slow but alive"
                await sub.unsubscribe()
                tg.cancel_scope.cancel()


async def test_a_control_message_gathers_every_replicas_answer() -> None:
    broker = MemoryBroker()
    async with MemoryTransport(broker) as a, MemoryTransport(broker) as b, MemoryTransport(broker) as caller:

        def replica(name: str) -> Any:
            async def pause(call: ToolCall, _: Delivery) -> ToolReply:
                return ToolReply(output=name)

            return pause

        subject = caller.subjects.pause("m")
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                await a.serve(tg, subject, replica("a"))
                await b.serve(tg, subject, replica("b"))
                replies = await caller.gather(subject, CALL, done=lambda r: len(r) == 2, timeout=5)
                tg.cancel_scope.cancel()
        assert sorted(r.output for r in replies) == ["a", "b"]


async def test_a_stored_publish_is_acked_and_stored_once_per_id() -> None:
    async with MemoryTransport() as bus:
        subject = bus.subjects.result("a", "b")
        with anyio.fail_after(10):
            for _ in range(3):
                await bus.js_publish(subject, CALL, msg_id="b:0:0:1:r")  # each returns once the stream acked it
            await bus.js_publish(subject, CALL, msg_id="b:1:0:1:r", keep=bus.subjects.kept("b", 1))
        assert len(bus.broker.messages(subject)) == 2
        kept = await bus.last_stored(bus.subjects.kept_stream, bus.subjects.kept("b", 1))  # a direct get
        assert kept is not None and await bus.decode(kept) == CALL
        assert await bus.last_stored(bus.subjects.kept_stream, bus.subjects.kept("b", 2)) is None
