"""A rollout's sandboxes seen from the rollout, in process on a real nats-server and a real Docker engine
(the LLM is the scripted adapter, a test double): its trace holds a span per sandbox operation, its own
and its environment's, under the rollout's span; an environment's wait for a lease is off the rollout's
clock and reported in the row."""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import anyio
import nats
import pytest

from gym_runtime.config import config_from_dict, resolve_config
from gym_runtime.data.collector import Collector
from gym_runtime.data.inputs import publish_rows
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.sandboxes.client import Sandboxes
from gym_runtime.sandboxes.engine_http import Engine
from gym_runtime.service.runner import make_workers, selected, start_workers
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.jetstream import ensure_streams
from gym_runtime.workers.sandbox_worker import SandboxWorker
from tests.helpers import ROWS, put_batch, read_jsonl


@pytest.fixture
def pool() -> str:
    return f"r{uuid.uuid4().hex[:8]}"


def config(engine: Engine, pool: str, tmp: Path, *, agent: str, timeout_s: float, **sbx: Any) -> Any:
    return config_from_dict(
        {
            "namespace": "gym",
            "models": {"policy": {"adapter": "scripted"}},
            "sandboxes": {pool: {"engine": f"unix://{engine.socket_path}", "reap_interval_s": 1, **sbx}},
            "resources": {"env": {"server": "tests.envs.sandboxed", "sandbox": pool}},
            "agents": {
                "agent": {
                    "agent": agent,
                    "model": "policy",
                    "resource": "env",
                    "sandbox": pool,
                    "timeout_s": timeout_s,
                    "max_attempts": 1,
                }
            },
            "base_dir": str(tmp),
        }
    )


async def one_row(bus: Bus, cfg: Any, batch: str, out: Path) -> dict[str, Any]:
    """``cfg``'s workers on ``bus`` run one row as batch ``batch``: the row the collector wrote to ``out``."""
    workers = make_workers(bus, resolve_config(cfg), selected(cfg, None))
    async with anyio.create_task_group() as tg:
        await start_workers(tg, workers)
        await publish_rows(bus, ROWS[:1], batch=batch, agents=["agent"])
        with anyio.fail_after(120):
            await Collector(bus, await put_batch(bus, batch, 1, agent="agent"), out).run()
        tg.cancel_scope.cancel()
    [row] = read_jsonl(out)
    return row


def assert_names_the_pools_image(engine: Engine, base_image: str, pool: str, prov: dict[str, Any]) -> None:
    """The row's provenance names the pool's default image and, beside it, ``docker image inspect``'s Id of that
    image (its first 12 hex digits, which the CLI takes too)."""
    full = inspected_id(engine, base_image)
    assert prov["images"] == [f"{pool}:default"] and prov["image_ids"] == [full.removeprefix("sha256:")[:12]], prov


async def test_a_rollouts_trace_holds_its_sandbox_operations_as_children(
    nats_server: EmbeddedServer, engine: Engine, base_image: str, pool: str, tmp_path: Path
) -> None:
    spans_file = tmp_path / "spans.jsonl"
    tel = Telemetry.from_options(trace_file=str(spans_file), service="test")
    bus = await Bus.connect(nats_server.url, namespace="gym", telemetry=tel, name="traced")
    await ensure_streams(bus)
    cfg = config(engine, pool, tmp_path, agent="tests.envs.sandboxed", timeout_s=120)
    try:
        row = await one_row(bus, cfg, "t", tmp_path / "out.jsonl")
    finally:
        tel.shutdown()  # flushes every span
        await bus.close()
    assert row["reward"] == 1.0

    spans = read_jsonl(spans_file)
    [rollout] = [s for s in spans if s["name"] == "rollout"]
    by_id = {s["span_id"]: s for s in spans if s["trace_id"] == rollout["trace_id"]}

    def under_rollout(s: dict[str, Any]) -> bool:
        while s["parent_span_id"] in by_id:
            s = by_id[s["parent_span_id"]]
            if s is rollout:
                return True
        return False

    ours = [s for s in by_id.values() if s["name"].startswith("sandbox.") and under_rollout(s)]
    names = sorted(s["name"] for s in ours)
    # the agent's sandbox (acquire, exec, close) and the environment's in verify (acquire, 2 writes, exec,
    # close), each on the author's side and in the worker that holds it (the engine's part)
    for name, n in {
        "sandbox.acquire": 2,
        "sandbox.exec": 2,
        "sandbox.write": 2,
        "sandbox.close": 2,
        "sandbox.engine.create": 2,
        "sandbox.engine.exec": 2,
        "sandbox.engine.write": 2,
        "sandbox.engine.remove": 2,
    }.items():
        assert names.count(name) == n, (name, names)
    acquires = [s for s in ours if s["name"] == "sandbox.acquire"]
    assert all(s["attributes"]["gym.sandbox.pool"] == pool for s in acquires)
    assert {s["attributes"]["gym.sandbox.id"] for s in acquires} == {
        s["attributes"]["gym.sandbox.id"] for s in ours if s["name"] == "sandbox.engine.create"
    }
    execs = [s for s in ours if s["name"] == "sandbox.engine.exec"]
    assert [s["attributes"]["gym.sandbox.exit_code"] for s in execs] == [0, 0]
    assert all(s["service"] == "test" and s["status"] != "ERROR" for s in ours)


