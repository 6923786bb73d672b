"""The Ray tier's cluster: real raylets on this machine (``ray.cluster_utils.Cluster``), one per test module;
or a head whose own Ray autoscaler launches them (``autoscaling_cluster``: Ray's fake multi-node provider).

Without Ray (the main suite's venv has no ``ray`` extra) every module here skips with the one line below
(pytest folds them: one location, one reason); with ``GYM_REQUIRE_RAY=1`` (CI's Ray stage) that skip is a failure.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cluster import monitor
from tests.cluster import write_config as cluster_config
from tests.helpers import cli, read_jsonl

REQUIRE_ENV = "GYM_REQUIRE_RAY"


def need_ray() -> Any:
    """``ray``, or a skip (a failure under GYM_REQUIRE_RAY=1)."""
    if os.environ.get(REQUIRE_ENV) == "1":
        return importlib.import_module("ray")
    try:
        return importlib.import_module("ray")
    except ImportError:
        pytest.skip(
            "ray is not installed: the Ray tier runs in its own venv (pip install -e '.[ray]'; .ci/run)",
            allow_module_level=True,
        )


@contextmanager
def local_cluster(nodes: list[dict[str, Any]]) -> Iterator[Any]:
    """A Ray cluster of ``len(nodes)`` raylets (the first the head), this process its driver."""
    ray = need_ray()
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"include_dashboard": False, **nodes[0]})
    for args in nodes[1:]:
        cluster.add_node(**args)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, logging_level=logging.ERROR)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


AUTOSCALER_ENV = {"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}


@contextmanager
def autoscaling_cluster(head: dict[str, float], node: dict[str, float], max_nodes: int) -> Iterator[Any]:
    """A head node (``head``'s resources) whose Ray autoscaler (v1, in the head's monitor process) launches up to
    ``max_nodes`` raylets of ``node``'s resources on this machine when actors or ``request_resources`` ask for
    them, and ends them once idle (3 s): Ray's fake multi-node provider, the one ``AutoscalingCluster`` uses.

    Not ``AutoscalingCluster`` itself: it runs ``ray stop --force`` (every Ray process of the machine's user,
    other test runs' clusters too) and reads an ``example.yaml`` the wheel does not ship. Here the head is
    ``Cluster``'s, on its own temp dir and GCS port (the provider's nodes join it there, not on 6379), and at
    the end every process under that temp dir is ended (the provider's raylets outlive the monitor). Autoscaler v2
    (``RAY_enable_autoscaler_v2=1``) is not usable so: its monitor fills this config from that missing
    ``example.yaml`` and exits (``FileNotFoundError`` in the head's ``monitor.err``)."""
    ray = need_ray()
    from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_ID
    from ray.cluster_utils import Cluster

    from gym_runtime.ops.nats_server import free_port

    temp = tempfile.mkdtemp(prefix="gym-ray-", dir="/tmp")  # short: Ray's socket paths live under it
    port = free_port()
    config = {
        "cluster_name": "gym-runtime-tests",
        "max_workers": max_nodes,
        "provider": {
            "type": "fake_multinode",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            "gcs_address": f"{ray.util.get_node_ip_address()}:{port}",
        },
        "available_node_types": {
            "ray.head.default": {"resources": head, "node_config": {}, "max_workers": 0},
            "ray.worker.gym": {"resources": node, "node_config": {}, "min_workers": 0, "max_workers": max_nodes},
        },
        "head_node_type": "ray.head.default",
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": 0.05,
        **{k: {} for k in ("auth", "docker", "file_mounts")},
        **{k: [] for k in ("initialization_commands", "setup_commands", "head_setup_commands")},
        **{k: [] for k in ("worker_setup_commands", "head_start_ray_commands", "worker_start_ray_commands")},
        **{k: [] for k in ("cluster_synced_files", "rsync_exclude", "rsync_filter")},
        "file_mounts_sync_continuously": False,
    }
    path = Path(temp) / "autoscaling.yaml"
    path.write_text(yaml.safe_dump(config))
    saved = {k: os.environ.get(k) for k in AUTOSCALER_ENV}
    os.environ.update(AUTOSCALER_ENV)  # read by the head's monitor process, which inherits them
    cluster = None
    try:
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": head.get("CPU", 0),
                "resources": {k: v for k, v in head.items() if k != "CPU"},
                "include_dashboard": False,
                "temp_dir": temp,
                "gcs_server_port": port,
                "autoscaling_config": str(path),
                "env_vars": {"RAY_OVERRIDE_NODE_ID_FOR_TESTING": FAKE_HEAD_NODE_ID},  # the provider's head
            },
        )
        ray.init(address=cluster.address, log_to_driver=False, logging_level=logging.ERROR)
        yield cluster
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        for pid in pids_under(temp):
            with contextlib.suppress(ProcessLookupError):
                kill(pid)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(temp, ignore_errors=True)


