"""Elastic by backlog on a real local Ray cluster (three raylets): the agents start at ``min: 0``, a batch's backlog
makes the scaler add actors up to ``max``, the batch completes with every row once, and once idle the agents are
drained back to 0; the same on a ``server --secure`` bus, the scaler with the publisher's credentials. (Ray's
autoscaler adding nodes for them: ``test_autoscaling``.)"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gym_runtime.errors import AuthError, UserError
from gym_runtime.ops.credentials import ClientAuth
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.ops.security import ensure_auth_dir
from tests.cluster import tasks_file
from tests.helpers import REPO, node_dir, secured_server
from tests.on_ray.cluster import collect, elastic_agents, local_cluster, need_ray, once_each, publish, write_config

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
    config = elastic_agents(tmp_path, cpus=0.5, high=3, delay_s=0.1)
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


def test_elastic_agents_scale_on_a_secured_bus_the_scaler_with_the_publishers_credentials(
    cluster: Any, tmp_path: Path
) -> None:
    """``server --secure``: the workers connect with their roles' credentials, the scaler with the publisher's
    (the queues' counts are the publisher's grant); no credential of a role it does not use (no admin)."""
    config = elastic_agents(tmp_path, cpus=0.5, high=2)
    with secured_server(tmp_path) as (srv, auth):
        node = node_dir(auth, tmp_path / "node", "publisher", "agent", "model", "resource")
        with OnRay(str(config), nats=srv.url, auth=ClientAuth(node)) as placed:
            pools = placed.pools
            assert pools is not None and pools.count("agents", "agent") == 0
            publish(config, srv.url, tasks_file(tmp_path, 12), "s1", auth=node)
            rows = collect(srv.url, "s1", tmp_path / "out.jsonl", timeout=90, auth=node)
            once_each(rows, 12)
            deadline = time.monotonic() + 120
            while pools.count("agents", "agent") != 0:  # idle: drained back to min over the secured bus
                assert time.monotonic() < deadline
                time.sleep(0.2)


def test_a_secured_bus_without_the_publishers_credential_is_one_line_before_ray_is_asked(tmp_path: Path) -> None:
    config = write_config(tmp_path, ray={"roles": {"agents.agent": {"min": 0, "max": 2}}})
    auth = ensure_auth_dir(tmp_path / "auth")
    node = node_dir(auth, tmp_path / "node", "agent", "model", "resource")
    with pytest.raises(AuthError, match=r"no publisher.creds \(nor admin.creds\)"):
        OnRay(str(config), nats="tls://127.0.0.1:4222", auth=ClientAuth(node))
    (tmp_path / "head").mkdir()
    head = write_config(tmp_path / "head", ray={"nats": "head"})
    with pytest.raises(UserError, match="ray.nats: head runs nats-server without --secure"):
        OnRay(str(head), auth=ClientAuth(node))


def test_a_scaler_the_secured_bus_refuses_is_one_line_before_any_actor_is_placed(cluster: Any, tmp_path: Path) -> None:
    """A publisher.creds the server does not know (another server's), or none at all: ``OnRay`` (``start --ray``)
    ends with the refusal's line before it places an actor (whose worker would wait for the bus), not with elastic
    pools that never scale."""
    config = write_config(tmp_path, ray={"roles": {"agents.agent": {"min": 0, "max": 2}}})
    with secured_server(tmp_path) as (srv, auth):
        node = node_dir(auth, tmp_path / "node", "agent", "model", "resource")
        stale = ensure_auth_dir(tmp_path / "other")
        shutil.copy(stale / "publisher.creds", node / "publisher.creds")
        for creds, said in [
            (ClientAuth(node), r"the scaler \(as publisher, .*publisher.creds\): .*Authorization"),
            (None, r"the scaler \(no credentials\): .*requires TLS and credentials.*--auth-dir"),
        ]:
            t0, before = time.monotonic(), worker_actors()
            with pytest.raises(UserError, match=said) as refused:
                OnRay(str(config), nats=srv.url, auth=creds).__enter__()
            assert "\n" not in str(refused.value) and time.monotonic() - t0 < 30, str(refused.value)
            assert worker_actors() == before  # none asked of Ray (the model's and environment's included)


def worker_actors() -> int:
    """The worker actors this Ray cluster has ever had (alive or dead: the GCS's table)."""
    return sum(1 for a in ray._private.state.actors().values() if a["ActorClassName"].endswith("WorkerProcess"))


def test_start_ray_takes_the_secured_bus_credentials_from_gym_auth_dir(cluster: Any, tmp_path: Path) -> None:
    """The command as a user runs it: ``$GYM_AUTH_DIR`` (not ``--auth-dir``) on ``start --ray``'s node only; its
    workers, on nodes whose environment has no such variable, and its scaler both connect with credentials."""
    config = elastic_agents(tmp_path, cpus=0.5, high=2)
    with secured_server(tmp_path) as (srv, auth):
        node = node_dir(auth, tmp_path / "node", "publisher", "agent", "model", "resource")
        argv = [sys.executable, "-m", "gym_runtime.cli", "start", str(config), "--nats", srv.url]
        env = {**os.environ, "GYM_AUTH_DIR": str(node)}
        workers = subprocess.Popen(
            [*argv, "--ray", cluster.address], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=env,
        )  # fmt: skip
        try:
            assert workers.stdout is not None
            line = workers.stdout.readline()
            assert line.startswith("workers ready on Ray (2 actors)"), line + (workers.stderr.read() or "")
            publish(config, srv.url, tasks_file(tmp_path, 8), "e1", auth=node)
            once_each(collect(srv.url, "e1", tmp_path / "out.jsonl", timeout=90, auth=node), 8)  # agents from 0
        finally:
            workers.send_signal(signal.SIGTERM)
            assert workers.wait(120) == 0, workers.stderr.read() if workers.stderr else ""
