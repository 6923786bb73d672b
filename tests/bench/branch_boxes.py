"""What keeping a sandbox rollout for branching costs per turn (issue 78, item 3): one rollout of ``--turns`` tool-call
turns on ``tests/envs/long_boxed.py`` (one write a turn in the session's Docker container; ``restorable: files``)
run without and with ``keep_checkpoints_s``, then ``--m`` branches of the kept one at ``--at``.

With ``keep_checkpoints_s`` each turn's snapshot parks a copy of the session's container (a fork: the copies count
against the pool's quota until their keep ends), so a turn costs one fork more; without it nothing changes. Each
figure is the median of ``--runs`` runs; every role in this process on an embedded nats-server, the scripted policy
(a TEST DOUBLE for the LLM) at ``--delay`` s a call. Needs a Docker engine (``DOCKER_HOST``).

    python tests/bench/branch_boxes.py [--turns 10] [--at 5] [--m 4] [--delay 0.05] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
KEEP_S = 120.0


def config(pool: str, m: int, delay_s: float, turns: int, runs: int) -> dict[str, Any]:
    """The pool holds every run's copies (kept ``KEEP_S``) and its branches at once."""
    agent = {"agent": "agents.simple", "model": "policy", "resource": "env", "timeout_s": 600, "concurrency": m}
    box = {"backend": "docker", "capacity": runs * (turns + m) + 4, "limits": {"memory_mb": 128, "pids": 64}}
    return {
        "namespace": "bench",
        "models": {"policy": {"adapter": "scripted", "token_ids": True, "delay_s": delay_s, "concurrency": 4 * m}},
        "sandboxes": {pool: {**box, "reap_interval_s": 1.0}},
        "resources": {"env": {"server": "tests.envs.long_boxed", "sandbox": pool, "options": {"restorable": "files"}}},
        "agents": {"agent": {**agent, "checkpoint": "off"}},
        "base_dir": str(REPO),
    }


async def measure(args: argparse.Namespace, url: str) -> dict[str, list[float]]:
    from gym_runtime import Client
    from gym_runtime.config import config_from_dict, resolve_config
    from tests.envs.long_boxed import task

    row = task(args.turns)
    got: dict[str, list[float]] = {k: [] for k in ("plain_s", "kept_s", "branch_s")}
    pool = f"bb{uuid.uuid4().hex[:6]}"
    cfg = resolve_config(config_from_dict(config(pool, args.m, args.delay, args.turns, args.runs)))
    async with Client(cfg, nats=url) as client:
        for _ in range(args.runs):
            t = time.perf_counter()
            (plain,) = await (await client.submit([row])).gather()
            got["plain_s"].append(time.perf_counter() - t)
            assert plain["reward"] == 1.0, plain.get("error")
            t = time.perf_counter()
            handle = await client.submit([row], keep_checkpoints_s=KEEP_S)
            (parent,) = await handle.gather()
            got["kept_s"].append(time.perf_counter() - t)
            assert parent["reward"] == 1.0, parent.get("error")
            t = time.perf_counter()
            rows = await (await client.branch(parent, parent=f"{handle.batch}:0:0", turn=args.at, m=args.m)).gather()
            got["branch_s"].append(time.perf_counter() - t)
            assert all(r.get("reward") == 1.0 for r in rows), [(r.get("error_class"), r.get("error")) for r in rows]
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=10, help="tool-call turns of the rollout (one more answers)")
    ap.add_argument("--at", type=int, default=5, help="the turn to branch at")
    ap.add_argument("--m", type=int, default=4, help="continuations")
    ap.add_argument("--delay", type=float, default=0.05, help="the scripted policy's seconds per call")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from gym_runtime.observability import logs
    from gym_runtime.ops.nats_server import EmbeddedServer

    logs.configure("warning")
    with tempfile.TemporaryDirectory() as d, EmbeddedServer(store_dir=d) as srv:
        got = asyncio.run(measure(args, srv.url))
    med = {k: statistics.median(v) for k, v in got.items()}
    per_turn = (med["kept_s"] - med["plain_s"]) / args.turns
    print(f"a {args.turns + 1}-turn sandbox rollout, scripted policy at {args.delay:g} s a call, median of {args.runs}")
    print(f"runs, load {os.getloadavg()[0]:.1f}\n")
    print("| | wall (s) | per tool turn (s) |")
    print("| --- | ---: | ---: |")
    print(f"| not kept | {med['plain_s']:.2f} | {med['plain_s'] / args.turns:.3f} |")
    print(f"| kept for branching (a copy a turn) | {med['kept_s']:.2f} | {med['kept_s'] / args.turns:.3f} |")
    print(f"| the copy's cost per turn | | {per_turn:.3f} |")
    print(f"| {args.m} branches at turn {args.at} (each forks the copy) | {med['branch_s']:.2f} | |")


if __name__ == "__main__":
    main()
