"""A long rollout resumes at its last turn (issue 69): real nats-server, real Docker sandboxes, real worker
processes SIGKILLed mid-rollout (only the LLM is a test double: ``scripted``, with token ids).

The environment (``tests/envs/long_boxed.py``) is 50 turns of one tool call each, every call bumping a counter of
its own in the session's one container. An agent worker killed at turn k is redelivered (``ack_wait_s`` lowered)
and its next attempt takes up the checkpoint: the row says ``resumed_from_turn`` = k, every tool's side effect
happened once, in the same container, and the token ids run on across the kill. With its resource worker killed
too, the session is restored from the environment's snapshot (or, for one without, the rollout restarts), as the
row says. A kill while a tool call runs: that call runs once. The checkpoint never outlives its row.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import yaml

from gym_runtime.messages import Checkpoint
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.sandboxes.engine_http import Engine
from gym_runtime.sandboxes.images import ensure_base
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.subjects import Subjects
from tests.docker import docker_socket
from tests.envs.long_boxed import STEPS, task
from tests.helpers import cli, read_jsonl, write_jsonl
from tests.pools import Pool, start_collect, wait_until

BATCH = "r1"
KEY = Subjects.checkpoint_key("agent", BATCH, 0, 0)
KILL_AT = 12  # the agent worker is killed once a checkpoint at this turn or later is stored


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EmbeddedServer]:
    srv = EmbeddedServer(store_dir=str(tmp_path / "js"), sync="interval")
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def box_pool() -> str:
    """A pool of this test's own on the shared engine, its base image built first (cached per machine)."""
    sock = docker_socket()

    async def build() -> None:
        async with Engine(sock) as e:
            await ensure_base(e)

    anyio.run(build)
    return f"rs{uuid.uuid4().hex[:6]}"


