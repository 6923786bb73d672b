"""Placement on a real local Ray cluster (three raylets): every role's replicas as Ray actors, a batch through them,
a dead worker and a lost node restarted by Ray with every row once, and a pool no node can hold said in one line.

The bus is a real nats-server outside Ray (``ray.nats: config``); the policy is the scripted double."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gym_runtime.ops.nats_server import EmbeddedServer
from tests.helpers import REPO
from tests.on_ray.cluster import (
    collect,
    kill,
    local_cluster,
    mid_batch,
    need_ray,
    once_each,
    publish,
    restarted,
    tasks_file,
    write_config,
)

ray = need_ray()
from gym_runtime.placement.on_ray import OnRay  # noqa: E402  (after the skip: it imports ray)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    # the head holds no worker (0 CPUs): a lost worker node never takes the driver's node with it
    with local_cluster([{"num_cpus": 0}, {"num_cpus": 2}, {"num_cpus": 2}]) as c:
        yield c


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EmbeddedServer]:
    with EmbeddedServer(store_dir=str(tmp_path / "store"), http_port=0) as srv:
        yield srv


@pytest.fixture
def nats(server: EmbeddedServer) -> str:
    return server.url


def test_a_batch_runs_with_every_role_placed_as_ray_actors(cluster: Any, nats: str, tmp_path: Path) -> None:
    config = write_config(
        tmp_path,
        replicas=2,
        ray={"roles": {"models.policy": {"num_cpus": 0.5}, "resources.env": {"num_cpus": 0.5, "memory_mb": 64}}},
    )
    with OnRay(str(config), nats=nats) as placed:
        actors = placed.actors
        assert sorted(r.spec for r in actors) == ["agents.agent", "agents.agent", "models.policy", "resources.env"]
        on = ray.get([r.handle.node.remote() for r in actors])  # each replica a live Ray actor, where Ray put it
        workers = {n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU")}
        assert set(on) == workers  # spread over both worker nodes (1 + 1 + 0.5 + 0.5 CPUs asked of 2 + 2)
        assert len({r.pid for r in actors}) == 4  # one worker process each
        publish(config, nats, tasks_file(tmp_path, 40), "b1")
        once_each(collect(nats, "b1", tmp_path / "out.jsonl"), 40)


def test_a_worker_that_dies_mid_batch_is_restarted_by_ray_and_every_row_comes_once(
    cluster: Any, server: EmbeddedServer, nats: str, tmp_path: Path
) -> None:
    config = write_config(tmp_path, delay_s=0.2, ray={"roles": {"models.policy": {"num_cpus": 0.5}}})
    with OnRay(str(config), nats=nats) as placed:
        agent = next(r for r in placed.actors if r.spec == "agents.agent")
        publish(config, nats, tasks_file(tmp_path, 60), "b2")
        out = tmp_path / "out.jsonl"
        got: list[list[dict[str, Any]]] = []
        collector = threading.Thread(target=lambda: got.append(collect(nats, "b2", out)))
        collector.start()
        mid_batch(server, 5, 60)
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
        publish(config, nats, tasks_file(tmp_path, 60), "b3")
        out = tmp_path / "out.jsonl"
        got: list[list[dict[str, Any]]] = []
        collector = threading.Thread(target=lambda: got.append(collect(nats, "b3", out)))
        collector.start()
        mid_batch(server, 5, 60)
        cluster.remove_node(victim, allow_graceful=False)  # its raylet and every process of it, killed
        for r in lost:  # Ray places each again on a live node, with a new worker
            assert restarted(r.handle, r.pid)[1] != victim.node_id
        collector.join(240)
        once_each(got[0], 60)
