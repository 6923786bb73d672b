"""Placement on a real local Ray cluster (three raylets): every role's replicas as Ray actors, a batch through them,
a dead worker and a lost node restarted by Ray with every row once, and a pool no node can hold said in one line.

The bus is a real nats-server outside Ray (``ray.nats: config``); the policy is the scripted double."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gym_runtime.ops.nats_server import EmbeddedServer, free_port, port_taken
from tests.cluster import tasks_file
from tests.helpers import REPO, cli, read_jsonl
from tests.on_ray.cluster import (
    collect,
    kill,
    local_cluster,
    mid_batch,
    need_ray,
    once_each,
    publish,
    restarted,
    write_config,
)
from tests.test_sandbox_metrics import labels, scrape

ray = need_ray()
from gym_runtime.placement.on_ray import OnRay  # noqa: E402  (after the skip: it imports ray)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    # the head holds no worker (0 CPUs): a lost worker node never takes the driver's node with it
    # what the workers' nodes have in their environment (the docs' recipe reads GYM_JS_REPLICAS: one server here)
    os.environ["GYM_JS_REPLICAS"] = "1"
    with local_cluster([{"num_cpus": 0}, {"num_cpus": 2}, {"num_cpus": 2}]) as c:
        yield c


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EmbeddedServer]:
    # room for the deploy config's stream limits (20GB each, reserved: not what a batch here writes)
    with EmbeddedServer(store_dir=str(tmp_path / "store"), http_port=0, max_store=100 * 2**30) as srv:
        yield srv


@pytest.fixture
def nats(server: EmbeddedServer) -> str:
    return server.url


def running_batch(
    server: EmbeddedServer, config: Path, tasks: Path, batch: str, out: Path
) -> tuple[threading.Thread, list[list[dict[str, Any]]]]:
    """A batch published and being collected (its rows in the list once the thread ends), a few results in."""
    publish(config, server.url, tasks, batch)
    got: list[list[dict[str, Any]]] = []
    collector = threading.Thread(target=lambda: got.append(collect(server.url, batch, out)))
    collector.start()
    mid_batch(server, 5, len(read_jsonl(tasks)))
    return collector, got


def test_a_batch_runs_with_every_role_placed_as_ray_actors(cluster: Any, nats: str, tmp_path: Path) -> None:
    config = write_config(
        tmp_path,
        replicas=2,
        ray={"roles": {"models.policy": {"num_cpus": 0.5}, "resources.env": {"num_cpus": 0.5, "memory_mb": 64}}},
    )
    base = metrics_ports(4)
    with OnRay(str(config), nats=nats, metrics_port=base) as placed:
        actors = placed.actors
        assert sorted(r.spec for r in actors) == ["agents.agent", "agents.agent", "models.policy", "resources.env"]
        on = ray.get([r.handle.node.remote() for r in actors])  # each replica a live Ray actor, where Ray put it
        workers = {n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU")}
        assert set(on) == workers  # spread over both worker nodes (1 + 1 + 0.5 + 0.5 CPUs asked of 2 + 2)
        assert len({r.pid for r in actors}) == 4  # one worker process each
        publish(config, nats, tasks_file(tmp_path, 40), "b1")
        once_each(collect(nats, "b1", tmp_path / "out.jsonl"), 40)
        # the same metrics as `start`'s: each actor's worker on --metrics-port, from the given port up
        roles = {r.spec: labels(scrape(base + r.index), "target_info")[0]["gym_role"] for r in actors}
        assert roles == {"agents.agent": "agent", "models.policy": "model", "resources.env": "resource"}
        rollouts = [
            labels(scrape(base + r.index), "gym_rollouts_completed_total") for r in actors if r.spec == "agents.agent"
        ]
        assert all(rollouts), rollouts  # both agents' workers served rollouts, each counted on its own endpoint


def metrics_ports(n: int) -> int:
    """The first of ``n`` consecutive free loopback ports (each actor's worker takes the next one)."""
    while True:
        base = random.SystemRandom().randrange(10_000, 30_000)
        if not any(port_taken("127.0.0.1", base + i) for i in range(n)):
            return base


def test_a_worker_that_dies_mid_batch_is_restarted_by_ray_and_every_row_comes_once(
    cluster: Any, server: EmbeddedServer, nats: str, tmp_path: Path
) -> None:
    config = write_config(tmp_path, delay_s=0.2, ray={"roles": {"models.policy": {"num_cpus": 0.5}}})
    with OnRay(str(config), nats=nats) as placed:
        agent = next(r for r in placed.actors if r.spec == "agents.agent")
        collector, got = running_batch(server, config, tasks_file(tmp_path, 60), "b2", tmp_path / "out.jsonl")
        kill(agent.pid or 0)  # the worker process, SIGKILL: nothing drains
        restarted(agent.handle, agent.pid)  # by Ray: a new worker takes the batch on (the dead one's redelivered)
        collector.join(240)
        once_each(got[0], 60)


def test_a_pool_asking_for_a_resource_no_node_has_is_one_line_within_the_bound(
    cluster: Any, nats: str, tmp_path: Path
) -> None:
    config = write_config(
        tmp_path,
        ray={"placement_timeout_s": 3, "roles": {"resources.env": {"num_cpus": 0.5, "resources": {"docker": 1}}}},
    )
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "gym_runtime.cli", "start", str(config), "--nats", nats] + ["--ray", cluster.address],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    took = time.monotonic() - t0
    assert p.returncode == 2, p.stderr
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, p.stderr
    assert "ray.roles.resources.env" in lines[0] and "docker: 1" in lines[0] and "no node" in lines[0], lines[0]
    print(lines[0], f"({took:.1f} s)")
    assert took < 60, took  # the placement bound (3 s) plus Ray's connect and the actors' stop


