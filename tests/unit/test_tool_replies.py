"""A session answers a tool call id once (issue 69, item 3): a repeat gets the first reply, one that arrives
while the first still runs waits for it, a call that raised is run again, and the record is bounded."""

from __future__ import annotations

import anyio
import pytest

from gym_runtime.messages import ToolReply
from gym_runtime.workers.tool_replies import REPLIES_PER_SESSION, ToolReplies


async def test_a_repeated_id_gets_the_first_reply_and_one_in_flight_is_waited_for() -> None:
    replies, ran = ToolReplies(), []
    release = anyio.Event()

    async def slow() -> ToolReply:
        ran.append("slow")
        await release.wait()
        return ToolReply(output=f"run {len(ran)}")

    got: list[ToolReply] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: _into(got, replies.once("3.0.ab", slow)))  # the dead attempt's call, running
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(lambda: _into(got, replies.once("3.0.ab", slow)))  # the resumed attempt's replay
        await anyio.wait_all_tasks_blocked()
        release.set()
    assert ran == ["slow"] and [r.output for r in got] == ["run 1", "run 1"]
    assert (await replies.once("3.0.ab", slow)).output == "run 1"  # and later: from the record
    assert ran == ["slow"]


async def test_a_call_that_raised_is_not_recorded_and_the_record_is_bounded() -> None:
    replies, ran = ToolReplies(), []

    async def fails() -> ToolReply:
        ran.append("x")
        raise RuntimeError("lost")

    for _ in range(2):
        with pytest.raises(RuntimeError):
            await replies.once("1.0.aa", fails)
    assert ran == ["x", "x"]  # run again: nothing was recorded

    async def ok() -> ToolReply:
        ran.append("ok")
        return ToolReply(output="ok")

    for i in range(REPLIES_PER_SESSION + 1):
        await replies.once(f"{i}.0.aa", ok)
    await replies.once(f"{REPLIES_PER_SESSION}.0.aa", ok)  # the newest: kept
    assert ran.count("ok") == REPLIES_PER_SESSION + 1
    await replies.once("0.0.aa", ok)  # the oldest: forgotten, run again
    assert ran.count("ok") == REPLIES_PER_SESSION + 2


async def _into(out: list[ToolReply], reply: object) -> None:
    out.append(await reply)  # type: ignore[misc]
