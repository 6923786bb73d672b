"""Large bodies in flight: one process holds at most ``jetstream.blob_bytes_in_flight`` bytes of bodies it
stores or reads through the blob stream at once; more wait their turn (back-pressure), none is dropped.

Real workers of every role in this process on a real server (they share one connection, so one budget),
``tests.envs.big``'s 9 MB tool outputs: every hop of a rollout carries a body over the 8 MB max payload.
"""

from __future__ import annotations

from pathlib import Path

import anyio

from gym_runtime.config import load_config, resolve_config
from gym_runtime.data.collector import Collector
from gym_runtime.data.inputs import publish_rows
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.service.runner import drain, make_workers, selected, start_workers
from gym_runtime.transport.blobs import ByteBudget
from gym_runtime.transport.bus import Bus
from tests.helpers import REPO, eventually, put_batch, read_jsonl

SIZE = 9_000_000
CAP = 40 << 20


async def test_many_large_bodies_at_once_hold_at_most_the_cap_and_all_complete(
    nats_server: EmbeddedServer, tmp_path: Path
) -> None:
    cfg = load_config(
        REPO / "resources/weather/config.yaml",
        [
            "resources.weather.server=tests.envs.big",
            f"resources.weather.options.size={SIZE}",
            f"jetstream.blob_bytes_in_flight={CAP}",
        ],
    )
    bus = await Bus.connect(nats_server.url, namespace="gym", telemetry=Telemetry(), name="t", jetstream=cfg.jetstream)
    rows = read_jsonl(REPO / "resources/weather/data/example.jsonl")
    n = 6
    try:
        workers = make_workers(bus, resolve_config(cfg), selected(cfg, None))
        async with anyio.create_task_group() as tg:
            await start_workers(tg, workers)
            await publish_rows(bus, rows[:3], batch="big", agents=["weather_agent"], repeats=2)
            with anyio.fail_after(120):
                manifest = await put_batch(bus, "big", 3, repeats=2, agent="weather_agent")
                stats = await Collector(bus, manifest, tmp_path / "o.jsonl").run()
            await drain(workers, timeout=5)
            tg.cancel_scope.cancel()
        budget = bus.blob_budget
    finally:
        await bus.close()
    got = read_jsonl(tmp_path / "o.jsonl")
    assert stats.rows == n and stats.failures == 0 and all(r["reward"] == 1.0 for r in got)
    # every rollout moves ~60 MB of bodies (tool output, model request and answer, result row); with a
    # 10 GiB cap the same six held 136 MB at once (measured)
    assert 2 * SIZE < budget.peak <= CAP, budget.peak
    assert budget.held == 0


async def test_a_waiter_cancelled_in_the_queue_gives_its_turn_on_and_holds_nothing() -> None:
    budget = ByteBudget(10)
    order: list[str] = []

    holding, release = anyio.Event(), anyio.Event()

    async def take(name: str, n: int) -> None:
        async with budget.hold(n):
            order.append(name)

    async def first() -> None:  # holds until told: events, not spans a loaded machine could outlast
        async with budget.hold(8):
            order.append("first")
            holding.set()
            await release.wait()

    async with anyio.create_task_group() as tg:
        tg.start_soon(first)
        await holding.wait()
        with anyio.move_on_after(0.05):  # queued behind "first", then given up
            await take("cancelled", 5)
        tg.start_soon(take, "big", 30)  # over the whole cap: goes alone once nothing is held
        tg.start_soon(take, "small", 2)  # first come, first served: waits behind "big"
        await eventually(lambda: len(budget._waiters) == 2)  # both queued behind "first"
        release.set()
    assert order == ["first", "big", "small"] and budget.held == 0 and budget.peak == 30
