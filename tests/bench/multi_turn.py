"""Multi-turn scale benchmark: policy and user simulator as separately scaled model workers.

Each rollout is a 4-turn conversation (``agents.multi_turn``, ``user: model``):
4 policy calls and 4 user-simulator calls (3 user turns, then the simulator ends
the conversation with its stop tool). Both models are the ``scripted`` test
double with simulated latency (policy 50 ms, user 30 ms per call); a replica
serves at most ``--policy-slots`` / ``--user-slots`` requests at once, like an
inference server with a bounded batch. The table shows rollouts/s with 1 vs 2
replicas of each, and the bound the slots allow
(``min(policy_replicas * policy_slots / 50 ms, user_replicas * user_slots / 30 ms) / 4``).

    python tests/bench/multi_turn.py [--n 400] [--policy-slots 8] [--user-slots 4]

Everything runs in one process over a real nats-server (replicas are separate
workers, each with its own slots).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from gym_runtime.config import config_from_dict, resolve_config  # noqa: E402
from gym_runtime.observability import logs
from gym_runtime.observability.tracing import Telemetry  # noqa: E402
from gym_runtime.ops.nats_server import EmbeddedServer  # noqa: E402
from gym_runtime.service.loop import run_async  # noqa: E402
from gym_runtime.service.runner import run_batch  # noqa: E402

DATA = REPO / "resources/multi_turn_gymnasium/data/example.jsonl"
TURNS = 4
POLICY_S, USER_S = 0.050, 0.030


def config(policy_replicas: int, user_replicas: int, policy_slots: int, user_slots: int) -> Any:
    return config_from_dict(
        {
            "namespace": "bench",
            "models": {
                "policy": {
                    "adapter": "scripted",
                    "delay_s": POLICY_S,
                    "replicas": policy_replicas,
                    "concurrency": policy_slots,
                },
                "user_sim": {
                    "adapter": "scripted",
                    "delay_s": USER_S,
                    "replicas": user_replicas,
                    "concurrency": user_slots,
                },
            },
            "resources": {"env": {"server": "resources.multi_turn_gymnasium"}},
            "agents": {
                "chat": {
                    "agent": "agents.multi_turn",
                    "model": "policy",
                    "resource": "env",
                    "concurrency": 512,
                    "options": {
                        "user": "model",
                        "user_model": "user_sim",
                        "stop_tool": "end_conversation",
                        "min_turns": TURNS,
                        "max_turns": TURNS + 1,
                    },
                }
            },
            "base_dir": str(REPO),
        }
    )


def one(n: int, policy_replicas: int, user_replicas: int, policy_slots: int, user_slots: int) -> float:
    rows = DATA.read_text().count("\n")
    repeats = max(1, n // rows)
    with tempfile.TemporaryDirectory() as tmp:
        srv = EmbeddedServer(store_dir=str(Path(tmp) / "js"))
        srv.start()
        try:
            cfg = config(policy_replicas, user_replicas, policy_slots, user_slots)
            result = run_async(
                lambda: run_batch(
                    resolve_config(cfg),
                    srv.url,
                    input_path=DATA,
                    out=Path(tmp) / "out.jsonl",
                    telemetry=Telemetry(),
                    repeats=repeats,
                    agent="chat",
                )
            )
        finally:
            srv.stop()
    assert result.stats.failures == 0, result.stats
    return result.tasks / (result.elapsed_s - result.ready_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=400, help="rollouts per measurement")
    ap.add_argument("--policy-slots", type=int, default=8)
    ap.add_argument("--user-slots", type=int, default=4)
    args = ap.parse_args()
    logs.configure(level="warning")

    print(
        f"{args.n} rollouts of {TURNS} policy turns; policy {POLICY_S * 1000:.0f} ms x {args.policy_slots} slots "
        f"per replica, user simulator {USER_S * 1000:.0f} ms x {args.user_slots} slots per replica\n"
    )
    print("| policy replicas | user-sim replicas | rollouts/s | bound from slots | % of bound |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for p, u in ((1, 1), (1, 2), (2, 1), (2, 2)):
        rate = one(args.n, p, u, args.policy_slots, args.user_slots)
        bound = min(p * args.policy_slots / POLICY_S, u * args.user_slots / USER_S) / TURNS
        print(f"| {p} | {u} | {rate:.1f} | {bound:.1f} | {100 * rate / bound:.0f}% |", flush=True)


if __name__ == "__main__":
    main()
