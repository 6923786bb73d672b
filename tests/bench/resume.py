"""What a dead agent worker costs a long rollout: resumed at its last turn against started over (issue 69, item 7).

One rollout of ``tests/envs/long_boxed.py`` (50 turns, one tool call each in the session's Docker container; the
scripted policy, a TEST DOUBLE for the LLM, with ``--delay-s`` per model call) on real worker processes. The agent
worker is SIGKILLed as turn ``--kill-at`` starts its tool call and a fresh one is started at once; the rollout's
wall time (publish to its row collected) is printed for: no kill, a kill with ``checkpoint: every_turn`` (it
resumes), and a kill with ``checkpoint: off`` (it starts over, as before). Redelivery waits the agent's
``ack_wait_s`` (2 s here) in both.

    DOCKER_HOST=unix:///... python tests/bench/resume.py [--kill-at 40] [--delay-s 0.5] [--rounds 1]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from gym_runtime.ops.nats_server import EmbeddedServer  # noqa: E402
from tests.docker import docker_socket  # noqa: E402
from tests.envs.long_boxed import step_name  # noqa: E402
from tests.long_rollout import Run, new_pool, write_config  # noqa: E402
from tests.pools import wait_until  # noqa: E402


def one(kill_at: int | None, checkpoint: str, delay_s: float, pool: str) -> tuple[float, dict[str, Any]]:
    with tempfile.TemporaryDirectory() as d, EmbeddedServer(store_dir=f"{d}/js", sync="interval") as srv:
        tmp = Path(d)
        marker = tmp / "turn-started"
        env = {"slow_step": kill_at - 1, "slow_s": 0, "marker": str(marker)} if kill_at else {}
        run = Run(tmp, srv.url, write_config(tmp, pool, checkpoint=checkpoint, delay_s=delay_s, **env))
        try:
            run.start_workers(pool)
            run.publish()
            if kill_at:
                wait_until(marker.exists, timeout=600)  # turn kill_at's tool call (step kill_at - 1) has started
                assert marker.read_text() == step_name(kill_at - 1)
                run.pool.kill("agents.agent")
                run.pool.start("agents.agent#2", "agents.agent")
            row = run.row()
            return time.monotonic() - run.published, row
        finally:
            run.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kill-at", type=int, default=40)
    ap.add_argument("--delay-s", type=float, default=0.5, help="the scripted model's time per call")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    pool = new_pool(docker_socket())
    cases = [("no kill", None, "every_turn"), ("kill, resumed", args.kill_at, "every_turn")]
    cases.append(("kill, started over", args.kill_at, "off"))
    print(f"one 50-turn rollout, {args.delay_s:g} s a model call, agent worker SIGKILLed at turn {args.kill_at}")
    for _ in range(args.rounds):
        for name, kill_at, checkpoint in cases:
            took, row = one(kill_at, checkpoint, args.delay_s, pool)
            how = (
                f"{row['resumed_how']} from turn {row['resumed_from_turn']}" if "resumed_how" in row else "one attempt"
            )
            attempt = row["provenance"].get("attempt", 1)
            print(f"{name:20s} checkpoint: {checkpoint:10s} {took:6.1f} s  ({how}, attempt {attempt})")


if __name__ == "__main__":
    main()
