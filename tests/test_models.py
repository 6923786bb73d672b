"""Model adapters: scripted (test double), replay (NeMo Gym recordings), openai (via a stub)."""

from __future__ import annotations

import copy
import json
import logging
import socket
import time
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from gym_runtime.errors import ModelError
from gym_runtime.messages import (
    CreateParams,
    FunctionCall,
    FunctionCallOutput,
    Message,
    Reasoning,
    Usage,
    message_text,
    parse_items,
)
from gym_runtime.model import load_adapter, model_config
from gym_runtime.models.openai import (
    OpenAIModel,
    build_chat_body,
    chat_completion_to_response,
    chat_message_to_items,
    responses_to_chat_messages,
    split_think,
)
from gym_runtime.models.openai import Options as OpenAIOptions
from gym_runtime.models.replay import Options as ReplayOptions
from gym_runtime.models.replay import ReplayModel
from gym_runtime.models.scripted import Options as ScriptedOptions
from gym_runtime.models.scripted import ScriptedModel, example_arguments, example_value
from tests.stub_openai import StubOpenAI, StubReply, chat_completion, error_body, responses_reply

COMPAT = Path(__file__).resolve().parent / "compat"
NEMO = COMPAT / "nemo_gym"

KEY = "sk-test-SECRET-0123456789abcdef"


def rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def params_of(row: dict[str, Any]) -> CreateParams:
    p = row["responses_create_params"]
    return CreateParams(input=parse_items(copy.deepcopy(p["input"])), tools=p.get("tools") or None)


# ----------------------------------------------------------- a tiny schema checker


def schema_errors(schema: Any, value: Any, root: Any = None, path: str = "$") -> list[str]:
    """The JSON-schema subset tool definitions use: enough to prove arguments valid."""
    root = schema if root is None else root
    if not isinstance(schema, dict):
        return []
    if "$ref" in schema:
        node = root
        for part in schema["$ref"][2:].split("/"):
            node = node[part]
        return schema_errors(node, value, root, path)
    errs: list[str] = []
    if "enum" in schema and value not in schema["enum"]:
        errs.append(f"{path}: {value!r} not in enum")
    if "const" in schema and value != schema["const"]:
        errs.append(f"{path}: {value!r} != const")
    for key in ("anyOf", "oneOf"):
        if key in schema and all(schema_errors(s, value, root, path) for s in schema[key]):
            errs.append(f"{path}: matches no {key} branch")
    kinds = schema.get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds] if kinds else []
    checks = {
        "string": lambda v: isinstance(v, str),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "array": lambda v: isinstance(v, list),
        "object": lambda v: isinstance(v, dict),
        "null": lambda v: v is None,
    }
    if kinds and not any(checks[k](value) for k in kinds):
        return errs + [f"{path}: {value!r} is not {kinds}"]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errs.append(f"{path}: below minimum")
        if "maximum" in schema and value > schema["maximum"]:
            errs.append(f"{path}: above maximum")
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            errs.append(f"{path}: too short")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            errs.append(f"{path}: too few items")
        for i, v in enumerate(value):
            errs += schema_errors(schema.get("items", {}), v, root, f"{path}[{i}]")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for req in schema.get("required", []):
            if req not in value:
                errs.append(f"{path}: missing required {req!r}")
        for k, v in value.items():
            if k in props:
                errs += schema_errors(props[k], v, root, f"{path}.{k}")
            elif schema.get("additionalProperties") is False:
                errs.append(f"{path}: unexpected property {k!r}")
    return errs


# ====================================================================== scripted

TOOL_DATASETS = [
    "example_multi_step",
    "example_session_state_mgmt",
    "example_single_tool_call",
    "math_advanced_calculations",
    "structured_outputs",
    "workplace_assistant",
]


@pytest.mark.parametrize("dataset", TOOL_DATASETS)
async def test_scripted_calls_every_tool_with_valid_arguments_then_answers(dataset: str) -> None:
    model = ScriptedModel(ScriptedOptions())
    path = NEMO / dataset / "example.jsonl"
    for row in rows(path):
        params = params_of(row)
        tools = [t for t in params.tools or [] if t.get("type", "function") == "function"]
        if not tools:
            continue
        first = await model.generate(params)
        calls = [i for i in first.output if isinstance(i, FunctionCall)]
        assert [c.name for c in calls] == list(dict.fromkeys(t["name"] for t in tools))
        by_name = {t["name"]: t for t in tools}
        for call in calls:
            args = json.loads(call.arguments)
            assert schema_errors(by_name[call.name]["parameters"], args) == [], (call.name, args)
        assert len({c.call_id for c in calls}) == len(calls)
        assert first.usage is not None and first.usage.output_tokens > 0

        # Same conversation → same calls (deterministic).
        again = await model.generate(params_of(row))
        assert msgspec.to_builtins(again.output) == msgspec.to_builtins(first.output)

        outputs = [FunctionCallOutput(call_id=c.call_id, output=f'{{"result": "{c.name}-out"}}') for c in calls]
        params.input = [*params.input, *first.output, *outputs]
        second = await model.generate(params)
        assert len(second.output) == 1 and isinstance(second.output[0], Message)
        text = message_text(second.output[0])
        assert all(f"{c.name}-out" in text for c in calls)
        assert second.usage is not None and second.usage.input_tokens > first.usage.input_tokens


