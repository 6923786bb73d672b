"""The sandbox fleet end to end: real dockerd, real nats-server, real worker processes (only the LLM is a
test double: the scripted policy).

An environment grades every rollout in a sandbox and the agent uses one of its own
(``tests/envs/sandboxed.py``). Mid-batch the agent and then the sandbox worker are SIGKILLed and started
again: every row comes exactly once, and no container is left behind (the dead worker's end by themselves,
the idle timeout ends the dead agent's). A whole cluster SIGKILLed (its worker and its nats-server) leaves no
container either, with no worker started again.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import yaml

from gym_runtime.observability.tracing import Telemetry
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.sandboxes.client import Sandboxes
from gym_runtime.sandboxes.engine_api import POOL
from gym_runtime.sandboxes.engine_http import Engine
from gym_runtime.sandboxes.images import ensure_base
from gym_runtime.transport.bus import Bus
from tests.docker import docker_socket
from tests.helpers import REPO
from tests.pools import (
    REPEATS,
    Pool,
    assert_exactly_once,
    publish,
    results_stored,
    start_collect,
    tasks_file,
    wait_until,
)

N_TASKS = 4  # x REPEATS rollouts: a few waves of the agents' concurrency, so the kills land mid-batch


def containers(label: str) -> list[dict[str, Any]]:
    async def ask() -> list[dict[str, Any]]:
        async with Engine(docker_socket()) as e:
            return await e.containers({POOL: label})

    return anyio.run(ask)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EmbeddedServer]:
    srv = EmbeddedServer(store_dir=str(tmp_path / "js"), sync="interval")
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def box_pool() -> str:
    """A pool name of this test's own: tests running beside it on the engine keep their containers."""
    sock = docker_socket()

    async def build() -> None:
        async with Engine(sock) as e:
            await ensure_base(e)  # once per machine (cached): not inside a worker's start-up line

    anyio.run(build)
    return f"box{uuid.uuid4().hex[:6]}"


