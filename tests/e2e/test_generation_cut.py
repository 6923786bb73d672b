"""A generation cut by its rollout's deadline keeps its tokens so far (issue 66, item 2): real nats-server, real
workers, the ``vllm`` adapter (``interruptible: true``) streaming from the vLLM emulator (tests/stub_openai.py, the
LLM's test double), whose answer is held mid-stream so only the deadline can end it.

The model worker stops the stream a little before the deadline (``ModelRequest.cut_at``) and answers the ids and
logprobs so far: the failure row (``timeout``, the policy's) ends with that generation, ``status: "incomplete"``,
its policy version stamped. An adapter that cannot stop keeps the completed turns only."""

from __future__ import annotations

from typing import Any

import anyio
import msgspec

from gym_runtime import Client
from gym_runtime.config import ResolvedConfig, resolve_config
from gym_runtime.model import model_config
from gym_runtime.trainers.rows import sequence
from tests.e2e.test_pause_modes import Continuing, wait_streamed
from tests.helpers import ROWS, weather_config
from tests.stub_openai import StubOpenAI

TIMEOUT_S = 4.0


def config(base_url: str, **options: Any) -> ResolvedConfig:
    """Weather, one rollout at a time, ``timeout_s`` short and no second attempt, its policy the emulator."""
    cfg = weather_config(agent_concurrency=1)
    cfg.models["policy"] = model_config(
        {"adapter": "vllm", "base_url": base_url, "model": "tiny", "return_token_ids": True, "eos_token_id": 4}
        | options
    )
    agent = cfg.agents["weather_agent"]
    cfg.agents["weather_agent"] = msgspec.structs.replace(agent, timeout_s=TIMEOUT_S, max_attempts=1)
    return resolve_config(cfg)


async def test_a_generation_cut_by_the_deadline_keeps_its_tokens_in_the_failure_row(nats_server) -> None:
    with StubOpenAI() as stub:
        em = stub.emulator
        em.policy = policy = Continuing(em)
        em.token_delay_s = 0.005
        em.hold_at = 30  # the stream waits there: only the rollout's deadline ends the generation
        try:
            async with Client(config(stub.base_url, interruptible=True), nats=nats_server.url) as client:
                await client.set_policy_version(3)
                batch = await client.submit(ROWS[:1])
                await wait_streamed(em, 30)
                with anyio.fail_after(60):
                    (row,) = await batch.gather()
            (model,) = [w for w in client.workers if hasattr(w, "gate")]
        finally:
            em.released.set()
    assert row["error_class"] == "timeout" and row["failure_attribution"] == "policy", row
    assert row["partial"] is True
    response = row["response"]
    assert response["status"] == "incomplete" and response["incomplete_details"] == {"reason": "failed", "cut": True}
    (item,) = [i for i in response["output"] if "generation_token_ids" in i]
    assert item["type"] == "message" and item["status"] == "incomplete"  # marked as cut
    ids, lps = item["generation_token_ids"], item["generation_log_probs"]
    assert ids == policy.answer[:30]  # every token streamed before the hold, in order
    assert lps == [em._logprob(t, i, 0) for i, t in enumerate(ids)]
    assert item["prompt_token_ids"] == policy.prompt
    assert item["policy_version"] == 3 and item["policy_version_ranges"] == [[0, 30, 3]]
    assert item["content"][0]["text"] == em.tokenizer.decode(ids)
    assert row["cost"]["models"]["policy"]["output_tokens"] == 30
    assert model.cut == 1 and len(stub.bodies("/v1/completions")) == 1  # one stream, stopped: never continued
    seq = sequence(row)  # what a trainer adapter trains on: the cut tokens, as the policy's (mask 1)
    assert seq.completion_ids == ids and seq.env_mask == [1] * 30 and seq.logprobs == lps


async def test_an_adapter_that_cannot_stop_keeps_the_completed_turns_only(nats_server) -> None:
    """``interruptible: false``: the call is not streamed, the deadline cancels it on the agent's side; the row
    keeps no cut generation (here none was completed: no trajectory at all)."""
    with StubOpenAI() as stub:
        stub.latency_s = 30.0  # the one call would answer long after the deadline
        async with Client(config(stub.base_url, interruptible=False), nats=nats_server.url) as client:
            batch = await client.submit(ROWS[:1])
            with anyio.fail_after(60):
                (row,) = await batch.gather()
        (model,) = [w for w in client.workers if hasattr(w, "gate")]
    assert row["error_class"] == "timeout" and row["failure_attribution"] == "policy", row
    assert "partial" not in row and model.cut == 0
