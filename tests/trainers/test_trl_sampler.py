"""The task sampler (issue 79) choosing TRL's prompts: the sync trainer's train sampler (``TRLRollouts.use_sampler``)
and the async rollout worker's next group. Real trl on CPU, real nats-server and workers; the rows' rewards are
fixed (a third always solved, a third never, a third with spread), so which tasks teach is known."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from gym_runtime import SyncClient
from gym_runtime.client.sampler import TaskSampler
from tests.trainers.world import grpo, need, world

need("trl")

KINDS = ("solved", "impossible", "learnable")


def mixed(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Two rows of each kind: solved (reward 1), impossible (0), learnable (rollouts alternate 1 and 0)."""
    out = []
    for i, row in enumerate(rows):
        kind = KINDS[i % 3]
        extra = {"solved": {"fixed_reward": 1.0}, "impossible": {"fixed_reward": 0.0}}.get(kind)
        out.append({**row, "kind": kind, "n": i, **(extra or {"rewards_by_rollout": [1.0, 0.0] * 4})})
    return out


def test_trls_train_sampler_picks_the_tasks_that_teach_and_keeps_each_prompts_completions(tmp_path: Path) -> None:
    from gym_runtime.trainers.trl import TRLRollouts

    w = world(tmp_path, rows=6)
    rows = mixed(w.rows)
    calls: list[tuple[list[Any], list[dict[str, Any]]]] = []
    with SyncClient(w.config) as client:
        sampler = TaskSampler.open_sync(client, rows, {"score": "learnability", "floor": 0.0}, seed=0)
        rollouts = TRLRollouts(client, rows, sampler=sampler)

        def recorded(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
            out = rollouts(prompts, trainer)
            calls.append((prompts, list(rollouts.last_rows)))
            return out

        trainer = grpo(w, recorded, rollouts.dataset(), tmp_path, steps=12, batch=8, generations=4)
        rollouts.use_sampler(trainer)
        trainer.train()
    picked: Counter[str] = Counter()
    for prompts, got in calls:
        assert len(prompts) == len(got) == 8
        for k in range(0, 8, 4):  # each group: one prompt, its own row's four completions
            assert all(p == prompts[k] for p in prompts[k : k + 4])
            own = rows[prompts[k][0]["gym_row"]]
            assert all(r["n"] == own["n"] for r in got[k : k + 4])
            assert {r["_ng_rollout_index"] for r in got[k : k + 4]} == {0, 1, 2, 3}
        picked.update(rows[p[0]["gym_row"]]["kind"] for p in prompts[::4])
    later = sum(picked.values())
    assert picked["learnable"] / later > 0.5, picked  # uniform: a third
    assert sampler.totals.groups == 2 * len(calls) and sum(s.rollouts for s in sampler.stats) == 8 * len(calls)
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert logged and all("gym_runtime/sampler/zero_spread_share" in h for h in logged)


def test_the_async_worker_picks_its_groups_by_the_sampler(tmp_path: Path) -> None:
    trl = need("trl.experimental.async_grpo.async_rollout_worker")
    from gym_runtime.live_models import LIVE_MODELS
    from gym_runtime.trainers.trl_async import GymRolloutWorker

    w = world(tmp_path, rows=6)
    rows = mixed(w.rows)
    with SyncClient(w.config) as client:
        LIVE_MODELS.register("policy", w.model, w.tokenizer)
        client.set_policy_version(0)
        sampler = TaskSampler.open_sync(client, rows, {"score": "learnability", "floor": 0.0}, seed=0)
        worker = GymRolloutWorker(
            client, rows, sample=trl.RolloutSample, num_generations=2, max_staleness=100, batch_size=4,
            groups_in_flight=1, sampler=sampler,
        )  # fmt: skip
        worker.start()
        try:
            deadline = time.monotonic() + 300
            while sampler.totals.groups < 30:
                assert time.monotonic() < deadline, f"only {sampler.totals.groups} groups"
                time.sleep(0.05)
        finally:
            worker.stop()
    kinds = Counter(rows[i]["kind"] for i, s in enumerate(sampler.stats) for _ in range(s.groups))
    assert kinds["learnable"] / sum(kinds.values()) > 0.42, kinds  # the rows in turn (before): a third
    samples = []
    while not worker.rollout_buffer.empty():
        samples.append(worker.rollout_buffer.get_nowait())
    by_group: dict[int, set[float]] = {}
    for s in samples:
        by_group.setdefault(s.group_id, set()).add(s.metrics["reward"])
    assert by_group
    metrics = []
    while not worker.metrics_queue.empty():
        metrics.append(worker.metrics_queue.get_nowait())
    assert any("gym_runtime/sampler/signal" in m for m in metrics)


def test_trl_ends_the_run_when_no_task_can_teach(tmp_path: Path) -> None:
    """Every row solved or failed every time: with ``skip_below`` the sampler is exhausted once each task's few
    groups have shown it, and TRL's run ends at that step (its logs say so) rather than generating the 40 steps'
    groups, none of which could have an advantage."""
    from gym_runtime.trainers.trl import TRLRollouts

    w = world(tmp_path, rows=4)
    rows = [{**row, "n": i, "fixed_reward": float(i % 2)} for i, row in enumerate(w.rows)]
    calls = 0
    with SyncClient(w.config) as client:
        config = {"score": "learnability", "floor": 0.1, "skip_below": 0.08}
        sampler = TaskSampler.open_sync(client, rows, config, seed=0, store=False)
        rollouts = TRLRollouts(client, rows, sampler=sampler)

        def counted(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
            nonlocal calls
            calls += 1
            return rollouts(prompts, trainer)

        trainer = grpo(w, counted, rollouts.dataset(), tmp_path, steps=40, batch=8, generations=4)
        rollouts.use_sampler(trainer)
        trainer.train()
    assert sampler.exhausted and 6 <= trainer.state.global_step < 20, trainer.state.global_step
    assert calls == trainer.state.global_step  # nothing generated after the step that exhausted the set
    logged = [h for h in trainer.state.log_history if "gym_runtime/sampler/exhausted" in h]
    assert logged[-1]["gym_runtime/sampler/exhausted"] == 1 and logged[0]["gym_runtime/sampler/exhausted"] == 0


def test_async_trl_ends_the_run_when_no_task_can_teach(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The async trainer likewise: the worker's sampler exhausted once each task's few groups have shown it solved
    or failed every time, TRL's ``AsyncGRPOTrainer`` ends at that step (one ``trainer.stopped`` line naming the
    sampler's run) rather than training its 30 steps on groups with no advantage. ``stop_when_exhausted=False``
    keeps the old way (not run here: it is the 30 steps)."""
    need("trl.experimental.async_grpo.async_rollout_worker")
    from tests.trainers.test_trl_async import trainer_of

    w = world(tmp_path, rows=4)
    w = dataclasses.replace(w, rows=[{**row, "n": i, "fixed_reward": float(i % 2)} for i, row in enumerate(w.rows)])
    with SyncClient(w.config) as client:
        config = {"score": "learnability", "floor": 0.1, "skip_below": 0.08, "run": "exp9"}
        sampler = TaskSampler.open_sync(client, w.rows, config, seed=0, store=False)
        trainer, rollouts, _ = trainer_of(w, tmp_path, client, steps=30, sampler=sampler)
        try:
            trainer.train()
        finally:
            rollouts.stop()
    assert sampler.exhausted and 1 <= trainer.state.global_step < 30, trainer.state.global_step
    stopped = [r.getMessage() for r in caplog.records if "trainer.stopped" in r.getMessage()]
    assert len(stopped) == 1 and "exp9" in stopped[0] and "trl_async" in stopped[0], stopped
