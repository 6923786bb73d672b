"""``gym-runtime explain``: a rollout's history from each attempt's own records, after the batch, as the
publisher reads it. Real nats-server, real worker processes (one SIGKILLed mid-rollout); only the LLM is a
test double (the scripted policy, slowed so that the rollout is in flight when its worker dies)."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path
from typing import Any

import anyio
import nats
import nats.js.errors
import pytest

from gym_runtime.config import load_config, resolve_config
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.ops.credentials import ClientAuth
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.service.runner import run_batch
from gym_runtime.transport.subjects import Subjects
from tests.helpers import REPO, cli, node_dir, read_jsonl
from tests.pools import BeaconWatch, Pool, start_collect, tasks_file, wait_until, write_config
from tests.test_view import serve


@pytest.fixture
def server(synced_server: EmbeddedServer) -> EmbeddedServer:
    return synced_server


def test_explain_shows_the_attempt_a_sigkilled_agent_left_and_the_one_that_stored_the_result(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    config = write_config(tmp_path, agent_concurrency=1, delay_s=3.0)  # two model calls of 3 s: a 6 s rollout
    pool = Pool(config, server.url)
    try:
        for only in ("models.policy", "resources.env"):
            pool.start(only, only)
        first = pool.start("agents.agent#1", "agents.agent")
        with BeaconWatch(server.url, Subjects("gym").live("task", "agent")) as watch:
            res = cli("publish", str(config), "-i", str(tasks_file(tmp_path, 1)), "--nats", server.url, "--batch", "b1")
            assert res.returncode == 0, res.stderr
            wait_until(lambda: watch.held() >= 1, timeout=90)  # it took the task and said so
            wait_until(lambda: _records(server.url) >= 1, timeout=90)  # ... and its record of the attempt is stored
            pool.kill("agents.agent#1")  # mid-rollout: its model calls take 6 s
        second = pool.start("agents.agent#2", "agents.agent")  # takes the task once its ack_wait (2 s) passed
        out = tmp_path / "out.jsonl"
        collector = start_collect(server.url, "b1", out)
        stdout, stderr = collector.communicate(timeout=180)
        assert collector.returncode == 0, stderr + stdout
    finally:
        pool.stop_all()
    (row,) = read_jsonl(out)
    assert row["reward"] == 1.0 and row["provenance"]["attempt"] >= 2

    got = cli("explain", "b1", "0", "0", "--nats", server.url, "--json")
    assert got.returncode == 0, got.stderr
    (hist,) = json.loads(got.stdout)["rollouts"]
    attempts = hist["attempts"]
    assert len(attempts) >= 2 and attempts[0]["number"] == 1
    killed, stored = attempts[0], attempts[-1]
    # the killed attempt: where it ran (the killed process), no result, nothing given back
    assert killed["start"]["pid"] == first.pid and killed["start"]["node"] == socket.gethostname()
    assert not killed["results"] and killed.get("retried") is None
    # the last: another process, its result with its calls and cost
    assert stored["start"]["pid"] == second.pid and stored["start"]["attempt"] == row["provenance"]["attempt"]
    assert stored["start"]["worker"] == row["provenance"]["workers"]["agent"][0] != killed["start"]["worker"]
    (result,) = stored["results"]
    assert result["row"]["reward"] == 1.0 and result["row"]["cost"] == row["cost"]
    calls = result["calls"]
    models = [c for c in calls if len(c) == 4]
    assert len(models) == row["cost"]["models"]["policy"]["calls"] == 2
    assert sum(c[2] for c in models) == row["cost"]["models"]["policy"]["input_tokens"]
    assert sum(c[3] for c in models) == row["cost"]["models"]["policy"]["output_tokens"]
    assert all(c[1] >= 3000 for c in models)  # each scripted call takes delay_s
    assert [c[0] for c in calls] == sorted(c[0] for c in calls)  # in the order they were made

    # collect kept the same records beside its output (they go with purge), and view shows them
    side = [json.loads(line) for line in (tmp_path / "out_attempts.jsonl").read_text().splitlines()]
    starts = [r for r in side if r["kind"] == "attempt.start.v1"]
    assert starts[0]["pid"] == first.pid and starts[-1]["pid"] == second.pid
    assert [r["attempt"] for r in starts] == [a["number"] for a in attempts]
    (kept,) = [r for r in side if r["kind"] == "result"]
    assert kept["calls"] == calls and kept["attempt"] == row["provenance"]["attempt"]
    batch = json.loads((tmp_path / "out_batch.json").read_text())
    assert batch["batch"] == "b1" and batch["manifest"]["models"]["policy"]["adapter"] == "scripted"
    for site in serve(str(out)):
        status, _, page = site.get("/rollout/0/0/0")
        assert status == 200
        text = page.decode()
        assert f"(pid {first.pid})" in text and f"(pid {second.pid})" in text and "(the slot&#39;s)" in text

    text = cli("explain", "b1", "0", "--nats", server.url)
    assert text.returncode == 0, text.stderr
    out_text = text.stdout
    assert "attempt 1  started" in out_text and f"worker {killed['start']['worker']} (pid {first.pid})" in out_text
    assert "no result: its worker was lost" in out_text
    assert f"redelivered: attempt {attempts[-2]['number']}'s worker was lost" in out_text
    assert f"worker {stored['start']['worker']} (pid {second.pid})" in out_text
    assert "result: reward 1.0 (the slot's result: collect writes it)" in out_text
    assert "cost: policy 2 calls" in out_text
    assert out_text.count("model policy (scripted") == 2 and "tool  get_weather" in out_text


async def test_explain_says_why_an_attempt_was_given_back(server: EmbeddedServer, tmp_path: Path) -> None:
    """A retryable failure (the verifier raises) is retried once (max_attempts 2), then a failure row: the first
    attempt's record says why it was given back, with its calls; the second's failure row is the slot's."""
    config = load_config(write_config(tmp_path, resource="tests.envs.flaky", delay_s=0.0, max_attempts=2))
    done = await run_batch(
        resolve_config(config),
        server.url,
        input_path=tasks_file(tmp_path, 1, explode={0}),
        out=tmp_path / "out.jsonl",
        telemetry=Telemetry(),
        batch="f1",
    )
    assert done.stats.failures == 1
    got = await anyio.to_thread.run_sync(lambda: cli("explain", "f1", "0", "--nats", server.url, "--json"))
    assert got.returncode == 0, got.stderr
    first, second = json.loads(got.stdout)["rollouts"][0]["attempts"]
    assert first["retried"]["error"]["error_class"] == "verify_error" and not first["results"]
    assert [len(c) for c in first["retried"]["calls"]] == [4, 2, 4]  # model, tool, model: then verify raised
    assert second["start"]["failed"] == 1 and second["results"][0]["error"]["error_class"] == "verify_error"
    text = await anyio.to_thread.run_sync(lambda: cli("explain", "f1", "0", "--nats", server.url))
    assert "verify_error: " in text.stdout and "(runs again)" in text.stdout, text.stdout
    assert "redelivered: attempt 1 failed with verify_error (retryable)" in text.stdout
    assert "failure row: verify_error" in text.stdout and "(the slot's result: collect writes it)" in text.stdout
    assert "caused by: environment (by its class, verify_error)" in text.stdout  # issue 66: the attribution


