"""Scheduling in the sandbox fleet, in process on a real nats-server and a real Docker engine: warm pools
(a warm container is used once, then removed; the pool refills) and the pool-wide quota (``max_live``:
never more live containers than it, across workers; a create past it waits for a lease, never fails)."""

from __future__ import annotations

import socket
import time
import urllib.request
import uuid

import anyio
import pytest

from gym_runtime.config import config_from_dict
from gym_runtime.errors import ConfigError
from gym_runtime.observability.meters import start as start_meters
from gym_runtime.ops.status import gather, render
from gym_runtime.sandboxes.client import Sandboxes
from gym_runtime.sandboxes.engine_api import LEASE, POOL
from gym_runtime.sandboxes.engine_http import Engine
from gym_runtime.transport.bus import Bus
from gym_runtime.workers.sandbox_worker import WARM_LEASE
from tests.test_sandbox_worker import fleet, wait_for


@pytest.fixture
def pool() -> str:
    return f"s{uuid.uuid4().hex[:8]}"


async def test_a_warm_pool_serves_creates_once_each_and_refills(
    bus: Bus, engine: Engine, base_image: str, pool: str
) -> None:
    label = f"gym.{pool}"

    async def warm_ids() -> set[str]:
        return {c["Id"] for c in await engine.containers({POOL: label, LEASE: WARM_LEASE})}

    async with fleet(bus, engine, pool) as worker:
        w = await worker(warm=3, capacity=8)
        await wait_for(lambda: _true(len(w.warm) == 3 and w.warming == 0), timeout=60)
        first = await warm_ids()
        assert first == set(w.warm)  # idle, labelled as warm (no lease yet)
        boxes = Sandboxes(bus, pool, lease="b:0:0", deadline=time.time() + 60)
        got = [await boxes.sandbox() for _ in range(3)]
        assert {b.id for b in got} == first  # each a warm one, none created for the call
        assert (await got[0].exec("echo ok")).stdout == b"ok\n"
        custom = await boxes.sandbox(cpu=0.5)  # another spec than the warm one: created cold
        assert custom.id not in first
        await boxes.close_all()

        async def removed() -> bool:  # a close is answered at once; the engine removes it just after
            live = {c["Id"] for c in await engine.containers({POOL: label})}
            return not live & (first | {custom.id})

        await wait_for(removed, timeout=30)  # used once, then removed: never handed out again
        await wait_for(lambda: _true(len(w.warm) == 3 and w.warming == 0), timeout=60)  # refilled, anew
        assert not (await warm_ids()) & first
        assert w.stats()["warm_hits"] == 3 and w.stats()["warm"] == 3
        shown = render(await gather(bus))  # what `gym-runtime status` prints
        assert f"sandbox {pool}: 1 replica(s); 3 live, 3 warm, 3 warm hits, 7 created" in shown, shown


async def test_warm_pools_per_image_serve_each_images_creates_warm(
    bus: Bus, engine: Engine, base_image: str, swe_demo_image: str, pool: str
) -> None:
    task_image = swe_demo_image  # a second image: the base plus a repository
    async with fleet(bus, engine, pool) as worker:
        w = await worker(warm=1, warm_images={task_image: 2}, capacity=8)
        await wait_for(lambda: _true(len(w.warm) == 3 and w.warming == 0), timeout=90)
        ready = {sid: (await engine.inspect(sid))["Config"]["Image"] for sid in w.warm}
        assert sorted(ready.values()) == sorted([base_image, task_image, task_image])
        boxes = Sandboxes(bus, pool, lease="i:0:0", deadline=time.time() + 60)
        tasks = [await boxes.sandbox(task_image) for _ in range(2)]
        assert all(ready.get(b.id) == task_image for b in tasks)  # each a warm one of its image
        assert (await tasks[0].exec("test -f /testbed/calc.py && echo repo")).stdout == b"repo\n"
        default = await boxes.sandbox()
        assert ready.get(default.id) == base_image
        assert (await default.exec("test -e /testbed || echo bare")).stdout == b"bare\n"
        assert w.stats()["warm_hits"] == 3
        third = await boxes.sandbox(task_image, memory_mb=128)  # not the warm spec of its image: cold
        assert third.id not in ready
        await boxes.close_all()
        await wait_for(lambda: _true(len(w.warm) == 3 and w.warming == 0), timeout=90)  # each image refilled
        again = sorted([(await engine.inspect(sid))["Config"]["Image"] for sid in w.warm])
        assert again == sorted([base_image, task_image, task_image]) and not set(w.warm) & set(ready)


async def _is(ids: object, n: int) -> bool:
    return len(await ids()) == n  # type: ignore[operator]


