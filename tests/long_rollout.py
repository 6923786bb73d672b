"""One long rollout (``tests/envs/long_boxed.py``: 50 turns in a Docker sandbox) on worker processes a test or a
benchmark can SIGKILL, and its checkpoint read off the bus (tests/e2e/test_resume.py, tests/bench/resume.py)."""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import yaml

from gym_runtime.messages import Checkpoint
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.rollout.checkpoint import Checkpointer
from gym_runtime.sandboxes.engine_api import POOL as POOL_LABEL
from gym_runtime.sandboxes.engine_http import Engine
from gym_runtime.sandboxes.images import ensure_base
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.subjects import Subjects
from tests.docker import docker_socket
from tests.envs.long_boxed import task
from tests.helpers import cli, read_jsonl, write_jsonl
from tests.pools import Pool, start_collect, wait_until

BATCH = "r1"


def new_pool(socket: str) -> str:
    """A sandbox pool name of its own on the shared engine, its base image built first (cached per machine)."""

    async def build() -> None:
        async with Engine(socket) as e:
            await ensure_base(e)

    anyio.run(build)
    return f"rs{uuid.uuid4().hex[:6]}"


def agent_entry(checkpoint: str = "every_turn") -> dict[str, Any]:
    """The agent ``agent``: the simple loop on ``policy`` and the resource ``env``, redelivered in seconds."""
    return {
        "agent": "agents.simple",
        "model": "policy",
        "resource": "env",
        "timeout_s": 300,
        "ack_wait_s": 2.0,  # redelivered in seconds, not the default 30
        "checkpoint": checkpoint,
    }


def write_config(
    tmp: Path,
    pool: str,
    *,
    checkpoint: str = "every_turn",
    delay_s: float = 0.05,
    agent_boxed: bool = False,
    agent_options: dict[str, Any] | None = None,
    lease_grace_s: float = 60.0,
    **env: Any,
) -> Path:
    """``agent_boxed``: the tools run in the agent's own sandbox (``tests/envs/agent_boxed.py``), not the
    environment's."""
    cfg: dict[str, Any] = {
        "namespace": "gym",
        "models": {
            "policy": {
                "adapter": "scripted",
                "delay_s": delay_s,
                "token_ids": True,
                "ack_wait_s": 2.0,
                "concurrency": 8,
            }
        },
        "sandboxes": {
            pool: {
                "backend": "docker",
                "capacity": 8,
                "idle_ttl_s": 120,  # a dead agent's environment session keeps its container meanwhile
                "lease_grace_s": lease_grace_s,  # ... and a dead agent's own container is kept this long
                "limits": {"memory_mb": 128, "pids": 64, "disk_mb": 16, "timeout_s": 60},
            }
        },
        "resources": {"env": {"server": "tests.envs.long_boxed", "sandbox": pool, "options": env}},
        "agents": {"agent": {**agent_entry(checkpoint), "concurrency": 2, "max_attempts": 2}},
    }
    if agent_boxed:
        cfg["resources"]["env"] = {"server": "tests.envs.agent_boxed"}
        cfg["agents"]["agent"].update(agent="tests.envs.agent_boxed", sandbox=pool, options=agent_options or {})
        cfg["sandboxes"][pool]["reap_interval_s"] = 1  # a dead agent's container goes within a second of its grace
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def stored_checkpoint(url: str, rollout: int = 0) -> Checkpoint | None:
    """The rollout's checkpoint (the task's ``rollout``-th repeat) as the server holds it now (None: none)."""

    async def read() -> Checkpoint | None:
        bus = await Bus.connect(url, namespace="gym", telemetry=Telemetry(), name="test-resume")
        try:  # its parts read in order, as a redelivered attempt reads them
            return await Checkpointer(bus, Subjects.checkpoint_key("agent", BATCH, 0, rollout), "every_turn").read()
        finally:
            await bus.close()

    return anyio.run(read)