def _records(url: str) -> int:
    """Attempt records the server stored (what a test waits on before it kills the worker that wrote one)."""

    async def count() -> int:
        nc = await nats.connect(url)
        try:
            return int((await nc.jetstream().stream_info(Subjects("gym").attempts_stream)).state.messages)
        except nats.js.errors.NotFoundError:
            return 0
        finally:
            await nc.close()

    return asyncio.run(count())


def test_explain_user_mistakes_are_one_line_exit_2(server: EmbeddedServer, tmp_path: Path) -> None:
    config = write_config(tmp_path)
    res = cli("publish", str(config), "-i", str(tasks_file(tmp_path, 3)), "--nats", server.url, "--batch", "b2")
    assert res.returncode == 0, res.stderr
    for args, says in (
        (["nope", "0"], "no batch 'nope'"),
        (["b2", "3"], "batch b2 has tasks 0..2, not 3"),
        (["b2", "0", "1"], "batch b2 has rollouts 0..0 of each task, not 1"),
    ):
        got = cli("explain", *args, "--nats", server.url)
        assert got.returncode == 2, got.stderr
        assert got.stderr.strip().count("\n") == 0 and says in got.stderr, got.stderr
    # queued, not yet run: said, not an error
    got = cli("explain", "b2", "1", "--nats", server.url)
    assert got.returncode == 0 and "no attempt recorded yet" in got.stdout, got.stderr
    dead = cli("explain", "b2", "0", "--nats", "nats://127.0.0.1:1", timeout=60)
    assert dead.returncode == 2 and dead.stderr.strip().splitlines()[-1].startswith("gym-runtime: "), dead.stderr


async def test_explain_reads_with_the_publishers_credentials_on_a_secured_bus(secured: Any, tmp_path: Path) -> None:
    srv, auth = secured
    workers = node_dir(auth, tmp_path / "workers", "publisher", "agent", "model", "resource")
    publisher = node_dir(auth, tmp_path / "client", "publisher")
    cfg = load_config(REPO / "resources/weather/config.yaml")
    data = REPO / "resources/weather/data/example.jsonl"
    done = await run_batch(
        resolve_config(cfg),
        srv.url,
        input_path=data,
        out=tmp_path / "out.jsonl",
        telemetry=Telemetry(),
        auth=ClientAuth(workers),
    )
    rows = read_jsonl(tmp_path / "out.jsonl")
    assert done.stats.failures == 0
    t0 = time.monotonic()
    got = cli("explain", done.batch, "1", "--nats", srv.url, "--auth-dir", str(publisher), "--json")
    assert got.returncode == 0, got.stderr
    assert time.monotonic() - t0 < 60
    (hist,) = json.loads(got.stdout)["rollouts"]
    (attempt,) = hist["attempts"]
    assert (
        attempt["start"]["attempt"] == 1 and attempt["start"]["worker"] == rows[1]["provenance"]["workers"]["agent"][0]
    )
    assert attempt["results"][0]["row"]["cost"] == rows[1]["cost"]
