"""Branch at turn k a rollout whose session holds a sandbox (issue 78, item 3): real nats-server, real Docker, every
worker in this process (``Client``), the simple agent on ``tests/envs/long_boxed.py`` with ``restorable: files`` (its
snapshot is its counts only: a restored session's files are those of the container it is handed) and the scripted
policy (a TEST DOUBLE for the LLM), which calls the steps in order, one a turn.

Each step bumps a counter file in the session's container and ``verify`` reads every counter back from it, so a
branch's counts say where its files came from: a step of the prefix at 1 is the copy kept at the branch point, a
step after it at 2 is the parent's later write (or a sibling's) seen. The copies kept per turn are parked
containers of the pool (counted against its capacity): they go at their keep's end, a branch whose fork finds no
room is ``sandbox_unavailable`` at once, and a turn whose copy found no room is refused by name.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import yaml

from gym_runtime import Client
from gym_runtime.data.batches import purge_batch
from gym_runtime.messages import CloseSession, RestoreSession, ResumeReply, SeedReply, SeedRequest
from gym_runtime.rollout.checkpoint import Checkpointer
from gym_runtime.sandboxes.client import Sandboxes
from gym_runtime.sandboxes.engine_api import POOL
from gym_runtime.sandboxes.engine_fork import FORK_OF
from gym_runtime.sandboxes.engine_http import Engine
from gym_runtime.transport.subjects import Subjects
from tests.docker import docker_socket
from tests.envs.long_boxed import step_name, task
from tests.long_rollout import containers, new_pool, remove_containers
from tests.test_sandbox_fork import fork_volumes

STEPS = 3  # model turns with a step each (one container write a turn), then one that answers
KEEP_S = 600.0


@pytest.fixture
def pool() -> Any:
    """A pool of its own on the shared engine; whatever a failed test left of it is removed after."""
    name = new_pool(docker_socket())
    yield name
    remove_containers(name)


def config(tmp: Path, pool: str, capacity: int = 8, delay_s: float = 0.0, **sandbox: Any) -> Path:
    agent = {"agent": "agents.simple", "model": "policy", "resource": "env", "timeout_s": 120, "concurrency": 4}
    raw: dict[str, Any] = {
        "namespace": "gym",
        "models": {"policy": {"adapter": "scripted", "token_ids": True, "concurrency": 8, "delay_s": delay_s}},
        "sandboxes": {
            pool: {
                "backend": "docker",
                "capacity": capacity,
                "limits": {"memory_mb": 128, "pids": 64},
                "reap_interval_s": 1.0,
                **sandbox,
            }
        },
        "resources": {"env": {"server": "tests.envs.long_boxed", "sandbox": pool, "options": {"restorable": "files"}}},
        "agents": {"a": agent, "b": agent},
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


async def parent(client: Client, keep_s: float = KEEP_S) -> tuple[str, dict[str, Any]]:
    handle = await client.submit([task(STEPS)], agent="a", keep_checkpoints_s=keep_s)
    with anyio.fail_after(120):
        (row,) = await handle.gather()
    assert row["reward"] == 1.0 and row["counts"] == all_once(STEPS), row
    return f"{handle.batch}:0:0", row


async def branches(client: Client, row: dict[str, Any], key: str, turn: int, m: int, agent: str = "a") -> list[Any]:
    handle = await client.branch(row, parent=key, turn=turn, m=m, agent=agent)
    with anyio.fail_after(120):
        return sorted(await handle.gather(), key=lambda r: r["_ng_rollout_index"])


def all_once(steps: int) -> dict[str, int]:
    return {step_name(i): 1 for i in range(steps)}


async def live(pool: str) -> int:
    return len(await anyio.to_thread.run_sync(containers, pool))


async def snapshots(pool: str) -> list[str]:
    """The pool's fork snapshots (``engine_fork``'s volumes) on the engine now."""
    async with Engine(docker_socket()) as engine:
        return await fork_volumes(engine, pool)


async def settles(pool: str, n: int) -> None:
    """The pool holds ``n`` containers (a closed one's removal may still be under way)."""
    with anyio.fail_after(60):
        while await live(pool) != n:
            await anyio.sleep(0.1)


async def test_a_branch_has_the_files_of_its_turn_and_its_own_writes(nats_server, tmp_path: Path, pool: str) -> None:
    """The prefix's files are there (from the copy kept at turn 2), the parent's later write is not, nor a
    sibling's: every step counts 1 in each branch's container, each container its own. Another agent pool that names
    the rollout finds nothing, and forks nothing."""
    async with Client(config(tmp_path, pool), nats=nats_server.url) as client:
        key, row = await parent(client)
        await settles(pool, STEPS)  # a copy per turn with a call, kept; the parent's own container closed
        parked = STEPS
        stolen = await branches(client, row, key, 2, 1, agent="b")
        assert stolen[0]["error_class"] == "invalid_task" and "no checkpoint" in stolen[0]["error"], stolen
        assert await live(pool) == parked  # nothing forked for it
        rows = await branches(client, row, key, 2, 2)
    for r in rows:
        assert r["reward"] == 1.0 and r["branch_turn"] == 2, r
        assert r["counts"] == all_once(STEPS), r["counts"]  # 2: a later write of the parent's, or a sibling's
    assert len({row["sandbox"], *(r["sandbox"] for r in rows)}) == 3  # a container of its own each


async def test_kept_copies_are_forked_only_for_their_rollout_and_caller(nats_server, tmp_path: Path, pool: str) -> None:
    """The attack in depth: a seed whose restore names the copies kept at a's turn 2 (their lease read from a's
    checkpoint, which only a's pool reads) as another caller's branch, or as a branch of another rollout, is
    refused and forks nothing; from the caller that seeded the parent, as a branch of it, it forks one copy."""
    async with Client(config(tmp_path, pool), nats=nats_server.url) as client:
        key, row = await parent(client)
        await settles(pool, STEPS)
        batch = key.split(":")[0]
        cp = await Checkpointer(client.bus, Subjects.checkpoint_key("a", batch, 0, 0), "off").at_turn(2)
        assert cp is not None and cp.sessions[0].kept is not None
        kept, snap = cp.sessions[0].kept, cp.sessions[0].snapshot or b""

        async def restore(caller: str, parent: str) -> ResumeReply:
            ask = RestoreSession(session="", snapshot=snap, kept=kept, branch_of=parent)
            seed = SeedRequest(row=task(STEPS), then=ask, rollout="x:0:0")
            subject = client.bus.subjects.seed("env", caller)
            reply: SeedReply = await client.bus.request(subject, seed, timeout=60, op="seed")
            assert isinstance(reply.result, ResumeReply)
            close = CloseSession(session=reply.session)  # its session closed: its sandboxes with it
            await client.bus.publish(Subjects.session_call(reply.address, "close", caller), close)
            return reply.result

        own = client.bus.caller  # the caller that seeded the parent's session (one connection here: unsecured)
        for caller, named in [("agent.b", key), (own, f"{batch}:0:1")]:
            refused = await restore(caller, named)
            assert not refused.ok and "not kept for that rollout of this caller" in refused.reason, refused
        assert await live(pool) == STEPS  # nothing forked
        assert (await restore(own, key)).ok
        await settles(pool, STEPS)  # its fork went with its session


async def test_a_live_rollout_is_branched_at_a_turn_it_made(nats_server, tmp_path: Path, pool: str) -> None:
    """The parent still running (1 s a policy call): once its turn-2 checkpoint is stored, a branch there runs in
    a fork of that turn's copy while the parent goes on writing in its own container; neither sees the other's."""
    async with Client(config(tmp_path, pool, delay_s=1.0), nats=nats_server.url) as client:
        handle = await client.submit([task(STEPS)], agent="a", keep_checkpoints_s=KEEP_S)
        cp_key = Subjects.checkpoint_key("a", handle.batch, 0, 0)
        with anyio.fail_after(120):
            while await Checkpointer(client.bus, cp_key, "off").at_turn(2) is None:
                await anyio.sleep(0.05)
        assert not handle.done  # still running
        (r,) = await branches(client, task(STEPS) | {"agent_ref": {"name": "a"}}, f"{handle.batch}:0:0", 2, 1)
        with anyio.fail_after(120):
            (row,) = await handle.gather()
    assert r["reward"] == 1.0 and r["counts"] == all_once(STEPS), r
    assert row["reward"] == 1.0 and row["counts"] == all_once(STEPS), row


async def test_the_agents_own_sandbox_is_kept_per_turn_too(nats_server, tmp_path: Path, pool: str) -> None:
    """A rollout whose agent runs the steps in a sandbox of its own (``ctx.sandbox`` in the agent,
    ``tests/envs/agent_boxed.py``): its copies are kept with each turn's checkpoint, and a branch's container is a
    fork of turn 2's: the prefix's files there, the parent's later ones not, a sibling's not."""
    path = config(tmp_path, pool)
    raw = yaml.safe_load(path.read_text())
    raw["resources"]["env"] = {"server": "tests.envs.agent_boxed"}
    raw["agents"]["a"].update(agent="tests.envs.agent_boxed", sandbox=pool)
    path.write_text(yaml.safe_dump(raw))
    async with Client(path, nats=nats_server.url) as client:
        key, row = await parent(client)
        await settles(pool, STEPS)  # a copy a turn with a call; the agent's own container closed
        rows = await branches(client, row, key, 2, 2)
    for r in rows:
        assert r["reward"] == 1.0 and r["counts"] == all_once(STEPS), r
    assert len({row["container"], *(r["container"] for r in rows)}) == 3


async def test_the_copies_go_at_their_keeps_end_and_leave_nothing(nats_server, tmp_path: Path, pool: str) -> None:
    async with Client(config(tmp_path, pool), nats=nats_server.url) as client:
        key, row = await parent(client, keep_s=10.0)
        assert await live(pool) > 0  # the last turns' copies, kept 10 s from their turns
        with anyio.fail_after(60):  # then removed by their worker's reaper
            while await live(pool):
                await anyio.sleep(0.2)
        (r,) = await branches(client, row, key, 2, 1)
        assert r["error_class"] == "invalid_task", r  # its checkpoint or its copy went too
        async with Engine(docker_socket()) as engine:
            images = [i for i in await engine.images({POOL: f"gym.{pool}"}) if FORK_OF in (i.get("Labels") or {})]
        assert not images and not await live(pool)
    assert await snapshots(pool) == []  # nor a snapshot its forks copied from, once its worker stopped


async def test_a_purged_batch_takes_its_copies_with_it(nats_server, tmp_path: Path, pool: str) -> None:
    async with Client(config(tmp_path, pool), nats=nats_server.url) as client:
        key, row = await parent(client)
        await settles(pool, STEPS)
        await purge_batch(client.bus, key.split(":")[0])
        await settles(pool, 0)  # long before their keep's end
        (r,) = await branches(client, row, key, 2, 1)
    assert r["error_class"] == "invalid_task", r
    assert await snapshots(pool) == []  # nor a snapshot its forks copied from, once its worker stopped


async def test_a_branch_past_the_pools_room_is_sandbox_unavailable_at_once(
    nats_server, tmp_path: Path, pool: str
) -> None:
    """Capacity 3, one sandbox held by the test: the parent's container and its turn-1 copy fill it, so its turn-2
    copy is not kept (the rollout goes on) and a branch there is refused by name. With a second one held, a branch
    at turn 1 finds no room for its fork: ``sandbox_unavailable``, not a wait; with both closed it runs."""
    async with Client(config(tmp_path, pool, capacity=3), nats=nats_server.url) as client:
        held = [Sandboxes(client.bus, pool, deadline=time.time() + 300) for _ in range(2)]
        await held[0].sandbox()
        key, row = await parent(client)
        await settles(pool, 2)  # the test's, and the turn-1 copy
        (unkept,) = await branches(client, row, key, 2, 1)
        assert unkept["error_class"] == "invalid_task" and "no copy of the sandboxes" in unkept["error"], unkept
        await held[1].sandbox()
        started = time.monotonic()
        (full,) = await branches(client, row, key, 1, 1)
        assert full["error_class"] == "sandbox_unavailable", full
        assert time.monotonic() - started < 60  # refused, never waited on
        for h in held:
            await h.close_all()
        (ok,) = await branches(client, row, key, 1, 1)
    assert ok["reward"] == 1.0 and ok["counts"] == all_once(STEPS), ok
