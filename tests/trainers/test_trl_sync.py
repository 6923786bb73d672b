"""TRL's GRPOTrainer (real trl, on CPU) fed by ``gym_runtime.trainers.trl``: real nats-server, real workers, the
tiny policy generating in process with the weights being trained."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from gym_runtime import SyncClient
from gym_runtime.live_models import LIVE_MODELS
from gym_runtime.trainers.rows import sequence
from gym_runtime.trainers.trl import TRLRollouts
from tests.trainers.world import grpo, need, world

need("trl")


def old_recipe(client: SyncClient, rows: list[dict[str, Any]]) -> Any:
    """docs/trainer.md's recipe before issue 54: ``repeats=num_generations`` on prompts TRL had repeated already."""

    def rollout_func(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {"prompt_ids": [], "completion_ids": [], "env_mask": [], "logprobs": []}
        LIVE_MODELS.register("policy", trainer.model, trainer.processing_class)  # the policy generates
        rewards = []
        picked = [rows[p[0]["gym_row"]] for p in prompts]
        for row in client.submit(picked, repeats=trainer.num_generations).gather():
            seq = sequence(row)
            out["prompt_ids"].append(seq.prompt_ids)
            out["completion_ids"].append(seq.completion_ids)
            out["env_mask"].append(seq.env_mask)
            out["logprobs"].append(seq.logprobs)
            rewards.append(row.get("reward", 0.0))
        out["gym_reward"] = rewards
        return out

    return rollout_func


def test_the_old_recipe_fails_inside_trl_and_the_adapter_trains(tmp_path: Path) -> None:
    w = world(tmp_path)
    with SyncClient(w.config) as client:
        rollouts = TRLRollouts(client, w.rows)
        old = grpo(w, old_recipe(client, w.rows), rollouts.dataset(), tmp_path / "old", steps=1)
        with pytest.raises((IndexError, ValueError, RuntimeError)):  # whatever TRL raises on 2x the completions
            old.train()
        trainer = grpo(w, rollouts, rollouts.dataset(), tmp_path / "new", steps=1)
        trainer.train()
    assert rollouts.totals.rollouts == 4
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert logged and math.isfinite(logged[-1]["loss"])