async def test_scripted_without_tools_says_ok_and_honours_tool_choice() -> None:
    model = ScriptedModel(ScriptedOptions(model="policy"))
    r = await model.generate(CreateParams(input=parse_items("hi there")))
    assert message_text(r.output[0]) == "OK" and r.model == "policy"
    assert r.id != (await model.generate(CreateParams(input=parse_items("hi")))).id

    tools = [
        {"type": "function", "name": "a", "parameters": {"type": "object", "properties": {}}},
        {"type": "function", "name": "b", "parameters": {"type": "object", "properties": {}}},
        {"type": "web_search"},
    ]
    r = await model.generate(CreateParams(input=parse_items("x"), tools=tools, tool_choice="none"))
    assert isinstance(r.output[0], Message)

    # parallel_tool_calls=False: one call per response, in tool order.
    conv = parse_items("x")
    names = []
    for _ in range(3):
        r = await model.generate(CreateParams(input=conv, tools=tools, parallel_tool_calls=False))
        assert len(r.output) == 1
        conv = [*conv, *r.output]
        if isinstance(r.output[0], FunctionCall):
            names.append(r.output[0].name)
            conv.append(FunctionCallOutput(call_id=r.output[0].call_id, output="done"))
    assert names == ["a", "b"] and message_text(r.output[0]) == "done"

    # Forced function: only that tool.
    r = await model.generate(
        CreateParams(input=parse_items("x"), tools=tools, tool_choice={"type": "function", "name": "b"})
    )
    assert [i.name for i in r.output] == ["b"]  # type: ignore[union-attr]


async def test_scripted_answers_by_prompt_replace_ok_after_the_tools() -> None:
    """``answers``: the text a test double needs (a judge's JSON, a game's move tag), chosen by the prompt."""
    opts = msgspec.convert(
        {
            "answers": {
                "Answer Check": '{"verdict": "a"}',
                "Quality Check": '{"verdict": "q"}',
                "": "<action>Down</action>",
            }
        },
        ScriptedOptions,
    )
    model = ScriptedModel(opts)

    async def answer(*messages: str, tools: list[dict[str, Any]] | None = None) -> str:
        items = [Message(role="user", content=m) for m in messages]
        r = await model.generate(CreateParams(input=items, tools=tools))
        return message_text(r.output[-1]) if isinstance(r.output[-1], Message) else "tool call"

    assert await answer("You are performing the Answer Check ...") == '{"verdict": "a"}'
    assert await answer("You are performing the Explanation Quality Check ...") == '{"verdict": "q"}'
    # the last message decides, the first key found in it (in the order given) wins, "" matches any prompt
    assert await answer("the Answer Check", "Tetris board: X___") == "<action>Down</action>"
    assert await answer("the Quality Check and the Answer Check") == '{"verdict": "a"}'
    # the tools offered are still called first; the answer replaces what would quote their outputs
    tool = {"type": "function", "name": "look", "parameters": {"type": "object", "properties": {}}}
    assert await answer("Tetris board", tools=[tool]) == "tool call"
    called = await model.generate(CreateParams(input=parse_items("Tetris board"), tools=[tool]))
    done = [*parse_items("Tetris board"), *called.output, FunctionCallOutput(call_id="call_1_0", output="seen")]
    r = await model.generate(CreateParams(input=done, tools=[tool]))
    assert message_text(r.output[0]) == "<action>Down</action>"

    # no key matches: the default answer ("OK", or the quoted tool outputs)
    only = ScriptedModel(ScriptedOptions(answers={"Answer Check": "{}"}))
    r = await only.generate(CreateParams(input=parse_items("hi")))
    assert message_text(r.output[0]) == "OK"
    with pytest.raises(msgspec.ValidationError, match=r"answers"):
        msgspec.convert({"answers": {"Answer Check": 1}}, ScriptedOptions)
    # a models.NAME entry takes it as a flat key, like every adapter option
    configured = load_adapter(model_config({"adapter": "scripted", "answers": {"": "<action>Left</action>"}}))
    r = await configured.generate(CreateParams(input=parse_items("Tetris board")))
    assert message_text(r.output[0]) == "<action>Left</action>"


