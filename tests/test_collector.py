"""data.collector: a batch's results, in any order and any number of times, into NeMo Gym-shaped files.

Results are stored on a real server out of order, some twice, one as a failure; the collector
writes each task×repeat once, laid out ``aabbcc``, failures in their sidecar, metrics beside them.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import anyio
import msgspec

from gym_runtime.data.collector import Collector
from gym_runtime.messages import ErrorInfo, RolloutResult
from gym_runtime.transport import subjects as sj
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.jetstream import ensure_blob_stream, ensure_streams, result_msg_id
from gym_runtime.transport.subjects import Subjects
from tests.helpers import put_batch, read_jsonl

TASKS, REPEATS = 4, 2


def result(task: int, rollout: int) -> RolloutResult:
    if (task, rollout) == (2, 1):
        error = ErrorInfo(error_class="tool_error", message="the tool broke")
        return RolloutResult(batch="b", task_index=task, rollout_index=rollout, agent="a", error=error, attempts=3)
    row = {
        "task": task,
        "reward": float(task % 2),
        "_ng_task_index": task,
        "_ng_rollout_index": rollout,
        "agent_ref": {"type": "responses_api_agents", "name": "a"},
    }
    return RolloutResult(batch="b", task_index=task, rollout_index=rollout, agent="a", row=row)


async def store_all(bus: Bus) -> None:
    order = [(t, r) for t in range(TASKS) for r in range(REPEATS)]
    random.Random(7).shuffle(order)
    # three of them stored twice (a redelivered rollout), each second copy before the batch's last result: a
    # collector stops once every slot is filled, so copies stored after that may go unread (and uncounted)
    for t, r in [*order[:3], *order]:
        await bus.js_publish(Subjects("gym").result("a", "b"), result(t, r), msg_id=result_msg_id("b", t, r, 0))


async def test_results_in_any_order_and_twice_are_written_once_in_task_order(bus: Bus, tmp_path: Path) -> None:
    await ensure_streams(bus, ["a"])
    await store_all(bus)
    out = tmp_path / "out.jsonl"
    collector = Collector(bus, await put_batch(bus, "b", TASKS, repeats=REPEATS), out)
    with anyio.fail_after(30):
        stats = await collector.run()
    rows = read_jsonl(out)
    assert [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in rows] == [
        (t, r) for t in range(TASKS) for r in range(REPEATS) if (t, r) != (2, 1)
    ]
    (failed,) = read_jsonl(tmp_path / "out_failures.jsonl")
    assert failed["error_class"] == "tool_error" and (failed["_ng_task_index"], failed["_ng_rollout_index"]) == (2, 1)
    assert (stats.rows, stats.failures, stats.duplicates) == (7, 1, 3)
    (metrics,) = json.loads((tmp_path / "out_aggregate_metrics.json").read_text())
    assert (metrics["num_rollouts"], metrics["num_tasks"]) == (7, 4)  # the failure is not a row
    assert metrics["agent_metrics"]["mean/reward"] == 4 / 7  # tasks 1 and 3 score 1.0, twice each
    assert not (tmp_path / "out.jsonl.partial").exists()


async def test_a_result_is_never_replaced_and_a_failure_gives_way_to_a_later_attempt(bus: Bus, tmp_path: Path) -> None:
    """The rule for later attempts, as the stream delivers rows in any order: slot 0 gets a failure of attempt
    1, then a result of attempt 2 (kept); slot 1 a result, then a failure of a later attempt (the result
    stays); slot 2 failures of attempts 2 then 1 (the later attempt's stays)."""
    await ensure_streams(bus, ["a"])
    fail = ErrorInfo(error_class="timeout", message="attempt ran out")

    def row(task: int, attempt: int, ok: bool) -> RolloutResult:
        body = {"reward": 1.0, "_ng_task_index": task, "_ng_rollout_index": 0} if ok else None
        error = None if ok else msgspec.structs.replace(fail, message=f"attempt {attempt} ran out")
        return RolloutResult(
            batch="r", task_index=task, rollout_index=0, agent="a", row=body, error=error, attempts=attempt
        )

    for res in [
        row(0, 1, False),
        row(0, 2, True),
        row(1, 1, True),
        row(1, 3, False),
        row(2, 2, False),
        row(2, 1, False),
    ]:
        msg_id = result_msg_id("r", res.task_index, 0, res.attempts)
        await bus.js_publish(Subjects("gym").result("a", "r"), res, msg_id=msg_id)
    with anyio.fail_after(30):
        stats = await Collector(bus, await put_batch(bus, "r", 3), tmp_path / "out.jsonl").run()
    assert [r["_ng_task_index"] for r in read_jsonl(tmp_path / "out.jsonl")] == [0, 1]
    (failed,) = read_jsonl(tmp_path / "out_failures.jsonl")
    assert (failed["_ng_task_index"], failed["error"]) == (2, "attempt 2 ran out")
    assert (stats.rows, stats.failures, stats.duplicates) == (2, 1, 2)


async def test_a_result_not_stored_as_an_agent_stores_one_is_refused(bus: Bus, tmp_path: Path) -> None:
    """Issue 33: a direct get's answer sent into a result subject (a borrowed reply; on one account the server
    stores it) is refused, as is a row without a message id naming its slot: counted, never written."""
    await ensure_streams(bus, ["a"])
    await ensure_blob_stream(bus, "agent")
    subject = Subjects("gym").result("a", "m")
    forged = RolloutResult(batch="m", task_index=0, rollout_index=0, agent="a", row={"reward": 1337.0})
    body = bus.codec.encode(forged)
    chunk = Subjects("gym").blob("agent.a", "forged", 0)
    await bus.js.publish(chunk, body, timeout=5.0)
    get = sj.direct_get(Subjects("gym").blob_stream("agent"), chunk)
    await bus.nc.publish(get, b"", reply=subject)  # the answer with its headers (Nats-Stream, ...)
    await bus.nc.publish(get, b'{"no_hdr": true}', reply=subject)  # the body alone: no message id
    await bus.js.publish(
        subject, body, headers={"Nats-Msg-Id": result_msg_id("m", 0, 1, 0)}, timeout=5.0
    )  # not its slot
    with anyio.fail_after(10):  # the borrowed answers are stored (one account): the attack is real here
        while (await bus.js.stream_info(Subjects("gym").results_stream("a"))).state.messages < 3:
            await anyio.sleep(0.02)
    genuine = msgspec.structs.replace(forged, row={"reward": 1.0})
    await bus.js_publish(subject, genuine, msg_id=result_msg_id("m", 0, 0, 1))
    with anyio.fail_after(30):
        stats = await Collector(bus, await put_batch(bus, "m", 1), tmp_path / "out.jsonl").run()
    assert [r["reward"] for r in read_jsonl(tmp_path / "out.jsonl")] == [1.0]
    assert stats.refused == 3
