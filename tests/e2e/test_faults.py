"""Fault tests: real worker processes are SIGKILLed, the real NATS server restarts.

Every batch must end with exactly one row (or failure row) per task×repeat:
none lost, none duplicated. Only the LLM is a test double (the scripted policy,
slowed down with ``delay_s`` so that work is in flight when the fault hits).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.transport.subjects import Subjects
from tests.helpers import cli, read_jsonl, write_jsonl
from tests.pools import (
    N_TASKS,
    REPEATS,
    BeaconWatch,
    Pool,
    assert_exactly_once,
    publish,
    results_stored,
    start_collect,
    tasks_file,
    wait_until,
    write_config,
)


@pytest.fixture
def server(synced_server: EmbeddedServer) -> EmbeddedServer:
    return synced_server


@pytest.fixture
def pool_factory(server: EmbeddedServer) -> Iterator[Any]:
    pools: list[Pool] = []

    def make(config: Path) -> Pool:
        pool = Pool(config, server.url)
        pools.append(pool)
        return pool

    yield make
    for p in pools:
        p.stop_all()


@pytest.mark.parametrize("victim", ["agents.agent", "models.policy", "resources.env"])
def test_sigkill_a_worker_mid_batch_loses_and_duplicates_nothing(victim: str, server, pool_factory, tmp_path) -> None:
    config = write_config(tmp_path)
    pool = pool_factory(config)
    for only in ("agents.agent", "models.policy", "resources.env"):
        pool.start(only + "#1", only)
    pool.start(victim + "#2", victim)  # a second replica of the role we are going to kill
    out = tmp_path / "out.jsonl"
    publish(config, server.url, tasks_file(tmp_path), "b1")
    collector = start_collect(server.url, "b1", out)
    wait_until(lambda: results_stored(server.url) >= 2)
    pool.kill(victim + "#1")  # work is in flight on it: rollouts, model calls or sessions
    stdout, stderr = collector.communicate(timeout=90)
    assert collector.returncode == 0, stderr
    assert f"{N_TASKS * REPEATS} rows, 0 failed" in stdout
    rows = assert_exactly_once(out)
    assert all(r["reward"] == 1.0 for r in rows)


def test_nats_server_restart_mid_batch_completes(server, pool_factory, tmp_path) -> None:
    config = write_config(tmp_path)
    pool = pool_factory(config)
    for only in ("agents.agent", "models.policy", "resources.env"):
        pool.start(only, only)
    publish(config, server.url, tasks_file(tmp_path), "b2")
    wait_until(lambda: results_stored(server.url) >= 2)
    server.kill()  # SIGKILL: no graceful shutdown; the store dir stays
    time.sleep(0.5)
    server.start()  # same port, same store dir
    out = tmp_path / "out.jsonl"
    res = cli("collect", "--batch", "b2", "--nats", server.url, "-o", str(out), timeout=120)
    assert res.returncode == 0, res.stderr
    assert_exactly_once(out)


def test_always_failing_verifier_becomes_failure_rows(server, pool_factory, tmp_path) -> None:
    config = write_config(tmp_path, resource="tests.envs.flaky", delay_s=0.0, max_attempts=3)
    pool = pool_factory(config)
    for only in ("agents.agent", "models.policy", "resources.env"):
        pool.start(only, only)
    explode = {3, 7}
    publish(config, server.url, tasks_file(tmp_path, explode=explode), "b3")
    out = tmp_path / "out.jsonl"
    res = cli("collect", "--batch", "b3", "--nats", server.url, "-o", str(out), timeout=120)
    assert res.returncode == 1, res.stderr  # failures present
    rows = read_jsonl(out)
    failures = read_jsonl(tmp_path / "out_failures.jsonl")
    assert len(rows) == (N_TASKS - len(explode)) * REPEATS
    assert sorted({f["_ng_task_index"] for f in failures}) == sorted(explode)
    assert len(failures) == len(explode) * REPEATS
    for f in failures:
        assert f["error_class"] == "verify_error"
        assert "always fails" in f["error"]
        assert f["attempts"] == 3
        assert f["input"]["explode"] is True


def test_collector_killed_and_rerun_writes_identical_output(server, pool_factory, tmp_path) -> None:
    config = write_config(tmp_path, delay_s=0.05)
    pool = pool_factory(config)
    for only in ("agents.agent", "models.policy", "resources.env"):
        pool.start(only, only)
    publish(config, server.url, tasks_file(tmp_path), "b4")
    out = tmp_path / "out.jsonl"
    first = start_collect(server.url, "b4", out)
    wait_until(lambda: results_stored(server.url) >= 4)
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    again = cli("collect", "--batch", "b4", "--nats", server.url, "-o", str(out), timeout=120)
    assert again.returncode == 0, again.stderr
    reference = tmp_path / "reference.jsonl"
    ref = cli("collect", "--batch", "b4", "--nats", server.url, "-o", str(reference), timeout=120)
    assert ref.returncode == 0, ref.stderr
    assert_exactly_once(out)
    assert out.read_bytes() == reference.read_bytes()
    assert not Path(str(out) + ".partial").exists()


def _agent_settings(config: Path, **settings: Any) -> None:
    cfg = yaml.safe_load(config.read_text())
    cfg["agents"]["agent"].update(settings)
    config.write_text(yaml.safe_dump(cfg))


def test_a_killed_agents_tasks_come_back_in_seconds_and_cost_no_attempt(server, pool_factory, tmp_path) -> None:
    """With ack_wait 120 s, the tasks a SIGKILLed agent held come back within seconds: its peer hears it fall
    silent (liveness beacons, one message a second per worker) and naks them on its behalf. With max_attempts
    1 they still score: a worker killed from outside is a worker loss, not a failed attempt (before: the
    rollouts it held became worker_lost failure rows)."""
    config = write_config(tmp_path, agent_concurrency=4, delay_s=2.0, max_attempts=1)  # rollouts of ~4 s
    _agent_settings(config, ack_wait_s=120.0)
    pool = pool_factory(config)
    for only in ("agents.agent", "models.policy", "resources.env"):
        pool.start(only + "#1", only)
    pool.start("agents.agent#2", "agents.agent")
    out = tmp_path / "out.jsonl"
    with BeaconWatch(server.url, Subjects("gym").live("task", "agent")) as watch:
        publish(config, server.url, tasks_file(tmp_path), "b1")
        collector = start_collect(server.url, "b1", out)
        # both agents took 4 rollouts and said so (a message taken and killed before its beacon waits
        # ack_wait by design); neither takes more before one ends, ~4 s later
        wait_until(lambda: watch.held() >= 8, timeout=90)
        pool.kill("agents.agent#1")
        killed = time.monotonic()
    stdout, stderr = collector.communicate(timeout=180)
    took = time.monotonic() - killed
    assert collector.returncode == 0, stderr + stdout
    assert f"{N_TASKS * REPEATS} rows, 0 failed" in stdout
    rows = assert_exactly_once(out)
    assert all(r["reward"] == 1.0 for r in rows)
    assert not (tmp_path / "out_failures.jsonl").exists()
    # 20 rollouts left for one agent of 4 slots: ~25 s on a quiet machine; ack_wait alone would be 120 s
    assert took < 90.0, f"the batch finished {took:.1f} s after the kill (ack_wait is 120 s)"


def test_a_task_that_kills_every_worker_ends_as_one_worker_lost_row(server, pool_factory, tmp_path) -> None:
    """A poison task (its agent calls os._exit) kills each worker that takes it; restarted workers take it
    again until its budget of worker losses (max_worker_losses, counted apart from max_attempts) is spent:
    then it is one failure row of class worker_lost, and every other rollout of the batch is a row."""
    # one slot: the rollouts beside the poison one would share each of its worker's deaths (each a loss
    # of theirs too: the reason the default budget of losses is larger than that of attempts)
    config = write_config(tmp_path, agent_concurrency=1, delay_s=0.0, max_attempts=1)
    _agent_settings(config, agent="tests.envs.poison_agent", max_worker_losses=2)
    rows_in = read_jsonl(tasks_file(tmp_path))
    rows_in[5]["poison"] = True
    tasks = write_jsonl(tmp_path / "tasks.jsonl", rows_in)
    pool = pool_factory(config)
    for only in ("models.policy", "resources.env"):
        pool.start(only, only)
    pool.start("agents.agent", "agents.agent")
    out = tmp_path / "out.jsonl"
    cli_res = cli("publish", str(config), "-i", str(tasks), "--nats", server.url, "--batch", "p1")
    assert cli_res.returncode == 0, cli_res.stderr
    collector = start_collect(server.url, "p1", out)
    deaths = 0
    deadline = time.monotonic() + 120
    while collector.poll() is None:  # the test is the supervisor: a dead agent worker is started again
        assert time.monotonic() < deadline, f"collect did not finish ({deaths} worker deaths)"
        if pool.procs["agents.agent"].poll() is not None:
            deaths += 1
            pool.procs.pop("agents.agent")
            pool.start("agents.agent", "agents.agent")
        time.sleep(0.2)
    stdout, stderr = collector.communicate()
    assert collector.returncode == 1, stderr + stdout  # a failure row is present
    rows = read_jsonl(out)
    failures = read_jsonl(tmp_path / "out_failures.jsonl")
    assert sorted(r["_ng_task_index"] for r in rows) == [i for i in range(N_TASKS) if i != 5]
    assert [(f["_ng_task_index"], f["error_class"]) for f in failures] == [(5, "worker_lost")]
    assert "2" in failures[0]["error"] and "worker" in failures[0]["error"]
    assert deaths == 3  # the first delivery and two more (the budget), then the failure row
