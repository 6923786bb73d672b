"""A resource worker's session limit is per caller (issue 33, "Agents reach only their environments").

The caller is the pool its reply subject names (``_INBOX.{role}.{pool}...``; on a ``server --secure`` bus a
pool may subscribe only to its own inbox). Before, ``max_sessions`` evicted the least recently used session
of the whole worker: one pool's flood of seed requests (25,000 in the red team's run) closed other pools'
live sessions and their rollouts became ``worker_lost`` rows.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest

from gym_runtime.config import AgentConfig, ResourceConfig
from gym_runtime.errors import Failure
from gym_runtime.messages import SeedReply, SeedRequest, ToolCall, ToolReply
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.ops.permissions import Reach
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.subjects import Subjects
from gym_runtime.workers.resource_worker import ResourceWorker
from tests.helpers import ROWS, pool_bus, resolved, secured_server

LIMIT = 8


@pytest.fixture
def pooled(tmp_path: Path) -> Iterator[tuple[EmbeddedServer, Path]]:
    """A secured server with the weather pool and two agent pools that both run rollouts on weather."""
    reach = Reach(agents={"weather_agent": ("weather",), "other_agent": ("weather",)})
    with secured_server(tmp_path, POOLS, reach) as server:
        yield server


@asynccontextmanager
async def weather_pools(
    server: tuple[EmbeddedServer, Path], agents: list[str]
) -> AsyncIterator[tuple[ResourceWorker, Bus, Bus]]:
    """A weather worker (``LIMIT`` sessions per caller; ``agents``: the config's agents) on the weather
    pool's credential, and buses of the weather_agent pool (honest) and the other_agent pool."""
    srv, auth = server
    buses = [await pool_bus(srv.url, auth, role, pool) for role, pool in POOLS]
    cfg = ResourceConfig(server="resources.weather", max_sessions=LIMIT)
    config = resolved(
        resources={"weather": cfg}, agents={a: AgentConfig(agent="agents.simple", model="policy") for a in agents}
    )
    worker = ResourceWorker(buses[0], "weather", config)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(worker.run)
            yield worker, buses[1], buses[2]
            tg.cancel_scope.cancel()
    finally:
        for b in buses:
            await b.close()


POOLS = [("resource", "weather"), ("agent", "weather_agent"), ("agent", "other_agent")]


def call(session: str) -> ToolCall:
    return ToolCall(session=session, name="get_weather", arguments=json.dumps({"city": "Paris"}))


async def seed(bus: Bus) -> SeedReply:
    reply = await bus.request(bus.subjects.seed("weather", bus.caller), SeedRequest(row=ROWS[0]), timeout=10, op="seed")
    assert isinstance(reply, SeedReply)
    return reply


async def seeded(worker: ResourceWorker, n: int) -> None:
    """Until the worker has opened ``n`` sessions (requests published without waiting for their replies)."""
    with anyio.fail_after(30):
        while worker.seeded < n:
            await anyio.sleep(0.01)


async def still_open(bus: Bus, sessions: list[SeedReply]) -> int:
    alive = 0
    for s in sessions:
        try:
            subject = Subjects.session_call(s.address, "tool", bus.caller)
            reply = await bus.request(subject, call(s.session), timeout=10, op="tool")
        except Failure as e:
            assert e.info.error_class == "worker_lost"
            continue
        assert isinstance(reply, ToolReply) and "Paris" in reply.output
        alive += 1
    return alive


async def test_one_pools_seed_flood_evicts_only_its_own_sessions(pooled) -> None:  # noqa: F811
    async with weather_pools(pooled, ["weather_agent", "other_agent"]) as (worker, honest, flooder):
        mine = [await seed(honest) for _ in range(LIMIT // 2)]
        flood = [await seed(flooder) for _ in range(20 * LIMIT)]
        assert await still_open(honest, mine) == len(mine)  # before: 0 (the flood closed them all)
        # the flooder's own sessions are bounded: its least recently used went first
        assert await still_open(flooder, flood[-LIMIT:]) == LIMIT
        assert await still_open(flooder, flood[:-LIMIT]) == 0
        assert len(worker.sessions) == len(mine) + LIMIT


async def test_callers_not_in_the_config_share_one_bounded_table(pooled) -> None:  # noqa: F811
    """A reply subject is chosen by whoever publishes the request: inboxes naming no pool of the config (made
    up, one per request) are one caller, so they cannot multiply the worker's sessions either."""
    async with weather_pools(pooled, ["weather_agent"]) as (worker, honest, flooder):
        mine = [await seed(honest) for _ in range(LIMIT // 2)]
        body = flooder.codec.encode(SeedRequest(row=ROWS[0]))
        own = flooder.subjects.seed("weather", flooder.caller)  # its own seed subject: the server allows no other
        for i in range(20 * LIMIT):
            await flooder.nc.publish(own, body, reply=f"_INBOX.agent.made_up_{i}.x.res.weather.1")
        await seeded(worker, len(mine) + 20 * LIMIT)
        assert await still_open(honest, mine) == len(mine)
        assert len(worker.sessions) == len(mine) + LIMIT


async def test_a_pool_naming_another_pools_inbox_cannot_evict_its_sessions(pooled) -> None:  # noqa: F811
    """A request's reply subject is the publisher's choice (NATS checks the subject of a publish, not its reply):
    so the caller a worker counts is in the seed subject, ``{ns}.res.{R}.seed.{role}.{pool}``, each pool allowed
    only its own. Naming the victim's inbox, or publishing on the victim's seed subject, evicts nothing."""
    async with weather_pools(pooled, ["weather_agent", "other_agent"]) as (worker, honest, forger):
        mine = [await seed(honest) for _ in range(LIMIT // 2)]
        body = forger.codec.encode(SeedRequest(row=ROWS[0]))
        victims = honest.subjects.seed("weather", honest.caller)
        own = forger.subjects.seed("weather", forger.caller)
        for i in range(4 * LIMIT):
            await forger.nc.publish(victims, body, reply=f"_INBOX.agent.weather_agent.f.res.weather.{i}")  # refused
            await forger.nc.publish(own, body, reply=f"_INBOX.agent.weather_agent.f.res.weather.{i}")
        await seeded(worker, len(mine) + 4 * LIMIT)  # the ones on its own subject, counted as its own
        assert await still_open(honest, mine) == len(mine)  # before: evicted (the reply named weather_agent)
        assert len(worker.sessions) == len(mine) + LIMIT
