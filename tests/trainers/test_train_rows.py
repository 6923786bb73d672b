"""The training rows file (``rows_path=``): TRL's GRPOTrainer (real trl, on CPU) writes what it was handed, with
the advantages TRL computed, as the run goes. The run's file is also the fixture ``view``'s browser tests read
(``tests/data/train_run``: the main suite has no TRL): ``GYM_UPDATE_TRAIN_RUN=1`` writes it again from this run."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from gym_runtime import SyncClient
from gym_runtime.data.sampling import task_key
from gym_runtime.trainers.failures import FailurePolicy
from gym_runtime.trainers.rows import sequence
from gym_runtime.trainers.trl import TRLRollouts
from tests.trainers.world import grpo, need, world

need("trl")

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "train_run"
STEPS, BATCH, GENERATIONS = 6, 8, 4


def approx(x: float) -> Any:
    return pytest.approx(x, rel=1e-5, abs=1e-6)


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def trl_advantages(rewards: list[float]) -> list[float]:
    """TRL 1.16's group advantage (``scale_rewards="group"``): (r - mean) / (unbiased std + 1e-4)."""
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1))
    return [(r - mean) / (std + 1e-4) for r in rewards]


def test_a_grpo_run_writes_its_rows_with_trls_advantages_as_it_goes(tmp_path: Path) -> None:
    w = world(tmp_path, rows=6, tool_bias=3.0)
    w.rows[1]["explode_once"] = str(tmp_path / "exploded")  # one verify raises: an excluded member (no retries)
    path = tmp_path / "train_rows.jsonl"
    seen_at_call: list[int] = []
    with SyncClient(w.config) as client:
        failures = FailurePolicy(retries=0, max_excluded=1.0)
        rollouts = TRLRollouts(client, w.rows, rows_path=str(path), failures=failures)

        def rollout_func(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
            seen_at_call.append(len(lines(path)))  # what a reader of the file sees when the next step starts
            return rollouts(prompts, trainer)

        trainer = grpo(w, rollout_func, rollouts.dataset(), tmp_path, steps=STEPS, batch=BATCH, generations=GENERATIONS)
        trainer.train()
        rollouts.close()
    # appended as the run goes: each step's rows are on disk (TRL scored them) before the next step asks for more
    assert seen_at_call == [k * BATCH for k in range(STEPS)]
    rows = lines(path)
    assert len(rows) == STEPS * BATCH
    keys = {task_key(r) for r in w.rows}
    assert [r["train_step"] for r in rows] == [s for s in range(STEPS) for _ in range(BATCH)]
    groups: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r["train_group"], []).append(r)
    assert sorted(groups) == list(range(STEPS * BATCH // GENERATIONS))
    multi_turn = 0
    failed: list[dict[str, Any]] = []
    for members in groups.values():
        assert len(members) == GENERATIONS and len({m["_ng_task_index"] for m in members}) == 1
        # the group's task by the sampler's key of its dataset row (view's task pages follow it across steps)
        assert len({m["train_task"] for m in members}) == 1 and members[0]["train_task"] in keys
        rewards = [m.get("reward") for m in members]  # (an excluded failure: handed over as None)
        assert [m["train_reward"] for m in members] == rewards  # the environment's reward, as handed over
        assert [m["train_total_reward"] for m in members] == rewards  # TRL's total: env_reward alone
        kept = [r for r in rewards if r is not None]
        want = iter(trl_advantages(kept))  # TRL's nan-aware statistics: the excluded member is out, advantage 0
        expected = [0.0 if r is None else next(want) for r in rewards]
        assert [m["train_advantage"] for m in members] == [approx(a) for a in expected]  # read back from TRL
        for m in members:
            if "error_class" in m:  # the excluded member: its failure row
                failed.append(m)
                continue
            assert m["policy_versions"] and set(m["policy_versions"]) == {m["train_step"]}
            multi_turn += 0 in sequence(m).env_mask  # the tool's tokens: mask 0 (the token view shows them)
    assert multi_turn > 0
    assert len(failed) == 1 and failed[0]["error_class"] == "verify_error" and failed[0]["train_reward"] is None
    assert failed[0]["failure_attribution"] == "environment"
    # the last step's advantages are the ones TRL logged last (``_logs``), in TRL's order
    assert [r["train_advantage"] for r in rows[-BATCH:]] == [approx(a) for a in trainer._logs["advantages"]]
    if os.environ.get("GYM_UPDATE_TRAIN_RUN") == "1":
        assert any(r["train_advantage"] != 0 for r in rows)  # some group had a spread: the fixture shows signal
        FIXTURE.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, FIXTURE / "train_rows.jsonl")
        w.tokenizer.save_pretrained(FIXTURE / "tokenizer")
    fixture = lines(FIXTURE / "train_rows.jsonl")  # the browser tests' run has what a run writes today
    assert fixture and set().union(*fixture) == set().union(*rows), "run with GYM_UPDATE_TRAIN_RUN=1 to write it again"


def test_the_async_worker_writes_each_group_it_handed_over_with_its_advantage(tmp_path: Path) -> None:
    from tests.trainers.test_trl_async import trainer_of

    w = world(tmp_path)
    path = tmp_path / "async_rows.jsonl"
    with SyncClient(w.config) as client:
        trainer, worker, _ = trainer_of(w, tmp_path, client, rows_path=str(path))
        try:
            trainer.train()
        finally:
            worker.stop()
    rows = lines(path)
    groups: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r["train_group"], []).append(r)
    assert len(groups) >= worker.counts.groups > 0  # every group handed to the buffer (and any dropped) is written
    for members in groups.values():
        assert len(members) == 2 and len({m["_ng_task_index"] for m in members}) == 1
        rewards = [m["reward"] for m in members]
        assert [m["train_reward"] for m in members] == rewards
        mean = sum(rewards) / 2
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / 2)  # the worker's own (population) spread
        assert [m["train_advantage"] for m in members] == [approx((r - mean) / (std + 1e-8)) for r in rewards]
        assert all(isinstance(m["train_step"], int) for m in members)  # the trainer's version at hand-over
