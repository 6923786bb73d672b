"""What checkpoints cost a long rollout, per turn: instructions per turn on 30- and 200-turn rollouts with
``checkpoint: off``, ``auto`` and ``every_turn`` (issue 74, item 6).

Each rollout is the simple agent on ``tests/envs/many_steps.py`` (one tool call a turn, in a session of the
resource worker; ``max_steps`` stops it at ``turns``), the scripted model (a TEST DOUBLE for the LLM) at zero
latency, every role in one process on an embedded nats-server. Every task offers the same tools (as many as the
longest rollout's turns) and the environment keeps no snapshot, so a turn of a short rollout and one of a long
rollout carry the same, but for the trajectory so far. Each figure is counted by valgrind (as
``instructions.py`` does: our Python process, nats-server not counted) as the difference of a run of ``--large``
and one of ``--small`` rollouts, divided by the rollouts between them and by their turns: start-up cancels out.
Only the agent worker writes checkpoints, so what a mode adds over ``off`` is the agent worker's.

The table gives, per length and mode, the instructions per turn and what the mode adds over ``off``; then what
one turn's checkpoints cost early (the 30-turn rollouts' added instructions per turn) and late (the added
instructions of turns 31 to 200 alone: the 200-turn rollouts' less the 30-turn ones', per extra turn). Rollouts
whose turns hold more cost more per turn in every mode (each model call carries the whole trajectory so far).

    python tests/bench/checkpoint_turns.py [--turns 30 200] [--modes off auto every_turn] [--small 2] [--large 6]
        [--tools N]  # the tools each task offers (default: the longest rollout's turns: 200)

Needs ``valgrind`` on PATH. A run takes a few minutes.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def config(turns: int, n: int, mode: str) -> dict[str, Any]:
    """``n`` rollouts at once, each stopped at ``turns`` model turns, checkpointed by ``mode``."""
    return {
        "namespace": "bench",
        "models": {"policy": {"adapter": "scripted", "concurrency": 64}},
        "resources": {"env": {"server": "tests.envs.many_steps"}},
        "agents": {
            "agent": {
                "agent": "agents.simple",
                "model": "policy",
                "resource": "env",
                "concurrency": n,
                "timeout_s": 3600,
                "max_steps": turns,
                "checkpoint": mode,
            }
        },
        "base_dir": str(REPO),
    }


def one_run(turns: int, n: int, mode: str, tools: int) -> None:
    """The measured workload (run under valgrind): ``n`` rollouts of ``turns`` turns, every role in this process."""
    sys.path.insert(0, str(REPO))
    from gym_runtime.cli._gc import tune_gc
    from gym_runtime.config import config_from_dict, resolve_config
    from gym_runtime.observability import logs
    from gym_runtime.observability.tracing import Telemetry
    from gym_runtime.ops.nats_server import EmbeddedServer
    from gym_runtime.service.loop import run_async
    from gym_runtime.service.runner import run_batch
    from tests.envs.many_steps import task

    logs.configure("warning")  # as the CLI does
    tune_gc()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        rows = tmp / "tasks.jsonl"
        rows.write_text("".join(json.dumps(task(turns, tools)) + "\n" for _ in range(n)))
        with EmbeddedServer(store_dir=str(tmp / "js")) as srv:
            cfg = resolve_config(config_from_dict(config(turns, n, mode)))
            res = run_async(
                lambda: run_batch(cfg, srv.url, input_path=rows, out=tmp / "out.jsonl", telemetry=Telemetry())
            )
        assert res.stats.rows == n and res.stats.failures == 0, res.stats
        got = [json.loads(line) for line in (tmp / "out.jsonl").read_text().splitlines()]
        assert all(r["reward"] == 1.0 for r in got), [r.get("reward") for r in got]


def instructions(turns: int, n: int, mode: str, tools: int) -> int:
    proc = subprocess.run(
        [
            "valgrind",
            "--tool=cachegrind",
            "--cache-sim=no",
            "--cachegrind-out-file=/dev/null",
            "--trace-children=yes",
            "--trace-children-skip=*nats-server*",
            sys.executable,
            __file__,
            "--one",
            str(turns),
            str(n),
            mode,
            str(tools),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        sys.exit(f"the measured run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    found = re.findall(r"I\s+refs:\s+([\d,]+)", proc.stderr)
    assert found, proc.stderr[-2000:]
    return sum(int(m.replace(",", "")) for m in found)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, nargs="+", default=[30, 200])
    ap.add_argument("--modes", nargs="+", default=["off", "auto", "every_turn"])
    ap.add_argument("--small", type=int, default=2, help="rollouts in the first run")
    ap.add_argument("--large", type=int, default=6, help="rollouts in the second run")
    ap.add_argument("--tools", type=int, help="tools every task offers (default: the longest rollout's turns)")
    ap.add_argument("--one", nargs=4, help=argparse.SUPPRESS)  # internal: the run valgrind measures
    args = ap.parse_args()
    if args.one is not None:
        one_run(int(args.one[0]), int(args.one[1]), args.one[2], int(args.one[3]))
        return
    if shutil.which("valgrind") is None:
        sys.exit("checkpoint_turns.py needs valgrind on PATH (apt-get install valgrind)")
    per_rollout: dict[tuple[int, str], float] = {}
    print("simple agent on tests/envs/many_steps.py, scripted model at zero latency, every role in one process;")
    print(f"each figure: a run of {args.large} rollouts less one of {args.small}\n")
    print("| turns | `checkpoint` | instructions per turn (M) | against `off` |")
    print("| ---: | --- | ---: | ---: |")
    for turns in args.turns:
        for mode in args.modes:
            tools = args.tools or max(args.turns)  # every task offers the same tools
            small, large = instructions(turns, args.small, mode, tools), instructions(turns, args.large, mode, tools)
            per_rollout[turns, mode] = (large - small) / (args.large - args.small)
            per_turn = per_rollout[turns, mode] / turns
            off = per_rollout.get((turns, "off"))
            against = f"{100 * (per_rollout[turns, mode] / off - 1):+.1f}%" if off and mode != "off" else ""
            print(f"| {turns} | `{mode}` | {per_turn / 1e6:.3f} | {against} |", flush=True)
    if len(args.turns) < 2 or "off" not in args.modes:
        return
    short, long = min(args.turns), max(args.turns)
    print(
        f"\nwhat a mode adds per turn, k instructions: early (turns 1-{short}), late (turns {short + 1}-{long} alone)"
    )
    print("| `checkpoint` | early | late |")
    print("| --- | ---: | ---: |")
    for mode in args.modes:
        if mode == "off":
            continue
        early = (per_rollout[short, mode] - per_rollout[short, "off"]) / short
        late_mode = per_rollout[long, mode] - per_rollout[short, mode]
        late_off = per_rollout[long, "off"] - per_rollout[short, "off"]
        late = (late_mode - late_off) / (long - short)
        print(f"| `{mode}` | {early / 1e3:.0f} | {late / 1e3:.0f} |")


if __name__ == "__main__":
    main()
