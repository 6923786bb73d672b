"""ops.status: who serves, how deep the queues are, and one batch's done / failed / pending (real server)."""

from __future__ import annotations

from typing import Any

import anyio
import msgspec
import pytest

from gym_runtime.data.batches import Manifest, put_manifest
from gym_runtime.errors import UserError
from gym_runtime.messages import Cost, ErrorInfo, RolloutResult
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


async def snapshot_once_done(bus: Bus, batch: str, done: int) -> dict[str, Any]:
    """``batch``'s watch snapshot once it has counted ``done`` results."""
    async with anyio.create_task_group() as tg:
        watch = await BatchWatch.open(bus, batch, tg)
        with anyio.fail_after(30):
            while watch.snapshot()["done"] < done:
                await anyio.sleep(0.05)
        snap = watch.snapshot()
        tg.cancel_scope.cancel()
    return snap


async def test_a_batch_is_counted_as_its_results_land(bus: Bus) -> None:
    await put_manifest(bus, Manifest(batch="w", expected=4, tasks=4, repeats=1, agents={"a": 4}, input="-"))
    for task, failed in ((0, False), (1, True), (0, False)):  # task 0 twice (a redelivery): counted once
        await store(bus, task, failed=failed)
    async with anyio.create_task_group() as tg:
        watch = await BatchWatch.open(bus, "w", tg)
        with anyio.fail_after(30):
            while watch.snapshot()["done"] < 2:
                await anyio.sleep(0.05)
        await store(bus, 3)
        with anyio.fail_after(30):
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
    snap = await snapshot_once_done(bus, "w", 3)
    assert (snap["done"], snap["failed"]) == (3, 2)


async def test_a_batch_says_what_its_results_cost_failed_ones_apart(bus: Bus) -> None:
    """``status --batch`` totals the ``cost`` of the results read so far (a row's key, a failure's own)."""
    await put_manifest(bus, Manifest(batch="c", expected=3, tasks=3, repeats=1, agents={"a": 3}, input="-"))
    await ensure_results_stream(bus, "a")
    policy = {"policy": {"calls": 2, "input_tokens": 30, "output_tokens": 4}}
    used = {"models": policy, "estimated_cost": 0.5, "currency": "EUR"}
    stored = 0  # bytes stored: what the reader weighs, each result's body as stored
    for task in (0, 1):
        res = RolloutResult(batch="c", task_index=task, rollout_index=0, agent="a", row={"reward": 1.0, "cost": used})
        stored += len(bus.codec.encode(res))
        await bus.js_publish(bus.subjects.result("a", "c"), res, msg_id=f"c:{task}:0")
    raw = {"models": {"policy": {"calls": 1, "input_tokens": 9}}, "estimated_cost": 0.25, "currency": "EUR"}
    spent = msgspec.convert(raw, Cost)
    error = ErrorInfo(error_class="timeout", message="x")
    failed = RolloutResult(batch="c", task_index=2, rollout_index=0, agent="a", error=error, cost=spent)
    await bus.js_publish(bus.subjects.result("a", "c"), failed, msg_id="c:2:0")
    snap = await snapshot_once_done(bus, "c", 3)
    assert snap["cost"]["rollouts"] == {
        "models": {"policy": {"calls": 4, "input_tokens": 60, "output_tokens": 8}},
        "stored_bytes": stored,
        "estimated_cost": 1.0,
        "currency": "EUR",
    }
    assert snap["cost"]["failed"]["models"]["policy"] == {"calls": 1, "input_tokens": 9}
    text = render_batch(snap).splitlines()
    assert text[1] == f"  cost: policy 4 calls, 60 in / 8 out tokens; results stored {stored} B; estimated 1 EUR", text
    assert text[2].startswith("  cost of 1 failed rollouts: policy 1 calls, 9 in / 0 out tokens"), text
