"""A group task's rows when its worker died after storing only part of them, on a real nats-server.

The redelivered run stores all K again: the group ends with exactly K rows, none twice; the rows
the dead run stored are kept (deduplicated by msg id), so the group mixes the two runs.
"""

from __future__ import annotations

from typing import Any

import anyio

from gym_runtime.messages import RolloutResult
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.jetstream import ensure_results_stream
from gym_runtime.transport.subjects import Subjects

K = 3
SUBJECT = Subjects("gym").result("agent", "b")


def row(i: int, run: int) -> tuple[RolloutResult, str]:
    res = RolloutResult(batch="b", task_index=0, rollout_index=i, agent="agent", row={"reward": 1.0, "run": run})
    return res, f"b:0:{i}"


async def stored(bus: Bus) -> list[tuple[int, Any]]:
    """(rollout index, run) of every result stored, in stream order."""
    info = await bus.js.stream_info(Subjects("gym").results_stream("agent"))
    sub = await bus.js.subscribe(SUBJECT, ordered_consumer=True)
    out = []
    for _ in range(info.state.messages):
        res = await bus.decode(await sub.next_msg(5))
        out.append((res.rollout_index, res.row["run"]))
    await sub.unsubscribe()
    return out


async def test_a_partly_stored_group_ends_with_k_rows_none_twice_mixing_the_two_runs(bus: Bus) -> None:
    """The dead run stored rows 0 and 1 of 3; the redelivered run stores its 3 rows as the agent worker
    does (each under its (batch, task, repeat) id): rows 0 and 1 stay the dead run's, row 2 is the new
    run's; a third run's store (an ack lost) adds nothing."""
    await ensure_results_stream(bus, "agent")
    for i in range(K - 1):
        res, msg_id = row(i, run=1)
        await bus.js_publish(SUBJECT, res, msg_id=msg_id)
    with anyio.fail_after(30):
        for run in (2, 3):
            for res, msg_id in [row(i, run=run) for i in range(K)]:
                await bus.js_publish(SUBJECT, res, msg_id=msg_id)
        assert sorted(await stored(bus)) == [(0, 1), (1, 1), (2, 2)]
