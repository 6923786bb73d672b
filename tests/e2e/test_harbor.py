"""Harbor tasks, unchanged, on the sandbox fleet: three small tasks of our own in Harbor's format
(``tests/harbor_tasks``: one reading a file as an unprivileged ``[agent] user``, one compiling C with the gcc
its Dockerfile installs from Debian's mirror, one with a partial reward in ``reward.json`` verified as
``[verifier] user = "nobody"``), each image built
here from its ``environment/Dockerfile`` (``FROM debian:bookworm-slim`` and ``FROM python:3.12-slim`` mapped to
the fleet's Debian base) once per engine, by content hash; a fourth in Terminal-Bench's style
(``tests/harbor_baked``: ``pytest`` on ``tests/test_outputs.py``, pytest baked from PyPI through the proxy); and
``gym-runtime run`` building a task's missing image itself.

Real parts: dockerd, nats-server, the sandbox, resource and agent workers in process, the tasks' own
``tests/test.sh``. Only the LLM is a test double: the ``scripted`` model (it calls ``bash`` once with
``"example"``, then answers). The oracle (``agents.harbor_oracle``: ``solution/solve.sh`` as the policy) must
score every task's full reward; the scripted policy scores 0, or the partial task's no-op share.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import anyio
import pytest

from gym_runtime.config import Config, config_from_dict, resolve_config
from gym_runtime.data.collector import Collector
from gym_runtime.data.inputs import publish_rows
from gym_runtime.harbor import ImageOptions, find_tasks, image_ref, task_row
from gym_runtime.harbor.hosting import ensure_images, harbor_config
from gym_runtime.resources.harbor import dataset_rows
from gym_runtime.sandboxes.engine_api import POOL
from gym_runtime.sandboxes.engine_http import Engine
from gym_runtime.service.runner import make_workers, selected, start_workers
from gym_runtime.transport.bus import Bus
from tests.helpers import REPO, put_batch, read_jsonl

TASKS = REPO / "tests" / "harbor_tasks"
BASES = {"debian:bookworm-slim": "base", "python:3.12-slim": "base"}
OPTS = ImageOptions(base_images=BASES)


@pytest.fixture
async def harbor_images(engine: Engine, base_image: str) -> dict[str, str]:
    """The three tasks' images, built once per engine (compile-c's apt-get takes ~1 min the first time)."""
    return await ensure_images(engine, find_tasks(TASKS), OPTS)


def config(
    tmp_path: Path, engine: Engine, tasks: Path, agent: dict[str, Any], opts: ImageOptions = OPTS
) -> tuple[Config, str]:
    pool = f"hb{uuid.uuid4().hex[:6]}"  # this test's own: others on the engine keep their containers
    raw = harbor_config(str(tasks), opts, f"unix://{engine.socket_path}", 120)
    raw["sandboxes"] = {pool: raw["sandboxes"]["harbor"]}
    raw["resources"]["harbor"]["sandbox"] = pool
    raw["agents"] = {"a": {"model": "policy", "resource": "harbor", "timeout_s": 600, "max_attempts": 1, **agent}}
    return config_from_dict({"namespace": "gym", **raw, "base_dir": str(tmp_path)}), pool


async def run_rows(bus: Bus, engine: Engine, cfg: Config, pool: str, rows: list[dict[str, Any]], out: Path) -> None:
    workers = make_workers(bus, resolve_config(cfg), selected(cfg, None))
    batch = f"hb{uuid.uuid4().hex[:6]}"
    async with anyio.create_task_group() as tg:
        await start_workers(tg, workers)
        await publish_rows(bus, rows, batch=batch, agents=["a"])
        with anyio.fail_after(300):
            await Collector(bus, await put_batch(bus, batch, len(rows), agent="a"), out).run()
        tg.cancel_scope.cancel()
    with anyio.fail_after(30):  # every session's container removed by its owner
        while await engine.containers({POOL: f"gym.{pool}"}):
            await anyio.sleep(0.2)


def by_task(path: Path) -> dict[str, dict[str, Any]]:
    return {r["harbor_task"]: r for r in read_jsonl(path)}


async def test_solve_sh_as_the_policy_scores_every_tasks_full_reward(
    bus: Bus, engine: Engine, harbor_images: dict[str, str], tmp_path: Path
) -> None:
    cfg, pool = config(tmp_path, engine, TASKS, {"agent": "agents.harbor_oracle"})
    rows = [task_row(t) for t in find_tasks(TASKS)]
    await run_rows(bus, engine, cfg, pool, rows, tmp_path / "out.jsonl")
    assert not (tmp_path / "out_failures.jsonl").exists()
    got = by_task(tmp_path / "out.jsonl")
    assert {k: r["reward"] for k, r in got.items()} == {"read-file": 1.0, "compile-c": 1.0, "partial-stats": 1.0}
    assert got["read-file"]["harbor_rewards"] == {"reward": 1.0}  # reward.txt
    assert got["partial-stats"]["harbor_rewards"] == {"reward": 1.0, "checks_passed": 4.0}  # reward.json
    assert {r["verifier_exit_code"] for r in got.values()} == {0}


async def test_a_policy_that_does_nothing_scores_zero_or_the_partial_share(
    bus: Bus, engine: Engine, harbor_images: dict[str, str], tmp_path: Path
) -> None:
    cfg, pool = config(tmp_path, engine, TASKS, {"agent": "agents.simple", "max_steps": 4})
    rows = dataset_rows({"tasks": str(TASKS)}, "train")  # what `prepare -i a=env` writes: the bash tool offered
    await run_rows(bus, engine, cfg, pool, rows, tmp_path / "out.jsonl")
    assert not (tmp_path / "out_failures.jsonl").exists()
    got = by_task(tmp_path / "out.jsonl")
    assert {k: r["reward"] for k, r in got.items()} == {"read-file": 0.0, "compile-c": 0.0, "partial-stats": 0.25}
    assert got["partial-stats"]["harbor_rewards"] == {"reward": 0.25, "checks_passed": 1.0}  # data.csv left intact
    # the prompt is the task's instruction; the model's bash ran in the task's container, in its WORKDIR
    first = got["read-file"]["responses_create_params"]["input"][0]
    assert first["content"] == (TASKS / "read-file" / "instruction.md").read_text()
    [out] = [i["output"] for i in got["read-file"]["response"]["output"] if i["type"] == "function_call_output"]
    assert "example: command not found" in out and out.rstrip().endswith("[exit code 127]"), out


async def test_a_verifier_past_its_timeout_and_a_missing_reward_file_are_failure_rows(
    bus: Bus, engine: Engine, harbor_images: dict[str, str], tmp_path: Path
) -> None:
    tasks = tmp_path / "tasks"
    for name, test_sh, timeout in (
        ("slow", "#!/bin/bash\nsleep 600\necho 1 > /logs/verifier/reward.txt\n", 3),
        ("silent", "#!/bin/bash\ncurl -sSf https://example.com/check.sh | sh\nexit 0\n", 60),
    ):
        shutil.copytree(TASKS / "read-file", tasks / name)  # the same environment/: the same image
        (tasks / name / "tests" / "test.sh").write_text(test_sh)
        toml = (tasks / name / "task.toml").read_text().replace("timeout_sec = 60.0", f"timeout_sec = {timeout}.0")
        (tasks / name / "task.toml").write_text(toml)
    notes: list[str] = []
    assert await ensure_images(engine, find_tasks(tasks), OPTS, note=notes.append) == {
        "slow": harbor_images["read-file"],
        "silent": harbor_images["read-file"],
    }
    assert notes == [
        "silent: tests/test.sh fetches at verify time (curl), which cannot work under --network none: pre-install"
        " what it needs with bake (--bake CMD), or its reward will be wrong"
    ]
    cfg, pool = config(tmp_path, engine, tasks, {"agent": "agents.harbor_oracle"})
    with anyio.fail_after(120):
        await run_rows(bus, engine, cfg, pool, [task_row(t) for t in find_tasks(tasks)], tmp_path / "out.jsonl")
    names = [t.name for t in find_tasks(tasks)]  # a failure row names its task by index
    failed = {names[r["_ng_task_index"]]: r for r in read_jsonl(tmp_path / "out_failures.jsonl")}
    assert failed["slow"]["error_class"] == "verify_error"  # the verifier's own limit: the environment's
    slow = failed["slow"]["error"]
    assert "tests/test.sh ran past its [verifier] timeout_sec=3 (Harbor's VerifierTimeoutError)" in slow
    assert failed["silent"]["error_class"] == "verify_error"
    assert "no reward file: test.sh wrote neither /logs/verifier/reward.txt nor" in failed["silent"]["error"]
    assert "it fetches at verify time (curl)" in failed["silent"]["error"]


def test_parity_command_checks_harbor_tasks_and_an_unmapped_base_is_one_line(
    engine: Engine, harbor_images: dict[str, str], tmp_path: Path
) -> None:
    cmd = [sys.executable, "-m", "gym_runtime.cli", "parity", str(TASKS), "--harbor", "--timeout", "120"]
    maps = [a for k, v in BASES.items() for a in ("--base-image", f"{k}={v}")]
    env = {**os.environ, "DOCKER_HOST": f"unix://{engine.socket_path}"}
    ok = subprocess.run([*cmd, *maps], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.splitlines() == [
        "compile-c: reward 1 (full) {'reward': 1.0}",
        "partial-stats: reward 1 (full) {'reward': 1.0, 'checks_passed': 4.0}",
        "read-file: reward 1 (full) {'reward': 1.0}",
    ]
    bad = subprocess.run(cmd[:-2], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().splitlines() == [
        "gym-runtime: error: compile-c: base image 'debian:bookworm-slim' is not in the engine and cannot be pulled"
        " here: map it to a local one (base_images: {'debian:bookworm-slim': base}, or --base-image"
        " debian:bookworm-slim=base)"
    ]
    assert json.dumps(bad.stderr).count("Traceback") == 0


async def test_baked_commands_are_in_the_image_the_verifier_runs_in(
    bus: Bus, engine: Engine, harbor_images: dict[str, str], tmp_path: Path
) -> None:
    tasks = tmp_path / "tasks"
    shutil.copytree(TASKS / "read-file", tasks / "baked")
    out = "/logs/verifier/reward.txt"
    test_sh = f'#!/bin/bash\nif [ "$(cat /opt/tool/version)" = 1.2 ]; then echo 1 > {out}; else echo 0 > {out}; fi\n'
    (tasks / "baked" / "tests" / "test.sh").write_text(test_sh)
    opts = ImageOptions(base_images=BASES, bake=["mkdir -p /opt/tool && echo 1.2 > /opt/tool/version"])
    [ref] = (await ensure_images(engine, find_tasks(tasks), opts)).values()
    assert ref != harbor_images["read-file"]  # what is baked is part of the image's name
    cfg, pool = config(tmp_path, engine, tasks, {"agent": "agents.harbor_oracle"}, opts)
    await run_rows(bus, engine, cfg, pool, [task_row(t) for t in find_tasks(tasks)], tmp_path / "out.jsonl")
    assert by_task(tmp_path / "out.jsonl")["baked"]["reward"] == 1.0


BAKED = REPO / "tests" / "harbor_baked"  # a task whose verifier runs pytest: pytest baked, as it needs
PYTEST_OPTS = ImageOptions(base_images=BASES, bake=["pip install pytest==8.3.4"])


async def test_a_pytest_verifier_with_pytest_baked_through_the_proxy(
    bus: Bus, engine: Engine, base_image: str, tmp_path: Path
) -> None:
    """Terminal-Bench's way of verifying (``pytest`` on ``tests/test_outputs.py``), with pytest pip-installed
    from PyPI at build time: through this machine's TLS-intercepting proxy, its CA given to the bake only."""
    [ref] = (await ensure_images(engine, find_tasks(BAKED), PYTEST_OPTS)).values()
    # the host's CA bundle was there for the bake only: not in the image's file system nor its environment
    env = {**os.environ, "DOCKER_HOST": f"unix://{engine.socket_path}"}
    look = ["docker", "run", "--rm", "--network", "none", ref, "sh", "-c", "ls /tmp; env; pytest --version"]
    seen = subprocess.run(look, capture_output=True, text=True, timeout=120, env=env)
    assert seen.returncode == 0 and "pytest 8.3.4" in seen.stdout + seen.stderr, seen.stdout + seen.stderr
    assert ".gym-host-ca.crt" not in seen.stdout and "PIP_CERT" not in seen.stdout
    await _pytest_task_scores(bus, engine, tmp_path, {"agent": "agents.harbor_oracle"}, 1.0)


