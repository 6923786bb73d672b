"""Branching a rollout at turn k against fresh rollouts (issue 78, item 5): M continuations of one 20-turn rollout
branched at turn 10 (``Client.branch``) against M fresh rollouts of the same task.

The simple agent on ``tests/envs/many_steps.py`` (``restorable``: its session's snapshot is each step's count; one
tool call a turn), the scripted policy (a TEST DOUBLE for the LLM) taking ``--delay`` seconds a call, every role in
this process on an embedded nats-server. Each figure is the median of ``--runs`` runs: the wall time from submit
(or branch) to the last row, and the policy's model turns the M rows made. A branch makes only the turns after k
(its prefix is the parent's, read from the checkpoint), so it saves k turns of generation and tool calls per
continuation; what it adds is reading the parent's parts and restoring a session. The parent itself (its rollout,
kept) is timed apart: a trainer that branches pays it once per tree.

    python tests/bench/branch_turns.py [--turns 20] [--at 10] [--m 8] [--delay 0.05] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def config(m: int, delay_s: float) -> dict[str, Any]:
    agent = {"agent": "agents.simple", "model": "policy", "resource": "env", "timeout_s": 600, "concurrency": m}
    return {
        "namespace": "bench",
        "models": {"policy": {"adapter": "scripted", "token_ids": True, "delay_s": delay_s, "concurrency": 4 * m}},
        "resources": {"env": {"server": "tests.envs.many_steps", "options": {"restorable": True}}},
        "agents": {"agent": {**agent, "checkpoint": "off"}},
        "base_dir": str(REPO),
    }


def turns_of(row: dict[str, Any]) -> int:
    return sum(1 for i in row["response"]["output"] if i.get("generation_token_ids"))


async def measure(args: argparse.Namespace, url: str) -> dict[str, list[float]]:
    from gym_runtime import Client
    from gym_runtime.config import config_from_dict, resolve_config
    from tests.envs.many_steps import task

    row = task(args.turns)
    got: dict[str, list[float]] = {k: [] for k in ("fresh_s", "fresh_turns", "parent_s", "branch_s", "branch_turns")}
    cfg = resolve_config(config_from_dict(config(args.m, args.delay)))
    async with Client(cfg, nats=url) as client:
        for _ in range(args.runs):
            t = time.perf_counter()
            rows = await (await client.submit([row], repeats=args.m)).gather()
            got["fresh_s"].append(time.perf_counter() - t)
            assert all(r["reward"] == 1.0 for r in rows), [r.get("error") for r in rows]
            got["fresh_turns"].append(sum(turns_of(r) for r in rows))
            t = time.perf_counter()
            handle = await client.submit([row], keep_checkpoints_s=600)
            (parent,) = await handle.gather()
            got["parent_s"].append(time.perf_counter() - t)
            t = time.perf_counter()
            key = f"{handle.batch}:0:0"
            rows = await (await client.branch(parent, parent=key, turn=args.at, m=args.m)).gather()
            got["branch_s"].append(time.perf_counter() - t)
            assert all(r["reward"] == 1.0 and r["branch_turn"] == args.at for r in rows), [r.get("error") for r in rows]
            got["branch_turns"].append(sum(turns_of(r) - args.at for r in rows))
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=20, help="tool-call turns of the rollout (one more answers)")
    ap.add_argument("--at", type=int, default=10, help="the turn to branch at")
    ap.add_argument("--m", type=int, default=8, help="continuations (and fresh rollouts)")
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
    print(
        f"{args.m} continuations of a {args.turns + 1}-turn rollout, branched at turn {args.at}, against {args.m} fresh"
    )
    print(f"rollouts; scripted policy at {args.delay:g} s a call; median of {args.runs} runs\n")
    print("| | wall (s) | policy turns made |")
    print("| --- | ---: | ---: |")
    print(f"| {args.m} fresh rollouts | {med['fresh_s']:.2f} | {med['fresh_turns']:.0f} |")
    print(f"| {args.m} branches at turn {args.at} | {med['branch_s']:.2f} | {med['branch_turns']:.0f} |")
    print(f"| the parent, kept (once per tree) | {med['parent_s']:.2f} | {args.turns + 1} |")


if __name__ == "__main__":
    main()