def test_example_values_cover_common_schema_shapes() -> None:
    schema = {
        "type": "object",
        "$defs": {"Unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "properties": {
            "unit": {"$ref": "#/$defs/Unit"},
            "maybe": {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": 5}]},
            "when": {"type": "string", "format": "date"},
            "ratio": {"type": "number", "minimum": 0.5, "maximum": 0.9},
            "small": {"type": "integer", "maximum": -3},
            "code": {"type": "string", "minLength": 12},
            "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2},
            "nested": {
                "type": "object",
                "properties": {"x": {"type": ["null", "boolean"]}, "y": {"type": "string"}},
                "required": ["x"],
            },
            "optional": {"type": "string"},
        },
        "required": ["unit", "maybe", "when", "ratio", "small", "code", "tags", "nested"],
    }
    value = example_value(schema)
    assert schema_errors(schema, value) == []
    assert value["unit"] == "celsius" and value["maybe"] == 5 and value["small"] == -3
    assert value["nested"] == {"x": True} and "optional" not in value
    assert len(value["tags"]) == 2 and value["when"] == "2024-01-01"
    assert json.loads(example_arguments({"type": "object", "properties": {}})) == {}
    assert json.loads(example_arguments(None)) == {}


async def test_scripted_delay_is_simulated_latency() -> None:
    model = ScriptedModel(ScriptedOptions(delay_s=0.3))
    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(10):
            tg.start_soon(model.generate, CreateParams(input=parse_items("x")))
    elapsed = time.perf_counter() - t0
    # concurrent calls overlap: one after another, ten sleeps of 0.3 s take at least 3 s whatever the load, so
    # under 3 s is the overlap itself; overlapped they take ~0.3 s (a stall of 2.7 s would be needed to flake)
    assert 0.3 <= elapsed < 10 * 0.3


# ======================================================================== replay

REPLAY_DATASETS = ["example_single_tool_call", "example_session_state_mgmt", "example_multi_step"]


async def replay_rollout(
    model: Any, row: dict[str, Any], *, change_tool_outputs: bool = False
) -> tuple[list[Any], int, Usage]:
    """Drive ``model`` like an agent: prompt, model call, recorded tool outputs, repeat."""
    params = params_of(row)
    recorded = parse_items(copy.deepcopy(row["response"]["output"]))
    conv = list(params.input)
    produced: list[Any] = []
    j = calls = 0
    usage = Usage()
    while True:
        resp = await model.generate(CreateParams(input=list(conv), tools=params.tools))
        calls += 1
        assert resp.output, "a model call must produce items"
        produced += resp.output
        conv += resp.output
        j += len(resp.output)
        usage.add(resp.usage)
        while j < len(recorded) and isinstance(recorded[j], FunctionCallOutput):
            out = recorded[j]
            if change_tool_outputs:  # a live resource may answer differently
                out = FunctionCallOutput(call_id=out.call_id, output=out.output + " (live)")
            conv.append(out)
            j += 1
        if not any(isinstance(i, FunctionCall) for i in resp.output):
            break
        assert calls < 50
    return produced, calls, usage


@pytest.mark.parametrize("dataset", REPLAY_DATASETS)
async def test_replay_reproduces_recorded_rollouts_call_by_call(dataset: str) -> None:
    path = NEMO / dataset / "example_rollouts.jsonl"
    model = ReplayModel(ReplayOptions(rollouts=str(path)))
    for row in rows(path):
        recorded = parse_items(copy.deepcopy(row["response"]["output"]))
        expected = [msgspec.to_builtins(i) for i in recorded if not isinstance(i, FunctionCallOutput)]
        produced, calls, usage = await replay_rollout(model, row, change_tool_outputs=True)
        assert [msgspec.to_builtins(i) for i in produced] == expected
        # one model call per run of tool outputs, plus the final answer
        runs = sum(
            1
            for k, i in enumerate(recorded)
            if isinstance(i, FunctionCallOutput) and not isinstance(recorded[k - 1], FunctionCallOutput)
        )
        assert calls == runs + 1
        rec_usage = row["response"]["usage"]
        assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (
            rec_usage["input_tokens"],
            rec_usage["output_tokens"],
            rec_usage["total_tokens"],
        )


async def test_replay_is_stateless_under_concurrency_and_repeats() -> None:
    path = NEMO / "example_multi_step" / "example_rollouts.jsonl"
    model = ReplayModel(ReplayOptions(rollouts=path.name), base_dir=str(path.parent))
    data = rows(path)
    results: dict[tuple[int, int], list[Any]] = {}

    async def one(i: int, rep: int) -> None:
        produced, _, _ = await replay_rollout(model, data[i])
        results[(i, rep)] = [msgspec.to_builtins(x) for x in produced]

    async with anyio.create_task_group() as tg:
        for rep in range(3):
            for i in range(len(data)):
                tg.start_soon(one, i, rep)
    for (i, _), produced in results.items():
        recorded = parse_items(copy.deepcopy(data[i]["response"]["output"]))
        assert produced == [msgspec.to_builtins(x) for x in recorded if not isinstance(x, FunctionCallOutput)]


async def test_replay_tells_prompts_apart_by_their_images(tmp_path: Path) -> None:
    """circle_count's rows ask the same question over different images: each image gets its own recording
    (matching by text alone answered row 3 with row 1's count)."""

    def row(image: str, answer: str) -> dict[str, Any]:
        content = [{"type": "input_text", "text": "How many circles?"}, {"type": "input_image", "image_url": image}]
        return {
            "responses_create_params": {"input": [{"role": "user", "content": content}]},
            "response": {"output": [{"type": "message", "role": "assistant", "content": answer}]},
        }

    recorded = [row("data:image/png;base64,AAAA", "\\boxed{3}"), row("data:image/png;base64,BBBB", "\\boxed{1}")]
    path = tmp_path / "rollouts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recorded))
    model = ReplayModel(ReplayOptions(rollouts=str(path)))
    for r in recorded:
        produced, _, _ = await replay_rollout(model, r)
        assert [msgspec.to_builtins(i)["content"] for i in produced] == [r["response"]["output"][0]["content"]]


async def test_replay_errors_are_clear(tmp_path: Path) -> None:
    path = NEMO / "example_session_state_mgmt" / "example_rollouts.jsonl"
    model = load_adapter(model_config(dict(adapter="replay", rollouts=str(path))))
    assert isinstance(model, ReplayModel)
    row = rows(path)[0]

    with pytest.raises(ModelError, match="no recorded rollout"):
        await model.generate(CreateParams(input=parse_items("something never recorded")))

    # Diverged: the model "called" a tool with other arguments than recorded.
    params = params_of(row)
    first = await model.generate(params)
    call = first.output[0]
    assert isinstance(call, FunctionCall)
    bad = FunctionCall(name=call.name, call_id=call.call_id, arguments='{"count": 999}')
    with pytest.raises(ModelError, match="diverged"):
        await model.generate(
            CreateParams(
                input=[*params.input, bad, *first.output[1:], FunctionCallOutput(call_id=call.call_id, output="1")]
            )
        )
    # A model call where the recording expects the tool outputs first.
    with pytest.raises(ModelError, match="expects a tool output"):
        await model.generate(CreateParams(input=[*params.input, *first.output]))
    # Past the end of the recording.
    produced, _, _ = await replay_rollout(model, row)
    conv = [*params.input]
    recorded = parse_items(copy.deepcopy(row["response"]["output"]))
    with pytest.raises(ModelError, match="ended"):
        await model.generate(CreateParams(input=[*conv, *recorded]))

    bad_file = tmp_path / "rollouts.jsonl"
    bad_file.write_text(path.read_text().splitlines()[0] + "\n{not json\n")
    with pytest.raises(ModelError, match=rf"{bad_file}:2"):
        ReplayModel(ReplayOptions(rollouts=str(bad_file)))
    bad_file.write_text('{"response": {"output": []}}\n')
    with pytest.raises(ModelError, match=rf"{bad_file}:1.*responses_create_params"):
        ReplayModel(ReplayOptions(rollouts=str(bad_file)))
    with pytest.raises(ModelError, match="cannot open"):
        ReplayModel(ReplayOptions(rollouts="missing.jsonl"), base_dir=str(tmp_path))


# ================================================== openai: conversion (pure)


def test_chat_messages_from_responses_items() -> None:
    items = parse_items(
        [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "input_text", "text": "weather in sf and nyc?"}]},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "two cities"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "sf"}'},
            {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "nyc"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "c2", "output": "rain"},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "done"}]},
            {"type": "message", "role": "assistant", "content": "SF sunny, NYC rain."},
            {"role": "user", "content": "thanks"},
        ]
    )
    assert responses_to_chat_messages(items, instructions="sys prompt") == [
        {"role": "system", "content": "sys prompt"},
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "weather in sf and nyc?"}]},
        {
            "role": "assistant",
            "content": "<think>two cities</think>Checking.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "sf"}'}},
                {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "nyc"}'}},
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "tool", "content": "rain", "tool_call_id": "c2"},
        {"role": "assistant", "content": "<think>done</think>SF sunny, NYC rain."},
        {"role": "user", "content": "thanks"},
    ]
    # Tool calls without text: content is None.
    only_call = parse_items([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}])
    assert responses_to_chat_messages(only_call)[0]["content"] is None
    with pytest.raises(ModelError, match="role"):
        responses_to_chat_messages([Message(role="robot", content="hi")])


