"""The collector on the in-memory transport (``gym_runtime.testing.MemoryTransport``): no nats-server.

What a user of ``collect`` checks of its files, each test well under a second: every slot's row written once,
in task×repeat order (``aabbcc``) whatever order results arrive in, failures in their sidecar; a result stored
twice (a publish retried under its id, a rollout run twice, a batch stored again after the duplicate window)
written once; a collector interrupted and run again ends with every row once and the same file; a slot whose
stored result was lost gets its task published again from its kept body, and its row; one that cannot be
published again ends as a ``lost`` failure row. The test plays the agent pool: it stores results as a worker
does (``js_publish`` under ``result_msg_id``). The same guarantees on a real server: ``tests/test_collector.py``,
``tests/e2e/test_completeness.py``, ``tests/e2e/test_duplicate_window.py``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import anyio
import msgspec

from gym_runtime.data.batches import Manifest, Owners, new_manifest, put_manifest
from gym_runtime.data.collector import Collector, CollectStats, sidecar_paths
from gym_runtime.data.inputs import publish_task
from gym_runtime.data.republish import NOT_KEPT
from gym_runtime.messages import ErrorInfo, RolloutResult, RolloutTask
from gym_runtime.testing import MemoryBroker, MemoryMessage, MemoryTransport, read_jsonl
from gym_runtime.transport.delivery import Delivery
from gym_runtime.transport.discovery import register
from gym_runtime.transport.headers import MSG_ID_HEADER
from gym_runtime.transport.jetstream import result_msg_id, task_msg_id

AGENT, BATCH = "a", "b"
TICK_S = 0.01  # how often the reader looks for lost slots here (5 s in production)


def result(task: int, rollout: int = 0, *, reward: float = 1.0, attempts: int = 1) -> RolloutResult:
    row = {
        "reward": reward,
        "_ng_task_index": task,
        "_ng_rollout_index": rollout,
        "agent_ref": {"type": "responses_api_agents", "name": AGENT},
    }
    return RolloutResult(batch=BATCH, task_index=task, rollout_index=rollout, agent=AGENT, row=row, attempts=attempts)


def failure(task: int, rollout: int) -> RolloutResult:
    error = ErrorInfo(error_class="tool_error", message="the tool broke")
    return RolloutResult(batch=BATCH, task_index=task, rollout_index=rollout, agent=AGENT, error=error, attempts=3)


async def store(bus: MemoryTransport, res: RolloutResult, msg_id: str | None = None) -> None:
    """Store ``res`` as an agent worker does (``AgentWorker``: its slot's id, attempt and random part)."""
    msg_id = msg_id or result_msg_id(res.batch, res.task_index, res.rollout_index, res.attempts)
    await bus.js_publish(bus.subjects.result(res.agent, res.batch), res, msg_id=msg_id)


async def put_batch(
    bus: MemoryTransport, tasks: int, *, repeats: int = 1, max_republish: int = 0, published: bool = True
) -> Manifest:
    """The manifest ``publish`` stores for ``tasks`` tasks of ``AGENT``."""
    manifest = new_manifest(
        BATCH, Owners.one(AGENT, tasks), repeats=repeats, input_path="-", max_republish=max_republish
    )
    manifest = msgspec.structs.replace(manifest, published=published)
    await put_manifest(bus, manifest)
    return manifest


def slots(rows: list[dict[str, Any]]) -> list[tuple[int, int]]:
    return [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in rows]


async def collect(bus: MemoryTransport, manifest: Manifest, out: Path) -> CollectStats:
    collector = Collector(bus, manifest, out)
    collector.reader.tick_s = TICK_S
    with anyio.fail_after(5):
        return await collector.run()


async def test_every_slots_row_is_written_once_in_task_order_whatever_order_results_arrive_in(tmp_path: Path) -> None:
    tasks, repeats = 4, 2
    order = [(t, r) for t in range(tasks) for r in range(repeats)]
    random.Random(7).shuffle(order)
    out = tmp_path / "out.jsonl"
    progress: list[int] = []
    half = anyio.Event()

    def on_progress(done: int, total: int) -> None:
        progress.append(done)
        if done == 4:
            half.set()

    async with MemoryTransport() as bus:
        manifest = await put_batch(bus, tasks, repeats=repeats)
        for t, r in order[:4]:  # stored before the collector starts, the rest while it runs
            await store(bus, failure(t, r) if (t, r) == (2, 1) else result(t, r, reward=float(t % 2)))
        collector = Collector(bus, manifest, out, on_progress=on_progress)
        got: list[CollectStats] = []

        async def run() -> None:
            got.append(await collector.run())

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(run)
                await half.wait()
                assert not out.exists()  # -o is only ever written whole
                for t, r in order[4:]:
                    await store(bus, failure(t, r) if (t, r) == (2, 1) else result(t, r, reward=float(t % 2)))
    stats = got[0]
    rows = read_jsonl(out)
    assert slots(rows) == [(t, r) for t in range(tasks) for r in range(repeats) if (t, r) != (2, 1)]
    assert [r["reward"] for r in rows] == [0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0]
    failures_path, metrics_path = sidecar_paths(out)
    assert [(f["_ng_task_index"], f["_ng_rollout_index"], f["error_class"]) for f in read_jsonl(failures_path)] == [
        (2, 1, "tool_error")
    ]
    assert json.loads(metrics_path.read_text())  # the aggregate metrics beside them
    assert (stats.rows, stats.failures, stats.duplicates) == (7, 1, 0)
    assert progress == list(range(1, 9))
    assert not Path(f"{out}.partial").exists()


async def test_a_result_stored_twice_is_written_once_and_the_first_stored_is_kept(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    async with MemoryTransport() as bus:
        manifest = await put_batch(bus, 2)
        same = result_msg_id(BATCH, 0, 0, 1)
        await store(bus, result(0), same)
        await store(bus, result(0, reward=0.0), same)  # a publish retried after a lost ack: dropped by its id
        await store(bus, result(0, reward=0.0, attempts=2))  # the rollout run again: stored, read, not written
        await store(bus, result(1))
        assert bus.broker.count(bus.subjects.batch_results(BATCH)) == 3
        stats = await collect(bus, manifest, out)
    rows = read_jsonl(out)
    assert slots(rows) == [(0, 0), (1, 0)]
    assert [r["reward"] for r in rows] == [1.0, 1.0]
    assert (stats.rows, stats.duplicates) == (2, 1)


async def test_a_result_stored_again_after_the_duplicate_window_is_written_once(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    async with MemoryTransport(MemoryBroker(duplicate_window_s=0.0)) as bus:  # every id's window has passed
        manifest = await put_batch(bus, 2)
        same = result_msg_id(BATCH, 0, 0, 1)
        await store(bus, result(0), same)
        await store(bus, result(0, reward=0.0), same)  # the batch stored again, past the window: stored twice
        await store(bus, result(1))
        assert bus.broker.count(bus.subjects.batch_results(BATCH)) == 3
        stats = await collect(bus, manifest, out)
    assert slots(read_jsonl(out)) == [(0, 0), (1, 0)]
    assert [r["reward"] for r in read_jsonl(out)] == [1.0, 1.0]
    assert (stats.rows, stats.duplicates) == (2, 1)


async def test_a_collector_interrupted_and_run_again_writes_every_row_once_and_the_same_file(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    three = anyio.Event()
    async with MemoryTransport() as bus:
        manifest = await put_batch(bus, 4)
        for t in range(3):
            await store(bus, result(t))
        first = Collector(bus, manifest, out, on_progress=lambda done, _total: three.set() if done == 3 else None)
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(first.run)
                await three.wait()
                tg.cancel_scope.cancel()  # Ctrl-C: the last task's result has not come yet
        assert not out.exists() and not Path(f"{out}.partial").exists()
        assert not bus.broker.consumers  # its reader's consumer went with it

        await store(bus, result(3))
        stats = await collect(bus, manifest, out)
        written = out.read_bytes()
        again = await collect(bus, manifest, out)  # run once more: the results are still stored
    assert slots(read_jsonl(out)) == [(0, 0), (1, 0), (2, 0), (3, 0)]
    assert (stats.rows, stats.duplicates, again.rows, again.duplicates) == (4, 0, 4, 0)
    assert out.read_bytes() == written


async def take(broker: MemoryBroker, pattern: str) -> MemoryMessage:
    """The next task on ``pattern`` as an agent worker takes it, waiting for one to be stored."""
    while True:
        changed = broker.changed
        msg = broker.take(pattern)
        if msg is not None:
            return msg
        await changed.wait()


async def test_a_slot_whose_result_was_lost_gets_its_task_published_again_and_its_row(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    async with MemoryTransport() as bus:
        manifest = await put_batch(bus, 3, max_republish=1, published=False)
        tasks = [RolloutTask(batch=BATCH, task_index=i, rollout_index=0, agent=AGENT, row={"q": i}) for i in range(3)]
        for task in tasks:
            await publish_task(bus, task, keep=True)  # as ``publish`` does: its body kept too
        await put_batch(bus, 3, max_republish=1)  # wholly published
        queue = bus.subjects.queue_filter("task", AGENT)
        for _ in tasks:  # the pool runs each; task 1's result is lost (acked, no result stored)
            msg = await take(bus.broker, queue)
            task = await bus.decode(Delivery(msg))
            if task.task_index != 1:
                await store(bus, result(task.task_index))
            await msg.ack()
        live = await register(bus, "agent", AGENT, "w1", dict)  # a worker serves the agent: a task may go again
        collector = Collector(bus, manifest, out)
        collector.reader.tick_s = TICK_S
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(collector.run)
                msg = await take(bus.broker, queue)
                assert (msg.headers or {})[MSG_ID_HEADER] == task_msg_id(BATCH, 1, 0, 0, again=1)
                assert await bus.decode(Delivery(msg)) == tasks[1]
                await store(bus, result(1, attempts=1))
                await msg.ack()
        await live.stop()
    assert slots(read_jsonl(out)) == [(0, 0), (1, 0), (2, 0)]
    assert not sidecar_paths(out)[0].exists()
    assert collector.reader.republished == 1


async def test_a_lost_slot_whose_task_is_not_kept_ends_as_a_lost_failure_row(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    async with MemoryTransport() as bus:
        manifest = await put_batch(bus, 2)  # max_republish 0: no body kept
        await store(bus, result(0))
        stats = await collect(bus, manifest, out)
        records = bus.broker.messages(bus.subjects.lost(BATCH))
    assert slots(read_jsonl(out)) == [(0, 0)]
    [row] = read_jsonl(sidecar_paths(out)[0])
    assert (row["_ng_task_index"], row["error_class"]) == (1, "lost")
    assert NOT_KEPT in row["error"]
    assert (stats.rows, stats.failures) == (1, 1)
    assert len(records) == 1  # the reader's record of it, on the batch's lost subject
