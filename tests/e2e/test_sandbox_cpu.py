"""A sandboxed environment's CPU-seconds reach its row's ``cost`` (issue 39): ``cost.sandbox_cpu_ms``.

Real nats-server, real workers, the real code sandbox (its cgroup's count) and a real Docker engine (its
stats); the only double is the LLM (``tests/stub_openai.py``). Each program measures its own CPU time with
``time.process_time()`` and prints it: the row's count is within 10% of that. CPU time, never wall time, so
a loaded machine changes neither side.
"""

from __future__ import annotations

import json
import socket
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

from gym_runtime import Client
from gym_runtime.config import config_from_dict, resolve_config
from gym_runtime.jail import landlock_abi
from gym_runtime.observability.meters import start as start_meters
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.sandboxes.engine_http import Engine
from gym_runtime.service.batches import collect_batch
from tests.envs.cpu_burn import BURN_S, program
from tests.helpers import REPO, ROWS, read_jsonl
from tests.stub_openai import StubOpenAI, StubReply, responses_reply


def answer(text: str) -> StubReply:
    message = {
        "id": "msg_0",
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }
    return StubReply(body=responses_reply([message]))


@pytest.mark.skipif(landlock_abi() < 1, reason="the sandbox needs Linux with Landlock")
async def test_a_code_sandboxs_cpu_seconds_reach_the_row_within_10_percent(nats_server, tmp_path: Path) -> None:
    """code_gen's verify runs the policy's program in the code sandbox: a program that spins for a second
    of CPU and prints its own count. The row's ``sandbox_cpu_ms`` (the sandbox's cgroup, read at the run's
    end by the resource worker, sent with the verdict) is within 10% of it; the estimate charges that CPU
    time at ``cpu_hour``; the metrics file and the metrics endpoint total it."""
    row = read_jsonl(REPO / "resources/code_gen/data/example.jsonl")[0]
    with StubOpenAI(handler=lambda req: answer(f"```python\n{program(1.0)}```")) as stub:
        raw: dict[str, Any] = {
            "namespace": "gym",
            "models": {"policy": {"adapter": "openai", "base_url": stub.base_url, "api_key": "t", "model": "p"}},
            "resources": {"code_gen": {"server": "resources.code_gen", "options": {"unit_test_timeout_secs": 60}}},
            "agents": {"code_gen_agent": {"agent": "agents.simple", "model": "policy", "resource": "code_gen"}},
            "pricing": {"cpu_hour": 3.6},
        }
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        meters = start_meters(service="test", role="agent", port=port)
        try:
            async with Client(
                resolve_config(config_from_dict(raw)), nats=nats_server.url, telemetry=Telemetry(meters=meters)
            ) as client:
                batch = await client.submit([row])
                [got] = await batch.gather()
                await collect_batch(client.bus, batch.batch, tmp_path / "out.jsonl", wait_s=5)
            scraped = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
        finally:
            meters.shutdown()
    assert "error_class" not in got, got
    measured = float(got["metadata"]["output"])  # a wrong answer: the verdict shows the program's output
    assert measured >= 1.0
    cost = got["cost"]
    assert abs(cost["sandbox_cpu_ms"] / 1000 - measured) <= 0.1 * measured, (cost, measured)
    assert "sandbox_ms" not in cost  # no fleet sandbox: no exec wall time
    assert abs(cost["estimated_cost"] - 3.6 * (cost["sandbox_cpu_ms"] + cost.get("tool_ms", 0)) / 3.6e6) < 1e-9
    (metrics,) = json.loads((tmp_path / "out_aggregate_metrics.json").read_text())
    assert metrics["cost"]["rollouts"]["sandbox_cpu_ms"] == cost["sandbox_cpu_ms"]
    [line] = [line for line in scraped.splitlines() if line.startswith("gym_cost_sandbox_cpu_seconds_total{")]
    assert 'gym_outcome="ok"' in line and abs(float(line.split()[-1]) - cost["sandbox_cpu_ms"] / 1000) < 1e-6, line


async def test_a_fleet_sandboxs_cpu_seconds_reach_the_row_within_10_percent(
    nats_server, engine: Engine, base_image: str, tmp_path: Path
) -> None:
    """An agent execs a program that spins for 2 s of CPU in a Docker sandbox of its own and leaves the
    sandbox open: the runtime ends the rollout's lease before the row is built, and the worker reads the
    container's CPU (its cgroup's count) as it removes it. The row's ``sandbox_cpu_ms`` is within 10% of
    what the program measured; ``sandbox_ms`` is the exec's wall time; the estimate charges the CPU time
    only (never both)."""
    pool = f"c{uuid.uuid4().hex[:8]}"
    raw: dict[str, Any] = {
        "namespace": "gym",
        "models": {"policy": {"adapter": "scripted"}},
        "sandboxes": {pool: {"engine": f"unix://{engine.socket_path}", "reap_interval_s": 1}},
        "resources": {"env": {"server": "resources.weather"}},
        "agents": {"agent": {"agent": "tests.envs.cpu_burn", "model": "policy", "resource": "env", "sandbox": pool}},
        "pricing": {"cpu_hour": 3.6},
    }
    async with Client(resolve_config(config_from_dict(raw)), nats=nats_server.url) as client:
        batch = await client.submit(ROWS[:1])
        [got] = await batch.gather()
    assert "error_class" not in got, got
    measured, cost = got["burned_cpu_s"], got["cost"]
    assert measured >= BURN_S
    assert abs(cost["sandbox_cpu_ms"] / 1000 - measured) <= 0.1 * measured, (cost, measured)
    assert cost["sandbox_ms"] > 0
    charged = cost["sandbox_cpu_ms"] + cost.get("tool_ms", 0)
    assert abs(cost["estimated_cost"] - 3.6 * charged / 3.6e6) < 1e-9, cost
