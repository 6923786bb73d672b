"""TRL's asynchronous GRPO (``trl.experimental.async_grpo``, real trl on CPU) fed by ``gym_runtime.trainers.
trl_async``: real nats-server and workers, the policy a copy of the trainer's model that the ``transformers``
adapter serves in process. TRL's FlashAttention-3 kernel (CUDA, from the hub) is the one part replaced: by a
plain-torch varlen attention (``gym_runtime.rigs.trl_cpu``, shipped for that)."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import pytest

from gym_runtime import SyncClient
from gym_runtime.trainers.trl_async import GymRolloutWorker, GymWeightTransfer
from tests.trainers.world import World, need, world

need("trl")


def trainer_of(
    w: World, tmp_path: Path, client: SyncClient, steps: int = 3, **worker: Any
) -> tuple[Any, GymRolloutWorker, Any]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    from gym_runtime.rigs.trl_cpu import use_cpu_attention

    use_cpu_attention()
    path = tmp_path / "model"
    w.model.save_pretrained(path)
    w.tokenizer.save_pretrained(path)
    rollouts = GymRolloutWorker(
        client, w.rows, sample=RolloutSample, num_generations=2, max_staleness=1, batch_size=8, **worker
    )
    transfer = GymWeightTransfer(client, AutoModelForCausalLM.from_pretrained(path), w.tokenizer)
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=2,
        max_steps=steps,
        max_staleness=1,
        token_budget=40,  # a packed row of about two samples (CPU: small steps)
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        learning_rate=1e-2,
    )
    trainer = AsyncGRPOTrainer(
        model=str(path),
        args=args,
        train_dataset=Dataset.from_list(rollouts.index.dataset()),
        processing_class=w.tokenizer,
        rollout_worker=rollouts,
        weight_transfer=transfer,
    )
    return trainer, rollouts, transfer


def test_async_grpo_steps_with_our_rollout_worker_and_weight_transfer(tmp_path: Path) -> None:
    w = world(tmp_path)
    with SyncClient(w.config) as client:
        trainer, rollouts, transfer = trainer_of(w, tmp_path, client)
        try:
            trainer.train()
        finally:
            rollouts.stop()
        assert client.policy_version == transfer.version == 4  # the first sync, then one per step, each stamped
    assert transfer.pauses == 4  # each sync paused the policy's replica (drain) and resumed it
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 3 and all(math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"]) for h in logged)
    assert rollouts.counts.groups > 0 and rollouts.counts.failed_groups == 0 and rollouts.totals.excluded == 0
    trained = dict(trainer.model.named_parameters())
    for name, param in transfer.live.model.named_parameters():  # the rollout copy holds the last step's weights
        assert param.detach().equal(trained[name].detach()), name


def test_a_group_too_stale_to_use_is_cancelled_in_flight_and_never_reaches_the_buffer(tmp_path: Path) -> None:
    trl = need("trl.experimental.async_grpo.async_rollout_worker")
    w = world(tmp_path, rows=1)
    verifying = tmp_path / "verifying"
    w.rows[0].update(verifying=str(verifying), verify_delay_s=300.0)  # the group stays in flight
    with SyncClient(w.config) as client:
        from gym_runtime.live_models import LIVE_MODELS

        LIVE_MODELS.register("policy", w.model, w.tokenizer)
        client.set_policy_version(0)
        rollouts = GymRolloutWorker(
            client,
            w.rows,
            sample=trl.RolloutSample,
            num_generations=2,
            max_staleness=1,
            batch_size=8,
            groups_in_flight=1,
        )
        rollouts.start()
        try:
            deadline = time.monotonic() + 120
            while not verifying.exists():
                assert time.monotonic() < deadline, "no rollout reached its verify"
                time.sleep(0.05)
            agent = next(x for x in client.client.workers if hasattr(x, "skipped"))
            rollouts.update_model_version(2)  # the trainer moved two versions on: the group can no longer be used
            while rollouts.counts.cancelled_groups < 1 or agent.skipped < 2:
                assert time.monotonic() < deadline, f"not cancelled: {rollouts.counts}, skipped {agent.skipped}"
                time.sleep(0.05)
        finally:
            rollouts.stop()
    assert rollouts.rollout_buffer.empty() and rollouts.counts.groups == 0


def started_worker(client: SyncClient, w: World, **kwargs: Any) -> GymRolloutWorker:
    """The rollout worker on its own (no trainer), the policy the world's model."""
    trl = need("trl.experimental.async_grpo.async_rollout_worker")
    from gym_runtime.live_models import LIVE_MODELS

    LIVE_MODELS.register("policy", w.model, w.tokenizer)
    client.set_policy_version(0)
    worker = GymRolloutWorker(
        client, w.rows, sample=trl.RolloutSample, num_generations=2, max_staleness=1, batch_size=4, **kwargs
    )
    worker.start()
    return worker