async def test_the_pytest_verifier_fails_a_policy_that_does_nothing(
    bus: Bus, engine: Engine, base_image: str, tmp_path: Path
) -> None:
    await ensure_images(engine, find_tasks(BAKED), PYTEST_OPTS)
    await _pytest_task_scores(bus, engine, tmp_path, {"agent": "agents.simple", "max_steps": 2}, 0.0)


async def _pytest_task_scores(bus: Bus, engine: Engine, tmp_path: Path, agent: dict[str, Any], reward: float) -> None:
    cfg, pool = config(tmp_path, engine, BAKED, agent, PYTEST_OPTS)
    await run_rows(bus, engine, cfg, pool, [task_row(t) for t in find_tasks(BAKED)], tmp_path / "out.jsonl")
    assert not (tmp_path / "out_failures.jsonl").exists()
    row = by_task(tmp_path / "out.jsonl")["pytest-outputs"]
    assert row["reward"] == reward, row["verifier_log"]
    assert ("2 passed" if reward else "2 failed") in row["verifier_log"], row["verifier_log"]


def _cli_run(cfg: Path, rows: Path, out: Path, engine: Engine, cwd: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "gym_runtime.cli", "run", str(cfg), "-i", str(rows), "-o", str(out), "--no-progress"]
    env = {**os.environ, "DOCKER_HOST": f"unix://{engine.socket_path}"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=cwd)


