"""``start --trace-file`` writes the workers' spans (as ``run --trace-file`` does), for tasks published by a
``publish`` that traced nothing itself: the workers join each task's trace and record it. Real nats-server, the
real ``start`` (its process pool: a child per entry, each writing the file) stopped by SIGTERM as a scheduler
stops it, the real ``publish`` and ``collect``; the LLM is the weather config's scripted adapter."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

from gym_runtime.ops.nats_server import EmbeddedServer
from tests.helpers import REPO, WEATHER, cli, read_until

ROWS = WEATHER.parent / "data/example.jsonl"


def test_start_writes_its_spans_to_the_trace_file(nats_server: EmbeddedServer, tmp_path: Path) -> None:
    spans = tmp_path / "spans.jsonl"
    argv = [sys.executable, "-m", "gym_runtime.cli", "start", str(WEATHER), "--nats", nats_server.url]
    p = subprocess.Popen(
        [*argv, "--trace-file", str(spans)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert p.stdout is not None
        ready, out = read_until(p.stdout, "workers ready", 120)
        assert ready, out
        published = cli("publish", str(WEATHER), "-i", str(ROWS), "--nats", nats_server.url, "--batch", "t1", "-q")
        assert published.returncode == 0, published.stderr
        collected = cli("collect", "--batch", "t1", "-o", str(tmp_path / "out.jsonl"), "--nats", nats_server.url)
        assert collected.returncode == 0, collected.stderr
    finally:
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    records = [json.loads(line) for line in spans.read_text().splitlines()]
    rollouts = [s for s in records if s["name"] == "rollout"]
    assert len(rollouts) == 5, sorted({s["name"] for s in records})
    # each rollout's trace holds its model and tool calls, recorded by the model and resource workers' processes
    services = {s["service"] for s in records if s["trace_id"] in {r["trace_id"] for r in rollouts}}
    assert len(services) >= 2, services