def test_the_async_workers_bound_stops_it_in_one_line_and_its_counts_reach_metrics_queue(tmp_path: Path) -> None:
    from gym_runtime.trainers.failures import FailurePolicy

    w = world(tmp_path, rows=1)
    w.rows[0]["explode"] = True  # every verify raises: every rollout excluded (before: dropped without a bound)
    with SyncClient(w.config) as client:
        worker = started_worker(client, w, groups_in_flight=2, failures=FailurePolicy(retries=1))
        try:
            deadline = time.monotonic() + 120
            while worker._future is None or not worker._future.done():
                assert time.monotonic() < deadline, f"the worker never stopped: {worker.totals}"
                time.sleep(0.05)
        finally:
            worker.stop()
    with pytest.raises(RuntimeError) as e:
        worker.check_health(1e9)  # what TRL's trainer calls: the worker's one line
    text = str(e.value)
    assert "\n" not in text and "rollouts still failed after 1 retries" in text
    assert "verify_error" in text and "dataset row 0 (verify_error)" in text
    metrics = []
    while not worker.metrics_queue.empty():
        metrics.append(worker.metrics_queue.get_nowait())
    assert metrics and sum(m["gym_runtime/excluded"] for m in metrics) >= 4
    assert sum(m["gym_runtime/retried"] for m in metrics) >= 4
    assert all(m["gym_runtime/failed/environment"] >= 1 for m in metrics)
    assert worker.rollout_buffer.empty()


def test_a_1e200_reward_neither_stops_the_worker_nor_yields_nan(tmp_path: Path) -> None:
    from gym_runtime.trainers.failures import FailurePolicy

    w = world(tmp_path, rows=2)
    w.rows[1]["reward_given"] = 1e200  # before: OverflowError in (x - mean) ** 2, the worker's task group died
    with SyncClient(w.config) as client:
        worker = started_worker(client, w, failures=FailurePolicy(retries=0, max_excluded=1.0))
        try:
            deadline = time.monotonic() + 120
            while worker.counts.groups < 2 or worker.totals.excluded < 4:
                assert time.monotonic() < deadline, f"not enough groups: {worker.counts}, {worker.totals}"
                assert not worker._future.done(), worker._future.exception()  # type: ignore[union-attr]
                time.sleep(0.05)
            worker.check_health(1e9)  # still running
        finally:
            worker.stop()
    assert worker.totals.by_class["verify_error"] >= 4  # the bound made it a verify_error, excluded
    samples = []
    while not worker.rollout_buffer.empty():
        samples.append(worker.rollout_buffer.get_nowait())
    assert samples and all(math.isfinite(s.advantage) and math.isfinite(s.metrics["reward"]) for s in samples)
    assert all(abs(s.metrics["reward"]) <= 1.0 for s in samples)


def test_a_stalling_policy_is_scored_in_the_async_worker_not_dropped(tmp_path: Path) -> None:
    """Issue 66's red team under TRL's async trainer: a policy that stalls on its hard task (its tool call runs the
    rollout's ``timeout_s`` out) gets samples of that task all the same, its generated tokens at reward 0 (a policy
    failure), where the worker dropped every group with a failure (0 of 34 samples from the stalled task)."""
    from gym_runtime.trainers.failures import FailurePolicy

    w = world(tmp_path, rows=2, tool_bias=20.0, timeout_s=4.0)
    w.rows[0]["fixed_reward"] = 1.0
    w.rows[1].update(fixed_reward=0.0, stall_s=600.0)
    with SyncClient(w.config) as client:
        worker = started_worker(client, w, failures=FailurePolicy(retries=0))
        try:
            deadline = time.monotonic() + 120
            while worker.totals.policy_failures < 2:
                assert time.monotonic() < deadline, f"no stalled group: {worker.totals}"
                assert not worker._future.done(), worker._future.exception()  # type: ignore[union-attr]
                time.sleep(0.05)
        finally:
            worker.stop()
    assert worker.totals.excluded == 0 and worker.totals.by_attribution["policy"] >= 2
    samples = []
    while not worker.rollout_buffer.empty():
        samples.append(worker.rollout_buffer.get_nowait())
    stalls = [s for s in samples if s.metrics["gym_policy_failure"] == 1.0]
    assert len(stalls) >= 2 and all(s.metrics["reward"] == 0.0 for s in stalls)
    assert all(1 in s.completion_mask.tolist() for s in stalls)  # the tokens it generated, trained on
