"""The Docker deploy files as written, on the real engine here: the image built on a local base, the
host-network Compose file brought up with Debian's docker-compose (v1), a batch scored, `stop` draining.

The image builds on the debootstrap base the sandbox fleet uses (``gym_runtime.sandboxes.images``: Debian 12
with python3 and python3-venv, no registry), with BuildKit and ``--network host`` (a build's RUN steps have
no network under ``dockerd --bridge=none``); the machine's CA bundle goes in as a build secret, for a
TLS-intercepting proxy. ``deploy/compose.host.yaml`` and ``deploy/config.yaml`` are copied unchanged
(but the config's 20GB stream limits) beside a work folder; only the ports (free ones) and the image name
come from the environment, as the file documents. Without an engine or docker-compose the test skips with
one line (a failure under GYM_REQUIRE_DOCKER=1, CI's first pass).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import yaml

from gym_runtime.ops.nats_server import free_port
from gym_runtime.sandboxes.engine_http import Engine
from gym_runtime.sandboxes.images import ensure_base
from tests.docker import _unavailable, docker_socket
from tests.helpers import REPO, read_jsonl

DOCKER, COMPOSE = "/usr/bin/docker", "/usr/bin/docker-compose"  # Debian's, not whatever is first on PATH
IMAGE = "gym-runtime:deploy-test"
CA = Path("/etc/ssl/certs/ca-certificates.crt")
N_ROWS = 8


@pytest.fixture(scope="module")
def image() -> str:
    sock = docker_socket()
    if not (os.access(DOCKER, os.X_OK) and os.access(COMPOSE, os.X_OK)):
        _unavailable(f"{DOCKER} or {COMPOSE} is missing (.ci/docker.sh installs docker.io and docker-compose)")

    async def base() -> str:
        async with Engine(sock) as engine:
            return await ensure_base(engine)

    ref = anyio.run(base)
    secret = ["--secret", f"id=pip_cert,src={CA}"] if CA.is_file() else []
    build = subprocess.run(
        [DOCKER, "build", "-q", "--network", "host", *secret, "--build-arg", f"PYTHON_IMAGE={ref}",
         "-f", "deploy/Dockerfile", "-t", IMAGE, "."],
        cwd=REPO, capture_output=True, text=True, timeout=900, env={**os.environ, "DOCKER_BUILDKIT": "1"},
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    return IMAGE


class Stack:
    """deploy/compose.host.yaml brought up as a project of its own, on free loopback ports."""

    def __init__(self, tmp: Path, image: str) -> None:
        self.dir = tmp
        shutil.copy(REPO / "deploy/compose.host.yaml", tmp / "compose.host.yaml")
        config = yaml.safe_load((REPO / "deploy/config.yaml").read_text())
        config["models"]["policy"]["delay_s"] = 5.0  # rollouts in flight (~10 s each) when `stop` comes
        # one at a time per agent replica: the batch's rollouts are in flight for ~40 s, not all at once for 10 s,
        # so a status poll (seconds on a loaded machine) cannot miss them
        config["agents"]["weather_agent"]["concurrency"] = 1
        # its 20GB stream limits lowered, as the other recipes' tests do: three servers reserve them on one disk
        config["jetstream"].update(tasks_max_bytes="1GB", results_max_bytes="1GB")
        (tmp / "config.yaml").write_text(json.dumps(config))
        (tmp / "work").mkdir()
        rows = (REPO / "resources/weather/data/example.jsonl").read_text().splitlines()
        (tmp / "work/tasks.jsonl").write_text("\n".join((rows * 2)[:N_ROWS]) + "\n")
        ports = {f"GYM_{kind}{i}": str(free_port()) for kind in ("PORT", "ROUTE", "HTTP") for i in (1, 2, 3)}
        self.nats = ",".join(f"nats://127.0.0.1:{ports[f'GYM_PORT{i}']}" for i in (1, 2, 3))
        self.env = {**os.environ, **ports, "GYM_IMAGE": image, "GYM_UID": str(os.getuid()), "GYM_GID": str(os.getgid())}
        self.project = f"gymdeploy{os.getpid()}"

    def compose(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [COMPOSE, "-p", self.project, "-f", "compose.host.yaml", *args],
            cwd=self.dir, capture_output=True, text=True, timeout=timeout, env=self.env,
        )  # fmt: skip

    def driver(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return self.compose("run", "--rm", "driver", *args, timeout=timeout)

    def scored(self, *compose: str, logs_of: str) -> list[dict[str, Any]]:
        """``up -d`` (with ``compose``'s files and profiles), work/tasks.jsonl published as b1 and collected: its
        rows (``logs_of``: the service whose log a failed collect shows)."""
        up = self.compose(*compose, "up", "-d")
        assert up.returncode == 0, up.stderr
        pub = self.driver("publish", "/config/config.yaml", "-i", "/work/tasks.jsonl", "--batch", "b1")
        assert pub.returncode == 0, pub.stderr[-2000:]
        col = self.driver("collect", "--batch", "b1", "-o", "/work/out.jsonl", "--nats", self.nats)
        assert col.returncode == 0, col.stderr[-2000:] + self.compose("logs", logs_of).stdout[-3000:]
        return read_jsonl(self.dir / "work/out.jsonl")

    def workers(self) -> list[dict[str, object]]:
        """The live workers' status answers (``gym-runtime status --json``, from this checkout: host networking
        puts the servers on loopback, and a poll that starts no container takes a second, not several)."""
        res = subprocess.run(
            [sys.executable, "-m", "gym_runtime.cli", "status", "--nats", self.nats, "--json"],
            cwd=REPO, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        return list(json.loads(res.stdout)["workers"]) if res.returncode == 0 else []

    def exit_codes(self, *services: str) -> dict[str, int]:
        out = {}
        for s in services:
            cid = self.compose("ps", "-q", s).stdout.split()
            state = subprocess.run(
                [DOCKER, "inspect", "-f", "{{.State.ExitCode}}", *cid], capture_output=True, text=True
            )
            out[s] = max(int(x) for x in state.stdout.split())
        return out


@pytest.fixture
def stack(tmp_path: Path, image: str) -> Iterator[Stack]:
    s = Stack(tmp_path, image)
    try:
        yield s
    finally:
        s.compose("down", "-v", "--timeout", "5")


def test_compose_on_host_networking_scores_a_batch_and_stop_drains_every_worker(stack: Stack) -> None:
    up = stack.compose("up", "-d", "--scale", "agents=2")
    assert up.returncode == 0, up.stderr
    pub = stack.driver("publish", "/config/config.yaml", "-i", "/work/tasks.jsonl", "--batch", "b1")
    assert pub.returncode == 0, pub.stderr[-2000:]
    # SIGTERM every worker while rollouts are in flight (each model call takes 5 s)
    deadline = time.monotonic() + 120
    while not any(w.get("role") == "agent" and w.get("in_flight") for w in stack.workers()):
        assert time.monotonic() < deadline, "no rollout ever in flight"
    stopped = stack.compose("stop", "agents", "resources", "models", timeout=200)
    assert stopped.returncode == 0, stopped.stderr
    codes = stack.exit_codes("agents", "resources", "models")
    assert codes == {"agents": 0, "resources": 0, "models": 0}, codes  # drained, not killed (137)
    again = stack.compose("up", "-d", "--scale", "agents=2")
    assert again.returncode == 0, again.stderr
    col = stack.driver("collect", "--batch", "b1", "-o", "/work/out.jsonl", "--nats", stack.nats)
    assert col.returncode == 0, col.stderr[-2000:]
    rows = read_jsonl(stack.dir / "work/out.jsonl")
    assert sorted(r["_ng_task_index"] for r in rows) == list(range(N_ROWS))  # every row once, none lost
    assert all(r["reward"] == 1.0 for r in rows)
    assert os.stat(stack.dir / "work/out.jsonl").st_uid == os.getuid()  # written as the user, not root or 10001


# An agent of the user's own that runs a command in a sandbox of the config's pool (mounted into the services
# by a Compose override, as a user's code is: docs/deployment.md).
BOX_AGENT = REPO / "tests" / "envs" / "box_agent.py"
# every service loads the whole config (the agent's module included), so each gets the folder
PLUGINS = "services:\n" + "".join(
    f"  {s}:\n    environment: {{PYTHONPATH: /plugins}}\n    volumes: ['./plugins:/plugins:ro']\n"
    for s in ("agents", "resources", "models", "sandboxes", "driver")
)


def test_compose_starts_the_configs_sandbox_pool_and_down_v_removes_everything(tmp_path: Path, image: str) -> None:
    """A config with a sandbox pool: `--profile sandboxes` starts its worker on the host's engine (its socket
    mounted), an agent's rollouts run in sandboxes there, and `down -v` leaves no container or volume."""
    stack = Stack(tmp_path, image)
    pool = f"cb{os.getpid()}"  # this test's own: pools of other runs on the engine keep their containers
    config = json.loads((tmp_path / "config.yaml").read_text())
    config["models"]["policy"]["delay_s"] = 0.0
    config["sandboxes"] = {pool: {"backend": "docker", "image": "base", "max_live": 4}}
    config["agents"]["weather_agent"].update(agent="box_agent", sandbox=pool, timeout_s=120)
    (tmp_path / "config.yaml").write_text(json.dumps(config))
    (tmp_path / "plugins").mkdir()
    shutil.copy(BOX_AGENT, tmp_path / "plugins" / "box_agent.py")
    (tmp_path / "plugins.yaml").write_text(PLUGINS)
    stack.env["GYM_ENGINE_SOCKET"] = docker_socket()
    compose = ["-f", "plugins.yaml", "--profile", "sandboxes"]
    try:
        rows = stack.scored(*compose, logs_of="sandboxes")
        assert sorted(r["_ng_task_index"] for r in rows) == list(range(N_ROWS))
        assert all(r["reward"] == 1.0 and r["sandbox_wait_s"] >= 0 for r in rows), rows[0]
        made = subprocess.run(  # the pool's containers were the host engine's; each rollout's is gone again
            [DOCKER, "ps", "-aq", "--filter", f"label=gym-runtime.pool=gym.{pool}"],
            capture_output=True, text=True, env=stack.env,
        )  # fmt: skip
        assert made.returncode == 0 and made.stdout.strip() == "", made.stdout
    finally:
        down = stack.compose(*compose, "down", "-v", "--timeout", "5")
    assert down.returncode == 0, down.stderr
    label = f"label=com.docker.compose.project={stack.project}"
    for what in (["ps", "-aq"], ["volume", "ls", "-q"]):
        left = subprocess.run([DOCKER, *what, "--filter", label], capture_output=True, text=True, env=stack.env)
        assert left.returncode == 0 and left.stdout.strip() == "", (what, left.stdout)


