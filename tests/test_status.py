"""ops.status: who serves, how deep the queues are, and one batch's done / failed / pending (real server)."""

from __future__ import annotations

import anyio
import pytest

from gym_runtime.data.batches import Manifest, put_manifest
from gym_runtime.errors import UserError
from gym_runtime.messages import ErrorInfo, RolloutResult
from gym_runtime.ops.status import BatchWatch, gather, render_batch
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.jetstream import ensure_results_stream
from gym_runtime.transport.subjects import LOST


async def store(bus: Bus, task: int, *, failed: bool = False) -> None:
    res = RolloutResult(
        batch="w",
        task_index=task,
        rollout_index=0,
        agent="a",
        row=None if failed else {"reward": 1.0},
        error=ErrorInfo(error_class="tool_error", message="x") if failed else None,
    )
    await ensure_results_stream(bus, "a")
    await bus.js_publish(bus.subjects.result("a", "w"), res, msg_id=f"w:{task}:0")


async def test_a_batch_is_counted_as_its_results_land(bus: Bus) -> None:
    await put_manifest(bus, Manifest(batch="w", expected=4, tasks=4, repeats=1, agents={"a": 4}, input="-"))
    for task, failed in ((0, False), (1, True), (0, False)):  # task 0 twice (a redelivery): counted once
        await store(bus, task, failed=failed)
    async with anyio.create_task_group() as tg:
        watch = await BatchWatch.open(bus, "w", tg)
        with anyio.fail_after(10):
            while watch.snapshot()["done"] < 2:
                await anyio.sleep(0.05)
        await store(bus, 3)
        with anyio.fail_after(10):
            while watch.snapshot()["done"] < 3:  # a watch reads what lands after it opened too
                await anyio.sleep(0.05)
        snap = watch.snapshot()
        tg.cancel_scope.cancel()
    assert (snap["expected"], snap["done"], snap["failed"], snap["pending"]) == (4, 3, 1, 1)
    assert render_batch(snap).startswith("batch w: 3/4 done (75%), 1 failed, 1 pending")


async def test_an_unknown_batch_is_said_at_once(bus: Bus) -> None:
    async with anyio.create_task_group() as tg:
        with anyio.fail_after(5), pytest.raises(UserError, match="no batch 'nope' in namespace 'gym'"):
            await BatchWatch.open(bus, "nope", tg)


async def test_the_overview_counts_stored_results(bus: Bus) -> None:
    await store(bus, 0)
    report = await gather(bus, window_s=0.2)
    assert report["namespace"] == "gym" and report["results_stored"] == 1 and report["workers"] == []


async def test_a_forged_reward_on_the_lost_subject_and_an_unreadable_body_count_as_failed(bus: Bus) -> None:
    """The lost subject's writers are not the agent pools: a row there is a failure whatever it claims, as
    ``collect`` reads it; a body that does not decode is a failure too, not a watch that dies."""
    await put_manifest(bus, Manifest(batch="w", expected=3, tasks=3, repeats=1, agents={"a": 3}, input="-"))
    forged = RolloutResult(batch="w", task_index=0, rollout_index=0, agent="a", row={"reward": 1.0})
    await ensure_results_stream(bus, LOST)
    await ensure_results_stream(bus, "a")
    await bus.js_publish(bus.subjects.lost("w"), forged, msg_id="w:0:0")
    await bus.nc.publish(bus.subjects.result("a", "w"), b"not a result", headers={"Nats-Msg-Id": "w:1:0"})
    await bus.nc.flush()
    await store(bus, 2)
    async with anyio.create_task_group() as tg:
        watch = await BatchWatch.open(bus, "w", tg)
        with anyio.fail_after(10):
            while watch.snapshot()["done"] < 3:
                await anyio.sleep(0.05)
        snap = watch.snapshot()
        tg.cancel_scope.cancel()
    assert (snap["done"], snap["failed"]) == (3, 2)
