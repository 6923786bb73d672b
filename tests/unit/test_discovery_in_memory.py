"""Discovery on the in-memory transport: a caller that knows whom it expects stops waiting once they answered,
not at the end of a window a loaded machine can overrun, and an answer claiming another lane is still dropped.
The same on a real (secured) server: ``tests/e2e/test_secured_bus_attacks.py``."""

from __future__ import annotations

import json
import time
from typing import Any

from gym_runtime.testing import MemoryTransport
from gym_runtime.transport.delivery import Delivery
from gym_runtime.transport.discovery import discover, register, serving
from gym_runtime.transport.subjects import answer, lane


def counters() -> dict[str, Any]:
    return {"in_flight": 0}


async def answer_as(bus: MemoryTransport, msg: Delivery, in_lane: tuple[str, str], **claims: str) -> None:
    """A discovery answer into ``in_lane`` (role, name) claiming ``claims`` (role, name, worker)."""
    assert msg.reply is not None
    body = {"namespace": bus.ns, **claims}
    await bus.publish_raw(answer(msg.reply, lane(*in_lane)), json.dumps(body).encode())


async def test_discovery_waits_until_the_expected_workers_answered_and_no_longer() -> None:
    async with MemoryTransport() as bus:
        await register(bus, "agent", "a", "w1", counters)
        await register(bus, "resource", "r", "w2", counters)

        async def forge(msg: Delivery) -> None:  # a pool answering in its own lane, claiming to be a model replica
            await answer_as(bus, msg, ("agent", "a"), role="model", name="policy", worker="ghost")

        await bus.subscribe(bus.subjects.status, forge)
        t0 = time.monotonic()
        both = await discover(bus, wait_s=60, until=lambda ws: {w["name"] for w in ws} >= {"a", "r"})
        assert time.monotonic() - t0 < 30  # it stopped when both had answered, not at the end of the window
        assert [(w["role"], w["name"], w["worker"]) for w in both] == [("agent", "a", "w1"), ("resource", "r", "w2")]
        assert await serving(bus, "resource", {"r", "s"}, wait_s=0.2) == {"r"}  # one that never answers: the window
        t0 = time.monotonic()
        assert await serving(bus, "agent", {"a"}, wait_s=60) == {"a"}
        assert time.monotonic() - t0 < 30
        assert await serving(bus, "model", {"policy"}, wait_s=0.2) == set()  # the forged answer is not believed


async def test_an_answer_lost_once_is_asked_for_again_within_the_window() -> None:
    """Core NATS carries a request and its answers at most once: a worker whose answer to the first round is lost
    (its connection busy or reconnecting as the request passed) is found by the next round, within the window,
    and counted once however many rounds it answered."""
    async with MemoryTransport() as bus:
        await register(bus, "agent", "a", "w1", counters)
        heard: list[str] = []

        async def late(msg: Delivery) -> None:  # the resource worker: its first answer never arrives
            heard.append(msg.subject)
            if len(heard) > 1:
                await answer_as(bus, msg, ("resource", "r"), role="resource", name="r", worker="w2")

        await bus.subscribe(bus.subjects.status, late)
        t0 = time.monotonic()
        both = await discover(bus, wait_s=60, until=lambda ws: {w["name"] for w in ws} >= {"a", "r"})
        assert time.monotonic() - t0 < 30
        assert [(w["role"], w["name"], w["worker"]) for w in both] == [("agent", "a", "w1"), ("resource", "r", "w2")]
        assert len(heard) >= 2
