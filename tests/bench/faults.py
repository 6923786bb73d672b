"""Fault-run wall time: the same batch undisturbed, then with workers SIGKILLed mid-batch and restarted.

Two replicas of each role run as `gym-runtime start --in-process` processes on a fresh
nats-server per run. In the faulted run, one replica of the agent, the model and the
resource role is SIGKILLed (at 25%, 45% and 65% of the undisturbed wall time) and started
again (`--kill agents` kills only the agent). Agents keep the default ``ack_wait_s`` (30 s):
a killed worker's tasks must come back through its peers (liveness beacons), not after
ack_wait. Prints wall time, failure rows, the mean time a killed worker took to be ready
again (its replica is missing meanwhile), the redelivery delay (from the agent's SIGKILL
until JetStream redelivered its first task) and the ratio to the undisturbed run; the
target is within 20%.

    python tests/bench/faults.py [--tasks 600] [--repeats 1] [--concurrency 8] [--delay 0.2]
                                 [--kill agents,models,resources]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import nats
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from gym_runtime.ops.nats_server import EmbeddedServer  # noqa: E402
from tests.pools import Pool  # noqa: E402

ROLES = ("agents.agent", "models.policy", "resources.env")
KILLS = (("agents.agent#1", 0.25), ("models.policy#1", 0.45), ("resources.env#1", 0.65))


def config(tmp: Path, concurrency: int, delay: float) -> Path:
    cfg = {
        "namespace": "gym",
        "models": {"policy": {"adapter": "scripted", "delay_s": delay, "concurrency": 4 * concurrency}},
        "resources": {"env": {"server": "resources.weather"}},
        "agents": {
            "agent": {"agent": "agents.simple", "model": "policy", "resource": "env", "concurrency": concurrency}
        },
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "gym_runtime.cli", *args]


class Redelivery:
    """Watches the agents' durable from a thread of its own: when did a task first come back after ``armed``."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.armed: float | None = None
        self.seen: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._watch()), daemon=True)
        self._thread.start()

    async def _watch(self) -> None:
        nc = await nats.connect(self.url)
        js = nc.jetstream()
        try:
            while not self._stop.is_set():
                await asyncio.sleep(0.05)
                if self.armed is None or self.seen is not None:
                    continue
                try:
                    info = await js.consumer_info("GYM_TASKS", "agent_agent")
                except Exception:  # noqa: BLE001 - not made yet, or the server is busy: ask again
                    continue
                if (info.num_redelivered or 0) > 0:
                    self.seen = time.perf_counter()
        finally:
            await nc.close()

    def stop(self) -> float | None:
        self._stop.set()
        self._thread.join(5)
        return None if self.armed is None or self.seen is None else self.seen - self.armed


def one_run(
    tmp: Path,
    tasks: Path,
    cfg: Path,
    repeats: int,
    kill_after: float | None,
    kills: tuple[tuple[str, float], ...],
    sync: str = "always",
) -> dict[str, Any]:
    srv = EmbeddedServer(store_dir=str(tmp / f"js-{kill_after is not None}-{sync}"), sync=sync)
    srv.start()
    pool = Pool(cfg, srv.url)

    try:
        for role in ROLES:
            for i in (1, 2):
                pool.start(f"{role}#{i}", role)
        watch = Redelivery(srv.url)
        out = tmp / f"out-{kill_after is not None}.jsonl"
        t0 = time.perf_counter()
        publish = cli("publish", str(cfg), "-i", str(tasks), "--nats", srv.url, "--repeats", str(repeats))
        batch = subprocess.run(publish, cwd=REPO, check=True, capture_output=True, text=True).stdout.strip()
        collect = cli("collect", "--batch", batch, "--nats", srv.url, "-o", str(out))
        collector = subprocess.Popen(collect, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        pending = [(key, at * kill_after) for key, at in kills] if kill_after is not None else []
        restarts: list[float] = []
        while collector.poll() is None:
            time.sleep(0.05)
            if pending and time.perf_counter() - t0 >= pending[0][1]:
                key, _ = pending.pop(0)
                pool.kill(key)  # SIGKILL
                if key.startswith("agents."):
                    watch.armed = time.perf_counter()
                t = time.perf_counter()
                pool.start(key, key.split("#")[0])  # restarted at once, as a supervisor would
                restarts.append(time.perf_counter() - t)
        wall = time.perf_counter() - t0
        collector.communicate()
        redelivery = watch.stop()
        failures = Path(str(out).removesuffix(".jsonl") + "_failures.jsonl")
        rows = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
        return {
            "wall_s": wall,
            "rows": len(rows),
            "failures": len(failures.read_text().splitlines()) if failures.exists() else 0,
            "redelivery_s": redelivery,
            "kills": len(restarts),
            "restart_s": sum(restarts) / len(restarts) if restarts else None,
            "exit": collector.returncode,
        }
    finally:
        pool.stop_all()
        srv.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=600)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=8, help="slots per agent worker (two workers)")
    ap.add_argument("--delay", type=float, default=0.2, help="the scripted model's seconds per call")
    ap.add_argument("--kill", default="agents,models,resources", help="the roles one replica of which is killed")
    ap.add_argument("--sync", choices=("always", "interval"), default="always", help="the server's jetstream.sync")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cfg = config(tmp, args.concurrency, args.delay)
        base = [json.loads(x) for x in (REPO / "resources/weather/data/example.jsonl").read_text().splitlines() if x]
        tasks = tmp / "tasks.jsonl"
        tasks.write_text("".join(json.dumps({**base[i % len(base)], "task_id": i}) + "\n" for i in range(args.tasks)))
        kills = tuple((key, at) for key, at in KILLS if key.split(".")[0] in args.kill.split(","))
        calm = one_run(tmp, tasks, cfg, args.repeats, None, kills, args.sync)
        hit = one_run(tmp, tasks, cfg, args.repeats, calm["wall_s"], kills, args.sync)
    n = args.tasks * args.repeats
    print(
        f"\nfaults: {n} rollouts, 2 workers per role, agent slots {args.concurrency}, model call {args.delay:g} s, "
        f"sync {args.sync}, load {os.getloadavg()[0]:.1f}"
    )
    head = f"{'run':<12} | {'wall s':>6} | {'rows':>5} | {'failures':>8} | {'kills':>5} | {'restart s':>9} | "
    print(head + f"{'redelivery s':>12} | ratio")
    for name, r in (("undisturbed", calm), ("faulted", hit)):
        red = "-" if r["redelivery_s"] is None else f"{r['redelivery_s']:.1f}"
        restart = "-" if r["restart_s"] is None else f"{r['restart_s']:.1f}"
        ratio = r["wall_s"] / calm["wall_s"]
        print(
            f"{name:<12} | {r['wall_s']:>6.1f} | {r['rows']:>5} | {r['failures']:>8} | {r['kills']:>5} | "
            f"{restart:>9} | {red:>12} | {ratio:.2f}"
        )
    ok = hit["rows"] == n and hit["failures"] == 0 and hit["wall_s"] <= 1.2 * calm["wall_s"]
    print("target (faulted within 20% of undisturbed, 0 failure rows):", "met" if ok else "NOT met")


if __name__ == "__main__":
    main()
