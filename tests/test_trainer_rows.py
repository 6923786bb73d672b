"""How the TRL adapter finds a prompt's row, cuts TRL's prompts into groups and answers (no TRL needed)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from gym_runtime import SyncClient
from gym_runtime.config import resolve_config
from gym_runtime.errors import ClientError
from gym_runtime.trainers.rows import RowIndex, runs
from gym_runtime.trainers.trl import TRLRollouts
from tests.helpers import rows, weather_config


def row(text: str, **task: object) -> dict[str, object]:
    return {"responses_create_params": {"input": [{"role": "user", "content": text}]}, **task}


def test_two_rows_with_the_same_prompt_are_not_confused() -> None:
    rows = [row("2+2?", answer=4), row("2+2?", answer=5), row("3+3?", answer=6)]
    index = RowIndex(rows)
    data = index.dataset()
    assert [index.find(d["prompt"]) for d in data] == [0, 1, 2]
    assert data[1]["prompt"] == [{"role": "user", "content": "2+2?", "gym_row": 1}]
    assert index.find([{"role": "user", "content": "3+3?"}]) == 2  # no key: by its text, once
    with pytest.raises(ClientError, match="2 rows have the prompt"):
        index.find([{"role": "user", "content": "2+2?"}])
    with pytest.raises(ClientError, match="no row has the prompt"):
        index.find("4+4?")
    with pytest.raises(ClientError, match="names row 7"):
        index.find([{"role": "user", "content": "x", "gym_row": 7}])


def test_trls_repeated_prompts_become_groups_in_order() -> None:
    assert runs([3, 3, 5, 5, 3, 3]) == [(3, 2), (5, 2), (3, 2)]
    assert runs([1, 1, 1, 1]) == [(1, 4)]  # one row twice in a row: one group of the run's length


def test_the_trl_adapter_turns_scripted_token_rollouts_into_trls_fields(tmp_path: Path) -> None:
    """``TRLRollouts`` without TRL (no trainer: nothing to register or log into) on weather rollouts whose model,
    the scripted double, says token ids as a token-in adapter does: one sequence per prompt, in order; the tool's
    output between the two generations masked 0 with logprob 0, the generations masked 1 with their logprobs;
    the reward the verifier gave."""
    cfg = weather_config()
    m = cfg.models["policy"]
    cfg.models["policy"] = msgspec.structs.replace(m, options=msgspec.structs.replace(m.options, token_ids=True))
    cfg = msgspec.structs.replace(cfg, namespace="trlrows")
    tasks = rows(3)
    with SyncClient(resolve_config(cfg)) as client:
        rollouts = TRLRollouts(client, tasks, live=None)
        prompts = [d["prompt"] for d in rollouts.dataset()]
        out = rollouts([prompts[0], prompts[0], prompts[2]], None)  # TRL's order: row 0 twice, then row 2
    said = [r["responses_create_params"]["input"][-1]["content"] for r in rollouts.last_rows if r is not None]
    assert said == [tasks[i]["responses_create_params"]["input"][-1]["content"] for i in (0, 0, 2)]
    assert said[0] != said[2]
    assert out["gym_reward"] == [r["reward"] for r in rollouts.last_rows if r is not None]
    for k in range(3):
        prompt, completion = out["prompt_ids"][k], out["completion_ids"][k]
        mask, logprobs = out["env_mask"][k], out["logprobs"][k]
        assert prompt and len(completion) == len(mask) == len(logprobs)
        assert 0 in mask and mask[0] == 1 and mask[-1] == 1  # generation, the tool's output, generation
        assert all((lp == -0.5) == (m == 1) for lp, m in zip(logprobs, mask, strict=True))
