"""Uniform sampling against the task sampler (issue 79) on a task set of mixed difficulty, with the learning
example's policy and trainer (``trl_learns.py``: TRL's GRPO through gym-runtime's real workers, the tiny CPU policy,
``tests/envs/say_word.py``).

The rows: a third always solved (``fixed_reward: 1``), a third never (``fixed_reward: 0``), a third learnable (say
the drawn word: a random policy that calls the tool scores 1/8). Prints, per run, the share of groups with zero
reward spread, the rollouts (and generated tokens) until the learnable tasks' mean reward over their last 20
groups reaches ``--threshold``, and the learnable tasks' last-20-groups mean at the end.

    python tests/bench/sampler_learns.py --score uniform --seed 0 --steps 300
    python tests/bench/sampler_learns.py --score learnability --seed 0 --steps 300
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gym_runtime import SyncClient
from gym_runtime.client.sampler import TaskSampler
from gym_runtime.trainers.trl import TRLRollouts
from tests.trainers.world import grpo, world


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--score", choices=["uniform", "learnability"], default="learnability")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--rows", type=int, default=24)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--floor", type=float, default=0.1)
    p.add_argument("--sharpness", type=float, default=4.0)
    p.add_argument(
        "--revisit-after", type=int, default=0, help="picks before an unpicked task is retried (0: 4 x rows)"
    )
    p.add_argument("--half-life", type=float, default=16.0, help="outcomes until an old one counts half (0: never)")
    p.add_argument(
        "--skip-below", type=float, default=0.0, help="the sampler skips tasks whose expected signal is below this"
    )
    p.add_argument("--go-on", action="store_true", help="with --skip-below: go on when no task can teach (no stop)")
    p.add_argument("--window", type=int, default=50, help="steps per window of the per-window figures")
    p.add_argument("--threshold", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="append the run's figures as one JSON line")
    args = p.parse_args()
    import transformers
    from transformers import TrainerCallback

    transformers.logging.set_verbosity_error()
    tmp = Path(tempfile.mkdtemp(prefix="sampler-learns-"))
    w = world(tmp, rows=args.rows, max_new_tokens=3, seed=args.seed, tool_bias=2.0)
    kinds = ["solved", "impossible", "learnable"]
    rows = []
    for i, row in enumerate(w.rows):
        kind = kinds[i % 3]
        fixed = {"solved": {"fixed_reward": 1.0}, "impossible": {"fixed_reward": 0.0}}.get(kind, {})
        rows.append({**row, "kind": kind, **fixed})
    started = time.monotonic()
    groups = zero = rollouts_run = tokens = 0
    learnable: list[float] = []  # each learnable group's mean reward
    learnable_at: list[float] = []  # per step: the mean reward of its learnable groups (none: not counted)
    reached: dict[str, int] | None = None

    class Stop(TrainerCallback):
        def on_step_end(self, _args, state, control, **_kw):  # type: ignore[no-untyped-def]
            if time.monotonic() - started > args.minutes * 60:
                control.should_training_stop = True

    with SyncClient(w.config) as client:
        config = {
            "score": args.score,
            "floor": args.floor,
            "sharpness": args.sharpness,
            "half_life": args.half_life,
            "revisit_after": args.revisit_after,
            "skip_below": args.skip_below,
            "run": f"bench{args.seed}",
        }
        sampler = TaskSampler.open_sync(client, rows, config, seed=args.seed, store=False)
        rollouts = TRLRollouts(client, rows, sampler=sampler)

        def rollout_func(prompts, trainer):  # type: ignore[no-untyped-def]
            nonlocal groups, zero, rollouts_run, tokens, reached
            out = rollouts(prompts, trainer)
            got = rollouts.last_rows
            for k in range(0, len(got), args.generations):
                group = got[k : k + args.generations]
                rewards = [float(r.get("reward", 0.0)) for r in group]
                groups += 1
                zero += max(rewards) == min(rewards)
                rollouts_run += len(group)
                tokens += sum(len(c) for c in out["completion_ids"][k : k + args.generations])
                if group[0]["kind"] == "learnable":
                    learnable.append(sum(rewards) / len(rewards))
            step = [
                sum(float(r.get("reward", 0.0)) for r in got[k : k + args.generations]) / args.generations
                for k in range(0, len(got), args.generations)
                if got[k]["kind"] == "learnable"
            ]
            learnable_at.append(sum(step) / len(step) if step else float("nan"))
            last = learnable[-20:]
            mean = sum(last) / len(last) if last else 0.0
            if reached is None and len(last) == 20 and mean >= args.threshold:
                reached = {"rollouts": rollouts_run, "tokens": tokens, "step": trainer.state.global_step}
            return out

        trainer = grpo(
            w,
            rollout_func,
            rollouts.dataset(),
            tmp,
            steps=args.steps,
            batch=args.batch,
            generations=args.generations,
            learning_rate=args.lr,
            disable_tqdm=True,
        )
        if args.score != "uniform":
            rollouts.use_sampler(trainer, stop_when_exhausted=not args.go_on)
        trainer.add_callback(Stop())
        trainer.train()
    last = learnable[-20:]
    per_step = args.batch // args.generations
    missing = (args.steps - trainer.state.global_step) * per_step  # groups a stopped run did not generate
    windows: dict[int, dict[str, list[float]]] = {}
    for h in trainer.state.log_history:
        if "frac_reward_zero_std" in h:
            w = windows.setdefault((int(h["step"]) - 1) // args.window, {"zero": [], "entropy": []})
            w["zero"].append(float(h["frac_reward_zero_std"]))
            w["entropy"].append(float(h.get("entropy", 0.0)))
    result = {
        "score": args.score,
        "sharpness": args.sharpness,
        "half_life": args.half_life,
        "floor": args.floor,
        "revisit_after": args.revisit_after,
        "seed": args.seed,
        "steps": trainer.state.global_step,
        "seconds": round(time.monotonic() - started),
        "groups": groups,
        "skip_below": args.skip_below,
        "window": args.window,
        "stopped": trainer.state.global_step < args.steps,
        "zero_spread_share": round(zero / max(1, groups), 3),  # of the groups generated
        "zero_spread_share_whole": round((zero + missing) / max(1, groups + missing), 3),  # not generated: no spread
        "zero_by_window": [round(sum(w["zero"]) / len(w["zero"]), 2) for _, w in sorted(windows.items())],
        "entropy_by_window": [round(sum(w["entropy"]) / len(w["entropy"]), 2) for _, w in sorted(windows.items())],
        "learnable_by_window": [
            round(sum(ms) / len(ms), 2) if ms else None
            for ms in (
                [m for m in learnable_at[k : k + args.window] if m == m]
                for k in range(0, len(learnable_at), args.window)
            )
        ],  # the learnable groups' mean reward per window (None: none in it)
        "rollouts": rollouts_run,
        "tokens": tokens,
        "learnable_groups": len(learnable),
        "top_task_share": round(max(st.groups for st in sampler.stats) / max(1, groups), 3),  # the most-run task's
        "learnable_last20": round(sum(last) / max(1, len(last)), 3),
        "reached": reached,
    }
    print(json.dumps(result), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
