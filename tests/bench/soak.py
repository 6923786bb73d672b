"""Soak: a larger batch while worker processes are SIGKILLed at random and the server restarts.

Two replicas of each role run as `gym-runtime start --in-process` processes; every
few seconds one of them is killed and replaced, and once mid-batch the NATS server
is killed and restarted on the same store dir. At the end the collector's file
must hold exactly one row per task×repeat, none failed. Prints a summary table.

    python tests/bench/soak.py [--tasks 1000] [--repeats 4] [--kill-every 1.5] [--seed 1]
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from gym_runtime.ops.nats_server import EmbeddedServer  # noqa: E402

ROLES = ("agents.agent", "models.policy", "resources.env")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--kill-every", type=float, default=1.5)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cfg = {
            "models": {"policy": {"adapter": "scripted", "delay_s": 0.05, "ack_wait_s": 3.0, "concurrency": 32}},
            "resources": {"env": {"server": "resources.counter"}},
            "agents": {
                "agent": {
                    "agent": "agents.simple",
                    "model": "policy",
                    "resource": "env",
                    "max_steps": 4,
                    "concurrency": 32,
                    "ack_wait_s": 3.0,
                    "max_attempts": 10,
                    "timeout_s": 120,
                }
            },
        }
        config = tmp / "config.yaml"
        config.write_text(yaml.safe_dump(cfg))
        base = [json.loads(x) for x in (REPO / "resources/counter/data/example.jsonl").read_text().splitlines() if x]
        tasks = tmp / "tasks.jsonl"
        tasks.write_text("".join(json.dumps({**base[i % len(base)], "task_id": i}) + "\n" for i in range(args.tasks)))
        srv = EmbeddedServer(store_dir=str(tmp / "js"))
        srv.start()
        procs: dict[str, subprocess.Popen[str]] = {}

        def start(key: str) -> None:
            role = key.split("#")[0]
            p = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "gym_runtime.cli",
                    "start",
                    str(config),
                    "--nats",
                    srv.url,
                    "--only",
                    role,
                    "--replicas",
                    "1",
                    "--in-process",
                ],
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            assert p.stdout is not None and "ready" in p.stdout.readline()
            procs[key] = p

        for role in ROLES:
            for i in (1, 2):
                start(f"{role}#{i}")
        t0 = time.perf_counter()
        batch = subprocess.run(
            [
                sys.executable,
                "-m",
                "gym_runtime.cli",
                "publish",
                str(config),
                "-i",
                str(tasks),
                "--nats",
                srv.url,
                "--repeats",
                str(args.repeats),
            ],
            cwd=REPO,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        out = tmp / "out.jsonl"
        collector = subprocess.Popen(
            [sys.executable, "-m", "gym_runtime.cli", "collect", "--batch", batch, "--nats", srv.url, "-o", str(out)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        kills = 0
        restarted = False
        while collector.poll() is None:
            time.sleep(args.kill_every)
            if collector.poll() is not None:
                break
            if not restarted and time.perf_counter() - t0 > 4 * args.kill_every:
                srv.kill()
                time.sleep(0.5)
                srv.start()
                restarted = True
                continue
            victim = rng.choice(sorted(procs))
            procs.pop(victim).send_signal(signal.SIGKILL)
            kills += 1
            start(victim)
        elapsed = time.perf_counter() - t0
        stdout, stderr = collector.communicate()
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            p.wait(30)
        srv.stop()
        rows = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
        keys = [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in rows]
        expected = [(t, k) for t in range(args.tasks) for k in range(args.repeats)]
        print(
            f"\nsoak: {args.tasks} tasks x {args.repeats} repeats, {kills} worker SIGKILLs, "
            f"server restarted: {restarted}, {elapsed:.1f} s"
        )
        print(
            f"{'rows expected':>14} | {'rows written':>12} | {'duplicates':>10} | {'missing':>7} | {'collect exit':>12}"
        )
        print(
            f"{len(expected):>14} | {len(rows):>12} | {len(keys) - len(set(keys)):>10} | "
            f"{len(set(expected) - set(keys)):>7} | {collector.returncode:>12}"
        )
        if keys != expected or collector.returncode != 0:
            print(stderr[-2000:])
            sys.exit(1)


if __name__ == "__main__":
    main()
