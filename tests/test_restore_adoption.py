"""A restore adopts only what the restored rollout held (issue 73 item 4), on a real nats-server and a real Docker
engine, in process: an environment session's sandboxes are leased to the rollout and the caller that seeded it,
and a restore that names them (``RestoreSession.held``) takes them up only for that same rollout of that same
caller. Before, a pool with no sandbox pool of its own restored its own session with ``held`` naming another
rollout's sandbox and lease, then ran a tool in it that answered the other rollout's state."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import anyio

from gym_runtime.agent import Session
from gym_runtime.config import ResourceConfig, SandboxConfig
from gym_runtime.messages import SessionHandle
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.sandboxes.engine_http import Engine
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.subjects import caller_of
from gym_runtime.workers.resource_worker import ResourceWorker
from tests.envs.long_boxed import task
from tests.helpers import resolved
from tests.test_sandbox_worker import fleet, pool

__all__ = ["pool"]  # the fixture

VICTIM = "b1:0:0"  # the victim rollout's key


@contextlib.asynccontextmanager
async def caller(server: EmbeddedServer, role: str, name: str) -> AsyncIterator[Bus]:
    """A connection that calls as ``role.name`` (an unsecured bus takes the caller its subject names; a secured
    one checks it: docs/security.md)."""
    bus = await Bus.connect(server.url, namespace="gym", telemetry=Telemetry(), name=f"{role}-{name}")
    bus.caller = caller_of(role, name)
    try:
        yield bus
    finally:
        await bus.close()


def ran_in(reply_output: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(reply_output)
    return out


async def test_a_restore_takes_up_only_the_sandboxes_leased_to_its_own_rollout_and_caller(
    nats_server: EmbeddedServer, bus: Bus, engine: Engine, base_image: str, pool: str
) -> None:
    cfg = resolved(
        resources={"env": ResourceConfig(server="tests.envs.long_boxed", sandbox=pool, options={"restorable": True})},
        sandboxes={pool: SandboxConfig(engine=f"unix://{engine.socket_path}")},
    )
    env = ResourceWorker(bus, "env", cfg)
    async with fleet(bus, engine, pool) as start, anyio.create_task_group() as tg:
        await start(lease_grace_s=60)
        await tg.start(env.run)
        async with caller(nats_server, "agent", "a") as a, caller(nats_server, "agent", "b") as b:
            victim = Session(a, "env", task(3), rollout=VICTIM)
            first = ran_in((await victim.call("step_00", "{}", snapshot=True)).output)
            held = victim.link.held
            assert held is not None and victim.snapshot is not None
            (box,) = held.sandboxes
            assert first == {"container": box.sandbox[:12], "sandbox": box.sandbox, "count": 1}
            # a dead session's handle naming the victim's snapshot, sandboxes and lease
            handle = SessionHandle(
                resource="env", session="0" * 32, address=env.address, snapshot=victim.snapshot, held=held
            )

            # another pool, claiming the victim's rollout key: refused, it restarts clean in a container of its own
            thief = Session(b, "env", task(3), rollout=VICTIM)
            assert await thief.resume(handle) == "restarted"
            stolen = ran_in((await thief.call("step_00", "{}")).output)
            assert stolen["sandbox"] != box.sandbox and stolen["count"] == 1
            # the victim's own pool, another of its rollouts: refused too
            sibling = Session(a, "env", task(3), rollout="b1:1:0")
            assert await sibling.resume(handle) == "restarted"
            assert ran_in((await sibling.call("step_00", "{}")).output)["sandbox"] != box.sandbox
            # the victim's container was never driven by either
            again = ran_in((await victim.call("step_00", "{}")).output)
            assert again == {"container": box.sandbox[:12], "sandbox": box.sandbox, "count": 2}

            # the rollout itself, resumed by its own pool: restored into the container it held, files and all
            heir = Session(a, "env", task(3), rollout=VICTIM)
            assert await heir.resume(handle) == "restored"
            taken = ran_in((await heir.call("step_01", "{}")).output)
            assert taken["sandbox"] == box.sandbox and taken["count"] == 1
            for s in (thief, sibling, heir, victim):
                await s.close()
        tg.cancel_scope.cancel()