async def test_an_environments_wait_for_a_lease_is_off_the_rollouts_clock_and_reported(
    bus: Bus, nats_server: EmbeddedServer, engine: Engine, base_image: str, pool: str, tmp_path: Path
) -> None:
    """The pool's only lease is held elsewhere while the environment's ``verify`` asks for a sandbox: the
    rollout waits past its whole ``timeout_s`` for it, then is scored, its row saying how long it waited."""
    timeout_s = 8.0
    cfg = config(engine, pool, tmp_path, agent="agents.simple", timeout_s=timeout_s, max_live=1)
    asked = anyio.Event()
    spy = await nats.connect(nats_server.url)

    async def on_present(msg: Any) -> None:  # a create found no room and asks whether the pool is there
        asked.set()

    await spy.subscribe(bus.subjects.sandbox_present(pool), cb=on_present)
    await spy.flush()
    workers = make_workers(bus, resolve_config(cfg), selected(cfg, None))
    try:
        async with anyio.create_task_group() as tg:
            await start_workers(tg, workers)
            [fleet] = [w for w in workers if isinstance(w, SandboxWorker)]
            holder = Sandboxes(bus, pool, lease="holder:0:0", deadline=time.time() + 300)
            held = await holder.sandbox()  # the pool's whole quota
            await publish_rows(bus, ROWS[:1], batch="w", agents=["agent"])
            collect = Collector(bus, await put_batch(bus, "w", 1, agent="agent"), tmp_path / "out.jsonl")
            finished = anyio.Event()

            async def collect_all() -> None:
                await collect.run()
                finished.set()

            tg.start_soon(collect_all)
            with anyio.fail_after(120):
                await asked.wait()  # verify's create is waiting for a lease
            started = time.monotonic()
            await anyio.sleep(timeout_s + 2)  # the wait outlasts the rollout's whole timeout_s
            await held.close()
            with anyio.fail_after(120):
                await finished.wait()
            waited = time.monotonic() - started
            assert fleet.created == 2  # the holder's, then verify's
            tg.cancel_scope.cancel()
    finally:
        await spy.close()
    assert not (tmp_path / "out_failures.jsonl").exists(), read_jsonl(tmp_path / "out_failures.jsonl")
    [row] = read_jsonl(tmp_path / "out.jsonl")
    assert row["reward"] == 1.0
    assert timeout_s + 2 <= row["sandbox_wait_s"] <= waited + 5, (row["sandbox_wait_s"], waited)


def inspected_id(engine: Engine, ref: str) -> str:
    """``docker image inspect``'s Id of ``ref`` (the CLI, on the test's engine)."""
    env = {**os.environ, "DOCKER_HOST": f"unix://{engine.socket_path}"}
    done = subprocess.run(
        ["docker", "image", "inspect", "--format", "{{.Id}}", ref], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


async def test_a_rows_provenance_names_the_content_of_the_image_its_sandbox_ran(
    bus: Bus, engine: Engine, base_image: str, pool: str, tmp_path: Path
) -> None:
    """The agent's sandbox ran the pool's default image: the row names it, and beside it the image's content id
    (a short Id the CLI takes, naming the same image)."""
    cfg = config(engine, pool, tmp_path, agent="tests.envs.sandboxed", timeout_s=120)
    prov = (await one_row(bus, cfg, "p", tmp_path / "out.jsonl"))["provenance"]
    assert_names_the_pools_image(engine, base_image, pool, prov)
    assert inspected_id(engine, prov["image_ids"][0]) == inspected_id(engine, base_image)


async def test_the_environments_own_sandbox_is_in_the_rows_provenance(
    bus: Bus, engine: Engine, base_image: str, pool: str, tmp_path: Path
) -> None:
    """An agent with no sandbox of its own (``agents.simple``) and an environment whose ``verify`` runs in one:
    the row names that sandbox's image and content all the same (the resource worker reports its session's)."""
    cfg = config(engine, pool, tmp_path, agent="agents.simple", timeout_s=120)
    prov = (await one_row(bus, cfg, "e", tmp_path / "out.jsonl"))["provenance"]
    assert_names_the_pools_image(engine, base_image, pool, prov)


async def test_a_warm_sandbox_reports_the_content_of_its_image_too(
    bus: Bus, engine: Engine, base_image: str, pool: str, tmp_path: Path
) -> None:
    """A sandbox served from the warm pool (created before anyone asked) says what it runs as a fresh one does."""
    cfg = config(engine, pool, tmp_path, agent="agents.simple", timeout_s=120, warm=1)
    workers = [w for w in make_workers(bus, resolve_config(cfg), selected(cfg, None)) if isinstance(w, SandboxWorker)]
    async with anyio.create_task_group() as tg:
        await start_workers(tg, workers)
        [fleet] = workers
        with anyio.fail_after(120):
            while not fleet.warm:  # its warm container is ready
                await anyio.sleep(0.05)
        client = Sandboxes(bus, pool, lease="prov:0:0", deadline=time.time() + 300)
        box = await client.sandbox()
        await box.close()
        tg.cancel_scope.cancel()
    assert fleet.warm_hits == 1
    assert client.images == ("",) and client.image_ids == (inspected_id(engine, base_image),)