def write_config(tmp: Path, pool: str) -> Path:
    cfg = {
        "namespace": "gym",
        "models": {"policy": {"adapter": "scripted", "delay_s": 0.2, "ack_wait_s": 2.0, "concurrency": 8}},
        "sandboxes": {
            pool: {
                "backend": "docker",
                "capacity": 32,
                "idle_ttl_s": 3,
                "reap_interval_s": 0.5,
                "orphan_after_s": 10,  # the killed worker's containers end by themselves (no peer ever heard it)
                "limits": {"memory_mb": 256, "pids": 64, "disk_mb": 16, "timeout_s": 60},
            }
        },
        "resources": {"env": {"server": "tests.envs.sandboxed", "sandbox": pool}},
        "agents": {
            "agent": {
                "agent": "tests.envs.sandboxed",
                "model": "policy",
                "resource": "env",
                "sandbox": pool,
                "max_steps": 4,
                "timeout_s": 60,
                "concurrency": 3,
                "ack_wait_s": 2.0,
                "max_attempts": 4,
            }
        },
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_a_batch_graded_in_sandboxes_survives_killed_agents_and_sandbox_workers(
    server: EmbeddedServer, box_pool: str, tmp_path: Path
) -> None:
    config = write_config(tmp_path, box_pool)
    label = f"gym.{box_pool}"
    pool = Pool(config, server.url)
    try:
        for only in (f"sandboxes.{box_pool}", "models.policy", "resources.env", "agents.agent"):
            pool.start(only, only)
        out = tmp_path / "out.jsonl"
        publish(config, server.url, tasks_file(tmp_path, N_TASKS), "b1")
        collector = start_collect(server.url, "b1", out)
        wait_until(lambda: results_stored(server.url) >= 1, timeout=60)
        pool.kill("agents.agent")  # its rollouts' sandboxes stay on the sandbox worker, unused
        pool.start("agents.agent#2", "agents.agent")
        wait_until(lambda: results_stored(server.url) >= 3, timeout=60)
        pool.kill(f"sandboxes.{box_pool}")  # its containers outlive it, until their keepers end them
        pool.start("sandboxes#2", f"sandboxes.{box_pool}")
        stdout, stderr = collector.communicate(timeout=120)
        assert collector.returncode == 0, stderr
        assert f"{N_TASKS * REPEATS} rows, 0 failed" in stdout
        rows = assert_exactly_once(out, N_TASKS)
        assert all(r["reward"] == 1.0 for r in rows)
        # every container of the killed worker reaped, every dead agent's lease ended: none left while the
        # pool still runs (each finished rollout closed its own)
        wait_until(lambda: containers(label) == [], timeout=90)
    finally:
        pool.stop_all()
    assert containers(label) == []


def test_start_only_a_sandbox_pool_whose_image_is_missing_is_one_line_exit_2(
    server: EmbeddedServer, box_pool: str, tmp_path: Path
) -> None:
    config = write_config(tmp_path, box_pool)
    raw = yaml.safe_load(config.read_text())
    raw["sandboxes"][box_pool]["image"] = "gym-runtime/nope:1"
    config.write_text(yaml.safe_dump(raw))
    started = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "gym_runtime.cli", "start", str(config), "--nats", server.url,
         "--only", f"sandboxes.{box_pool}", "--in-process"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert "image 'gym-runtime/nope:1' is not in the docker engine" in res.stderr
    assert "Traceback" not in res.stderr and time.monotonic() - started < 30


def test_a_whole_cluster_sigkilled_leaves_no_container_without_any_worker_starting_again(
    box_pool: str, tmp_path: Path
) -> None:
    """Round 4 of the red team: after a whole cluster was SIGKILLed, its containers ran until some later worker
    of the same namespace and pool started (2 of 2 still running 30 s after). Now they end within the pool's
    ``orphan_after_s`` (10 s here) of the worker's death, with nothing of the cluster left to remove them."""
    srv = EmbeddedServer(store_dir=str(tmp_path / "js"))
    srv.start()
    config = write_config(tmp_path, box_pool)
    label = f"gym.{box_pool}"
    pool = Pool(config, srv.url)
    try:
        pool.start("sandboxes", f"sandboxes.{box_pool}")

        async def hold_two() -> list[str]:
            bus = await Bus.connect(srv.url, namespace="gym", telemetry=Telemetry(), name="holder")
            try:
                boxes = Sandboxes(bus, box_pool, lease="held", deadline=time.time() + 3600)
                return [(await boxes.sandbox()).id for _ in range(2)]  # never closed: their holder dies too
            finally:
                await bus.close()

        held = anyio.run(hold_two)
        assert sorted(c["Id"] for c in containers(label)) == sorted(held)
        pool.kill("sandboxes")
        srv.kill()
        wait_until(lambda: containers(label) == [], timeout=90)  # 10 s, and a loaded engine's removals
    finally:
        pool.stop_all()
        srv.stop()
        for c in containers(label):  # only if the test failed: this test's own pool
            anyio.run(_remove, c["Id"])


async def _remove(cid: str) -> None:
    async with Engine(docker_socket()) as e:
        await e.remove(cid)


def test_a_frozen_sandbox_worker_its_calls_fail_over_and_every_row_arrives_once(
    server: EmbeddedServer, box_pool: str, tmp_path: Path
) -> None:
    """One of two sandbox workers frozen (SIGSTOP) mid-batch (issue 77): a call in flight on it fails as
    ``worker_lost`` after the bus's 10 s liveness window (its rollout runs again), the server drops it within
    20 s so no create lands on it again, and the batch ends with every row once, each scored."""
    config = write_config(tmp_path, box_pool)
    pool = Pool(config, server.url)
    frozen = None
    try:
        for only in (f"sandboxes.{box_pool}", "models.policy", "resources.env", "agents.agent"):
            pool.start(only, only)
        frozen = pool.start("sandboxes#2", f"sandboxes.{box_pool}")
        out = tmp_path / "out.jsonl"
        publish(config, server.url, tasks_file(tmp_path, N_TASKS), "b1")
        collector = start_collect(server.url, "b1", out)
        wait_until(lambda: results_stored(server.url) >= 1, timeout=90)
        frozen.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        stdout, stderr = collector.communicate(timeout=240)
        took = time.monotonic() - t0
        assert collector.returncode == 0, stderr
        assert f"{N_TASKS * REPEATS} rows, 0 failed" in stdout
        rows = assert_exactly_once(out, N_TASKS)
        assert all(r["reward"] == 1.0 for r in rows)
        print(f"frozen sandbox worker: batch done {took:.1f}s after the freeze")
    finally:
        if frozen is not None:
            frozen.send_signal(signal.SIGCONT)
        pool.stop_all()
