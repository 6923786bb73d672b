"""workers.resource_worker: sessions are actors pinned to the worker that seeded them (real server, weather).

A seed opens a session here and names this worker's address; later calls go to that address; a
call for a session this worker does not hold is ``worker_lost`` (the caller redelivers, never hangs);
past ``max_sessions`` the least recently used session is closed; a row its publisher could not
check is checked at seed time.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from gym_runtime.config import ResourceConfig
from gym_runtime.errors import Failure
from gym_runtime.messages import RowCheck, SeedReply, SeedRequest, ToolCall, ToolReply
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.subjects import Subjects
from gym_runtime.workers.resource_worker import ResourceWorker
from tests.helpers import ROWS, resolved


@contextlib.asynccontextmanager
async def serving(bus: Bus) -> AsyncIterator[ResourceWorker]:
    """A weather resource worker (at most 3 sessions) in this process, for the block (a task group
    cannot be held open across a pytest-asyncio fixture's yield)."""
    w = ResourceWorker(
        bus, "weather", resolved(resources={"weather": ResourceConfig(server="resources.weather", max_sessions=3)})
    )
    async with anyio.create_task_group() as tg:
        await tg.start(w.run)
        yield w
        tg.cancel_scope.cancel()


def weather_call(session: str = "", city: str = "Paris") -> ToolCall:
    return ToolCall(session=session, name="get_weather", arguments=json.dumps({"city": city}))


async def seed(
    bus: Bus, *, row: dict[str, Any], then: ToolCall | None = None, check: RowCheck | None = None
) -> SeedReply:
    request = SeedRequest(row=row, then=then, check=check)
    reply = await bus.request(bus.subjects.seed("weather", bus.caller), request, timeout=10, op="seed")
    assert isinstance(reply, SeedReply)
    return reply


async def test_a_session_lives_on_the_worker_that_seeded_it(bus: Bus) -> None:
    async with serving(bus) as worker:
        reply = await seed(bus, row=ROWS[0], then=weather_call())
        assert reply.address == worker.address and reply.session in worker.sessions
        assert isinstance(reply.result, ToolReply) and "Paris" in reply.result.output
        again = await bus.request(
            Subjects.session_call(reply.address, "tool", bus.caller),
            weather_call(reply.session, "Oslo"),
            timeout=10,
            op="tool",
        )
        assert isinstance(again, ToolReply) and "Oslo" in again.output


async def test_a_call_for_a_session_not_held_here_is_worker_lost(bus: Bus) -> None:
    async with serving(bus) as worker:
        with pytest.raises(Failure) as e:
            await bus.request(
                Subjects.session_call(worker.address, "tool", bus.caller),
                weather_call("no-such-session"),
                timeout=10,
                op="tool",
            )
        assert e.value.info.error_class == "worker_lost" and e.value.info.retryable


async def test_past_max_sessions_the_least_recently_used_is_closed(bus: Bus) -> None:
    async with serving(bus) as worker:
        first = await seed(bus, row=ROWS[0])
        others = [await seed(bus, row=ROWS[0]) for _ in range(3)]
        assert len(worker.sessions) == 3 and worker.evicted == 1
        assert first.session not in worker.sessions and all(o.session in worker.sessions for o in others)


async def test_a_row_its_publisher_could_not_check_is_checked_at_seed(bus: Bus) -> None:
    async with serving(bus) as worker:
        row = json.loads(json.dumps(ROWS[0]))
        row["responses_create_params"]["tools"][0]["name"] = "get_wether"
        with pytest.raises(Failure) as e:
            await seed(bus, row=row, check=RowCheck())
        assert e.value.info.error_class == "invalid_task" and "get_wether" in e.value.info.message
        assert not worker.sessions  # nothing was opened
        assert (await seed(bus, row=row, check=RowCheck(any_tools=True))).session in worker.sessions
        assert (await seed(bus, row=row)).session in worker.sessions  # checked by its publisher: not again
