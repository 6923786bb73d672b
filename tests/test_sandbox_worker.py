"""Sandbox workers on a real nats-server and a real Docker engine, in process: the author's API over the
bus, the pool's limits, and the reaper (dead workers' containers, ended leases, idle sandboxes)."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import anyio
import pytest

from gym_runtime.config import SandboxConfig, SandboxLimits, config_from_dict, resolve_config
from gym_runtime.data.collector import Collector
from gym_runtime.data.inputs import publish_rows
from gym_runtime.errors import Failure
from gym_runtime.messages import SandboxSpec
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.sandboxes.backend import Resolved
from gym_runtime.sandboxes.client import Sandboxes
from gym_runtime.sandboxes.engine_api import POOL, EngineBackend
from gym_runtime.sandboxes.engine_http import Engine
from gym_runtime.sandboxes.leases import lease_tag
from gym_runtime.sandboxes.reaper import DEAD_AFTER_S
from gym_runtime.service.runner import make_workers, selected, start_workers
from gym_runtime.transport.bus import Bus
from gym_runtime.workers.sandbox_worker import SandboxWorker
from tests.helpers import ROWS, put_batch, read_jsonl


@pytest.fixture
def pool() -> str:
    return f"t{uuid.uuid4().hex[:8]}"


@contextlib.asynccontextmanager
async def fleet(bus: Bus, engine: Engine, pool: str) -> AsyncIterator[Callable[..., Awaitable[SandboxWorker]]]:
    """Start sandbox workers of ``pool`` in this process (``await start(**config)``) for the block (a task
    group cannot be held open across a pytest-asyncio fixture's yield); after it, none of its containers."""
    async with anyio.create_task_group() as tg:

        async def start(**cfg: object) -> SandboxWorker:
            w = SandboxWorker(bus, pool, SandboxConfig(engine=f"unix://{engine.socket_path}", **cfg))  # type: ignore[arg-type]
            await tg.start(w.run)
            return w

        yield start
        tg.cancel_scope.cancel()
    for c in await engine.containers({POOL: f"gym.{pool}"}):
        await engine.remove(c["Id"])


async def wait_for(pred: Callable[[], object], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not await pred():  # type: ignore[misc]
        assert time.monotonic() < deadline, "timed out"
        await anyio.sleep(0.1)


async def test_the_authors_api_over_the_bus_and_the_pools_limits(
    bus: Bus, engine: Engine, base_image: str, pool: str
) -> None:
    async with fleet(bus, engine, pool) as worker:
        w = await worker(limits=SandboxLimits(memory_mb=128, max_output=1000, timeout_s=5))
        boxes = Sandboxes(bus, pool, lease="b1:0:0", deadline=time.time() + 60)
        async with boxes.sandbox() as box:
            r = await box.exec("echo hi; echo oops >&2; exit 4")
            assert (r.exit_code, r.stdout, r.stderr) == (4, b"hi\n", b"oops\n")
            await box.write("a/b.txt", "hello")
            assert await box.read("a/b.txt") == b"hello"
            r = await box.exec("head -c 100000 /dev/zero")
            assert r.truncated and len(r.stdout) == 1000
            r = await box.exec(["sleep", "30"], timeout_s=60)  # the pool's timeout_s caps the author's
            # uncapped, ``sleep 30`` alone takes 30 s whatever the load: under that is the pool's 5 s cap
            assert r.timed_out and r.exit_code is None and r.duration_s < 30
            [c] = await engine.containers({POOL: f"gym.{pool}"})
            assert c["Labels"]["gym-runtime.lease"] == lease_tag("b1:0:0")  # never the lease itself
        assert await engine.containers({POOL: f"gym.{pool}"}) == []
        assert w.stats()["sandboxes"] == 0
        with pytest.raises(Failure, match=rf"sandboxes\.{pool}: memory_mb=4096 is past the pool's limit \(128\)"):
            await boxes.sandbox(memory_mb=4096)
        with pytest.raises(Failure, match="no network"):
            await boxes.create(SandboxSpec(network=True))
        with pytest.raises(Failure, match=r"set agents\.x\.sandbox"):
            await Sandboxes(bus, "", lease="l", where="agents.x").sandbox()
        # a rollout's end closes what its author left open
        left = [await boxes.sandbox(), await boxes.sandbox()]
        assert len(await engine.containers({POOL: f"gym.{pool}"})) == 2
        await boxes.close_all()
        assert all(b.closed for b in left) and await engine.containers({POOL: f"gym.{pool}"}) == []


async def test_the_reaper_removes_dead_workers_containers_and_ended_leases_never_a_live_peers(
    bus: Bus, engine: Engine, base_image: str, pool: str
) -> None:
    async with fleet(bus, engine, pool) as worker:
        # a worker nobody here heard (dead, or another cluster's): its container ends by itself (unrenewed)
        backend = EngineBackend(engine, name="docker", pool=f"gym.{pool}", orphan_after_s=2)
        spec = Resolved(image=base_image, cpu=0.5, memory_mb=64, pids=16, disk_mb=4, timeout_s=5, max_output=100)
        dead = await backend.create(spec, owner="deadworker00", lease="x", expires=time.time() + 3600)
        # one its worker created and was SIGKILLed before it started it: no keeper runs in it to end it
        body = backend.container_body(spec, owner="deadworker01", lease="z", expires=time.time() + 3600)
        never_started = await engine.create(body, name=f"gym-{pool}-never-started")
        peer = await worker(reap_interval_s=0.5)  # a live peer: its own sandbox stays
        boxes = Sandboxes(bus, pool, lease="kept", deadline=time.time() + 3600)
        kept = await boxes.sandbox()
        ended = await backend.create(spec, owner=peer.worker_id, lease="y", expires=time.time() + 2)
        await worker(reap_interval_s=0.5, orphan_after_s=2)  # listens DEAD_AFTER_S, then sweeps

        async def only_kept() -> bool:
            return {c["Id"] for c in await engine.containers({POOL: f"gym.{pool}"})} == {kept.id}

        await wait_for(only_kept, timeout=DEAD_AFTER_S + 10)
        assert len({dead, ended, never_started}) == 3
        r = await kept.exec("echo alive")
        assert r.stdout == b"alive\n"


async def test_a_reaper_never_removes_a_live_clusters_containers_on_a_shared_engine(
    bus: Bus, engine: Engine, base_image: str, pool: str, tmp_path: Path
) -> None:
    """Another cluster (its own nats-server, the same namespace and pool names) on the same engine: this
    cluster's reaper never hears its workers, and leaves its containers alone (round 4 of the red team: labels
    carried only the namespace and pool, and the other cluster's live sandboxes were taken for a dead worker's)."""
    other = EmbeddedServer(store_dir=str(tmp_path / "js2"))
    other.start()
    other_bus = await Bus.connect(other.url, namespace="gym", telemetry=Telemetry(), name="other-cluster")
    try:
        async with fleet(other_bus, engine, pool) as other_worker:
            theirs = await other_worker(reap_interval_s=0.3)
            boxes = Sandboxes(other_bus, pool, lease="theirs", deadline=time.time() + 3600)
            box = await boxes.sandbox()
            async with fleet(bus, engine, pool) as worker:
                mine = await worker(reap_interval_s=0.3)
                assert mine.reaper is not None

                async def swept() -> bool:
                    return mine.reaper is not None and mine.reaper.sweeps >= 5

                await wait_for(swept, timeout=DEAD_AFTER_S + 60)
                assert mine.reaper.reaped == 0
                assert [c["Id"] for c in await engine.containers({POOL: f"gym.{pool}"})] == [box.id]
                assert (await box.exec("echo alive")).stdout == b"alive\n"
                assert theirs.stats()["sandboxes"] == 1
    finally:
        await other_bus.close()
        other.stop()


async def test_an_idle_sandbox_whose_holder_vanished_is_removed(
    bus: Bus, engine: Engine, base_image: str, pool: str
) -> None:
    async with fleet(bus, engine, pool) as worker:
        w = await worker(idle_ttl_s=1, reap_interval_s=0.3)
        boxes = Sandboxes(bus, pool, lease="gone", deadline=time.time() + 3600)
        box = await boxes.sandbox()
        busy = await box.exec("sleep 2; echo done", timeout_s=10)  # in use longer than idle_ttl_s: not idle
        assert busy.stdout == b"done\n"

        async def none_left() -> bool:
            return await engine.containers({POOL: f"gym.{pool}"}) == []

        await wait_for(none_left, timeout=DEAD_AFTER_S + 10)
        assert w.stats()["sandboxes"] == 0
        with pytest.raises(Failure, match="not held"):
            await box.exec("true")


async def test_a_rollouts_sandboxes_end_with_it_scored_failed_or_timed_out(
    bus: Bus, engine: Engine, base_image: str, pool: str, tmp_path: Path
) -> None:
    cfg = config_from_dict(
        {
            "namespace": "gym",
            "models": {"policy": {"adapter": "scripted"}},
            "sandboxes": {pool: {"engine": f"unix://{engine.socket_path}"}},
            "resources": {"env": {"server": "resources.weather"}},
            "agents": {
                "agent": {
                    "agent": "tests.envs.sandbox_leases",
                    "model": "policy",
                    "resource": "env",
                    "sandbox": pool,
                    "timeout_s": 3,
                    "max_attempts": 1,
                }
            },
            "base_dir": str(tmp_path),
        }
    )
    rows = [{**ROWS[i], "end": end} for i, end in enumerate(("scored", "failed", "timeout"))]
    workers = make_workers(bus, resolve_config(cfg), selected(cfg, None))
    async with anyio.create_task_group() as tg:
        await start_workers(tg, workers)
        await publish_rows(bus, rows, batch="b", agents=["agent"])
        with anyio.fail_after(60):
            await Collector(bus, await put_batch(bus, "b", 3, agent="agent"), tmp_path / "out.jsonl").run()
        [sandboxes] = [w for w in workers if isinstance(w, SandboxWorker)]
        assert sandboxes.created == 3
        assert await engine.containers({POOL: f"gym.{pool}"}) == []  # removed as each rollout ended
        tg.cancel_scope.cancel()
    assert [r["_ng_task_index"] for r in read_jsonl(tmp_path / "out.jsonl")] == [0]
    failures = {r["_ng_task_index"]: r["error_class"] for r in read_jsonl(tmp_path / "out_failures.jsonl")}
    assert failures == {1: "tool_error", 2: "timeout"}