def test_run_builds_a_tasks_missing_image_once_and_refuses_what_cannot_build(
    engine: Engine, base_image: str, tmp_path: Path
) -> None:
    """``gym-runtime run`` on a config naming Harbor tasks builds the image its engine lacks (a fresh one: this
    test's own file in ``environment/``), before anything starts; the next run builds nothing. A base the map
    lacks, or a Dockerfile that fails, is one line and exit 2, with nothing published."""
    tasks = tmp_path / "tasks"
    shutil.copytree(TASKS / "read-file", tasks / "fresh")
    (tasks / "fresh" / "environment" / "nonce.txt").write_text(uuid.uuid4().hex)  # a new hash: a real build
    dockerfile = tasks / "fresh" / "environment" / "Dockerfile"
    dockerfile.write_text(dockerfile.read_text() + "COPY nonce.txt /etc/nonce.txt\n")
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(task_row(t)) + "\n" for t in find_tasks(tasks)))

    def write_config(opts: ImageOptions) -> Path:
        raw = harbor_config(str(tasks), opts, f"unix://{engine.socket_path}", 120)
        path = tmp_path / f"config-{len(opts.base_images)}.yaml"
        path.write_text(json.dumps(raw))  # YAML reads JSON
        return path

    cfg = write_config(OPTS)
    first = _cli_run(cfg, rows, tmp_path / "one.jsonl", engine, tmp_path)
    assert first.returncode == 0, first.stderr
    ref = image_ref(find_tasks(tasks)[0], OPTS)
    assert f"gym-runtime: fresh: building its image {ref} from environment/Dockerfile (once per engine)" in (
        first.stderr.splitlines()
    )
    assert any(ln.startswith(f"gym-runtime: fresh: built {ref} in ") for ln in first.stderr.splitlines())
    # each build step is named as the engine starts it, between those two lines (a slow step is not silent)
    said = first.stderr.splitlines()
    began = said.index(f"gym-runtime: fresh: building its image {ref} from environment/Dockerfile (once per engine)")
    steps = [ln for ln in said[began:] if ln.startswith("gym-runtime: fresh: Step ")]
    assert any(" : COPY nonce.txt /etc/nonce.txt" in ln for ln in steps), first.stderr
    assert said.index(steps[-1]) < next(i for i, ln in enumerate(said) if ln.startswith("gym-runtime: fresh: built "))
    assert by_task(tmp_path / "one.jsonl")["fresh"]["reward"] == 1.0  # the oracle, in the image just built
    again = _cli_run(cfg, rows, tmp_path / "two.jsonl", engine, tmp_path)
    assert again.returncode == 0, again.stderr
    assert "building" not in again.stderr and "built" not in again.stderr
    assert by_task(tmp_path / "two.jsonl")["fresh"]["reward"] == 1.0

    def refused(out: Path, run: subprocess.CompletedProcess[str]) -> str:
        assert run.returncode == 2, run.stderr
        assert "Traceback" not in run.stderr and not out.exists()  # nothing published, no rows
        [line] = [ln for ln in run.stderr.splitlines() if "error" in ln]
        return line

    unmapped = refused(
        tmp_path / "three.jsonl",
        _cli_run(write_config(ImageOptions()), rows, tmp_path / "three.jsonl", engine, tmp_path),
    )
    assert unmapped == (
        "gym-runtime: error: fresh: base image 'debian:bookworm-slim' is not in the engine and cannot be pulled here:"
        " map it to a local one (base_images: {'debian:bookworm-slim': base}, or --base-image"
        " debian:bookworm-slim=base)"
    )
    # `start` builds for the pools it serves, before it waits for the server (none listens here)
    unmapped_config = tmp_path / "config-0.yaml"
    start = [sys.executable, "-m", "gym_runtime.cli", "start", str(unmapped_config), "--nats", "nats://127.0.0.1:1"]
    env = {**os.environ, "DOCKER_HOST": f"unix://{engine.socket_path}"}
    served = subprocess.run([*start, "--only", "sandboxes"], capture_output=True, text=True, timeout=300, env=env)
    assert served.returncode == 2 and served.stderr.strip().splitlines() == [unmapped], served.stderr
    dockerfile.write_text(dockerfile.read_text() + "RUN echo 'no such tool' >&2 && exit 3\n")
    failing = refused(tmp_path / "four.jsonl", _cli_run(cfg, rows, tmp_path / "four.jsonl", engine, tmp_path))
    assert failing.startswith("gym-runtime: error: fresh: building its image failed: building ")
    assert "returned a non-zero code: 3" in failing


