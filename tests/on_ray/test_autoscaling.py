"""Ray's autoscaler adding nodes under the scaler's request, for real: a head node with room for the model and
the environment only, whose autoscaler (Ray's fake multi-node provider: raylets launched on this machine) may add
two one-CPU nodes. The agents start at ``min: 0`` and ask one CPU each: a batch's backlog makes the scaler want
two, ask Ray's autoscaler for them (``request_resources``), and place them on the nodes it launches; the batch
completes on them with every row once; once idle the agents are drained to 0, the scaler withdraws its request,
and the autoscaler ends the nodes."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gym_runtime.ops.nats_server import EmbeddedServer
from tests.cluster import tasks_file
from tests.on_ray.cluster import (
    alive_nodes,
    autoscaling_cluster,
    collect,
    elastic_agents,
    need_ray,
    once_each,
    publish,
    results_stored,
)

ray = need_ray()
from ray._private.ray_constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL  # noqa: E402
from ray.experimental.internal_kv import _internal_kv_get  # noqa: E402

from gym_runtime.placement.on_ray import OnRay  # noqa: E402  (after the skip: it imports ray)

TASKS = 24


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    with autoscaling_cluster(head={"CPU": 1}, node={"CPU": 1}, max_nodes=2) as c:
        yield c


def requested() -> list[tuple[tuple[str, float], ...]]:
    """What the cluster has asked Ray's autoscaler for (``request_resources``' last bundles, sorted)."""
    raw = _internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)
    return sorted(tuple(sorted(b.items())) for b in json.loads(raw)) if raw else []


HALF, ONE = (("CPU", 0.5),), (("CPU", 1),)


def test_a_backlog_makes_ray_add_nodes_for_new_agents_that_serve_it_and_idle_ends_them(
    cluster: Any, tmp_path: Path
) -> None:
    config = elastic_agents(tmp_path, cpus=1, high=2, delay_s=0.2, placement_timeout_s=45)
    head = alive_nodes()
    assert len(head) == 1
    with (
        EmbeddedServer(store_dir=str(tmp_path / "store"), http_port=0) as srv,
        OnRay(str(config), nats=srv.url) as placed,
    ):
        pools = placed.pools
        assert pools is not None and pools.count("agents", "agent") == 0
        asked: list[list[tuple[tuple[str, float], ...]]] = []
        agent_nodes: set[str] = set()
        first: dict[str, float] = {}
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                asked.append(requested())
                agent_nodes.update(r.node for r in pools.replicas.get(("agents", "agent"), []) if r.node)
                if "node" not in first and alive_nodes() - head:
                    first["node"] = time.monotonic()
                if "result" not in first and results_stored(srv):
                    first["result"] = time.monotonic()
                time.sleep(0.1)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            t0 = time.monotonic()
            publish(config, srv.url, tasks_file(tmp_path, TASKS), "b1")
            rows = collect(srv.url, "b1", tmp_path / "out.jsonl", timeout=300)
            took = time.monotonic() - t0
            once_each(rows, TASKS)
            # the scaler asked Ray's autoscaler for both agents (one CPU each) beside the head's two half-CPU actors
            assert max(asked, key=len) == [HALF, HALF, ONE, ONE]
            # the agents that served the batch ran on nodes Ray's autoscaler launched for them, none on the head
            # (a pool lists its new actors once all of them are ready: the second node may come after the batch)
            deadline = time.monotonic() + 60
            while len(agent_nodes) < 2:
                assert time.monotonic() < deadline, agent_nodes
                time.sleep(0.1)
            assert not agent_nodes & head, (agent_nodes, head)
            print(
                f"batch of {TASKS} from 0 agents and 0 worker nodes: {took:.1f} s; first node up "
                f"{first['node'] - t0:.1f} s, first result {first['result'] - t0:.1f} s after publish"
            )
            t1 = time.monotonic()
            deadline = t1 + 120
            while pools.count("agents", "agent") or alive_nodes() != head:  # idle: agents drained, nodes ended
                assert time.monotonic() < deadline, (pools.count("agents", "agent"), alive_nodes() - head)
                time.sleep(0.2)
            print(f"idle to 0 agents and the head alone: {time.monotonic() - t1:.1f} s")
            assert requested() == [HALF, HALF]  # the agents' request withdrawn
        finally:
            done.set()
            watcher.join()