def write_config(tmp: Path, pool: str, *, checkpoint: str = "every_turn", **env: Any) -> Path:
    cfg = {
        "namespace": "gym",
        "models": {
            "policy": {"adapter": "scripted", "delay_s": 0.05, "token_ids": True, "ack_wait_s": 2.0, "concurrency": 8}
        },
        "sandboxes": {
            pool: {
                "backend": "docker",
                "capacity": 8,
                "idle_ttl_s": 120,  # a dead agent's environment session keeps its container meanwhile
                "limits": {"memory_mb": 128, "pids": 64, "disk_mb": 16, "timeout_s": 60},
            }
        },
        "resources": {"env": {"server": "tests.envs.long_boxed", "sandbox": pool, "options": env}},
        "agents": {
            "agent": {
                "agent": "agents.simple",
                "model": "policy",
                "resource": "env",
                "timeout_s": 300,
                "concurrency": 2,
                "ack_wait_s": 2.0,  # redelivered in seconds, not the default 30
                "max_attempts": 2,
                "checkpoint": checkpoint,
            }
        },
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def stored_checkpoint(url: str) -> Checkpoint | None:
    async def read() -> Checkpoint | None:
        bus = await Bus.connect(url, namespace="gym", telemetry=Telemetry(), name="test-resume")
        try:
            raw = await (await bus.kv(bus.subjects.checkpoints_bucket)).get(KEY)
        finally:
            await bus.close()
        return msgspec.msgpack.decode(raw, type=Checkpoint) if raw else None

    return anyio.run(read)


def turn_stored(url: str) -> int:
    cp = stored_checkpoint(url)
    return cp.turn if cp is not None else -1


class Run:
    """One rollout of the long environment on its own worker processes, collected to ``out``."""

    def __init__(self, tmp: Path, url: str, config: Path) -> None:
        self.tmp, self.url, self.config = tmp, url, config
        self.pool = Pool(config, url)
        self.out = tmp / "out.jsonl"
        self.collector: Any = None

    def start(self, pool: str) -> None:
        for only in (f"sandboxes.{pool}", "models.policy", "resources.env", "agents.agent"):
            self.pool.start(only, only)
        tasks = write_jsonl(self.tmp / "tasks.jsonl", [task()])
        res = cli("publish", str(self.config), "-i", str(tasks), "--nats", self.url, "--batch", BATCH)
        assert res.returncode == 0, res.stderr
        self.collector = start_collect(self.url, BATCH, self.out)

    def row(self) -> dict[str, Any]:
        stdout, stderr = self.collector.communicate(timeout=240)
        assert self.collector.returncode == 0, stderr[-3000:]
        assert "1 rows, 0 failed" in stdout, (stdout, read_jsonl(self.out))
        (row,) = read_jsonl(self.out)
        return row

    def close(self) -> None:
        if self.collector is not None and self.collector.poll() is None:
            self.collector.kill()
        self.pool.stop_all()


def tool_outputs(row: dict[str, Any]) -> list[dict[str, Any]]:
    import json

    return [json.loads(i["output"]) for i in row["response"]["output"] if i["type"] == "function_call_output"]


def assert_once_each(row: dict[str, Any]) -> None:
    """Every step ran, and each one's side effect happened once (its counter in the container is 1)."""
    counts = row["counts"]
    assert sorted(counts) == [f"step_{i:02d}" for i in range(STEPS)], counts
    assert set(counts.values()) == {1}, {k: v for k, v in counts.items() if v != 1}


def assert_contiguous(row: dict[str, Any]) -> None:
    """Each turn's prompt token ids start with the turn before it: its prompt, then its generation."""
    gens = [i for i in row["response"]["output"] if i.get("generation_token_ids")]
    assert len(gens) == STEPS + 1, len(gens)
    for before, after in zip(gens, gens[1:], strict=False):
        seen = before["prompt_token_ids"] + before["generation_token_ids"]
        assert after["prompt_token_ids"][: len(seen)] == seen


def test_an_agent_worker_killed_at_turn_k_resumes_there_in_the_same_container(
    server: EmbeddedServer, box_pool: str, tmp_path: Path
) -> None:
    run = Run(tmp_path, server.url, write_config(tmp_path, box_pool))
    try:
        run.start(box_pool)
        wait_until(lambda: turn_stored(server.url) >= KILL_AT, timeout=120)
        run.pool.kill("agents.agent")
        cp = stored_checkpoint(server.url)  # what the next attempt finds: nothing writes it now
        assert cp is not None and cp.turn < STEPS
        run.pool.start("agents.agent#2", "agents.agent")
        row = run.row()
        assert row["resumed_from_turn"] == cp.turn
        assert row["resumed_how"] == "reattached"
        assert row["provenance"]["attempt"] == 2
        assert_once_each(row)
        containers = {o["container"] for o in tool_outputs(row)}
        assert containers == {row["container"]}, containers  # one container, before and after the kill
        assert_contiguous(row)
        assert stored_checkpoint(server.url) is None  # the checkpoint went with its row
    finally:
        run.close()


@pytest.mark.parametrize("restorable", [True, False])
def test_a_resource_worker_killed_too_is_restored_from_its_snapshot_or_restarts(
    server: EmbeddedServer, box_pool: str, tmp_path: Path, restorable: bool
) -> None:
    run = Run(tmp_path, server.url, write_config(tmp_path, box_pool, restorable=restorable))
    try:
        run.start(box_pool)
        wait_until(lambda: turn_stored(server.url) >= KILL_AT, timeout=120)
        run.pool.kill("agents.agent")
        run.pool.kill("resources.env")  # its session, and the container it held, are gone with it
        cp = stored_checkpoint(server.url)
        assert cp is not None
        run.pool.start("resources.env#2", "resources.env")
        run.pool.start("agents.agent#2", "agents.agent")
        row = run.row()
        if restorable:
            assert (row["resumed_how"], row["resumed_from_turn"]) == ("restored", cp.turn)
        else:
            assert (row["resumed_how"], row["resumed_from_turn"]) == ("restarted", 0)
        assert_once_each(row)  # in the container the rollout ended in: each step once
        assert_contiguous(row)
        assert stored_checkpoint(server.url) is None
    finally:
        run.close()


def test_a_tool_call_in_flight_when_its_agent_dies_runs_once(
    server: EmbeddedServer, box_pool: str, tmp_path: Path
) -> None:
    marker = tmp_path / "slow-call-running"
    run = Run(tmp_path, server.url, write_config(tmp_path, box_pool, slow_step=KILL_AT, slow_s=4, marker=str(marker)))
    try:
        run.start(box_pool)
        wait_until(marker.exists, timeout=120)  # the slow step's call is running on the resource worker
        run.pool.kill("agents.agent")
        run.pool.start("agents.agent#2", "agents.agent")
        row = run.row()
        assert (row["resumed_how"], row["resumed_from_turn"]) == ("reattached", KILL_AT + 1)
        assert_once_each(row)  # the slow step too: answered from its first run, never run again
        assert stored_checkpoint(server.url) is None
    finally:
        run.close()
