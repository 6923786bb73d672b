"""An example that learns: TRL's GRPO through gym-runtime's real workers teaches a tiny random model to call a tool
and say back what it returned.

The environment is ``tests/envs/say_word.py``: the tool ``draw_word`` returns one of 8 words (the row's), the reward
is 1 when the tool was called and the last message names the word, so a policy that calls the tool and then says
a random one of the 8 words scores 1/8. The policy is ``runtime/rigs/tiny_policy.py``'s random 2-layer Qwen2 shape
and word-level tokenizer (built here, no hub), generating in this process with the weights being trained
(``adapter: transformers``, ``live: policy``); tool calls are Hermes blocks
(``<tool_call>{"name": "draw_word", "arguments": {}}</tool_call>``, one token of this tokenizer). Real nats-server
(embedded), real agent and environment workers; TRL's ``GRPOTrainer`` on CPU with ``gym_runtime.trainers.trl``.

Prints the mean reward of each step and, at the end, the mean of the last 10 steps. Goal: >= 0.5 within 10 minutes
on 2 cores. Needs the ``trl`` extra (``pip install -e '.[trl]'`` with torch's CPU wheel).

    python tests/bench/trl_learns.py                 # until 10 minutes or --steps
    python tests/bench/trl_learns.py --minutes 3 --steps 400 --lr 5e-3

The stallable variant (issue 66), ``--wait-s S --timeout-s T`` (S > T): the rows offer a second tool, ``wait``,
that takes S seconds, so a rollout that calls it runs its ``timeout_s`` out: a ``timeout`` whose time went to the
policy's tool call, a policy failure, scored ``policy_failure_reward`` (0) with its tokens. Prints each step's share
of stalled rollouts too, and at the end the first 10 steps' share against the last 10 steps'.

    python tests/bench/trl_learns.py --wait-s 30 --timeout-s 2 --minutes 5 --seed 1
    python tests/bench/trl_learns.py --wait-s 30 --timeout-s 2 --minutes 5 --seed 1 --old-drop   # the contrast

``--old-drop`` is the contrast: the stall treated as ``on_failure="drop"`` treated it before issue 66 (its group
replaced by the next row's, nothing scored), here as a stall that is excluded and its group refilled.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gym_runtime import SyncClient
from gym_runtime.trainers.failures import FailurePolicy, Kind
from gym_runtime.trainers.trl import TRLRollouts
from tests.envs.say_word import WORDS
from tests.trainers.world import grpo, world


class OldDrop(TRLRollouts):
    """The behaviour before issue 66, for contrast: a stall (a policy failure) is not scored; its group is replaced by
    the next row's (``refill``), and what still stalls is left out."""

    def _saw(self, row: dict) -> Kind:  # type: ignore[type-arg]
        kind = super()._saw(row)
        return "excluded" if kind == "policy" else kind


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--tool-bias", type=float, default=2.0)
    p.add_argument("--max-new-tokens", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wait-s", type=float, default=None, help="the stallable variant: the wait tool's seconds")
    p.add_argument("--timeout-s", type=float, default=2.0, help="the stallable variant: each rollout's timeout_s")
    p.add_argument("--old-drop", action="store_true", help="the contrast: stalls dropped and refilled, not scored")
    args = p.parse_args()
    import transformers
    from transformers import TrainerCallback

    transformers.logging.set_verbosity_error()
    tmp = Path(tempfile.mkdtemp(prefix="trl-learns-"))
    stall = {} if args.wait_s is None else {"wait_s": args.wait_s, "timeout_s": args.timeout_s}
    w = world(
        tmp, rows=args.rows, max_new_tokens=args.max_new_tokens, seed=args.seed, tool_bias=args.tool_bias, **stall
    )
    assert {r["word"] for r in w.rows} == set(WORDS)
    started = time.monotonic()
    means: list[float] = []
    stalls: list[float] = []  # each step's share of rollouts that ran their timeout_s out

    class Report(TrainerCallback):
        def on_step_end(self, _args, state, control, **_kw):  # type: ignore[no-untyped-def]
            if time.monotonic() - started > args.minutes * 60:
                control.should_training_stop = True

    with SyncClient(w.config) as client:
        if args.old_drop:
            rollouts = OldDrop(client, w.rows, failures=FailurePolicy(retries=0, refill=True, max_excluded=1.0))
        else:
            rollouts = TRLRollouts(client, w.rows)

        def rollout_func(prompts, trainer):  # type: ignore[no-untyped-def]
            out = rollouts(prompts, trainer)
            rewards = [r if r is not None else 0.0 for r in out["gym_reward"]]
            means.append(sum(rewards) / len(rewards))
            c = rollouts.counts  # every rollout the step ran (a refilled group's replaced ones too)
            stalls.append(c.by_class["timeout"] / (len(rewards) + c.refilled_groups * args.generations))
            last10 = means[-10:]
            print(
                f"step {len(means):4d}  t={time.monotonic() - started:6.1f}s  mean reward {means[-1]:.3f}  "
                f"last-10 {sum(last10) / len(last10):.3f}  stalled {stalls[-1]:.3f}",
                flush=True,
            )
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
        trainer.add_callback(Report())
        trainer.train()
    last10 = means[-10:]
    print(
        f"done: {len(means)} steps in {time.monotonic() - started:.0f} s; first-10 mean "
        f"{sum(means[:10]) / max(1, len(means[:10])):.3f}, last-10 mean {sum(last10) / max(1, len(last10)):.3f} "
        f"(random policy that calls the tool: 0.125); totals {rollouts.totals}"
    )
    if args.wait_s is not None:
        print(
            f"stalled: first-10 share {sum(stalls[:10]) / max(1, len(stalls[:10])):.3f}, last-10 share "
            f"{sum(stalls[-10:]) / max(1, len(stalls[-10:])):.3f}"
        )


if __name__ == "__main__":
    main()
