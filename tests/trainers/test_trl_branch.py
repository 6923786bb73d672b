"""TRL trains on a branch point's rows as one group (issue 78, item 4): real trl on CPU, real workers, the tiny
policy (``tests/trainers/world.py``) on the say-word environment, whose ``snapshot``/``restore`` keep the word drawn.

With ``TRLRollouts(..., branch_at=1)`` each group is one rollout of its row (its checkpoints kept) and the rest of
the group branched from it after turn 1 (the draw): every member's prompt ids are that prefix, the task's prompt
then the draw and its answer, and its completion only what it generated after it, so TRL's advantages compare the
continuations of one state.
"""

from __future__ import annotations

import math
from pathlib import Path

from gym_runtime import SyncClient
from gym_runtime.trainers.failures import FailurePolicy
from gym_runtime.trainers.rows import branched, sequence
from gym_runtime.trainers.trl import TRLRollouts
from tests.trainers.test_trl_sync import Recorder
from tests.trainers.world import grpo, need, world

need("trl")


def test_a_branch_points_rows_train_as_one_group_sharing_their_prefix(tmp_path: Path) -> None:
    w = world(tmp_path, rows=2, tool_bias=20.0)  # the policy draws first: turn 1 makes the call
    with SyncClient(w.config) as client:
        rollouts = TRLRollouts(client, w.rows, branch_at=1, failures=FailurePolicy(retries=0))
        calls = Recorder(rollouts)
        trainer = grpo(w, calls, rollouts.dataset(), tmp_path, steps=1, batch=6, generations=3)
        trainer.train()
    ((_, prompts, out, rows),) = calls.calls
    assert len(rows) == 6
    for g in (0, 3):  # TRL's order: a prompt's three completions in a row, each group one tree
        parent, kids = rows[g], rows[g + 1 : g + 3]
        assert "branch_of" not in parent and "error_class" not in parent, parent
        for kid in kids:
            assert kid["branch_turn"] == 1 and kid["branch_of"].endswith(f":{g // 3}:0"), kid
            assert kid["tool_calls"] >= 1.0  # the parent's draw, restored in its own session
            assert kid["response"]["output"][:2] == parent["response"]["output"][:2]  # the same turn 1, ids and all
        prefix = out["prompt_ids"][g]
        assert out["prompt_ids"][g + 1] == out["prompt_ids"][g + 2] == prefix
        assert len(prefix) > len(sequence(parent).prompt_ids) and w.tool_token in prefix  # the draw is the prompt's
        for i in range(g, g + 3):
            assert out["completion_ids"][i] == branched(rows[i], 1).completion_ids
            assert len(out["completion_ids"][i]) == len(out["env_mask"][i]) == len(out["logprobs"][i])
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert logged and math.isfinite(logged[0]["loss"])