def checkpoint_gone(url: str, rollout: int = 0) -> None:
    """Wait until the rollout's checkpoint is deleted: its delete follows its row, unacknowledged, so a reader of
    the row may still see the key for a moment."""
    wait_until(lambda: stored_checkpoint(url, rollout) is None, timeout=10)


def turn_stored(url: str, rollout: int = 0) -> int:
    cp = stored_checkpoint(url, rollout)
    return cp.turn if cp is not None else -1


class Run:
    """One rollout of the long environment on its own worker processes, collected to ``out``."""

    def __init__(self, tmp: Path, url: str, config: Path) -> None:
        self.tmp, self.url, self.config = tmp, url, config
        self.pool = Pool(config, url)
        self.out = tmp / "out.jsonl"
        self.collector: subprocess.Popen[str] | None = None
        self.published = 0.0
        self.tasks = [task()]  # what ``publish`` publishes: the long environment's one task

    def start_workers(self, sandbox_pool: str | None) -> None:
        pools = (f"sandboxes.{sandbox_pool}",) if sandbox_pool else ()
        for only in (*pools, "models.policy", "resources.env", "agents.agent"):
            self.pool.start(only, only)

    def publish(self, *, collect: bool = True, repeats: int = 1) -> None:
        tasks = write_jsonl(self.tmp / "tasks.jsonl", self.tasks)
        self.published = time.monotonic()
        batch = ["--batch", BATCH, "--repeats", str(repeats)]
        res = cli("publish", str(self.config), "-i", str(tasks), "--nats", self.url, *batch)
        assert res.returncode == 0, res.stderr
        if collect:
            self.collect()

    def collect(self) -> None:
        self.collector = start_collect(self.url, BATCH, self.out)

    def start(self, sandbox_pool: str | None) -> None:
        self.start_workers(sandbox_pool)
        self.publish()

    def kill_agent_after(self, reached: Callable[[Checkpoint], bool]) -> Checkpoint:
        """SIGKILL the agent worker once its stored checkpoint has ``reached`` a point; that checkpoint (what the
        next attempt finds: nothing writes it now)."""

        def stored() -> bool:
            cp = stored_checkpoint(self.url)
            return cp is not None and reached(cp)

        wait_until(stored, timeout=180)
        self.pool.kill("agents.agent")
        cp = stored_checkpoint(self.url)
        assert cp is not None
        return cp

    def row(self) -> dict[str, Any]:
        (row,) = self.rows(1)
        return row

    def rows(self, n: int) -> list[dict[str, Any]]:
        """The batch's ``n`` rows, once ``collect`` has them all (none failed), by rollout."""
        assert self.collector is not None
        stdout, stderr = self.collector.communicate(timeout=240)
        assert self.collector.returncode == 0, stderr[-3000:]
        assert f"{n} rows, 0 failed" in stdout, (stdout, read_jsonl(self.out))
        return sorted(read_jsonl(self.out), key=lambda r: r["_ng_rollout_index"])

    def close(self) -> None:
        if self.collector is not None and self.collector.poll() is None:
            self.collector.kill()
        self.pool.stop_all()


def tool_outputs(row: dict[str, Any]) -> list[dict[str, Any]]:
    return [json.loads(i["output"]) for i in row["response"]["output"] if i["type"] == "function_call_output"]


def containers(pool: str) -> list[str]:
    """The ids of the containers of sandbox pool ``pool`` (namespace ``gym``) on the engine now."""

    async def ask() -> list[str]:
        async with Engine(docker_socket()) as e:
            return [c["Id"] for c in await e.containers({POOL_LABEL: f"gym.{pool}"})]

    return anyio.run(ask)


def remove_containers(pool: str) -> None:
    """Remove what is left of pool ``pool``'s containers (a failed test's), by its label: never another's."""

    async def remove() -> None:
        async with Engine(docker_socket()) as e:
            for c in await e.containers({POOL_LABEL: f"gym.{pool}"}):
                await e.remove(c["Id"])

    anyio.run(remove)
