"""``gym_runtime.testing.MemoryTransport``: the in-memory double keeps the semantics workers rely on.

Queue groups deal each message to one member; request-reply carries typed errors and says when nobody
serves a subject; a work queue redelivers what was nak'd (counting attempts) or left unanswered past
``ack_wait``, and forgets what was acked; a body over the max payload goes by reference and comes back
whole. Each test waits on events, never on sleeps.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import pytest

from gym_runtime.errors import Failure
from gym_runtime.messages import ToolCall, ToolReply
from gym_runtime.testing import MemoryBroker, MemoryTransport, subject_matches
from gym_runtime.transport.delivery import Delivery
from gym_runtime.transport.headers import BLOB_HEADER
from gym_runtime.transport.rpc import NoResponders

CALL = ToolCall(session="s", name="x", arguments="{}")


def test_subjects_match_as_nats_wildcards_do() -> None:
    assert subject_matches("gym.task.a.>", "gym.task.a.b1")
    assert not subject_matches("gym.task.a.>", "gym.task.a")
    assert subject_matches("gym.*.seed", "gym.env.seed") and not subject_matches("gym.*.seed", "gym.env.x.seed")


async def test_a_queue_group_deals_each_message_to_one_member_and_every_plain_subscriber_gets_it() -> None:
    broker = MemoryBroker()
    async with MemoryTransport(broker) as a, MemoryTransport(broker) as b:
        got: dict[str, list[str]] = {"a": [], "b": [], "all": []}
        done = anyio.Event()

        def on(who: str) -> Callable[[Delivery], Awaitable[None]]:
            async def cb(msg: Delivery) -> None:
                got[who].append(msg.data.decode())
                if len(got["all"]) == 10 and len(got["a"]) + len(got["b"]) == 10:
                    done.set()

            return cb

        await a.subscribe("gym.x", on("a"), queue="q")
        await b.subscribe("gym.x", on("b"), queue="q")
        await a.subscribe("gym.x", on("all"))
        for i in range(10):
            await b.publish_raw("gym.x", str(i).encode())
        with anyio.fail_after(5):
            await done.wait()
    assert sorted(got["a"] + got["b"], key=int) == got["all"] == [str(i) for i in range(10)]
    assert got["a"] and got["b"]  # both members got some


async def test_request_reply_carries_typed_errors_and_says_when_nobody_serves() -> None:
    async with MemoryTransport() as bus:

        async def tool(call: ToolCall, _: Delivery) -> ToolReply:
            if call.name == "boom":
                raise Failure("tool_error", "it broke")
            return ToolReply(output=f"ran {call.name}")

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                await bus.serve(tg, "gym.tool", tool)
                assert (await bus.request("gym.tool", CALL, timeout=5, op="tool")).output == "ran x"
                with pytest.raises(Failure) as e:
                    await bus.request("gym.tool", ToolCall(session="s", name="boom", arguments="{}"), timeout=5, op="t")
                assert e.value.info.error_class == "tool_error" and e.value.info.message == "it broke"
                with pytest.raises(NoResponders):
                    await bus.request("gym.nobody", CALL, timeout=5, op="tool")
                tg.cancel_scope.cancel()


async def test_a_work_queue_redelivers_what_was_nakd_or_left_unanswered_and_forgets_what_was_acked() -> None:
    broker = MemoryBroker()
    async with MemoryTransport(broker) as bus:
        attempts: dict[int, list[int]] = {}
        finished = anyio.Event()

        async def handle(msg: Delivery) -> None:
            call = await bus.decode(msg)
            n = int(call.session)
            attempts.setdefault(n, []).append(msg.attempt)
            if n == 0 and msg.attempt == 1:
                await msg.nak()  # try again
            elif n == 1 and msg.attempt == 1:
                pass  # neither acked nor nak'd: sent again after ack_wait
            else:
                await msg.ack()
            if attempts.get(0) == [1, 2] and attempts.get(1) == [1, 2] and attempts.get(2) == [1]:
                finished.set()

        puller = await bus.work_queue("task", "agent", slots=2, ack_wait=0.05, handle=handle)
        subject = bus.subjects.task("agent", "b")
        for i in range(3):
            await bus.js_publish(subject, ToolCall(session=str(i), name="x", arguments="{}"), msg_id=f"b:{i}:0")
        await bus.js_publish(subject, CALL, msg_id="b:0:0")  # a duplicate id: dropped, as the server drops it
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(puller.run)
                await finished.wait()
                puller.stop_pulling()
        assert not broker.messages(subject)  # all acked: the work queue holds nothing


async def test_a_body_over_the_max_payload_goes_by_reference_and_comes_back_whole() -> None:
    async with MemoryTransport(max_payload=128 * 1024) as bus:  # a body over 64 KiB goes by reference
        big = ToolCall(session="s", name="x", arguments='"' + "y" * 200_000 + '"')
        await bus.js_publish("gym.result.a.b", big, msg_id="b:0:0:1")
        (stored,) = bus.broker.messages("gym.result.a.b")
        assert BLOB_HEADER in (stored.headers or {}) and not stored.data
        assert len(bus.broker.messages(bus.subjects.role_blobs("any"))) == 4  # its chunks, 64 KiB each at most
        assert await bus.decode(stored) == big


async def test_a_reader_reads_in_order_keeps_what_it_read_and_a_reader_made_again_gets_what_it_had_not_acked() -> None:
    async with MemoryTransport() as bus:
        stream, subject = bus.subjects.results_stream("a"), bus.subjects.result("a", "b")
        for i in range(4):
            await bus.js_publish(subject, ToolCall(session=str(i), name="x", arguments="{}"), msg_id=f"b:{i}:0:1:r")
        await bus.js_publish("gym.result.a.other", CALL, msg_id="other:0:0:1:r")  # another batch: not its filter
        got: list[tuple[str, int]] = []
        read = {n: anyio.Event() for n in (4, 6)}

        async def handle(msg: Delivery) -> None:
            got.append(((await bus.decode(msg)).session, msg.attempt))
            if msg.stream_seq == 2 or len(got) == 6:
                await msg.ack()  # ack-all: every one before it too
            if len(got) in read:
                read[len(got)].set()

        first = await bus.reader(stream, "collect_b_1", subject, handle=handle)
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(first.run)
                await read[4].wait()  # the 3rd and 4th are read, not acked
                assert not await first.settled()
                first.stop_pulling()
            again = await bus.reader(stream, "collect_b_1", subject, handle=handle)  # not deleted: made again
            async with anyio.create_task_group() as tg:
                tg.start_soon(again.run)
                await read[6].wait()
                assert await again.settled()
                again.stop_pulling()
        assert got == [("0", 1), ("1", 1), ("2", 1), ("3", 1), ("2", 2), ("3", 2)]
        await again.close()
        assert not bus.broker.consumers
        assert len(bus.broker.messages(subject)) == 4  # read and acked, still stored: a results stream keeps them
