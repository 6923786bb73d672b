"""Elastic by backlog on a real local Ray cluster (three raylets): the agents start at ``min: 0``, a batch's backlog
makes the scaler add actors up to ``max``, the batch completes with every row once, and once idle the agents are
drained back to 0. (Ray's autoscaler adding nodes for them is not under test here: ``AutoscalingCluster``, Ray's
fake multi-node provider, runs ``ray stop --force``, which ends every Ray process of the machine's user, other
sessions' included; the scaler's ``request_resources`` call runs, and a cluster without an autoscaler ignores it.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gym_runtime.ops.nats_server import EmbeddedServer
from tests.cluster import tasks_file
from tests.on_ray.cluster import collect, local_cluster, need_ray, once_each, publish, write_config

ray = need_ray()
from gym_runtime.placement.on_ray import OnRay  # noqa: E402  (after the skip: it imports ray)

TASKS = 40


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    with local_cluster([{"num_cpus": 0}, {"num_cpus": 2}, {"num_cpus": 2}]) as c:
        yield c


def test_agents_scale_from_0_to_n_under_a_backlog_and_back_to_0_when_idle_with_every_row_once(
    cluster: Any, tmp_path: Path
) -> None:
    config = write_config(
        tmp_path,
        delay_s=0.1,
        concurrency=4,
        ray={
            "idle_s": 2,
            "roles": {
                "agents.agent": {"num_cpus": 0.5, "min": 0, "max": 3},
                "models.policy": {"num_cpus": 0.5},
                "resources.env": {"num_cpus": 0.5},
            },
        },
    )
    with EmbeddedServer(store_dir=str(tmp_path / "store")) as srv, OnRay(str(config), nats=srv.url) as placed:
        pools = placed.pools
        assert pools is not None and pools.count("agents", "agent") == 0
        seen: list[int] = []
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                seen.append(pools.count("agents", "agent"))
                time.sleep(0.1)

        watcher = threading.Thread(target=watch)
        watcher.start()
        t0 = time.monotonic()
        publish(config, srv.url, tasks_file(tmp_path, TASKS), "b1")
        rows = collect(srv.url, "b1", tmp_path / "out.jsonl", timeout=400)
        print(f"batch of {TASKS} from 0 agents: {time.monotonic() - t0:.1f} s")
        once_each(rows, TASKS)
        assert max(seen) == 3  # 40 tasks at 4 slots a replica want 10: max 3
        deadline = time.monotonic() + 120
        while pools.count("agents", "agent") != 0:  # idle: drained back to min
            assert time.monotonic() < deadline, seen[-5:]
            time.sleep(0.2)
        done.set()
        watcher.join()
