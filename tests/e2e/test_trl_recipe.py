"""The TRL recipe in docs/trainer.md: a ``rollout_func`` over the client API, the ``vllm`` adapter and the vLLM
emulator (tests/stub_openai.py, the LLM test double). TRL's NeMo Gym integration rebuilds one
sequence per rollout from the output items that carry token ids and asserts each turn's prompt
starts with everything before it; that must hold across multi-turn tool rollouts."""

from __future__ import annotations

from typing import Any

from gym_runtime import SyncClient
from tests.helpers import ROWS, weather_on_vllm
from tests.stub_openai import StubOpenAI, VLLMEmulator


def trl_sequences(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """TRL-style extraction: prompt ids of the first turn; completion = generations + tool tokens (masked)."""
    out: dict[str, list[Any]] = {
        "prompt_ids": [],
        "completion_ids": [],
        "env_mask": [],
        "logprobs": [],
        "rewards": [],
        "versions": [],
    }
    for row in rows:
        prompt: list[int] | None = None
        completion: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        for item in row["response"]["output"]:
            if "generation_token_ids" not in item:
                continue
            ids = item["prompt_token_ids"]
            if prompt is None:
                prompt = ids
            else:
                seen = prompt + completion
                assert ids[: len(seen)] == seen, "token ids are not contiguous across turns"
                env = ids[len(seen) :]  # tool results and the template between turns
                completion += env
                mask += [0] * len(env)
                logprobs += [0.0] * len(env)
            completion += item["generation_token_ids"]
            mask += [1] * len(item["generation_token_ids"])
            logprobs += item["generation_log_probs"]
            out["versions"].append(item["policy_version"])
        out["prompt_ids"].append(prompt)
        out["completion_ids"].append(completion)
        out["env_mask"].append(mask)
        out["logprobs"].append(logprobs)
        out["rewards"].append(row["reward"])
    return out


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
