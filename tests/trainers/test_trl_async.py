"""TRL's asynchronous GRPO (``trl.experimental.async_grpo``, real trl on CPU) fed by ``gym_runtime.trainers.
trl_async``: real nats-server and workers, the policy a copy of the trainer's model that the ``transformers``
adapter serves in process. TRL's FlashAttention-3 kernel (CUDA, from the hub) is the one part replaced: by a
plain-torch varlen attention (``gym_runtime.trainers.trl_cpu``, shipped for that)."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from gym_runtime import SyncClient
from gym_runtime.trainers.trl_async import GymRolloutWorker, GymWeightTransfer
from tests.trainers.world import World, need, world

need("trl")


def trainer_of(w: World, tmp_path: Path, client: SyncClient, **worker: Any) -> tuple[Any, GymRolloutWorker, Any]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    from gym_runtime.trainers.trl_cpu import use_cpu_attention

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
        max_steps=3,
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
    assert rollouts.counts.groups > 0 and rollouts.counts.failed_groups == 0
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
