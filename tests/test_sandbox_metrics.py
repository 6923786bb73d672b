"""A sandbox pool's metrics as Prometheus shows them: the histograms in seconds have buckets in seconds (not
OpenTelemetry's default ones, made for milliseconds), a rollout's wait for its environment's sandbox is
counted under that pool's name, and a ``start`` of a pool alone names its process ``gym-runtime.sandbox``.
On a real nats-server with the ``process`` backend (no engine needed); the LLM is the scripted adapter."""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import anyio
import yaml

from gym_runtime.config import config_from_dict
from gym_runtime.observability import meters
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.ops.nats_server import EmbeddedServer, free_port
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.jetstream import ensure_streams
from tests.helpers import REPO, read_until
from tests.test_sandbox_rollouts import one_row


def scrape(port: int) -> list[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode().splitlines()


def buckets(lines: list[str], family: str) -> set[float]:
    return {float(m.group(1)) for line in lines if (m := re.match(rf'{family}_bucket{{.*le="([^"]+)"', line))}


def labels(lines: list[str], sample: str) -> list[dict[str, str]]:
    return [
        dict(re.findall(r'(\w+)="([^"]*)"', line.split("{", 1)[1].rsplit("}", 1)[0]))
        for line in lines
        if line.startswith(sample + "{")
    ]


async def test_sandbox_histograms_have_seconds_buckets_and_the_wait_names_the_environments_pool(
    nats_server: EmbeddedServer, tmp_path: Path
) -> None:
    pool = f"m{uuid.uuid4().hex[:8]}"
    port = free_port()
    tel = Telemetry(meters=meters.start(service="gym-runtime.test", role="run", port=port))
    bus = await Bus.connect(nats_server.url, namespace="gym", telemetry=tel, name="metered")
    await ensure_streams(bus)
    cfg = config_from_dict(
        {
            "namespace": "gym",
            "models": {"policy": {"adapter": "scripted"}},
            "sandboxes": {pool: {"backend": "process"}},
            # the environment grades in a sandbox of the pool; the agent (agents.simple) names none
            "resources": {"env": {"server": "tests.envs.sandboxed", "sandbox": pool}},
            "agents": {"agent": {"agent": "agents.simple", "model": "policy", "resource": "env", "max_attempts": 1}},
            "base_dir": str(tmp_path),
        }
    )
    try:
        row = await one_row(bus, cfg, "m", tmp_path / "out.jsonl")
        lines = await anyio.to_thread.run_sync(scrape, port)
    finally:
        await bus.close()
        tel.shutdown()
    assert row["reward"] == 1.0, row
    for family in ("gym_sandbox_acquire_seconds", "gym_sandbox_exec_seconds", "gym_sandbox_wait_seconds"):
        seen = buckets(lines, family)
        assert {0.001, 0.5, 60.0, 600.0} <= seen and 10000.0 not in seen, (family, sorted(seen))
    [wait] = labels(lines, "gym_sandbox_wait_seconds_count")
    assert wait["gym_name"] == pool, wait
    assert {d["gym_name"] for d in labels(lines, "gym_sandbox_exec_seconds_count")} == {pool}


def test_a_pool_started_alone_is_named_sandbox(nats_server: EmbeddedServer, tmp_path: Path) -> None:
    cfg = tmp_path / "pool.yaml"
    cfg.write_text(yaml.safe_dump({"namespace": "gym", "sandboxes": {"box": {"backend": "process"}}}))
    port = free_port()
    argv = [sys.executable, "-m", "gym_runtime.cli", "start", str(cfg), "--nats", nats_server.url]
    p = subprocess.Popen(
        [*argv, "--only", "sandboxes.box", "--metrics-port", str(port)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert p.stdout is not None
        ready, out = read_until(p.stdout, "workers ready", 120)
        assert ready, out
        [target] = labels(scrape(port), "target_info")
    finally:
        p.terminate()
        p.communicate(timeout=60)
    assert (target["service_name"], target["gym_role"]) == ("gym-runtime.sandbox", "sandbox"), target