def test_chat_body_tools_and_params() -> None:
    tool = {
        "type": "function",
        "name": "get_weather",
        "description": "",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        "strict": True,
    }
    params = CreateParams(
        input=parse_items("hi"),
        tools=[tool],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=64,
        temperature=0.5,
        extra={
            "user": "",
            "store": True,
            "metadata": None,
            "seed": 7,
            "stream": True,
            "reasoning": {"effort": "low"},
            "text": {"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}}},
        },
    )
    body = build_chat_body(params, model="tiny", extra_body={"top_k": 5})
    assert body == {
        "messages": [{"role": "user", "content": "hi"}],
        "model": "tiny",
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "",
                    "parameters": tool["parameters"],
                    "strict": True,
                },
            }
        ],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "temperature": 0.5,
        "max_tokens": 64,
        "reasoning_effort": "low",
        "response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": {"type": "object"}}},
        "seed": 7,
        "top_k": 5,
    }
    # No tools: no tools key, and tool_choice/parallel_tool_calls are dropped (vLLM 400s otherwise).
    body = build_chat_body(
        CreateParams(input=parse_items("hi"), tools=[], tool_choice="auto", parallel_tool_calls=True), model=None
    )
    assert body == {"messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(ModelError, match="needs at least one tool"):
        build_chat_body(CreateParams(input=parse_items("hi"), tool_choice="required"), model=None)


def test_chat_completion_to_responses_items() -> None:
    assert split_think("a<think>x</think>b<think>y</think>c") == (["x", "y"], "abc")
    assert split_think("plain") == ([], "plain")

    items = chat_message_to_items(
        {
            "role": "assistant",
            "content": "<think>need weather</think>Let me check.",
            "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"sf"}'}}
            ],
        }
    )
    assert [type(i) for i in items] == [Reasoning, Message, FunctionCall]
    assert items[0].summary == [{"text": "need weather", "type": "summary_text"}]  # type: ignore[union-attr]
    assert message_text(items[1]) == "Let me check."  # type: ignore[arg-type]
    assert (items[2].call_id, items[2].name, items[2].arguments) == ("t1", "get_weather", '{"city":"sf"}')  # type: ignore[union-attr]

    # vLLM's reasoning parser puts reasoning in a field; tool-call-only messages have no text item.
    items = chat_message_to_items(
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "hmm",
            "tool_calls": [{"id": "t2", "function": {"name": "f", "arguments": '{"a": 1}'}}],
        }
    )
    assert [type(i) for i in items] == [Reasoning, FunctionCall]
    assert items[1].arguments == '{"a": 1}'  # type: ignore[union-attr]
    # Nothing at all: an empty assistant message (so the trajectory still ends in a message).
    items = chat_message_to_items({"role": "assistant", "content": None})
    assert len(items) == 1 and message_text(items[0]) == ""  # type: ignore[arg-type]

    data = (
        json.loads((COMPAT / "vllm" / "chat_plain.json").read_text())["response"]["body"]
        if (COMPAT / "vllm" / "chat_plain.json").exists()
        else chat_completion("x", finish_reason="length", prompt_tokens=107, completion_tokens=4)
    )
    resp = chat_completion_to_response(data, CreateParams(input=parse_items("hi")))
    assert resp.status == "incomplete" and resp.incomplete_details == {"reason": "max_output_tokens"}
    assert resp.usage is not None
    assert (resp.usage.input_tokens, resp.usage.output_tokens, resp.usage.total_tokens) == (107, 4, 111)


