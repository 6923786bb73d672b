"""Staleness by admission (``submit(batch_size=B, max_staleness=S)``): real nats-server, real workers, the
weather environment's stub policy (the LLM test double).

The trainer double takes B rows per step, reports them with ``consumed(B)``, then "trains" for as long as it
takes the cluster to go idle (every task published has started and finished) before it bumps the version:
a runtime that started more than the bound would have started it by then. What started is read from the
agent workers themselves (their completed, in-flight and skipped counts), not from the client."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from gym_runtime import Client, ClientError, SyncClient
from gym_runtime.service.batches import collect_batch
from gym_runtime.transport.jetstream import consumers
from tests.helpers import ROWS, read_jsonl, rows, weather


def agent_of(client: Client) -> Any:
    return next(w for w in client.workers if hasattr(w, "skipped"))


def started(client: Client) -> int:
    """Rollouts the agent worker took from its queue: finished, running, or dropped without running."""
    a = agent_of(client)
    return int(a.completed + a.stats()["in_flight"] + a.skipped)


async def idle(client: Client) -> None:
    """Every task published so far has been taken and its result stored (the trainer's slow step)."""
    with anyio.fail_after(60):
        while True:
            lag = {c["consumer"]: c for c in await consumers(client.bus, client.bus.subjects.tasks_stream)}
            queue = lag.get("agent_weather_agent", {"pending": 0, "ack_pending": 0})
            if queue["pending"] == 0 and queue["ack_pending"] == 0 and agent_of(client).stats()["in_flight"] == 0:
                return
            await anyio.sleep(0.05)


async def update(client: Client, version: int) -> None:
    """The trainer's weight update: calls held, the new version made current and seen by the policy's replica
    (its announcement may reach it after a task admitted by the update), calls let go."""
    (model,) = [w for w in client.workers if hasattr(w, "gate")]
    await client.pause()
    await client.set_policy_version(version)
    with anyio.fail_after(30):
        while await model.control.version("policy") != version:
            await anyio.sleep(0.01)
    await client.resume()


async def take(batch: Any, n: int) -> list[dict[str, Any]]:
    with anyio.fail_after(60):
        return [await batch.__anext__() for _ in range(n)]


async def update_midway(
    url: str, tasks: list[dict[str, Any]], first: int, last: int, **submit: Any
) -> tuple[int, int, dict[tuple[int, int], list[int]]]:
    """Two repeats of ``tasks`` at staleness 0 under version 1: ``first`` rows taken, the policy updated to 2 once
    nothing runs, then the ``last`` rows. Returns (rollouts started, redone, policy versions by (task, rollout))."""
    async with Client(weather(delay_s=0.02, agent_concurrency=8), nats=url) as client:
        await client.set_policy_version(1)
        batch = await client.submit(tasks, repeats=2, max_staleness=0, **submit)
        got = await take(batch, first)
        await batch.consumed(first)
        await idle(client)
        assert started(client) == first
        await update(client, 2)
        got += await take(batch, last)
        await batch.consumed(last)
        done = (started(client), batch.redone)
    return *done, {(r["_ng_task_index"], r["_ng_rollout_index"]): r["policy_versions"] for r in got}


async def test_started_never_exceeds_the_bound_and_nothing_is_discarded(nats_server) -> None:
    S, B, steps = 0, 4, 3
    async with Client(weather(delay_s=0.05, agent_concurrency=8), nats=nats_server.url) as client:
        await client.set_policy_version(1)
        batch = await client.submit(rows(B * steps), max_staleness=S, batch_size=B)  # three steps ahead
        consumed: list[tuple[int, dict[str, Any]]] = []
        for step in range(steps):
            version = 1 + step
            got = await take(batch, B)
            assert started(client) <= (step + S + 1) * B  # AReaL's rule, counted from the first version
            await batch.consumed(B)
            await idle(client)  # the trainer trains: workers are free the whole time
            assert started(client) == (step + 1) * B, "a rollout started that would be consumed too stale"
            consumed += [(version, r) for r in got]
            await update(client, version + 1)
        assert started(client) == B * steps and agent_of(client).skipped == 0
        assert batch.redone == B * (steps - 1)  # submitted at version 1, started under the version they are used at
    assert all(r["reward"] == 1.0 for _, r in consumed), [r.get("error") for _, r in consumed]
    for version, r in consumed:  # each row consumed within S versions of the policy that generated it
        lo, hi = r["policy_versions"]
        assert version - lo <= S and hi <= version


async def test_a_straddling_group_redoes_only_its_stale_members(nats_server) -> None:
    """B=3 with groups of 2: the second group's first member starts under version 1, its second could not
    start in bound and is redone under version 2; the first member is not run again."""
    started_n, redone, versions = await update_midway(nats_server.url, ROWS[:2], 3, 1, batch_size=3)
    assert (started_n, redone) == (4, 1)
    assert versions == {(0, 0): [1, 1], (0, 1): [1, 1], (1, 0): [1, 1], (1, 1): [2, 2]}


async def test_group_staleness_group_starts_and_redoes_a_group_whole(nats_server) -> None:
    started_n, redone, versions = await update_midway(
        nats_server.url, ROWS[:3], 4, 2, batch_size=4, group_staleness="group"
    )
    assert (started_n, redone) == (6, 2)
    assert {k: v for k, v in versions.items() if k[0] == 2} == {(2, 0): [2, 2], (2, 1): [2, 2]}
    assert all(v == [1, 1] for k, v in versions.items() if k[0] < 2)


async def test_admission_mistakes_are_one_line(nats_server) -> None:
    async with Client(weather(), nats=nats_server.url) as client:
        await client.set_policy_version(1)
        cases = [
            (dict(max_staleness=-1, batch_size=4), "max_staleness must be >= 0, got -1"),
            (dict(batch_size=4), "batch_size bounds rollouts by staleness: give max_staleness too"),
            (dict(max_staleness=0, batch_size=0), "batch_size (the rollouts the trainer consumes per policy"),
            (dict(max_staleness=0, batch_size=4, group_staleness="task"), "group_staleness must be one of member"),
            (dict(repeats=4, max_staleness=0, batch_size=6, group_staleness="group"), "must be a multiple of them"),
        ]
        for kwargs, message in cases:
            with pytest.raises(ClientError) as e:
                await client.submit(ROWS[:1], **kwargs)
            assert message in str(e.value) and "\n" not in str(e.value)
        batch = await client.submit(ROWS[:1], max_staleness=0, batch_size=1)
        await take(batch, 1)
        with pytest.raises(ClientError, match=r"^consumed\(2\) on batch \w+: only 1 rows were delivered and 0 "):
            await batch.consumed(2)
        with pytest.raises(ClientError, match=r"consumed\(n\) takes a count of rows >= 0, got -1"):
            await batch.consumed(-1)
        await batch.consumed(1)


def test_a_synchronous_trainer_reports_what_it_consumed(nats_server) -> None:
    with SyncClient(weather(), nats=nats_server.url) as client:
        client.set_policy_version(1)
        batch = client.submit(ROWS[:3], max_staleness=0, batch_size=1)
        got = []
        for row in batch:
            got.append(row)
            batch.consumed(1)
            if len(got) < 3:
                client.set_policy_version(1 + len(got))  # the next row starts only now
        assert batch.handle.redone == 2 and batch.handle.started == 3
    assert [r["reward"] for r in got] == [1.0, 1.0, 1.0]


async def test_a_cancelled_batch_gives_its_room_back(nats_server, tmp_path) -> None:
    """...and still ends: its held tasks become ``cancelled`` rows, unrun, so a collector settles it."""
    async with Client(weather(), nats=nats_server.url) as client:
        await client.set_policy_version(1)
        first = await client.submit(ROWS[:4], max_staleness=0, batch_size=2)
        await take(first, 2)  # delivered, never reported consumed: they hold the whole window
        await first.cancel()  # its two held tasks never start, and its two started ones leave the window
        second = await client.submit(ROWS[:2], max_staleness=0, batch_size=2)
        assert second.started == 2 and [r["reward"] for r in await take(second, 2)] == [1.0, 1.0]
        await idle(client)
        assert agent_of(client).completed - agent_of(client).skipped == 4 and first.started == 2
        with anyio.fail_after(60):
            stats = await collect_batch(client.bus, first.batch, tmp_path / "out.jsonl", wait_s=5)
    failures = read_jsonl(tmp_path / "out_failures.jsonl")
    assert stats.failures == 2 and {f["error_class"] for f in failures} == {"cancelled"}, failures
