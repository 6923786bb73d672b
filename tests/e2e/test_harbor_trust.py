"""A Harbor task against a hostile policy and a hostile task author (issue 52), on a real engine.

The policy (``tests.envs.harbor_attack``) leaves a process behind its ``bash`` turn and shows it alive after the
turn; that process (a) turns the ``reward.txt`` test.sh wrote into ``1``, or (b) reads ``/tests/test.sh`` once
it is copied in and writes the answer it holds before test.sh reads it. Each attack is tried by a root agent (no
``[agent] user``, the usual case) and an unprivileged one, its process started with ``setsid``, by a double fork,
and as a fork loop (a chain of short-lived processes, each starting the next). Verify must score all of them 0.

The task author: a link in ``tests/``, ``environment/`` or ``solution/`` to a 0600 file of the operator's must
not put its bytes anywhere; ``gym-runtime run`` and ``parity --harbor`` refuse the task in one line, exit 2.

Real parts: dockerd, nats-server, the sandbox, resource and agent workers, the task's own test.sh.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from gym_runtime.harbor import find_tasks, load_task, task_row
from gym_runtime.harbor.hosting import ensure_images, harbor_config
from gym_runtime.sandboxes.engine_http import Engine
from gym_runtime.transport.bus import Bus
from tests.e2e.test_harbor import BASES, OPTS, TASKS, config, run_rows
from tests.helpers import read_jsonl

SECRET = "s3cr3t-5d1e"  # the answer: nowhere but in test.sh
TEST_SH = f"""#!/bin/bash
if [ "$(cat /app/answer.txt 2>/dev/null)" = "{SECRET}" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""
REWARD = "/logs/verifier/reward.txt"
STEPS = {  # one step of each attack (run again and again by the process left behind)
    "reward": f'if [ "$(cat {REWARD} 2>/dev/null)" = 0 ]; then rm -f {REWARD}; echo 1 > {REWARD}; fi',
    "answer": "s=$(grep -o 's3cr3t-[0-9a-f]*' /tests/test.sh 2>/dev/null) && echo \"$s\" > /app/answer.txt",
}
QUIET = "</dev/null >/dev/null 2>&1"
BEAT = "date +%s%N > /tmp/.b$$ && mv -f /tmp/.b$$ /tmp/.beat"  # the heartbeat, replaced whole (never seen empty)
LAUNCH = {  # how the process outlives the turn: the script it runs, and the line that starts it
    "setsid": (
        "while :; do {beat}; {step}; sleep 0.01; done",
        f"setsid nohup sh /tmp/.x.sh {QUIET} &",
    ),
    "double-fork": ("while :; do {beat}; {step}; sleep 0.01; done", f"(sh /tmp/.x.sh {QUIET} &)"),
    # each process does one step, starts the next and ends: no pid lives long enough to be listed and killed
    "fork-loop": (
        f"{{beat}}; {{step}}; sleep 0.01; sh /tmp/.x.sh {QUIET} &",
        f"sh /tmp/.x.sh {QUIET} &",
    ),
}


def attack(step: str, launch: str) -> str:
    script, start = LAUNCH[launch]
    return f"cat > /tmp/.x.sh <<'EOF'\n{script.format(step=STEPS[step], beat=BEAT)}\nEOF\n{start}\necho started"


def secret_tasks(root: Path) -> Path:
    """The read-file task (its image) with TEST_SH as its test: ``agent`` runs as the unprivileged ``agent``
    user, ``root`` names no user (the image's: root)."""
    for name in ("agent", "root"):
        shutil.copytree(TASKS / "read-file", root / name)
        (root / name / "tests" / "test.sh").write_text(TEST_SH)
        (root / name / "instruction.md").write_text("Guess the answer and write it to /app/answer.txt.\n")
    toml = root / "root" / "task.toml"
    toml.write_text(toml.read_text().replace('user = "agent"\n', ""))
    assert load_task(root / "root").config.agent.user is None
    assert load_task(root / "agent").config.agent.user == "agent"
    return root


async def test_a_process_left_behind_by_the_policy_cannot_touch_verify(
    bus: Bus, engine: Engine, base_image: str, tmp_path: Path
) -> None:
    tasks = secret_tasks(tmp_path / "tasks")
    await ensure_images(engine, find_tasks(tasks), OPTS)  # read-file's image: built once per engine
    cfg, pool = config(tmp_path, engine, tasks, {"agent": "tests.envs.harbor_attack"})
    rows = [
        {**task_row(t), "attack": attack(step, launch), "case": f"{t.name}/{step}/{launch}"}
        for t in find_tasks(tasks)
        for step in STEPS
        for launch in LAUNCH
    ]
    await run_rows(bus, engine, cfg, pool, rows, tmp_path / "out.jsonl")
    assert not (tmp_path / "out_failures.jsonl").exists(), (tmp_path / "out_failures.jsonl").read_text()
    got = {r["case"]: r for r in read_jsonl(tmp_path / "out.jsonl")}
    assert sorted(got) == sorted(r["case"] for r in rows)
    for case, row in got.items():
        outputs = [i["output"] for i in row["response"]["output"] if i["type"] == "function_call_output"]
        assert "started" in outputs[0] and "ALIVE" in outputs[1], (case, outputs)  # it outlived its turn
        assert (case, row["reward"], row["verifier_exit_code"]) == (case, 0.0, 0), (case, row["verifier_log"])


async def test_the_honest_oracle_still_scores_after_verify_ends_the_turns_processes(
    bus: Bus, engine: Engine, base_image: str, tmp_path: Path
) -> None:
    """The files a policy wrote survive what verify does first (its solve.sh's answer, as the agent's user)."""
    tasks = tmp_path / "tasks"
    shutil.copytree(TASKS / "read-file", tasks / "read-file")
    await ensure_images(engine, find_tasks(tasks), OPTS)
    cfg, pool = config(tmp_path, engine, tasks, {"agent": "agents.harbor_oracle"})
    await run_rows(bus, engine, cfg, pool, [task_row(t) for t in find_tasks(tasks)], tmp_path / "out.jsonl")
    [row] = read_jsonl(tmp_path / "out.jsonl")
    assert row["reward"] == 1.0, row["verifier_log"]


# ---------------------------------------------------------------------------------------------------- links


def operator_secret(tmp_path: Path) -> tuple[Path, str]:
    """A 0600 file of the operator's (an SSH key, ``admin.creds``): what a task's link would read."""
    secret = uuid.uuid4().hex
    home = tmp_path / "operator"
    home.mkdir()
    path = home / "admin.creds"
    path.write_text(f"token={secret}\n")
    path.chmod(0o600)
    return path, secret


def linking_task(tasks: Path, where: str, target: Path) -> Path:
    """read-file with a link to ``target`` in ``where`` (tests/, environment/ or solution/), and what would put
    the target's bytes into the verifier's log on a reader that follows it."""
    task = tasks / f"link-{where}"
    shutil.copytree(TASKS / "read-file", task)
    (task / where / "leak").symlink_to(target)
    test_sh = task / "tests" / "test.sh"
    shows = {"tests": "/tests/leak", "environment": "/leak", "solution": "/solution/leak"}[where]
    test_sh.write_text(test_sh.read_text() + f"cat {shows}\n")
    if where == "environment":
        dockerfile = task / "environment" / "Dockerfile"
        dockerfile.write_text(dockerfile.read_text() + "COPY leak /leak\n")
    return task


def _cli(args: list[str], engine: Engine, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DOCKER_HOST": f"unix://{engine.socket_path}"}
    cmd = [sys.executable, "-m", "gym_runtime.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=cwd)


def _refused(run: subprocess.CompletedProcess[str], link: Path, secret: str, out: Path) -> None:
    assert run.returncode == 2, run.stdout + run.stderr
    assert "Traceback" not in run.stderr and secret not in run.stdout + run.stderr
    assert run.stderr.strip().splitlines() == [
        f"gym-runtime: error: {link}: a symbolic link in a Harbor task is refused (its files must be its own)"
    ]
    leaked = [p for p in out.parent.glob("*.jsonl") if secret in p.read_text()]
    assert not out.exists() and not leaked


@pytest.mark.parametrize("where", ["tests", "environment", "solution"])
def test_run_refuses_a_task_that_links_to_the_operators_files(
    engine: Engine, base_image: str, tmp_path: Path, where: str
) -> None:
    """On a reader that follows links (the old one), this ran and the row's ``verifier_log`` held the secret (the
    sandbox had it: /tests/leak, /leak in the image, /solution/leak)."""
    target, secret = operator_secret(tmp_path)
    tasks = tmp_path / "tasks"
    task = linking_task(tasks, where, target)
    cfg = tmp_path / "config.yaml"
    cfg.write_text(json.dumps(harbor_config(str(tasks), OPTS, f"unix://{engine.socket_path}", 120)))
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({**task_row(load_task(TASKS / "read-file")), "harbor_task": task.name}) + "\n")
    out = tmp_path / "out.jsonl"
    run = _cli(["run", str(cfg), "-i", str(rows), "-o", str(out), "--no-progress"], engine, tmp_path)
    _refused(run, task / where / "leak", secret, out)


def test_parity_refuses_a_task_that_links_to_the_operators_files(
    engine: Engine, base_image: str, tmp_path: Path
) -> None:
    target, secret = operator_secret(tmp_path)
    task = linking_task(tmp_path / "tasks", "tests", target)
    maps = [a for k, v in BASES.items() for a in ("--base-image", f"{k}={v}")]
    run = _cli(["parity", str(tmp_path / "tasks"), "--harbor", "--timeout", "120", *maps], engine, tmp_path)
    _refused(run, task / "tests" / "leak", secret, tmp_path / "parity.jsonl")