def _without_ids(item: Any) -> dict[str, Any]:
    d = msgspec.to_builtins(item)
    for k in ("id", "status", "prompt_token_ids", "generation_token_ids", "generation_log_probs"):
        d.pop(k, None)
    return d


@pytest.mark.parametrize(
    ("case", "token_ids"),
    [("expected_output", False), ("expected_output_return_token_id_information", True)],
)
def test_nemo_gym_round_trip_cases(case: str, token_ids: bool) -> None:
    """NeMo Gym's vllm_model round-trip data: Responses items ↔ chat messages.

    The expected chat *messages* must match exactly. The other keys of NeMo Gym's
    expected body are its pydantic model's defaults (``parallel_tool_calls: true``,
    ``"n": null``, ...), not conversion results, so they are not compared.
    """
    data = json.loads((NEMO / "vllm_model" / "round_trip_test_data.json").read_text())
    items = parse_items(
        [{"content": "system", "role": "system"}, {"content": "hello!", "role": "user"}, *data["input"]["output"]]
    )
    messages = responses_to_chat_messages(items, token_ids=token_ids)
    assert messages == data[case]["messages"]

    # And back: each expected assistant message converts to the original output items.
    original = [i for i in items[2:] if not isinstance(i, FunctionCallOutput)]
    back = [item for m in data[case]["messages"] if m["role"] == "assistant" for item in chat_message_to_items(m)]
    assert [_without_ids(i) for i in back] == [_without_ids(i) for i in original]


# ======================================================= openai: through a stub


@pytest.fixture
def stub() -> Any:
    with StubOpenAI() as s:
        yield s


def openai_cfg(stub: StubOpenAI, **kw: Any) -> OpenAIOptions:
    base: dict[str, Any] = dict(
        api="chat",
        base_url=stub.base_url,
        api_key=KEY,
        model="tiny",
        max_retries=2,
        retry_backoff_s=0.001,
        timeout_s=5.0,
    )
    base.update(kw)
    return OpenAIOptions(**base)


WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


async def test_openai_chat_round_trip_through_stub(stub: StubOpenAI) -> None:
    model = OpenAIModel(openai_cfg(stub, extra_body={"chat_template_kwargs": {"enable_thinking": True}}))
    stub.enqueue(
        chat_completion(
            "<think>user wants sf</think>",
            tool_calls=[{"id": "chatcmpl-tool-1", "name": "get_weather", "arguments": '{"city": "sf"}'}],
            prompt_tokens=527,
            completion_tokens=70,
        ),
        chat_completion("It is sunny.", reasoning="tool said sunny", reasoning_field="reasoning_content"),
    )
    conv = parse_items([{"role": "developer", "content": "be helpful"}, {"role": "user", "content": "sf?"}])
    r1 = await model.generate(CreateParams(input=conv, tools=[WEATHER_TOOL], max_output_tokens=256))
    assert [type(i) for i in r1.output] == [Reasoning, FunctionCall]
    assert r1.usage is not None and r1.usage.total_tokens == 597 and r1.status == "completed"
    conv = [*conv, *r1.output, FunctionCallOutput(call_id="chatcmpl-tool-1", output='{"weather": "sunny"}')]
    r2 = await model.generate(CreateParams(input=conv, tools=[WEATHER_TOOL]))
    assert [type(i) for i in r2.output] == [Reasoning, Message]
    assert message_text(r2.output[1]) == "It is sunny."  # type: ignore[arg-type]

    first, second = stub.requests
    assert first.path == "/v1/chat/completions"
    assert first.headers["authorization"] == f"Bearer {KEY}"
    assert first.body["model"] == "tiny" and first.body["max_tokens"] == 256
    assert first.body["chat_template_kwargs"] == {"enable_thinking": True}
    assert first.body["tools"][0]["function"]["name"] == "get_weather"
    assert second.body["messages"][2:] == [
        {
            "role": "assistant",
            "content": "<think>user wants sf</think>",
            "tool_calls": [
                {
                    "id": "chatcmpl-tool-1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "sf"}'},
                }
            ],
        },
        {"role": "tool", "content": '{"weather": "sunny"}', "tool_call_id": "chatcmpl-tool-1"},
    ]
    await model.aclose()


