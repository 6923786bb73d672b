"""Failures in TRL's GRPOTrainer (real trl on CPU, real workers; issue 66): a policy's stall is scored like a wrong
answer with its own tokens, an excluded member is TRL's unscorable (None, advantage 0) while its group trains, and a
refilled group's own columns reach a second reward function."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from gym_runtime import SyncClient
from gym_runtime.trainers.failures import FailurePolicy
from gym_runtime.trainers.rows import sequence
from gym_runtime.trainers.trl import TRLRollouts, env_reward
from tests.trainers.test_trl_sync import Recorder
from tests.trainers.world import grpo, need, world

need("trl")


def step(tmp_path: Path, stall: bool) -> tuple[list[Any], dict[str, list[Any]], list[dict[str, Any]]]:
    """One step on an easy task (reward 1) and a hard one (reward 0); a policy that calls the tool first, which on
    the hard task (``stall``) takes longer than the rollout's ``timeout_s``: the policy stalls."""
    tmp_path.mkdir()
    w = world(tmp_path, rows=2, tool_bias=20.0, timeout_s=8.0)
    w.rows[0]["fixed_reward"] = 1.0
    w.rows[1]["fixed_reward"] = 0.0
    if stall:
        w.rows[1]["stall_s"] = 600.0
    with SyncClient(w.config) as client:
        rollouts = TRLRollouts(client, w.rows, failures=FailurePolicy(retries=0))
        calls = Recorder(rollouts)
        trainer = grpo(w, calls, rollouts.dataset(), tmp_path, steps=1, batch=4, generations=2)
        trainer.train()
    ((_, prompts, out, rows),) = calls.calls
    logged = [h for h in trainer.state.log_history if "loss" in h]
    return logged, out, rows


def trained(w: Any, tmp_path: Path, failures: FailurePolicy, *, batch: int, generations: int) -> tuple[Any, ...]:
    """One GRPO step on ``w``'s rows: the trainer, and what the one rollout call got (prompts, outputs, rows)."""
    with SyncClient(w.config) as client:
        rollouts = TRLRollouts(client, w.rows, failures=failures)
        calls = Recorder(rollouts)
        trainer = grpo(w, calls, rollouts.dataset(), tmp_path, steps=1, batch=batch, generations=generations)
        trainer.train()
    ((_, prompts, out, rows),) = calls.calls
    return trainer, prompts, out, rows


def test_a_stalling_policy_gets_the_honest_policys_step_rewards(tmp_path: Path) -> None:
    honest_logs, honest, _ = step(tmp_path / "honest", stall=False)
    stalled_logs, stalled, rows = step(tmp_path / "stalled", stall=True)
    assert honest["gym_reward"] == stalled["gym_reward"] == [1.0, 1.0, 0.0, 0.0]  # before: [1, 1, 1, 1] (dropped)
    assert honest_logs[0]["reward"] == stalled_logs[0]["reward"] == 0.5
    for i in (2, 3):  # the stalls: scored with the tokens the policy generated before its tool ran the clock out
        row = rows[i]
        assert row["error_class"] == "timeout" and row["failure_attribution"] == "policy", row
        assert row["partial"] is True and row["response"]["status"] == "incomplete"
        assert row["time_split"]["tools_ms"] > row["time_split"]["total_ms"] / 2
        assert stalled["completion_ids"][i] == sequence(row).completion_ids and 1 in stalled["env_mask"][i]
        assert stalled["gym_excluded"][i] is False
    assert stalled_logs[0]["gym_runtime/policy_failures"] == 2.0 and stalled_logs[0]["gym_runtime/excluded"] == 0.0
    assert math.isfinite(stalled_logs[0]["loss"])


