"""The Ray tier's cluster: real raylets on this machine (``ray.cluster_utils.Cluster``), one per test module.

Without Ray (the main suite's venv has no ``ray`` extra) every module here skips with the one line below
(pytest folds them: one location, one reason); with ``GYM_REQUIRE_RAY=1`` (CI's Ray stage) that skip is a failure.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
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


def write_config(tmp: Path, *, delay_s: float = 0.0, ray: dict[str, Any] | None = None, **agent: Any) -> Path:
    """The weather world on the scripted double (the LLM double) of ``tests.cluster``, with ``ray:`` placement."""
    path = cluster_config(tmp, replicas=1, agent_concurrency=16, delay_s=delay_s)
    cfg = yaml.safe_load(path.read_text())
    cfg["agents"]["agent"].update(agent)
    cfg["ray"] = {"placement_timeout_s": 30, "scale_interval_s": 0.5, **(ray or {})}
    path.write_text(yaml.safe_dump(cfg))
    return path


def publish(config: Path, url: str, tasks: Path, batch: str) -> None:
    p = cli("publish", str(config), "--nats", url, "-i", str(tasks), "--batch", batch)
    assert p.returncode == 0, p.stderr


def collect(url: str, batch: str, out: Path, timeout: float = 240) -> list[dict[str, Any]]:
    p = cli("collect", "--batch", batch, "--nats", url, "-o", str(out), "--no-progress", timeout=timeout)
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