def pids_under(path: str) -> list[int]:
    """The processes whose command line names ``path`` (a cluster's temp dir: its raylets, its GCS...)."""
    import psutil  # Ray's own copy (ray/thirdparty_files), on the path once ray is imported

    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(path in a for a in p.info["cmdline"] or []):
                found.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def alive_nodes() -> set[str]:
    """The ids of the Ray cluster's alive nodes."""
    return {n["NodeID"] for n in need_ray().nodes() if n.get("Alive")}


def write_config(tmp: Path, *, delay_s: float = 0.0, ray: dict[str, Any] | None = None, **agent: Any) -> Path:
    """The weather world on the scripted double (the LLM double) of ``tests.cluster``, with ``ray:`` placement."""
    path = cluster_config(tmp, replicas=1, agent_concurrency=16, delay_s=delay_s)
    cfg = yaml.safe_load(path.read_text())
    cfg["agents"]["agent"].update(agent)
    cfg["ray"] = {"placement_timeout_s": 30, "scale_interval_s": 0.5, **(ray or {})}
    path.write_text(yaml.safe_dump(cfg))
    return path


def elastic_agents(tmp: Path, *, cpus: float, high: int, delay_s: float = 0.0, **ray: Any) -> Path:
    """The weather world with its agents elastic from 0 to ``high`` (4 slots a replica, ``cpus`` CPUs an actor),
    the model and the environment one actor of half a CPU each, a surplus agent drained after 2 s idle."""
    roles = {
        "agents.agent": {"num_cpus": cpus, "min": 0, "max": high},
        "models.policy": {"num_cpus": 0.5},
        "resources.env": {"num_cpus": 0.5},
    }
    return write_config(tmp, delay_s=delay_s, concurrency=4, ray={"idle_s": 2, "roles": roles, **ray})


def publish(config: Path, url: str, tasks: Path, batch: str, auth: Path | None = None) -> None:
    """``publish`` (``auth``: a secured bus's publisher node directory)."""
    creds = ["--auth-dir", str(auth)] if auth else []
    p = cli("publish", str(config), "--nats", url, "-i", str(tasks), "--batch", batch, *creds)
    assert p.returncode == 0, p.stderr


def collect(url: str, batch: str, out: Path, timeout: float = 240, auth: Path | None = None) -> list[dict[str, Any]]:
    creds = ["--auth-dir", str(auth)] if auth else []
    p = cli("collect", "--batch", batch, "--nats", url, "-o", str(out), "--no-progress", *creds, timeout=timeout)
    assert p.returncode == 0, p.stderr
    return read_jsonl(out)


def restarted(handle: Any, old_pid: int | None, within: float = 120) -> tuple[int, str]:
    """Wait until Ray restarted the actor (``handle``) with a new worker: (its pid, its node)."""
    ray = need_ray()
    deadline = time.monotonic() + within
    while True:
        assert time.monotonic() < deadline, "the actor was not restarted"
        try:
            pid = ray.get(handle.ready.remote(60), timeout=90)
            if pid != old_pid:
                return pid, ray.get(handle.node.remote(), timeout=30)
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.RayActorError):
            pass  # restarting: the calls in between fail
        time.sleep(0.2)


def results_stored(srv: Any, agent: str = "agent", namespace: str = "gym") -> int:
    """Results the server holds for ``agent`` (its monitoring endpoint, as an operator reads it)."""
    accounts = monitor(srv, "/jsz?acc=$G&streams=true").get("account_details") or []
    acc = next((a for a in accounts if a["name"] == "$G"), {})
    streams = {x["name"]: x for x in acc.get("stream_detail") or []}
    s = streams.get(f"{namespace.upper()}_RESULTS_{agent}")
    return int(s["state"]["messages"]) if s else 0


def mid_batch(srv: Any, at_least: int, of: int, within: float = 120) -> int:
    """Wait until ``at_least`` of a batch's ``of`` results are stored; how many are (fewer than ``of``: the
    batch is still running, which the caller's fault must meet)."""
    deadline = time.monotonic() + within
    while (n := results_stored(srv)) < at_least:
        assert time.monotonic() < deadline, f"{n} results after {within} s"
        time.sleep(0.05)
    assert n < of, f"the batch ended ({n} of {of}) before the fault"
    return n


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def once_each(rows: list[dict[str, Any]], n: int) -> None:
    """Every task's row, once, none a failure."""
    ids = sorted(r["task_id"] for r in rows)
    assert ids == list(range(n)), f"{len(ids)} rows for {n} tasks: {sorted(set(range(n)) ^ set(ids))[:10]}"
    failed = [r for r in rows if r.get("error_class")]
    assert not failed, failed[0]