@pytest.mark.parametrize(
    ("roles", "said"),
    [
        ({"resources.nope": {}}, "ray.roles: 'resources.nope' names no entry of the config's resources"),
        ({"policy": {}}, "'policy' must be ROLE.NAME"),
        ({"models.policy": {"min": 3, "max": 2}}, "min (3) is more than max (2)"),
    ],
)
def test_a_ray_section_mistake_is_one_line_before_ray_is_asked(
    cluster: Any, tmp_path: Path, roles: dict[str, Any], said: str
) -> None:
    config = write_config(tmp_path, ray={"roles": roles})
    p = cli("start", str(config), "--nats", "nats://127.0.0.1:1", "--ray", cluster.address, timeout=60)
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert p.returncode == 2 and len(lines) == 1 and said in lines[0], p.stderr


def docs_recipe() -> tuple[dict[str, Any], list[str]]:
    """docs/deployment.md's "On a Ray cluster": its `ray:` section and its commands, as written."""
    text = (REPO / "docs/deployment.md").read_text()
    section = text[text.index("## On a Ray cluster") :]
    blocks = re.findall(r"```(\w+)\n(.*?)```", section, re.S)
    ray_block = next(body for lang, body in blocks if lang == "yaml" and body.startswith("ray:"))
    bash = next(body for lang, body in blocks if lang == "bash")
    commands = [line.split("#")[0].strip().rstrip("&").strip() for line in bash.splitlines()]
    return yaml.safe_load(ray_block), [c for c in commands if c.startswith("gym-runtime")]


def test_the_deployment_docs_ray_recipe_runs_as_written(cluster: Any, nats: str, tmp_path: Path) -> None:
    ray_section, commands = docs_recipe()
    cfg = yaml.safe_load((REPO / "deploy/config.yaml").read_text()) | ray_section
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    tasks = tasks_file(tmp_path, 20)

    def argv(command: str) -> list[str]:  # the docs' paths and HEAD, this test's
        words = command.replace("nats://HEAD:4222", nats).replace("deploy/config.yaml", str(config)).split()
        words = [str(tasks) if w == "tasks.jsonl" else str(tmp_path / w) if w == "out.jsonl" else w for w in words]
        return [sys.executable, "-m", "gym_runtime.cli", *words[1:]]

    start = next(c for c in commands if " start " in f" {c} ")
    assert "--ray auto" in start
    env = {**os.environ, "RAY_ADDRESS": cluster.address}  # `auto`: this cluster
    workers = subprocess.Popen(
        argv(start), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        assert workers.stdout is not None
        line = workers.stdout.readline()
        assert line.startswith("workers ready on Ray (2 actors)"), line + workers.stderr.read()  # agents: min 0
        for command in commands:
            if command != start and not command.startswith("gym-runtime server"):
                p = subprocess.run(argv(command), cwd=REPO, capture_output=True, text=True, timeout=240, env=env)
                assert p.returncode == 0, (command, p.stderr)
        once_each(read_jsonl(tmp_path / "out.jsonl"), 20)
    finally:
        workers.send_signal(signal.SIGTERM)  # every worker drains, the actors end
        assert workers.wait(120) == 0, workers.stderr.read() if workers.stderr else ""


def test_nats_on_the_head_node_serves_a_batch_and_keeps_its_store(cluster: Any, tmp_path: Path) -> None:
    port = free_port()
    store = tmp_path / "head-store"
    config = write_config(tmp_path, ray={"nats": "head", "nats_port": port, "store_dir": str(store)})
    with OnRay(str(config)) as placed:
        url = str(placed.url)
        assert url.endswith(f":{port}")
        publish(config, url, tasks_file(tmp_path, 10), "h1")
        once_each(collect(url, "h1", tmp_path / "out.jsonl"), 10)
    assert list(store.glob("**/GYM_RESULTS_agent"))  # the store stays on the head node's disk


def test_a_raylet_lost_mid_batch_its_actors_restart_elsewhere_and_every_row_comes_once(
    cluster: Any, server: EmbeddedServer, nats: str, tmp_path: Path
) -> None:
    config = write_config(
        tmp_path,
        delay_s=0.2,
        ray={"roles": {f"{r}": {"num_cpus": 0.5} for r in ("agents.agent", "models.policy", "resources.env")}},
    )
    cluster.add_node(num_cpus=2)  # room elsewhere for the lost node's actors
    cluster.wait_for_nodes()
    with OnRay(str(config), nats=nats) as placed:
        nodes = {r.node for r in placed.actors}
        victim = next(n for n in cluster.worker_nodes if n.node_id in nodes)  # the others take over
        lost = [r for r in placed.actors if r.node == victim.node_id]
        collector, got = running_batch(server, config, tasks_file(tmp_path, 60), "b3", tmp_path / "out.jsonl")
        cluster.remove_node(victim, allow_graceful=False)  # its raylet and every process of it, killed
        for r in lost:  # Ray places each again on a live node, with a new worker
            assert restarted(r.handle, r.pid)[1] != victim.node_id
        collector.join(240)
        once_each(got[0], 60)
