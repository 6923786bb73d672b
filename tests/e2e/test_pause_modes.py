"""``client.pause(mode=...)`` end to end: real nats-server, real workers, the ``vllm`` adapter streaming from the
vLLM emulator (tests/stub_openai.py, the LLM test double) one token every few milliseconds.

The emulated model is a function of its prompt: it continues one fixed answer from wherever the prompt's
generated part ends, each token's logprob that of the ``weights`` current when the token is sampled (a
trainer's update is ``weights += 1``). So a continued generation that is right yields exactly the answer's
token ids, with logprobs that say which weights sampled each token."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from gym_runtime import Client, ClientError
from gym_runtime.config import ResolvedConfig, resolve_config
from gym_runtime.model import model_config
from gym_runtime.transport.subjects import Subjects
from gym_runtime.workers import control
from tests.helpers import ROWS, weather, weather_config, weather_on_vllm
from tests.stub_openai import Gen, StubOpenAI, VLLMEmulator

ANSWER = "It is sunny in San Francisco today, with a light breeze from the west and no rain expected. " * 3


class Continuing:
    """The emulated policy: the first request's prompt is the task's; a later one continues the answer."""

    def __init__(self, em: VLLMEmulator) -> None:
        self.answer = [*em.tokenizer.encode_bytewise(ANSWER), em.tokenizer.EOS]
        self.prompt: list[int] | None = None

    def __call__(self, path: str, body: dict[str, Any]) -> Gen:
        sent = list(body["prompt"])
        if self.prompt is None:
            self.prompt = sent
        done = len(sent) - len(self.prompt)
        assert sent[: len(self.prompt)] == self.prompt and sent[len(self.prompt) :] == self.answer[:done]
        return Gen(token_ids=self.answer[done:])


def streaming(stub: StubOpenAI, **extra: Any) -> ResolvedConfig:
    return weather_on_vllm(stub.base_url, **{"timeout_s": 60.0, "interruptible": True, **extra})


def token_item(row: dict[str, Any]) -> dict[str, Any]:
    (item,) = [i for i in row["response"]["output"] if "generation_token_ids" in i]
    return item


async def wait_streamed(em: VLLMEmulator, tokens: int) -> None:
    assert await anyio.to_thread.run_sync(em.wait_streamed, tokens, 60.0), f"fewer than {tokens} tokens streamed"


async def test_interrupt_keeps_the_tokens_and_continues_under_the_new_policy(nats_server) -> None:
    with StubOpenAI() as stub:
        em = stub.emulator
        em.policy = policy = Continuing(em)
        em.token_delay_s = 0.01
        em.hold_at = len(policy.answer) - 1  # the stream cannot end before the pause stops it
        async with Client(streaming(stub), nats=nats_server.url) as client:
            await client.set_policy_version(1)
            em.weights = 1
            batch = await client.submit(ROWS[:1])
            await wait_streamed(em, 20)
            assert await client.pause(mode="interrupt") == 1  # returned once the stream was stopped
            em.released.set()
            cut = len(stub.bodies("/v1/completions"))
            await client.set_policy_version(2)
            em.weights = 2
            await client.resume()
            (row,) = await batch.gather()
        (model,) = [w for w in client.workers if hasattr(w, "gate")]
    first, second = stub.bodies("/v1/completions")  # the call and its continuation, nothing else
    assert cut == 1 and em.streams_cut == 1
    item = token_item(row)
    ids, lps = item["generation_token_ids"], item["generation_log_probs"]
    assert ids == policy.answer  # contiguous across the interruption: every token once, in order
    (a, n, v1), (b, end, v2) = item["policy_version_ranges"]
    assert (a, v1, b, end, v2) == (0, 1, n, len(ids), 2) and 20 <= n < len(ids)
    assert item["prompt_token_ids"] == first["prompt"] == policy.prompt
    assert second["prompt"] == first["prompt"] + ids[:n]  # the continuation: token ids, nothing re-tokenized
    assert lps[:n] == [em._logprob(t, i, 1) for i, t in enumerate(ids[:n])]  # sampled by the old weights
    assert lps[n:] == [em._logprob(t, i, 2) for i, t in enumerate(ids[n:])]  # and by the new ones
    assert item["policy_version"] == 1 and row["policy_versions"] == [1, 2]
    assert row["response"]["output"][-1]["content"][0]["text"] == ANSWER  # the agent saw one answer
    assert model.stopped == 1 and model.regenerated == 0


async def test_abort_drops_the_tokens_and_makes_the_call_again(nats_server) -> None:
    with StubOpenAI() as stub:
        em = stub.emulator
        em.policy = policy = Continuing(em)
        em.token_delay_s = 0.01
        em.hold_at = len(policy.answer) - 1  # the stream cannot end before the pause stops it
        async with Client(streaming(stub), nats=nats_server.url) as client:
            await client.set_policy_version(1)
            batch = await client.submit(ROWS[:1])
            await wait_streamed(em, 20)
            assert await client.pause(mode="abort") == 1
            em.released.set()
            await client.set_policy_version(2)
            em.weights = 2
            await client.resume()
            (row,) = await batch.gather()
        (model,) = [w for w in client.workers if hasattr(w, "gate")]
    first, second = stub.bodies("/v1/completions")
    assert second["prompt"] == first["prompt"]  # made again from the start
    item = token_item(row)
    assert item["generation_token_ids"] == policy.answer
    assert item["policy_version_ranges"] == [[0, len(policy.answer), 2]]
    assert item["generation_log_probs"] == [em._logprob(t, i, 2) for i, t in enumerate(policy.answer)]
    assert row["policy_versions"] == [2, 2]
    assert model.stopped == 1 and model.regenerated >= 20


async def test_calls_let_go_by_a_resume_start_on_the_version_written_before_it(nats_server) -> None:
    """A trainer writes the new version, then resumes. The version's announcement is read by the worker on its
    own, and at load the resume was handled first: CI's aborted call was made again tagged with the old version.
    Here the version is written without any announcement at all."""
    async with Client(weather(), nats=nats_server.url) as client:
        await client.set_policy_version(1)
        (row,) = await (await client.submit(ROWS[:1])).gather()
        assert row["policy_versions"] == [1, 1]
        assert await client.pause() == 1
        await (await control.control_kv(client.bus)).put(Subjects.version_key("policy"), b"2")  # no announcement
        await client.resume()
        (row,) = await (await client.submit(ROWS[:1])).gather()
    assert row["policy_versions"] == [2, 2]


async def test_abort_cancels_a_call_of_an_adapter_without_token_ids(nats_server) -> None:
    """The scripted test double cannot stop by itself: its call is cancelled and made again after the resume."""
    async with Client(weather(delay_s=30.0), nats=nats_server.url) as client:
        (model,) = [w for w in client.workers if hasattr(w, "gate")]
        batch = await client.submit(ROWS[:1])
        with anyio.fail_after(60):
            while model.gate.active == 0:  # the call is in flight (it would take 30 s)
                await anyio.sleep(0.01)
        with anyio.fail_after(10):  # far less than the call: it was cancelled, not waited for
            assert await client.pause(mode="abort") == 1
        assert model.stopped == 1 and model.gate.active == 0
        model.adapter._delay = 0.0  # type: ignore[attr-defined]  # the call made again answers at once
        await client.resume()
        (row,) = await batch.gather()
    assert row["reward"] == 1.0


async def test_interrupt_without_token_ids_is_refused_before_anything_is_paused(nats_server) -> None:
    with StubOpenAI() as stub:
        openai = weather_config()
        openai.models["policy"] = model_config({"adapter": "openai", "base_url": stub.base_url, "model": "tiny"})
        for cfg, why in (
            (resolve_config(openai), "adapter 'openai' has no token ids"),
            (streaming(stub, interruptible=False), "set interruptible: true"),
            (weather(), "adapter 'scripted' has no token ids"),
        ):
            async with Client(cfg, nats=nats_server.url, workers=False) as client:
                with pytest.raises(ClientError, match=f"^models.policy: cannot pause with mode='interrupt': {why}"):
                    await client.pause(mode="interrupt")
                with pytest.raises(ClientError, match="pause mode must be one of drain, interrupt, abort"):
                    await client.pause(mode="stop")
                kv = await control.control_kv(client.bus)
                assert await kv.get(Subjects.paused_key("policy")) is None  # nothing was published
