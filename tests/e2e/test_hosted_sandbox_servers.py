"""NeMo Gym's container servers (nemo-gym 0.7.0's swebench and terminal_bench_2_1), unchanged, hosted on the
sandbox fleet: their config says ``sandbox_provider: gym_runtime`` and their own code creates, drives and grades
sandboxes that our sandbox workers hold (``gym_runtime.nemo_gym.hosting.sandbox_provider``).

Real parts only: the real ``gym-runtime run`` in a subprocess, a real nats-server, a real dockerd
(``.ci/docker.sh``), the servers' environments built by ``gym-runtime env build`` (swebench's with
``swebench==4.1.0``), the task images built here and tagged with the names the rows carry
(``tests/nemo_container_tasks.py``). Only the policy is a test double (``tests/envs/container_policy.py``):
scripted commands run in the session's sandbox. Rewards are the servers' own grading: SWE-bench's eval script
and log parser, Terminal-Bench's ``tests/test.sh`` and its ``reward.txt``.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path
from typing import Any

import anyio
import pytest

from gym_runtime.nemo_gym.hosting import env as hosting_env
from gym_runtime.sandboxes.engine_api import POOL
from gym_runtime.sandboxes.engine_http import Engine
from tests.helpers import cli, read_jsonl, write_jsonl
from tests.hosting import catalogue_root
from tests.nemo_container_tasks import (
    SWE_FIX,
    TB_SOLVE,
    build_swe_image,
    build_tb_image,
    swe_image_name,
    swe_row,
    tb_row,
    tb_task_folder,
)

SOLVES, IDLES = "pytest-dev__pytest-90001", "pytest-dev__pytest-90002"


@pytest.fixture
def catalogue(engine: Engine) -> Path:
    """The swebench and terminal_bench_2_1 environments (built once, cached by content hash); asked after the
    engine, so that without one the test skips before building anything (CI's fresh-clone pass)."""
    return catalogue_root("--server", "swebench", "--server", "terminal_bench_2_1")


def config(
    tmp_path: Path, engine: Engine, pool: str, server: str, commands: dict[str, list[str]], **options: Any
) -> Path:
    """``server`` hosted with ``sandbox_provider: gym_runtime`` on pool ``pool`` (``rootfs: writable``: its images
    keep their work at /testbed and /app), and the scripted policy with ``commands`` per row."""
    path = tmp_path / "config.yaml"
    sandbox_config = {"resources": {"cpu": 1, "memory_mib": 1024}, "derive_cpu_env": True}
    path.write_text(
        json.dumps(
            {
                "models": {"policy": {"adapter": "scripted"}},
                "sandboxes": {
                    pool: {
                        "backend": "docker",
                        "engine": f"unix://{engine.socket_path}",
                        "rootfs": "writable",
                        "limits": {"cpu": 1, "memory_mb": 1024, "timeout_s": 300},
                    }
                },
                "resources": {
                    "env": {
                        "nemo_gym": server,
                        "sandbox": pool,
                        "options": {"sandbox_provider": "gym_runtime", "sandbox_config": sandbox_config},
                    }
                },
                "agents": {
                    "policy": {
                        "agent": "tests.envs.container_policy",
                        "model": "policy",
                        "resource": "env",
                        "timeout_s": 600,
                        "max_attempts": 2,
                        "options": {"commands": commands, **options},
                    }
                },
            }
        )
    )
    return path


async def run(
    tmp_path: Path, engine: Engine, pool: str, cfg: Path, rows: list[dict[str, Any]], created: int
) -> list[dict[str, Any]]:
    """Run the rows; every row scored, ``created`` sandboxes made, none left open when each rollout ended."""
    write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    args = ["run", str(cfg), "-i", str(tmp_path / "in.jsonl"), "-o", str(out), "--log-level", "info"]
    r = await anyio.to_thread.run_sync(lambda: cli(*args, timeout=900))
    assert r.returncode == 0, r.stderr[-4000:]
    failures = tmp_path / "out_failures.jsonl"
    assert not failures.exists() or read_jsonl(failures) == [], read_jsonl(failures)
    # each rollout's sandboxes ended with its session: the pool's worker held none when the run stopped it ...
    events = [json.loads(line) for line in r.stderr.splitlines() if line.startswith("{")]
    [stopped] = [e for e in events if e.get("event") == "sandbox.stopped"]
    assert (stopped["left"], stopped["created"]) == (0, created)
    assert [e for e in events if e.get("event") == "guest.leases_ended"] == []  # none waited for the guest's end
    # ... and the engine has none left
    assert await engine.containers({POOL: f"default.{pool}"}) == [] == await engine.containers({POOL: f"gym.{pool}"})
    return read_jsonl(out)


async def test_swebench_server_hosted_on_the_fleet_grades_the_fix_1_and_its_absence_0(
    catalogue: Path, engine: Engine, base_image: str, tmp_path: Path
) -> None:
    commit = await build_swe_image(engine, base_image, [SOLVES, IDLES])
    rows = [swe_row(SOLVES, commit), swe_row(IDLES, commit)]
    assert [swe_image_name(r["instance_id"]) for r in rows] == [
        "swebench/sweb.eval.x86_64.pytest-dev_1776_pytest-90001:latest",
        "swebench/sweb.eval.x86_64.pytest-dev_1776_pytest-90002:latest",
    ]
    pool = f"swe{uuid.uuid4().hex[:6]}"
    cfg = config(tmp_path, engine, pool, "swebench", {SOLVES: [SWE_FIX, "git --no-pager diff"]})
    # each rollout: its session's sandbox (seed_session), then a fresh one that verify grades in
    got = {row["instance_id"]: row for row in await run(tmp_path, engine, pool, cfg, rows, created=4)}

    solved, idle = got[SOLVES], got[IDLES]
    # the policy ran in the session's sandbox, which the server made from the row's image (its WORKDIR)
    assert solved["policy_exec"][0]["stdout"] == "/testbed\n"
    assert "+    return a + b" in solved["policy_exec"][3]["stdout"]
    # SWE-bench's own grading: the session's diff applied in a fresh sandbox, its eval script, its log parser
    assert (solved["reward"], solved["resolved"], solved["evaluation_completed"]) == (1.0, True, True)
    assert "+    return a + b" in solved["model_patch"]
    assert solved["verifier_sandbox_observation"]["provider"] == "gym_runtime"
    assert solved["verifier_sandbox_observation"]["outcome"] == "completed"
    assert (idle["reward"], idle["resolved"]) == (0.0, False)
    assert idle["model_patch"] is None  # nothing to apply: SWE-bench's rule fails it


async def test_terminal_bench_server_hosted_on_the_fleet_rewards_by_its_own_test_script(
    catalogue: Path, engine: Engine, base_image: str, tmp_path: Path
) -> None:
    image = "gym-runtime-tests/sum-numbers:20260101"
    await build_tb_image(engine, base_image, [image])
    folder = tb_task_folder(tmp_path / "sum-numbers")
    solves, idles, flaky = "gym-tests/sum-numbers", "gym-tests/sum-numbers-idle", "gym-tests/sum-numbers-flaky"
    rows = [tb_row(name, image, folder) for name in (solves, idles, flaky)]
    pool = f"tb{uuid.uuid4().hex[:6]}"
    marker = tmp_path / "flaky-first-attempt.json"
    commands = {solves: [TB_SOLVE], flaky: [TB_SOLVE]}
    cfg = config(tmp_path, engine, pool, "terminal_bench_2_1", commands, flaky={flaky: str(marker)})
    # each rollout: one sandbox (seed_session's), which verify runs the task's tests in; the flaky row's first
    # attempt ends (failed, retryable) holding its sandbox, which the server itself never stops: its session's
    # end removes it, and the redelivered attempt gets a fresh one (4 created, none left open)
    got = {row["task_name"]: row for row in await run(tmp_path, engine, pool, cfg, rows, created=4)}

    solved, idle, retried = got[solves], got[idles], got[flaky]
    assert solved["policy_exec"][0]["stdout"] == "/app\n"  # the image's WORKDIR
    assert (solved["reward"], solved["evaluation_completed"]) == (1.0, True)
    assert (idle["reward"], idle["evaluation_completed"]) == (0.0, True)
    first = json.loads(marker.read_text())
    assert first[-1]["exit_code"] == 0  # its first attempt wrote /app/answer.txt, then failed
    assert retried["policy_exec"][1]["stdout"] == "numbers.txt\n"  # the second attempt's sandbox is a fresh one
    assert retried["policy_exec"][1]["sandbox"] != first[1]["sandbox"]
    assert retried["reward"] == 1.0


PROBE = """
import asyncio, json
from nemo_gym.sandbox.providers.registry import create_provider, list_providers
from nemo_gym.sandbox import SandboxSpec
from gym_runtime.nemo_gym.hosting.sandbox_provider import fleet_spec

out = {"listed": "gym_runtime" in list_providers()}
provider = create_provider({"gym_runtime": {}})
out["class"] = type(provider).__name__
spec = fleet_spec(SandboxSpec(image="img:1", env={"A": 1}, resources={"cpu": 0.5, "memory_mib": 512}))
out["spec"] = [spec.image, spec.cpu, spec.memory_mb, spec.env, spec.workdir]
refused = []
for bad in (
    lambda: create_provider({"gym_runtime": {"pool": "x"}}),
    lambda: fleet_spec(SandboxSpec(image="img:1", ports=[8080])),
    lambda: fleet_spec(SandboxSpec(image="img:1", resources={"gpu": 1})),
    lambda: asyncio.run(provider.create(SandboxSpec(image="img:1"))),
):
    try:
        bad()
    except (ValueError, RuntimeError) as e:
        refused.append(str(e))
out["refused"] = refused
print(json.dumps(out))
"""


def test_the_fleet_is_published_as_a_nemo_gym_sandbox_provider() -> None:
    """NeMo Gym's own registry finds ``gym_runtime`` in a hosted environment (the entry point); what it cannot
    give (ports, a GPU, options, a call outside a hosted request) is one line each. No engine needed."""
    catalogue_root("--server", "terminal_bench_2_1")  # a layer with nothing beyond the base: quick to build
    built = hosting_env.ensure("terminal_bench_2_1")
    r = subprocess.run([built.python, "-c", PROBE], capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.splitlines()[-1])
    assert (out["listed"], out["class"]) == (True, "FleetProvider")
    assert out["spec"] == ["img:1", 0.5, 512, {"A": "1"}, ""]  # workdir "": the image's own WORKDIR
    options, ports, gpu, outside = out["refused"]
    assert "takes no options" in options
    assert "ports" in ports and "--network none" in ports
    assert "a GPU" in gpu
    assert "within one of its requests" in outside
    assert all("\n" not in line for line in out["refused"])


# a process the policy leaves behind its command (issue 52): it turns the reward.txt test.sh wrote into 1, or reads
# /tests/test.sh once uploaded and writes the answer it holds before test.sh reads it
OUTLIVE = {
    "gym-tests/sum-numbers-reward": ': outliver; while :; do if [ "$(cat /logs/verifier/reward.txt 2>/dev/null)" = 0 ];'
    " then echo 1 > /logs/verifier/reward.txt; fi; sleep 0.01; done",
    # no fork while it waits (the server runs test.sh right after uploading it): a builtin test in a tight loop
    "gym-tests/sum-numbers-answer": ": outliver; while :; do if [ -r /tests/test.sh ]; then"
    " grep -o '= \"[0-9]*\"' /tests/test.sh | tr -dc 0-9 > /app/answer.txt; fi; done",
}


async def test_a_process_the_policy_leaves_behind_cannot_touch_the_terminal_bench_servers_verify(
    catalogue: Path, engine: Engine, base_image: str, tmp_path: Path
) -> None:
    """The server runs its ``tests/test.sh`` in the sandbox the policy's commands ran in: the resource worker
    restarts the session's sandboxes before the server's verify (their files kept), so a ``setsid`` or
    double-forked loop of the policy's is gone by then. Before, both rows scored 1 without solving the task."""
    image = "gym-runtime-tests/sum-numbers:20260101"
    await build_tb_image(engine, base_image, [image])
    folder = tb_task_folder(tmp_path / "sum-numbers")
    rows = [tb_row(name, image, folder) for name in OUTLIVE]
    starts = {
        "gym-tests/sum-numbers-reward": "setsid nohup sh -c '{}' </dev/null >/dev/null 2>&1 & echo started",
        "gym-tests/sum-numbers-answer": "(sh -c '{}' </dev/null >/dev/null 2>&1 &); echo started",
    }
    alive = "sleep 1; grep -qs 'outlive[r]' /proc/[0-9]*/cmdline && echo ALIVE"
    commands = {name: [starts[name].format(loop.replace("'", "'\\''")), alive] for name, loop in OUTLIVE.items()}
    pool = f"tb{uuid.uuid4().hex[:6]}"
    cfg = config(tmp_path, engine, pool, "terminal_bench_2_1", commands)
    got = {row["task_name"]: row for row in await run(tmp_path, engine, pool, cfg, rows, created=2)}
    for row in got.values():
        assert [e["stdout"] for e in row["policy_exec"][2:]] == ["started\n", "ALIVE\n"], row["policy_exec"]
        assert row["evaluation_completed"] is True
    assert {name: row["reward"] for name, row in got.items()} == dict.fromkeys(OUTLIVE, 0.0)