def test_compose_starts_what_a_config_other_than_weather_declares(tmp_path: Path, image: str) -> None:
    """Issue 67: the services start what the mounted config declares. A user's own config (the counter environment,
    its model entry named otherwise) mounted in place of the weather one, the Compose file unchanged: every service
    starts (none restart-loops on an entry it does not have) and the batch is scored."""
    stack = Stack(tmp_path, image)
    config = json.loads((tmp_path / "config.yaml").read_text())
    config["models"] = {"mine": {"adapter": "scripted", "concurrency": 8}}
    config["resources"] = {"counter": {"server": "resources.counter"}}
    config["agents"] = {"counter_agent": {"agent": "agents.simple", "model": "mine", "resource": "counter"}}
    (tmp_path / "config.yaml").write_text(json.dumps(config))
    rows = (REPO / "resources/counter/data/example.jsonl").read_text().splitlines()
    (tmp_path / "work/tasks.jsonl").write_text("\n".join(rows[:N_ROWS]) + "\n")
    got = stack.scored(logs_of="agents")
    assert sorted(r["_ng_task_index"] for r in got) == list(range(len(rows[:N_ROWS])))
    assert {r["agent_ref"]["name"] for r in got} == {"counter_agent"}
    restarts = subprocess.run(
        [DOCKER, "inspect", "-f", "{{.RestartCount}}", *stack.compose("ps", "-q").stdout.split()],
        capture_output=True, text=True, env=stack.env,
    )  # fmt: skip
    assert set(restarts.stdout.split()) == {"0"}, restarts.stdout  # no service restarted on a missing entry