# Terminal-Bench's usual verifier: uv fetched with curl at verify time, then pytest through uvx (without its
# ``-p 3.13``: that Python is a download from GitHub, which these machines cannot reach)
UV_TEST_SH = """#!/bin/bash
apt-get update
apt-get install -y curl
curl -LsSf https://astral.sh/uv/0.9.5/install.sh | sh
source $HOME/.local/bin/env
uvx -w pytest==8.4.1 pytest /tests/test_outputs.py -rA
if [ $? -eq 0 ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""
UV_BAKE = [
    "pip install uv==0.9.5",  # on PATH where the failed curl | sh would have put it
    "uvx -w pytest==8.4.1 pytest --version",  # the verifier's very tools, in root's uv cache
    "mkdir -p /etc/uv && printf 'offline = true\\n' > /etc/uv/uv.toml",  # uv resolves from that cache only
]


async def test_a_verifier_that_fetches_uv_at_verify_time_scores_with_uv_baked(
    bus: Bus, engine: Engine, base_image: str, tmp_path: Path
) -> None:
    """The recipe docs/bring-your-environment.md gives for such a task, unchanged: its fetches fail under
    ``--network none`` and the baked uv, offline, runs its pytest (without the offline config, checked by hand, uv
    asks PyPI for pytest and fails: reward 0)."""
    tasks = tmp_path / "tasks"
    shutil.copytree(BAKED / "pytest-outputs", tasks / "uv-outputs")
    (tasks / "uv-outputs" / "tests" / "test.sh").write_text(UV_TEST_SH)
    opts = ImageOptions(base_images=BASES, bake=UV_BAKE)
    await ensure_images(engine, find_tasks(tasks), opts)
    cfg, pool = config(tmp_path, engine, tasks, {"agent": "agents.harbor_oracle"}, opts)
    await run_rows(bus, engine, cfg, pool, [task_row(t) for t in find_tasks(tasks)], tmp_path / "out.jsonl")
    row = by_task(tmp_path / "out.jsonl")["uv-outputs"]
    assert row["reward"] == 1.0, row["verifier_log"]
    assert "2 passed" in row["verifier_log"] and "/root/.local/bin/env: No such file" in row["verifier_log"]
