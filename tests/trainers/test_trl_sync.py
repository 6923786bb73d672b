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
from tests.trainers.world import grpo, need, spans, world

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


class Recorder:
    """The adapter as TRL calls it, keeping what each call got and gave (with the step it ran at)."""

    def __init__(self, rollouts: TRLRollouts) -> None:
        self.rollouts = rollouts
        self.calls: list[tuple[int, list[Any], dict[str, list[Any]], list[Any]]] = []

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        out = self.rollouts(prompts, trainer)
        self.calls.append((trainer.state.global_step, prompts, out, list(self.rollouts.last_rows)))
        return out


def test_grpo_steps_on_a_multi_turn_tool_environment(tmp_path: Path) -> None:
    w = world(tmp_path, rows=6, tool_bias=3.0)
    with SyncClient(w.config) as client:
        rollouts = TRLRollouts(client, w.rows)
        calls = Recorder(rollouts)
        trainer = grpo(w, calls, rollouts.dataset(), tmp_path, steps=3, batch=4, generations=2)
        trainer.train()
    assert len(calls.calls) == 3
    multi_turn = 0
    for step, prompts, out, rows in calls.calls:
        assert len(out["completion_ids"]) == len(prompts) == len(rows) == 4  # one completion per received prompt
        for k in range(0, 4, 2):  # TRL's pairs: one group each, whole, in TRL's order
            group = rows[k : k + 2]
            assert prompts[k] == prompts[k + 1]
            assert {r["_ng_rollout_index"] for r in group} == {0, 1}
            assert all(r["word"] == w.rows[prompts[k][0]["gym_row"]]["word"] for r in group)  # its own row
        for i, row in enumerate(rows):
            assert "error_class" not in row
            assert out["env_mask"][i] == spans(row)  # 0 exactly on the tool and template tokens between turns
            assert len(out["completion_ids"][i]) == len(out["logprobs"][i]) == len(out["env_mask"][i])
            assert out["gym_reward"][i] == row["reward"]  # the environment's reward, as its verifier gave it
            assert out["gym_said_word"][i] == row["said_word"]
            assert row["policy_versions"] == [step, step]  # made by the weights of the step that used it
            multi_turn += 0 in out["env_mask"][i]
    assert multi_turn > 0  # some rollouts called the tool and went on (the policy's tool bias)
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 3
    for h in logged:
        assert math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"])
        assert h["gym_runtime/excluded"] == h["gym_runtime/policy_failures"] == 0.0
    rewards = [sum(out["gym_reward"]) / 4 for _, _, out, _ in calls.calls]
    assert [h["reward"] for h in logged] == pytest.approx(rewards)  # TRL trained on the environment's rewards


def test_the_transformers_adapter_loads_a_model_directory(tmp_path: Path) -> None:
    """``model: DIR`` instead of a live model: loaded once from disk (no hub), the same token-id items."""
    import yaml

    w = world(tmp_path, rows=2)
    w.model.save_pretrained(tmp_path / "policy")
    w.tokenizer.save_pretrained(tmp_path / "policy")
    cfg = yaml.safe_load(w.config.read_text())
    del cfg["models"]["policy"]["live"]
    cfg["models"]["policy"]["model"] = "policy"  # relative to the config's directory
    w.config.write_text(yaml.safe_dump(cfg))
    with SyncClient(w.config) as client:
        client.set_policy_version(7)
        rows = client.submit(w.rows, repeats=2).gather()
    assert len(rows) == 4
    for row in rows:
        seq = sequence(row)
        assert seq.prompt_ids and len(seq.completion_ids) == len(seq.logprobs) == len(seq.env_mask)
        assert seq.policy_versions and set(seq.policy_versions) == {7}
        assert all(lp <= 0.0 for lp, m in zip(seq.logprobs, seq.env_mask) if m)
