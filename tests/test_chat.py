"""gym_runtime.chat against NeMo Gym's own model server: ``<think>`` spans, the reasoning fields and tool-call
arguments that are not a string, both ways.

The reference is what NeMo Gym 0.7.0's ``vllm_model`` server did with the same vLLM answers and chat histories
(``tests/compat/nemo_gym/vllm_model/chat_cases.json``, recorded by ``record_chat_cases.py`` beside it, with the
server's reasoning parser on, as NeMo Gym's reasoning-model configs run it). The item ids it mints are random;
items are compared by what a reader of the rollout sees: reasoning texts, message role and text, call fields.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from gym_runtime.chat import chat_body_to_params, chat_message_to_items, chat_to_items, response_to_chat
from gym_runtime.errors import Failure, ModelError
from gym_runtime.messages import CreateParams, Item, Response, parse_items
from gym_runtime.models.vllm import Options as VLLMOptions
from gym_runtime.models.vllm import VLLMModel
from tests.differential import compat_dir

CASES = msgspec.json.decode(compat_dir("nemo_gym", "vllm_model", "chat_cases.json").read_bytes())
ANSWERS: dict[str, Any] = CASES["answers"]
REQUESTS: dict[str, Any] = CASES["requests"]
REFUSED = sorted(n for n, c in ANSWERS.items() if c["responses_status"] != 200)


def shape(item: Item | dict[str, Any]) -> tuple[Any, ...]:
    """What a reader of the rollout sees of an item (not the ids NeMo Gym mints at random)."""
    d = item if isinstance(item, dict) else msgspec.to_builtins(item)
    kind = d.get("type", "message")
    if kind == "reasoning":
        return (kind, [s["text"] for s in d["summary"]])
    if kind == "message":
        content = d["content"]
        text = content if isinstance(content, str) else "".join(p.get("text", "") for p in content)
        return (kind, d["role"], text)
    if kind == "function_call":
        return (kind, d["call_id"], d["name"], d["arguments"])
    return (kind, d["call_id"], d["output"])


def vllm_bound(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages our ``vllm`` adapter (with a reasoning parser on the server) sends for these items."""
    model = VLLMModel(VLLMOptions(base_url="http://127.0.0.1:9/v1", model="m", reasoning_parser="deepseek_r1"))
    return model.chat_body(CreateParams(input=chat_to_items(messages)))["messages"]


def seen_by_vllm(message: dict[str, Any]) -> dict[str, Any]:
    """What the model reads of a history message: vLLM < 0.16 reads ``reasoning_content`` (NeMo Gym sends both
    fields when it moves ``<think>`` spans out of the content, and passes a client's ``reasoning_content`` on)."""
    return {k: v for k, v in message.items() if k != "reasoning" and v is not None}


@pytest.mark.parametrize("name", sorted(set(ANSWERS) - set(REFUSED)))
def test_an_answer_reads_as_nemo_gyms_model_server_reads_it(name: str) -> None:
    case = ANSWERS[name]
    assert [shape(i) for i in chat_message_to_items(case["message"])] == [shape(i) for i in case["output"]]


# vLLM's text with spans after (or between) text: served with the spans first, as the items hold them
MOVED_SPANS = {"think_spans", "think_then_text"}


def served(items: list[Item], **kw: Any) -> dict[str, Any]:
    resp = Response(id="resp_1", created_at=1.0, model="m", output=items)
    message = response_to_chat(resp, "m", **kw)["choices"][0]["message"]
    return {k: v for k, v in message.items() if v is not None}


@pytest.mark.parametrize("name", sorted(set(ANSWERS) - set(REFUSED)))
def test_hosted_code_is_served_what_nemo_gyms_model_server_serves(name: str) -> None:
    """A hosted server's ``/v1/chat/completions`` call gets the message ``vllm_model`` would have answered:
    the same, or (spans that came after text) the same reasoning and text when read back."""
    case = ANSWERS[name]
    ours = served(chat_message_to_items(case["message"]))
    if name in MOVED_SPANS:
        assert ours != case["served"]
        assert [shape(i) for i in chat_message_to_items(ours)] == [
            shape(i) for i in chat_message_to_items(case["served"])
        ]
    else:
        assert ours == case["served"]


def test_a_verifiers_environment_gets_reasoning_in_its_field() -> None:
    """verifiers reads ``reasoning_content``, as from vLLM with a reasoning parser: the content stays the answer."""
    got = served(chat_message_to_items(ANSWERS["reasoning_and_think"]["message"]), reasoning="field")
    assert got == {"role": "assistant", "content": "x", "reasoning_content": "ab"}


