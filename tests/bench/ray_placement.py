"""The weather batch with its pools as Ray actors (``start --ray``) against ``start`` on the same machine, and the
scale-up time from a backlog to the first new replica's first rollout.

    python tests/bench/ray_placement.py [--tasks 400] [--pairs 3]   # in a venv with the ray extra

Each pair runs the same batch (the bundled weather rows on the scripted policy, one replica per role) twice on one
nats-server, alternated (start, ray, ray, start, ...): ``gym-runtime start CONFIG`` (a process per replica) and
``gym-runtime start CONFIG --ray ADDRESS`` (an actor per replica holding the same process) on a local Ray cluster of
one raylet with 2 CPUs, started once before the pairs (its idle cost is on the machine in both modes). Timed: the
``publish`` and ``collect`` commands, from the publish's start to the collect's end; rollouts/s is tasks over that.

Scale-up (``--scale-ups N``): the agents at ``min: 0`` (none placed) under ``start --ray``; a batch is published and
the time to its first stored result is the backlog's read (``ray.scale_interval_s``: 1 s), the actor's placement and
its worker's start, then the first rollout; beside it the same first result with one agent already placed (min 1).
Not a CI test.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from gym_runtime.ops.nats_server import EmbeddedServer  # noqa: E402
from tests.helpers import read_jsonl, write_jsonl  # noqa: E402

CLI = [sys.executable, "-m", "gym_runtime.cli"]


def config(tmp: Path, name: str, agents: dict[str, Any] | None = None) -> Path:
    cfg = {
        "namespace": "gym",
        "models": {"policy": {"adapter": "scripted", "concurrency": 256}},
        "resources": {"env": {"server": "resources.weather"}},
        "agents": {"agent": {"agent": "agents.simple", "model": "policy", "resource": "env", "concurrency": 64}},
        "ray": {
            "roles": {
                "agents.agent": {"num_cpus": 0.5, **(agents or {})},
                "models.policy": {"num_cpus": 0.5},
                "resources.env": {"num_cpus": 0.5},
            }
        },
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def tasks(tmp: Path, n: int) -> Path:
    base = read_jsonl(REPO / "resources/weather/data/example.jsonl")
    return write_jsonl(tmp / f"tasks-{n}.jsonl", [{**base[i % len(base)], "task_id": i} for i in range(n)])


def workers(cfg: Path, url: str, ray_address: str | None) -> subprocess.Popen[str]:
    argv = [*CLI, "start", str(cfg), "--nats", url] + (["--ray", ray_address] if ray_address else [])
    p = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert p.stdout is not None
    line = p.stdout.readline()
    assert "ready" in line, f"workers did not start: {line!r}"
    return p


def stop(p: subprocess.Popen[str]) -> None:
    p.send_signal(signal.SIGTERM)
    p.wait(120)


def batch(cfg: Path, url: str, tasks_path: Path, name: str, out: Path) -> float:
    t0 = time.monotonic()
    subprocess.run(
        [*CLI, "publish", str(cfg), "--nats", url, "-i", str(tasks_path), "--batch", name],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    subprocess.run(
        [*CLI, "collect", "--batch", name, "--nats", url, "-o", str(out), "--no-progress"],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    took = time.monotonic() - t0
    rows = read_jsonl(out)
    assert len(rows) == len({r["task_id"] for r in rows}) and not any(r.get("error_class") for r in rows)
    return took


def results_stored(srv: EmbeddedServer, ns: str = "gym") -> int:
    with urllib.request.urlopen(f"{srv.monitor_url}/jsz?acc=$G&streams=true", timeout=5) as r:
        data = json.loads(r.read())
    acc = next((a for a in data.get("account_details") or [] if a["name"] == "$G"), {})
    s = {x["name"]: x for x in acc.get("stream_detail") or []}.get(f"{ns.upper()}_RESULTS_agent")
    return int(s["state"]["messages"]) if s else 0


def first_result(srv: EmbeddedServer, cfg: Path, tasks_path: Path, name: str) -> float:
    before = results_stored(srv)
    t0 = time.monotonic()
    subprocess.Popen(
        [*CLI, "publish", str(cfg), "--nats", srv.url, "-i", str(tasks_path), "--batch", name],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    while results_stored(srv) == before:
        time.sleep(0.02)
    return time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=400)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--scale-ups", type=int, default=3)
    args = ap.parse_args()
    from ray.cluster_utils import Cluster

    print(f"load average at start: {os.getloadavg()}")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    with TemporaryDirectory() as d, EmbeddedServer(store_dir=f"{d}/store", http_port=0, sync="interval") as srv:
        tmp = Path(d)
        t = tasks(tmp, args.tasks)
        took: dict[str, list[float]] = {"start": [], "ray": []}
        for i in range(args.pairs):
            for mode in ("start", "ray") if i % 2 == 0 else ("ray", "start"):
                cfg = config(tmp, f"b{mode}{i}")
                w = workers(cfg, srv.url, cluster.address if mode == "ray" else None)
                try:
                    took[mode].append(batch(cfg, srv.url, t, f"{mode}{i}", tmp / f"{mode}{i}.jsonl"))
                finally:
                    stop(w)
                print(
                    f"pair {i} {mode:5}: {took[mode][-1]:.2f} s, {args.tasks / took[mode][-1]:.0f} rollouts/s, "
                    f"load {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
        s, r = statistics.median(took["start"]), statistics.median(took["ray"])
        print(
            f"median: start {args.tasks / s:.0f} rollouts/s, ray {args.tasks / r:.0f} rollouts/s "
            f"(ray/start {s / r:.2f})"
        )
        small = tasks(tmp, 8)
        for i in range(args.scale_ups):
            for mode, agents in (("from0", {"min": 0, "max": 2}), ("placed", {"min": 1, "max": 2})):
                ns = f"s{mode}{i}"
                cfg = config(tmp, ns, agents)
                w = workers(cfg, srv.url, cluster.address)
                try:
                    print(
                        f"scale-up {i} {mode}: first result {first_result(srv, cfg, small, ns):.2f} s "
                        f"after publish, load {os.getloadavg()[0]:.1f}",
                        flush=True,
                    )
                finally:
                    stop(w)
    cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