def test_an_excluded_member_is_unscorable_in_trl_while_the_rest_of_its_group_trains(tmp_path: Path) -> None:
    w = world(tmp_path, rows=2)
    w.rows[0].update(rewards_by_rollout=[1.0, 0.0, 0.0, 1.0], explode_rollout=1)  # rollout 1's verify raises
    w.rows[1]["rewards_by_rollout"] = [1.0, 0.0, 1.0, 0.0]
    failures = FailurePolicy(retries=0, max_excluded=0.25)
    trainer, prompts, out, rows = trained(w, tmp_path, failures, batch=8, generations=4)
    first = [i for i in range(8) if prompts[i][0]["gym_row"] == 0]
    excluded = next(i for i in first if rows[i].get("error_class"))
    assert rows[excluded]["failure_attribution"] == "environment" and rows[excluded]["_ng_rollout_index"] == 1
    assert out["gym_reward"][excluded] is None and out["gym_excluded"][excluded] is True  # before: 0.0 (a fake zero)
    assert out["env_mask"][excluded] == [0]
    sibling = next(i for i in first if i != excluded)  # its prompt ids are its own group's
    assert out["prompt_ids"][excluded] == out["prompt_ids"][sibling]
    advantages = list(trainer._logs["advantages"])
    assert advantages[excluded] == 0.0
    kept = [advantages[i] for i in first if i != excluded]
    assert all(math.isfinite(a) and a != 0.0 for a in kept)
    assert sum(kept) == pytest.approx(0.0, abs=1e-4)  # the mean is the kept members' (a 0 would shift it)
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert logged[0]["gym_runtime/excluded"] == 1.0 and logged[0]["gym_runtime/failed/verify_error"] == 1.0
    assert math.isfinite(logged[0]["loss"])


def test_a_refilled_group_carries_its_own_rows_columns_to_a_second_reward_function(tmp_path: Path) -> None:
    w = world(tmp_path, rows=2)
    w.rows[0]["explode"] = True  # every verify of row 0 raises: its group is refilled by row 1's
    seen: list[Any] = []

    def said(prompts: Any = None, completions: Any = None, *, word: list[str], **kw: Any) -> list[float | None]:
        seen.extend(word)
        return [None if x else 0.0 for x in kw["gym_excluded"]]

    with SyncClient(w.config) as client:
        rollouts = TRLRollouts(client, w.rows, failures=FailurePolicy(retries=1, refill=True))
        calls = Recorder(rollouts)
        dataset = [{**d, "word": r["word"]} for d, r in zip(rollouts.dataset(), w.rows, strict=True)]
        # a second reward function, reading a dataset column
        trainer = grpo(w, calls, dataset, tmp_path, steps=1, batch=4, generations=2, reward_funcs=[env_reward, said])
        trainer.train()
    ((_, prompts, out, rows),) = calls.calls
    assert rollouts.totals.refilled_groups == 1
    assert [r["word"] for r in rows] == [w.rows[1]["word"]] * 4  # row 0's group was replaced by row 1's
    assert seen == [r["word"] for r in rows]  # before: row 0's word for the refill's completions
    assert env_reward(gym_reward=out["gym_reward"]) == out["gym_reward"]


def test_a_1e200_reward_never_reaches_trl(tmp_path: Path) -> None:
    """The reward bound end to end (issue 66): an environment answering 1e200 (which TRL's float32 would hold as
    ``inf``) gives a ``verify_error`` row, excluded: ``gym_reward`` None in TRL, advantage 0, and the step's logged
    reward and loss finite, from the other group's rewards alone."""
    w = world(tmp_path, rows=2)
    w.rows[0]["reward_given"] = 1e200
    w.rows[1]["rewards_by_rollout"] = [1.0, 0.0]
    trainer, prompts, out, rows = trained(
        w, tmp_path, FailurePolicy(retries=0, max_excluded=0.5), batch=4, generations=2
    )
    bounded = [i for i in range(4) if prompts[i][0]["gym_row"] == 0]
    for i in bounded:
        assert rows[i]["error_class"] == "verify_error" and "1e+200" in rows[i]["error"], rows[i]
        assert out["gym_reward"][i] is None and out["gym_excluded"][i] is True
    assert sorted(r for r in out["gym_reward"] if r is not None) == [0.0, 1.0]
    advantages = list(trainer._logs["advantages"])
    assert all(advantages[i] == 0.0 for i in bounded) and all(math.isfinite(a) for a in advantages)
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert logged[0]["reward"] == pytest.approx(0.5) and math.isfinite(logged[0]["loss"])
    assert logged[0]["gym_runtime/excluded"] == 2.0
