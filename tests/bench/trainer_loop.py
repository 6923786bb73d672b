"""Trainer idle per step and rollouts fed per second: the synchronous TRL adapter against the asynchronous rollout
worker, at the same model speed.

The trainer is a double with a fixed step time (``--train-s``, as ``async_rl.py``'s): per step it needs ``--batch``
rollouts (``--generations`` per prompt). Synchronous (``gym_runtime.trainers.trl.TRLRollouts``, TRL's
``rollout_func`` way): it asks for the step's rollouts, waits for them, then trains. Asynchronous
(``gym_runtime.trainers.trl_async.GymRolloutWorker``): rollouts run while it trains, and it takes the step's
samples from the buffer (``max_staleness`` 1, admission ``batch_size`` = the batch). The policy is the same in
both: ``runtime/rigs/tiny_policy.py``'s model generating in process (``adapter: transformers``), on the say-word
tool environment, real workers on an embedded nats-server. Needs torch and transformers (the ``trl`` extra).

    python tests/bench/trainer_loop.py --steps 10 --train-s 1.0
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gym_runtime import SyncClient
from gym_runtime.live_models import LIVE_MODELS
from gym_runtime.trainers.trl import TRLRollouts
from tests.trainers.world import world


def run_sync(args: argparse.Namespace, w: Any) -> tuple[list[float], float, int]:
    with SyncClient(w.config) as client:
        rollouts = TRLRollouts(client, w.rows)
        trainer = SimpleNamespace(model=w.model, processing_class=w.tokenizer, state=SimpleNamespace(global_step=0))
        prompts_of = rollouts.dataset()
        idle, fed, started = [], 0, time.perf_counter()
        for step in range(args.steps):
            prompts = [
                prompts_of[(step * args.batch // args.generations + k // args.generations) % len(prompts_of)]["prompt"]
                for k in range(args.batch)
            ]
            t0 = time.perf_counter()
            out = rollouts(prompts, trainer)
            idle.append(time.perf_counter() - t0)
            fed += len(out["completion_ids"])
            time.sleep(args.train_s)  # the optimizer step
            trainer.state.global_step += 1
        return idle, time.perf_counter() - started, fed


def run_async(args: argparse.Namespace, w: Any) -> tuple[list[float], float, int]:
    from gym_runtime.trainers.trl_async import GymRolloutWorker

    with SyncClient(w.config) as client:
        LIVE_MODELS.register("policy", w.model, w.tokenizer)
        client.set_policy_version(0)
        worker = GymRolloutWorker(
            client,
            w.rows,
            sample=dict,
            num_generations=args.generations,
            max_staleness=1,
            batch_size=args.batch,
            groups_in_flight=2 * args.batch // args.generations,
        )
        worker.start()
        idle, fed, started = [], 0, time.perf_counter()
        try:
            for step in range(args.steps):
                t0 = time.perf_counter()
                for _ in range(args.batch):
                    worker.rollout_buffer.get(timeout=300)
                idle.append(time.perf_counter() - t0)
                fed += args.batch
                time.sleep(args.train_s)  # the optimizer step; rollouts go on meanwhile
                client.set_policy_version(step + 1)
                worker.update_model_version(step + 1)
        finally:
            worker.stop()
        return idle, time.perf_counter() - started, fed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--train-s", type=float, default=1.0)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=8)
    args = p.parse_args()
    print("| loop | trainer idle per step (s, median after the first) | rollouts fed per s | steps | train_s |")
    print("| --- | --- | --- | --- | --- |")
    for name, run in (("synchronous (TRLRollouts)", run_sync), ("asynchronous (GymRolloutWorker)", run_async)):
        w = world(
            Path(tempfile.mkdtemp(prefix="trainer-loop-")), rows=16, max_new_tokens=args.max_new_tokens, tool_bias=2.0
        )
        idle, wall, fed = run(args, w)
        print(
            f"| {name} | {statistics.median(idle[1:] or idle):.2f} | {fed / wall:.1f} | {args.steps} | "
            f"{args.train_s:g} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
