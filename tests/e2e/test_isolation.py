"""No environment code can silence a worker (issue 33, item 5): ``isolation: process``.

The attack: environment code that holds the GIL (Python's ``re`` on a quadratic pattern, as NeMo Gym's
imo_proofbench_judge grader is on a long answer of repeated ``\\(``; a sync OpenEnv ``step`` doing the same)
stopped the resource worker's event loop; the bus's keepalives stopped with it and every call in flight on
that worker became ``worker_lost``. With the environment's code in a guest process, the worker kills the guest
when one call overruns ``call_timeout_s``: that rollout is a ``timeout`` row, and every other rollout is scored
(those whose sessions lived in the killed guest run again as new attempts, never as failure rows).

Real parts: a real nats-server, the resource worker as a real ``gym-runtime start`` process (its guest a real
child of it), agent and model workers in this process. The scripted policy is the LLM's test double.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import anyio
import psutil
import yaml

from gym_runtime import Client
from gym_runtime.resources.openenv import action_tool
from tests.cluster import start_worker, stop
from tests.envs.openenv_hog import HogAction
from tests.helpers import REPO, cli, read_jsonl, rows, write_jsonl
from tests.hosting import catalogue_root

HOG_KB = 200  # ~80 s of one regex search on an idle core: the worker must stop it, not wait it out
N = 12
HOG = 5  # the task whose environment code overruns


def write_config(tmp: Path, resource: dict[str, Any], *, delay_s: float = 0.0) -> Path:
    cfg = {
        "namespace": "gym",
        "models": {"policy": {"adapter": "scripted", "delay_s": delay_s, "concurrency": 32}},
        "resources": {"env": resource},
        "agents": {
            "agent": {
                "agent": "agents.simple",
                "model": "policy",
                "resource": "env",
                "max_steps": 4,
                "timeout_s": 90,
                "concurrency": 16,
            }
        },
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


async def run_batch(config: Path, url: str, tasks: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The batch's rows (failure rows included) by task, the resource worker a process of its own."""
    worker = start_worker(config, url, "resources.env")
    try:
        async with Client(config, nats=url, workers=["models.policy", "agents.agent"]) as client:
            batch = await client.submit(tasks)
            with anyio.fail_after(150):
                got = await batch.gather()
    finally:
        stop([worker])
    return {r["_ng_task_index"]: r for r in got}


def assert_only_the_hog_failed(by_task: dict[int, dict[str, Any]]) -> None:
    assert sorted(by_task) == list(range(N))
    hog = by_task[HOG]
    assert hog.get("error_class") == "timeout", hog
    assert "call_timeout_s=3" in hog["error"], hog["error"]
    others = {i: r.get("error_class", r.get("reward")) for i, r in by_task.items() if i != HOG}
    assert all(v == 1.0 for v in others.values()), others  # no worker_lost, no timeout: every one scored


async def test_a_verify_that_holds_the_gil_times_out_alone(nats_server, tmp_path: Path) -> None:
    config = write_config(
        tmp_path, {"server": "tests.envs.gil_hog", "isolation": "process", "call_timeout_s": 3}, delay_s=0.2
    )
    tasks = [dict(r) for r in rows(N)]
    tasks[HOG]["hog_kb"] = HOG_KB
    assert_only_the_hog_failed(await run_batch(config, nats_server.url, tasks))


async def test_an_openenv_step_that_holds_the_gil_times_out_alone(nats_server, tmp_path: Path) -> None:
    """OpenEnv runs in a guest by default (no ``isolation`` key); ``step_timeout_s`` could not stop the step."""
    resource = {
        "server": "resources.openenv",
        "call_timeout_s": 3,
        "options": {"env": "tests.envs.openenv_hog:HogEnv", "step_timeout_s": 2},
    }
    config = write_config(tmp_path, resource, delay_s=0.2)
    tool = action_tool(HogAction)
    tasks: list[dict[str, Any]] = [
        {"responses_create_params": {"input": [{"role": "user", "content": f"play {i}"}], "tools": [tool]}}
        for i in range(N)
    ]
    tasks[HOG]["openenv_reset"] = {"hog_kb": HOG_KB}
    assert_only_the_hog_failed(await run_batch(config, nats_server.url, tasks))


def guests(worker_pid: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(worker_pid).children() if "gym_runtime.workers.guest_main" in p.cmdline()]