async def test_a_quota_across_two_workers_is_never_passed_and_creates_wait_for_a_lease(
    bus: Bus, engine: Engine, base_image: str, pool: str
) -> None:
    label, most = f"gym.{pool}", 0
    done = anyio.Event()

    async def watch() -> None:
        nonlocal most
        while not done.is_set():
            most = max(most, len(await engine.containers({POOL: label})))
            await anyio.sleep(0.02)

    async with fleet(bus, engine, pool) as worker:
        # two replicas of the pool: the quota counts at most ``replicas`` workers (issue 52)
        a = await worker(max_live=3, capacity=16, warm=1, replicas=2)
        b = await worker(max_live=3, capacity=16, warm=1, replicas=2)
        await wait_for(lambda: _true(a.limit() + b.limit() == 3), timeout=20)  # shares: 2 and 1
        waits: list[float] = []
        extended: list[float] = []

        async def rollout(i: int) -> None:
            boxes = Sandboxes(bus, pool, lease=f"b:{i}:0", deadline=time.time() + 120)
            boxes.on_acquire = lambda took: extended.append(took) if took is not None else None
            async with boxes.sandbox() as box:
                assert (await box.exec("sleep 0.3; echo $((1+1))")).stdout == b"2\n"
            waits.append(boxes.waited_s)

        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            async with anyio.create_task_group() as rollouts:
                for i in range(12):
                    rollouts.start_soon(rollout, i)
            done.set()
        assert len(waits) == 12  # every create got a lease; none failed
        assert 0 < most <= 3, most
        assert sum(extended) == pytest.approx(sum(waits))  # each acquisition's time reported to its holder
        assert max(waits) > 0.3  # some waited for another's lease to end
        assert a.stats()["created"] + b.stats()["created"] >= 12
        shown = render(await gather(bus))
        assert f"sandbox {pool}: 2 replica(s); " in shown and " live of max_live 3, " in shown, shown


async def _true(v: bool) -> bool:
    return v


async def test_a_pools_metrics_on_its_prometheus_endpoint(bus: Bus, engine: Engine, base_image: str, pool: str) -> None:
    """What an operator scrapes: live and warm sandboxes, creates, warm hits and acquire latency per pool."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    meters = start_meters(service="test", role="sandbox", port=port)
    bus.telemetry.meters = meters
    try:
        async with fleet(bus, engine, pool) as worker:
            w = await worker(warm=2, capacity=4)
            await wait_for(lambda: _true(len(w.warm) == 2 and w.warming == 0), timeout=60)
            boxes = Sandboxes(bus, pool, lease="m:0:0", deadline=time.time() + 60)
            await (await boxes.sandbox()).exec("true")
            await boxes.sandbox(cpu=0.5)  # cold
            text = await anyio.to_thread.run_sync(
                lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            )
            await boxes.close_all()
    finally:
        meters.shutdown()
    mine = [line for line in text.splitlines() if f'gym_name="{pool}"' in line]
    assert any(line.startswith("gym_sandbox_warm_hits_total{") and line.endswith(" 1.0") for line in mine), mine
    assert any(line.startswith("gym_sandbox_live{") for line in mine), mine
    assert any(line.startswith("gym_sandbox_created_total{") for line in mine), mine
    counts = {line.split("{")[0]: line for line in mine if "_acquire_seconds_count" in line}
    assert len([line for line in mine if line.startswith("gym_sandbox_acquire_seconds_count")]) == 2, counts
    assert any(line.startswith("gym_sandbox_exec_seconds_count{") and line.endswith(" 1.0") for line in mine), mine


@pytest.mark.parametrize(
    ("entry", "said"),
    [
        ({"capacity": 2, "warm": 5}, "sandboxes.box: warm (5) must not exceed capacity (2)"),
        ({"max_live": -1}, "sandboxes.box: max_live and warm must be at least 0"),
        ({"capacity": 4, "warm": 1, "warm_images": {"x:1": 4}}, "warm (1) plus warm_images (4) must not exceed"),
        ({"warm_images": {"x:1": -1}}, "sandboxes.box: warm_images counts must be at least 0"),
        ({"backend": "dockr"}, "sandboxes.box.backend: Invalid enum value 'dockr' (one of: daytona, docker, podman, "),
        ({"max_live": 2, "warm": 3}, "sandboxes.box: max_live (2) is less than warm (3): warm containers count"),
        ({"max_live": 2, "warm": 1, "warm_images": {"x:1": 2}}, "max_live (2) is less than warm (1) plus warm_images"),
    ],
)
def test_a_scheduling_mistake_in_the_config_is_one_line(entry: dict[str, object], said: str) -> None:
    with pytest.raises(ConfigError) as e:
        config_from_dict({"sandboxes": {"box": entry}})
    assert said in str(e.value) and "\n" not in str(e.value)