async def test_openai_responses_api_through_stub(stub: StubOpenAI) -> None:
    model = OpenAIModel(openai_cfg(stub, api="responses", model="gpt-x"))
    stub.enqueue(
        responses_reply(
            [
                {
                    "id": "rs_1",
                    "type": "reasoning",
                    "summary": [{"type": "summary_text", "text": "think"}],
                    "encrypted_content": None,
                    "status": None,
                },
                {
                    "id": "fc_1",
                    "type": "function_call",
                    "call_id": "call_1",
                    "name": "get_weather",
                    "arguments": '{"city":"sf"}',
                    "status": "completed",
                },
            ],
            input_tokens=60,
            output_tokens=30,
        )
    )
    conv = parse_items([{"role": "user", "content": "sf?"}])
    r = await model.generate(
        CreateParams(input=conv, tools=[WEATHER_TOOL], temperature=1.0, extra={"store": False, "stream": True})
    )
    assert [type(i) for i in r.output] == [Reasoning, FunctionCall]
    assert r.output[1].call_id == "call_1"  # type: ignore[union-attr]
    assert r.usage is not None and r.usage.total_tokens == 90
    req = stub.requests[0]
    assert req.path == "/v1/responses"
    assert req.body["model"] == "gpt-x" and req.body["tools"] == [WEATHER_TOOL]
    assert req.body["input"] == [{"type": "message", "role": "user", "content": "sf?"}]
    assert req.body["store"] is False and "stream" not in req.body

    stub.enqueue(responses_reply([{"type": "web_search_call", "id": "ws_1", "status": "completed"}]))
    with pytest.raises(ModelError, match="web_search_call") as exc:
        await model.generate(CreateParams(input=conv))
    assert exc.value.retryable is False

    stub.enqueue(responses_reply(status="incomplete", incomplete_details={"reason": "max_output_tokens"}))
    r = await model.generate(CreateParams(input=conv))
    assert r.status == "incomplete" and r.incomplete_details == {"reason": "max_output_tokens"}
    await model.aclose()


async def test_openai_retries_are_bounded(stub: StubOpenAI) -> None:
    model = OpenAIModel(openai_cfg(stub, max_retries=3))
    stub.handler = lambda req: StubReply(status=503, body=error_body(503, "overloaded"))
    with pytest.raises(ModelError, match="503") as exc:
        await model.generate(CreateParams(input=parse_items("hi")))
    assert exc.value.retryable is True
    assert len(stub.requests) == 4  # max_retries + 1 attempts, no more
    await model.aclose()


async def test_openai_429_then_success(stub: StubOpenAI) -> None:
    model = OpenAIModel(openai_cfg(stub))
    stub.enqueue(
        StubReply(status=429, body=error_body(429, "slow down"), headers={"Retry-After": "0.1"}),
        chat_completion("finally"),
    )
    t0 = time.perf_counter()
    r = await model.generate(CreateParams(input=parse_items("hi")))
    assert message_text(r.output[0]) == "finally"  # type: ignore[arg-type]
    assert len(stub.requests) == 2
    assert time.perf_counter() - t0 >= 0.1  # Retry-After honoured
    await model.aclose()


async def test_openai_400_is_not_retried(stub: StubOpenAI) -> None:
    model = OpenAIModel(openai_cfg(stub))
    stub.enqueue(StubReply(status=400, body=error_body(400, "bad tool schema")))
    with pytest.raises(ModelError, match="bad tool schema") as exc:
        await model.generate(CreateParams(input=parse_items("hi")))
    assert exc.value.retryable is False and len(stub.requests) == 1
    await model.aclose()


async def test_openai_context_overflow_is_an_incomplete_response(stub: StubOpenAI) -> None:
    model = OpenAIModel(openai_cfg(stub))
    msg = "This model's maximum context length is 1024 tokens. However, your prompt contains at least 1025"
    stub.enqueue(StubReply(status=400, body=error_body(400, msg)))
    r = await model.generate(CreateParams(input=parse_items("long " * 2000)))
    assert r.status == "incomplete" and r.incomplete_details == {"reason": "max_output_tokens"}
    assert len(r.output) == 1 and message_text(r.output[0]) == ""  # type: ignore[arg-type]
    # An explicit max_output_tokens=0 is a caller error, not an overflow.
    stub.enqueue(StubReply(status=400, body=error_body(400, "max_tokens must be at least 1, got 0.")))
    with pytest.raises(ModelError):
        await model.generate(CreateParams(input=parse_items("hi"), max_output_tokens=0))
    await model.aclose()