async def test_a_guest_killed_mid_batch_loses_no_rollout(nats_server, tmp_path: Path) -> None:
    """SIGKILL of the guest (out of memory, a crash in native code) while sessions live in it: every rollout
    is scored; the ones it held ran again as new attempts."""
    config = write_config(tmp_path, {"server": "tests.envs.gil_hog", "isolation": "process"}, delay_s=0.3)
    worker = start_worker(config, nats_server.url, "resources.env")
    try:
        (first,) = guests(worker.pid)
        async with Client(config, nats=nats_server.url, workers=["models.policy", "agents.agent"]) as client:
            batch = await client.submit(rows(3 * N))
            got = []
            with anyio.fail_after(150):
                async for row in batch:
                    got.append(row)
                    if len(got) == 4:  # sessions of the other rollouts are open in the guest now
                        first.send_signal(signal.SIGKILL)
        (second,) = guests(worker.pid)
    finally:
        stop([worker])
    assert second.pid != first.pid
    assert len(got) == 3 * N
    failures = [r for r in got if "error_class" in r]
    assert not failures, failures[:3]
    assert all(r["reward"] == 1.0 for r in got)


GILHOG = REPO / "tests" / "data" / "nemo_servers" / "gilhog"


def test_a_hosted_nemo_gym_verify_that_holds_the_gil_times_out_alone(tmp_path: Path) -> None:
    """A hosted NeMo Gym server (isolation: process by default) whose verify holds the GIL past call_timeout_s,
    with the worker run by `gym-runtime run` as users run it: that rollout is a ``timeout`` row, the others
    are scored, none is ``worker_lost`` (on the old in-child bus, the server's regex stopped the keepalives)."""
    catalogue_root("--server", "example_session_state_mgmt")  # skips without a Python >= 3.13
    cfg = {
        "models": {"policy": {"adapter": "scripted", "delay_s": 0.2}},
        "resources": {"env": {"nemo_gym": str(GILHOG), "call_timeout_s": 3}},
        "agents": {"agent": {"agent": "agents.simple", "model": "policy", "resource": "env", "timeout_s": 90}},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    tasks = [{"responses_create_params": {"input": f"go {i}"}} for i in range(N)]
    tasks[HOG]["hog_kb"] = HOG_KB
    data = write_jsonl(tmp_path / "in.jsonl", tasks)
    r = cli("run", str(path), "-i", str(data), "-o", str(tmp_path / "out.jsonl"), timeout=600)
    failures = read_jsonl(tmp_path / "out_failures.jsonl") if (tmp_path / "out_failures.jsonl").exists() else []
    by_task = {row["_ng_task_index"]: row for row in [*read_jsonl(tmp_path / "out.jsonl"), *failures]}
    assert r.returncode == 1, r.stderr[-2000:]  # one failure row
    assert_only_the_hog_failed(by_task)


async def test_a_frozen_guest_is_restarted_within_seconds_not_after_call_timeout_s(nats_server, tmp_path: Path) -> None:
    """SIGSTOP of the guest while sessions live in it (issue 77): no call of it ends until ``call_timeout_s``
    (120 s by default), so the worker kills a guest it finds stopped for 5 s and starts another; the rollouts it
    held run again as new attempts: every row scored, the batch done within 60 s of the freeze."""
    config = write_config(tmp_path, {"server": "tests.envs.gil_hog", "isolation": "process"}, delay_s=0.3)
    worker = start_worker(config, nats_server.url, "resources.env")
    frozen = None
    try:
        (first,) = guests(worker.pid)
        async with Client(config, nats=nats_server.url, workers=["models.policy", "agents.agent"]) as client:
            batch = await client.submit(rows(3 * N))
            got = []
            with anyio.fail_after(150):
                async for row in batch:
                    got.append(row)
                    if len(got) == 4:  # sessions of the other rollouts are open in the guest now
                        first.send_signal(signal.SIGSTOP)
                        frozen, t0 = first, time.monotonic()
            took = time.monotonic() - t0
        (second,) = guests(worker.pid)
    finally:
        if frozen is not None and frozen.is_running():
            frozen.send_signal(signal.SIGCONT)
        stop([worker])
    assert second.pid != first.pid
    assert len(got) == 3 * N
    failures = [r for r in got if "error_class" in r]
    assert not failures, failures[:3]
    assert all(r["reward"] == 1.0 for r in got)
    assert took < 60.0, took
    print(f"frozen guest: batch done {took:.1f}s after the freeze")