@pytest.mark.parametrize("name", REFUSED)
def test_arguments_that_are_not_a_string_are_refused_as_nemo_gym_refuses_them(name: str) -> None:
    """NeMo Gym's server answers 500 to these (its pydantic models take only a JSON string); encoding them
    ourselves would hand the verifier arguments the model never wrote."""
    assert ANSWERS[name]["chat_status"] == 500
    with pytest.raises(ModelError, match="arguments must be a JSON string"):
        chat_message_to_items(ANSWERS[name]["message"])


@pytest.mark.parametrize("name", ["think_in_history", "call_in_history"])
def test_a_hosted_chat_history_reads_as_nemo_gyms_converter_reads_it(name: str) -> None:
    case = REQUESTS[name]
    assert [shape(i) for i in chat_to_items(case["messages"])] == [shape(i) for i in case["items"]]


@pytest.mark.parametrize("name", sorted(n for n, c in REQUESTS.items() if c["chat_status"] == 200))
def test_a_hosted_chat_history_reaches_vllm_as_through_nemo_gyms_model_server(name: str) -> None:
    """Hosted code's history, through our items and the ``vllm`` adapter, reaches vLLM with the content and
    reasoning NeMo Gym's server forwards (a ``<think>`` span moved to the reasoning field, a client's
    ``reasoning_content`` kept)."""
    case = REQUESTS[name]
    assert [seen_by_vllm(m) for m in vllm_bound(case["messages"])] == [seen_by_vllm(m) for m in case["sent"]]


def test_a_history_with_the_newer_reasoning_field_reads_like_reasoning_content() -> None:
    """vLLM 0.16 names the field ``reasoning``; NeMo Gym's request model refuses it (422), which reads as an
    accident of its schema, not a rule: here it is the same reasoning as ``reasoning_content``."""
    assert REQUESTS["reasoning_in_history"]["chat_status"] == 422
    newer = vllm_bound(REQUESTS["reasoning_in_history"]["messages"])
    assert [seen_by_vllm(m) for m in newer] == [
        seen_by_vllm(m) for m in REQUESTS["reasoning_content_in_history"]["sent"]
    ]


def test_a_hosted_history_with_arguments_that_are_not_a_string_is_an_invalid_request() -> None:
    """NeMo Gym answers 422; the host answers 400 (``invalid_task``), naming the message."""
    assert REQUESTS["object_arguments_in_history"]["chat_status"] == 422
    with pytest.raises(Failure, match=r"messages\[1\]: tool call 'get_weather': arguments must be a JSON string") as e:
        chat_body_to_params({"messages": REQUESTS["object_arguments_in_history"]["messages"]})
    assert e.value.info.error_class == "invalid_task"


@pytest.mark.parametrize("name", sorted(CASES["items"]))
def test_items_reach_vllm_as_nemo_gyms_model_server_sends_them(name: str) -> None:
    """Responses items (reasoning, calls, outputs, text) through the ``vllm`` adapter: the exact messages
    ``vllm_model`` sends vLLM, reasoning fields included."""
    case = CASES["items"][name]
    model = VLLMModel(VLLMOptions(base_url="http://127.0.0.1:9/v1", model="m", reasoning_parser="deepseek_r1"))
    assert model.chat_body(CreateParams(input=parse_items(case["input"])))["messages"] == case["sent"]


def test_verifiers_message_models_and_flat_tool_calls_read_as_dicts() -> None:
    """verifiers hands over pydantic message models whose tool calls are flat (``id``, ``name``, ``arguments``)."""

    class Model:
        def __init__(self, **fields: Any) -> None:
            self.fields = fields

        def model_dump(self) -> dict[str, Any]:
            return self.fields

    msg = Model(
        role="assistant", content="<think>r</think>ok", tool_calls=[{"id": "c", "name": "f", "arguments": "{}"}]
    )
    assert [shape(i) for i in chat_to_items([msg])] == [
        ("reasoning", ["r"]),
        ("message", "assistant", "ok"),
        ("function_call", "c", "f", "{}"),
    ]


def test_served_answers_carry_vllms_token_id_fields_from_the_last_item_with_ids() -> None:
    """What vLLM returns with ``return_token_ids`` (verifiers reads a turn's ids from these)."""
    items = chat_message_to_items(ANSWERS["reasoning_and_call"]["message"])
    items[-1].prompt_token_ids, items[-1].generation_token_ids = [1, 2], [7, 8]  # type: ignore[union-attr]
    items[-1].generation_log_probs = [-0.5, -0.25]  # type: ignore[union-attr]
    body = response_to_chat(Response(id="resp_1", created_at=1.0, model="m", output=items), "m", reasoning="field")
    choice = body["choices"][0]
    assert body["prompt_token_ids"] == [1, 2] and choice["token_ids"] == [7, 8]
    assert [(c["token"], c["logprob"]) for c in choice["logprobs"]["content"]] == [
        ("token_id:7", -0.5),
        ("token_id:8", -0.25),
    ]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning_content"] == "need sf"
