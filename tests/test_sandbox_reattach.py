"""A sandbox kept under its lease past its holder's death (issue 69 item 2), on a real nats-server and a real Docker
engine, in process: a holder that renews keeps it; one that falls silent loses it after the pool's
``lease_grace_s``; a resumed attempt of the same rollout (the same lease) takes it up, files and all; an exec under
a tool call's id runs once."""

from __future__ import annotations

import asyncio
import time

from gym_runtime.messages import SandboxCall, SandboxReply, SandboxSpec
from gym_runtime.sandboxes.client import Sandboxes
from gym_runtime.sandboxes.engine_api import POOL
from gym_runtime.sandboxes.engine_http import Engine
from gym_runtime.transport.bus import Bus
from tests.test_sandbox_worker import fleet, pool, wait_for

__all__ = ["pool"]  # the fixture


def lease(bus: Bus, pool: str, key: str = "b1:0:0") -> Sandboxes:
    return Sandboxes(bus, pool, lease=key, deadline=time.time() + 120)


async def test_a_resumed_attempt_reattaches_by_its_lease_and_an_exec_id_runs_once(
    bus: Bus, engine: Engine, base_image: str, pool: str
) -> None:
    async with fleet(bus, engine, pool) as worker:
        await worker(lease_grace_s=60)
        first = lease(bus, pool)
        box = await first.create(SandboxSpec())
        bump = "n=$(cat c 2>/dev/null || echo 0); echo $((n+1)) > c; cat c"
        assert (await box.exec(bump, id="3.0.ab")).stdout == b"1\n"
        handles = first.handles()
        # the attempt dies here (its holder never closes it); the next one takes it up by the same lease
        stranger = lease(bus, pool, key="b1:0:1")
        stranger.take_up(handles)
        assert not await stranger.reattach()  # another rollout's lease: refused
        second = lease(bus, pool)
        second.take_up(handles)
        again = await second.create(SandboxSpec())
        assert again.id == box.id
        assert (await again.exec(bump, id="3.0.ab")).stdout == b"1\n"  # the replayed call: its first reply
        assert (await again.exec(bump, id="4.0.cd")).stdout == b"2\n"  # the next one runs
        assert (await again.exec("cat c")).stdout == b"2\n"
        other = await second.create(SandboxSpec(memory_mb=64))  # another spec: a fresh container
        assert other.id != box.id
        await second.close_all()
        assert await engine.containers({POOL: f"gym.{pool}"}) == []


async def test_a_silent_holders_sandbox_ends_after_the_grace_and_a_renewing_ones_stays(
    bus: Bus, engine: Engine, base_image: str, pool: str
) -> None:
    async with fleet(bus, engine, pool) as worker:
        await worker(lease_grace_s=3, idle_ttl_s=600, reap_interval_s=0.5)
        alive, dead = lease(bus, pool), lease(bus, pool, key="b1:1:0")
        kept = await alive.create(SandboxSpec())
        gone = await dead.create(SandboxSpec())
        assert alive.renew_s == 0.75  # a quarter of the grace
        await asyncio.sleep(1.0)  # each renewed once at least
        assert dead._renewing is not None
        dead._renewing.cancel()  # its holder dies: no more renewals

        async def only_kept() -> bool:
            return [c["Id"] for c in await engine.containers({POOL: f"gym.{pool}"})] == [kept.id]

        await wait_for(only_kept, timeout=20)
        assert gone.id != kept.id
        await asyncio.sleep(4)  # past the grace again: the renewing holder's is still there
        assert await only_kept()
        await alive.close_all()


async def test_an_older_holder_that_never_renews_is_not_judged_by_the_grace(
    bus: Bus, engine: Engine, base_image: str, pool: str
) -> None:
    """A create without ``renews`` (a holder of an older version) is kept until ``idle_ttl_s`` as before, never
    ended by a grace it cannot know of."""
    async with fleet(bus, engine, pool) as worker:
        await worker(lease_grace_s=2, idle_ttl_s=600, reap_interval_s=0.5)
        create = SandboxCall(op="create", spec=SandboxSpec(), lease="b1:2:0", key="k1")
        reply: SandboxReply = await bus.request(
            bus.subjects.sandbox_create(pool, bus.caller), create, timeout=120, op="sandbox.create"
        )
        assert reply.renew_s == 0.5 and reply.sandbox
        await asyncio.sleep(4)  # twice the grace, with no renewal
        assert [c["Id"] for c in await engine.containers({POOL: f"gym.{pool}"})] == [reply.sandbox]
