"""The TRL adapter's sequences (docs/trainer.md) from the ``vllm`` adapter and the vLLM emulator
(tests/stub_openai.py, the LLM test double): one sequence per rollout from the output items that carry token
ids, each turn's prompt starting with everything before it, across multi-turn tool rollouts (the TRL runs
themselves are tests/trainers, in the trainer tier)."""

from __future__ import annotations

from typing import Any

from gym_runtime import SyncClient
from gym_runtime.trainers.rows import sequence
from tests.helpers import ROWS, weather_on_vllm
from tests.stub_openai import StubOpenAI, VLLMEmulator


def trl_sequences(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """What the TRL adapter hands TRL per rollout (``gym_runtime.trainers.rows.sequence``), column by column."""
    seqs = [sequence(row) for row in rows]
    return {
        "prompt_ids": [s.prompt_ids for s in seqs],
        "completion_ids": [s.completion_ids for s in seqs],
        "env_mask": [s.env_mask for s in seqs],
        "logprobs": [s.logprobs for s in seqs],
        "rewards": [row["reward"] for row in rows],
        "versions": [v for s in seqs for v in s.policy_versions],
    }


def test_trl_rollout_func_multi_turn_token_contiguity() -> None:
    with StubOpenAI() as stub:
        em = stub.emulator
        rollouts = 4
        for _ in range(rollouts):  # each rollout: two tool calls, then the answer (three model turns)
            em.script(
                VLLMEmulator.tool_call_text("get_weather", {"city": "sf"}),
                VLLMEmulator.tool_call_text("get_weather", {"city": "nyc"}),
                "cold in sf",
            )
        cfg = weather_on_vllm(stub.base_url, timeout_s=10.0)  # one rollout at a time: the script in order
        with SyncClient(cfg, nats="embedded") as client:
            client.set_policy_version(5)
            rows = client.submit(ROWS[:2], repeats=2).gather()
    seq = trl_sequences(rows)
    assert len(seq["prompt_ids"]) == rollouts
    for prompt, completion, mask, lps in zip(
        seq["prompt_ids"], seq["completion_ids"], seq["env_mask"], seq["logprobs"], strict=True
    ):
        assert prompt and len(completion) == len(mask) == len(lps)
        assert 0 in mask and mask.count(1) > 0  # tool tokens masked out, generations in
    assert seq["versions"] == [5] * (3 * rollouts)  # every token-id item names the weights that made it
    assert all(r["policy_versions"] == [5, 5] for r in rows)
    paths = [p.split("?")[0] for p in stub.paths()]
    assert paths.count("/v1/completions") == 2 * rollouts  # turns 2 and 3 sent token-in