async def test_openai_timeout_and_unreachable(stub: StubOpenAI) -> None:
    model = OpenAIModel(openai_cfg(stub, timeout_s=0.2, max_retries=1))
    stub.handler = lambda req: StubReply(delay_s=60.0)  # the stub stops waiting when it stops
    t0 = time.perf_counter()
    with pytest.raises(ModelError, match="timed out") as exc:
        await model.generate(CreateParams(input=parse_items("hi")))
    assert exc.value.retryable is True and len(stub.requests) == 2
    # waiting for an answer would take 60 s; the two 0.2 s timeouts end it long before half of that
    assert time.perf_counter() - t0 < 30
    await model.aclose()

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = OpenAIModel(openai_cfg(stub, base_url=f"http://127.0.0.1:{port}/v1", max_retries=1))
    with pytest.raises(ModelError, match="cannot reach") as exc:
        await dead.generate(CreateParams(input=parse_items("hi")))
    assert exc.value.retryable is True
    await dead.aclose()


async def test_api_key_never_logged(
    stub: StubOpenAI, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    caplog.set_level(logging.DEBUG)
    for name in ("openai", "httpx", "httpx2", "httpcore"):
        logging.getLogger(name).setLevel(logging.DEBUG)
    cfg = openai_cfg(stub, max_retries=1)
    model = OpenAIModel(cfg)
    stub.enqueue(chat_completion("ok"), StubReply(status=503), StubReply(status=503))
    await model.generate(CreateParams(input=parse_items("hi")))
    with pytest.raises(ModelError) as exc_503:
        await model.generate(CreateParams(input=parse_items("hi")))
    # A provider that echoes the key back in its error message.
    stub.enqueue(StubReply(status=401, body=error_body(401, f"Incorrect API key provided: {KEY}")))
    with pytest.raises(ModelError) as exc_401:
        await model.generate(CreateParams(input=parse_items("hi")))
    logging.getLogger("test").error("config: %r adapter: %r", cfg, model)
    out, err = capfd.readouterr()
    assert stub.requests[0].headers["authorization"] == f"Bearer {KEY}"  # it was used...
    assert KEY not in caplog.text  # ...and never logged
    assert "model.retry" in out + err or "retry" in caplog.text  # the retry was logged
    assert KEY not in out and KEY not in err
    assert KEY not in str(exc_503.value) and KEY not in str(exc_401.value)
    assert "***" in str(exc_401.value) and exc_401.value.retryable is False
    assert KEY not in repr(cfg) and KEY not in repr(model)
    await model.aclose()


async def test_openai_key_from_env_and_load_adapter(stub: StubOpenAI, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-env")
    model = load_adapter(model_config(dict(adapter="openai", api="chat", base_url=stub.base_url, model="tiny")))
    assert isinstance(model, OpenAIModel)
    await model.generate(CreateParams(input=parse_items("hi")))
    assert stub.requests[-1].headers["authorization"] == "Bearer sk-from-env"
    await model.aclose()
    monkeypatch.delenv("OPENAI_API_KEY")
    with pytest.raises(ValueError, match="API key"):
        OpenAIModel(OpenAIOptions())
    with pytest.raises(ValueError, match="api"):
        OpenAIModel(OpenAIOptions(api="completions", base_url=stub.base_url))
    assert isinstance(load_adapter(model_config(dict(adapter="scripted"))), ScriptedModel)


# ============================================== openai: hosted-API hardening


async def test_azure_openai_config_routes_to_the_deployment(stub: StubOpenAI) -> None:
    root = stub.base_url.removesuffix("/v1")
    model = load_adapter(
        model_config(
            dict(
                adapter="openai",
                provider="azure",
                api="chat",
                base_url=root,
                api_key=KEY,
                model="gpt-4o",
                azure_deployment="gpt4o-prod",
                api_version="2024-10-21",
                max_retries=0,
            )
        )
    )
    stub.enqueue(chat_completion("from azure"))
    r = await model.generate(CreateParams(input=parse_items("hi")))
    assert message_text(r.output[0]) == "from azure"  # type: ignore[arg-type]
    req = stub.requests[-1]
    assert req.path == "/openai/deployments/gpt4o-prod/chat/completions?api-version=2024-10-21"
    assert req.headers["api-key"] == KEY and "authorization" not in req.headers
    await model.aclose()

    responses = load_adapter(
        model_config(
            dict(
                adapter="openai",
                provider="azure",
                api="responses",
                base_url=root,
                api_key=KEY,
                model="gpt-4o",
                api_version="2025-04-01-preview",
                max_retries=0,
            )
        )
    )
    stub.enqueue(responses_reply())
    await responses.generate(CreateParams(input=parse_items("hi")))
    assert stub.requests[-1].path == "/openai/responses?api-version=2025-04-01-preview"
    await responses.aclose()
    with pytest.raises(ValueError, match="api_version"):
        OpenAIModel(OpenAIOptions(provider="azure", base_url=root, api_key=KEY))
    with pytest.raises(ValueError, match="provider"):
        OpenAIModel(OpenAIOptions(provider="anthropic", api_key=KEY))


async def test_a_hosted_endpoints_failures_are_classified_as_a_self_hosted_ones(stub: StubOpenAI) -> None:
    """Azure goes through the OpenAI client, whose errors the pool reads as its own: a 503 is retried
    (after its Retry-After), a 401 fails at once, a full context is an incomplete response, and a port
    nobody listens on is 'cannot reach'."""
    root = stub.base_url.removesuffix("/v1")
    azure = dict(adapter="openai", provider="azure", api="chat", api_key=KEY, api_version="2024-10-21")
    model = load_adapter(model_config(dict(azure, base_url=root, model="gpt-4o", max_retries=1)))
    assert isinstance(model, OpenAIModel) and model.pool.endpoints[0].client is not None
    stub.enqueue(StubReply(status=503, body=error_body(503, "busy"), headers={"Retry-After": "0.2"}))
    stub.enqueue(chat_completion("second try"))
    t0 = time.perf_counter()
    r = await model.generate(CreateParams(input=parse_items("hi")))
    assert message_text(r.output[0]) == "second try" and time.perf_counter() - t0 >= 0.2  # type: ignore[arg-type]
    stub.enqueue(StubReply(status=401, body=error_body(401, "bad key")))
    with pytest.raises(ModelError, match="HTTP 401 .*bad key") as exc:
        await model.generate(CreateParams(input=parse_items("hi")))
    assert exc.value.retryable is False and len(stub.requests) == 3
    msg = "This model's maximum context length is 1024 tokens. However, your prompt contains at least 1025"
    stub.enqueue(StubReply(status=400, body=error_body(400, msg)))
    r = await model.generate(CreateParams(input=parse_items("long " * 2000)))
    assert r.status == "incomplete" and r.incomplete_details == {"reason": "max_output_tokens"}
    await model.aclose()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    unreachable = load_adapter(model_config(dict(azure, base_url=dead, model="gpt-4o", max_retries=0)))
    with pytest.raises(ModelError, match="cannot reach") as exc:
        await unreachable.generate(CreateParams(input=parse_items("hi")))
    assert exc.value.retryable is True
    await unreachable.aclose()


async def test_rate_limits_shrink_the_window_and_pause_new_calls(stub: StubOpenAI) -> None:
    model = OpenAIModel(openai_cfg(stub, max_retries=3), concurrency=8)
    limiter = model.pool.endpoints[0].limiter
    stub.enqueue(StubReply(status=429, body=error_body(429, "slow down"), headers={"Retry-After": "0.3"}))
    t0 = time.perf_counter()
    done: list[float] = []

    async def one() -> None:
        await model.generate(CreateParams(input=parse_items("hi")))
        done.append(time.perf_counter() - t0)

    await one()  # 429, waits Retry-After, succeeds
    assert limiter.limit < 8 and done[0] >= 0.3
    # a second 429 halves it again and pauses every new call until Retry-After passes
    stub.enqueue(StubReply(status=429, body=error_body(429, "slow down"), headers={"Retry-After": "0.3"}))
    t0 = time.perf_counter()
    done.clear()
    window = limiter.limit
    async with anyio.create_task_group() as tg:
        tg.start_soon(one)
        with anyio.fail_after(30):  # the 429 came back: new calls are held from here
            while limiter.paused_until <= time.monotonic():
                await anyio.sleep(0.005)
        for _ in range(3):
            tg.start_soon(one)
    assert limiter.limit < window and min(done) >= 0.3
    # successes grow the window back (additive increase)
    before = limiter.limit
    for _ in range(5):
        await one()
    assert limiter.limit > before
    # OpenAI's x-ratelimit headers: remaining 0 → pause until the reset, before any 429
    stub.enqueue(
        StubReply(
            body=chat_completion("last one"),
            headers={"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "300ms"},
        )
    )
    await one()
    t0 = time.perf_counter()
    done.clear()
    await one()
    assert done[0] >= 0.25
    await model.aclose()


async def test_concurrency_window_bounds_requests_in_flight(stub: StubOpenAI) -> None:
    import threading

    lock = threading.Lock()
    state = {"now": 0, "peak": 0}

    def handler(req: Any) -> StubReply:
        with lock:
            state["now"] += 1
            state["peak"] = max(state["peak"], state["now"])
        time.sleep(0.03)
        with lock:
            state["now"] -= 1
        return StubReply(body=chat_completion("ok"))

    stub.handler = handler
    model = OpenAIModel(openai_cfg(stub), concurrency=3)
    async with anyio.create_task_group() as tg:
        for _ in range(12):
            tg.start_soon(model.generate, CreateParams(input=parse_items("hi")))
    assert state["peak"] == 3
    await model.aclose()


async def test_openai_several_base_urls_fail_over(stub: StubOpenAI) -> None:
    with StubOpenAI() as other:
        model = OpenAIModel(openai_cfg(stub, base_url=[stub.base_url, other.base_url], max_retries=1))
        stub.handler = lambda req: StubReply(status=502)
        for k in range(4):
            await model.generate(CreateParams(input=parse_items("hi")), rollout_key=f"r{k}")
        assert len(other.requests) == 4 and len(stub.requests) == 1
        await model.aclose()
