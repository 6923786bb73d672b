"""Record what NeMo Gym's own ``vllm_model`` server does with ``<think>`` spans, the ``reasoning`` fields and
non-string tool-call arguments: the reference ``tests/test_chat.py`` holds ``gym_runtime.chat`` to.

Run it with the interpreter of a hosted environment (it has nemo-gym installed; see ``gym-runtime env build``)::

    ~/.cache/gym-runtime/envs/base-*/bin/python tests/compat/nemo_gym/vllm_model/record_chat_cases.py

It drives the server's FastAPI app (``VLLMModel.setup_webserver``, ``uses_reasoning_parser: true``, the
configuration NeMo Gym's reasoning-model configs use) the way NeMo Gym's own tests do: vLLM is the test double,
answering each case's message and recording the body the server sent it. Writes ``chat_cases.json`` beside
this file. The item ids NeMo Gym mints (``rs_<uuid>``, ``msg_<uuid>``) are random and left out.
"""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path
from typing import Any
from unittest.mock import AsyncMock, MagicMock

from fastapi.testclient import TestClient
from nemo_gym.openai_utils import NeMoGymAsyncOpenAI
from nemo_gym.responses_converter import ResponsesConverter
from nemo_gym.server_utils import ServerClient
from responses_api_models.vllm_model.app import VLLMModel, VLLMModelConfig

OUT = Path(__file__).with_name("chat_cases.json")

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "sf"}'}}


def call(arguments: Any) -> dict[str, Any]:
    return {**CALL, "function": {**CALL["function"], "arguments": arguments}}


# What vLLM answers (the assistant message of its chat completion).
ANSWERS: dict[str, dict[str, Any]] = {
    "think_spans": {"role": "assistant", "content": "<think>a</think>x<think>b</think>y"},
    "think_then_text": {"role": "assistant", "content": " <think>plan</think>\n\nThe answer is 4."},
    "unclosed_think": {"role": "assistant", "content": "<think>still thinking"},
    "reasoning_content": {"role": "assistant", "content": "4", "reasoning_content": "2+2"},
    "reasoning": {"role": "assistant", "content": "4", "reasoning": "2+2"},
    "both_reasoning_fields": {"role": "assistant", "content": "4", "reasoning_content": "first", "reasoning": "second"},
    "reasoning_and_think": {"role": "assistant", "content": "<think>b</think>x", "reasoning_content": "a"},
    "reasoning_and_call": {"role": "assistant", "content": None, "reasoning": "need sf", "tool_calls": [CALL]},
    "only_think": {"role": "assistant", "content": "<think>a</think>"},
    "empty": {"role": "assistant", "content": ""},
    "string_arguments": {"role": "assistant", "content": None, "tool_calls": [CALL]},
    "empty_string_arguments": {"role": "assistant", "content": None, "tool_calls": [call("")]},
    "object_arguments": {"role": "assistant", "content": None, "tool_calls": [call({"city": "sf"})]},
    "number_arguments": {"role": "assistant", "content": None, "tool_calls": [call(3)]},
    "null_arguments": {"role": "assistant", "content": None, "tool_calls": [call(None)]},
}

# Chat histories a client sends to the server's /v1/chat/completions (their assistant turns).
USER = {"role": "user", "content": "weather in sf?"}
REQUESTS: dict[str, list[dict[str, Any]]] = {
    "think_in_history": [USER, {"role": "assistant", "content": "<think>a</think>x<think>b</think>y"}, USER],
    "reasoning_content_in_history": [USER, {"role": "assistant", "content": "x", "reasoning_content": "r"}, USER],
    "reasoning_in_history": [USER, {"role": "assistant", "content": "x", "reasoning": "r"}, USER],
    "call_in_history": [
        USER,
        {"role": "assistant", "content": "<think>need sf</think>", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ],
    "object_arguments_in_history": [
        USER,
        {"role": "assistant", "content": None, "tool_calls": [call({"city": "sf"})]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ],
}

# Responses input items a client sends to /v1/responses (what reaches vLLM).
ITEMS: dict[str, list[dict[str, Any]]] = {
    "reasoning_text_and_call": [
        {"role": "user", "content": "weather in sf?"},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "need sf"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "sf"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "a"}]},
        {"type": "reasoning", "id": "rs_3", "summary": [{"type": "summary_text", "text": "b"}]},
        {
            "type": "message",
            "role": "assistant",
            "id": "msg_1",
            "status": "completed",
            "content": [{"type": "output_text", "text": "It is sunny.", "annotations": []}],
        },
        {"role": "user", "content": "thanks"},
    ],
    "only_reasoning_turn": [
        {"role": "user", "content": "hi"},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "hmm"}]},
        {"role": "user", "content": "go on"},
    ],
}


def server() -> tuple[VLLMModel, list[dict[str, Any]], list[dict[str, Any]]]:
    config = VLLMModelConfig(
        host="127.0.0.1",
        port=8081,
        base_url="http://vllm.invalid/v1",
        api_key="dummy",  # pragma: allowlist secret
        model="m",
        entrypoint="",
        name="policy",
        return_token_id_information=False,
        uses_reasoning_parser=True,
    )
    model = VLLMModel(config=config, server_client=MagicMock(spec=ServerClient, global_config_dict={}))
    answers: list[dict[str, Any]] = []  # set per case: the message vLLM answers with
    sent: list[dict[str, Any]] = []  # the bodies the server sent vLLM

    async def create_chat_completion(**body: Any) -> dict[str, Any]:
        sent.append(json.loads(json.dumps(body)))
        message = json.loads(json.dumps(answers[-1]))
        choice = {"index": 0, "finish_reason": "stop", "message": message}
        return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m", "choices": [choice]}

    client = MagicMock(spec=NeMoGymAsyncOpenAI)
    client.create_chat_completion = AsyncMock(side_effect=create_chat_completion)
    model._clients = [client]
    return model, answers, sent


def without_ids(item: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in item.items() if k != "id" or not str(v).startswith(("rs_", "msg_"))}


def main() -> None:
    model, answers, sent = server()
    http = TestClient(model.setup_webserver(), raise_server_exceptions=False)
    converter = ResponsesConverter(return_token_id_information=False)
    out: dict[str, Any] = {"nemo_gym": version("nemo-gym"), "answers": {}, "requests": {}, "items": {}}

    for name, message in ANSWERS.items():
        answers.append(message)
        res = http.post("/v1/responses", json={"input": "hi"})
        case: dict[str, Any] = {"message": message, "responses_status": res.status_code}
        if res.status_code == 200:
            case["output"] = [without_ids(i) for i in res.json()["output"]]
        res = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        case["chat_status"] = res.status_code
        if res.status_code == 200:
            case["served"] = {k: v for k, v in res.json()["choices"][0]["message"].items() if v is not None}
        out["answers"][name] = case

    answers.append({"role": "assistant", "content": "ok"})
    for name, messages in REQUESTS.items():
        case = {"messages": messages}
        try:
            items = converter.chat_completions_messages_to_responses_items(json.loads(json.dumps(messages)))
            case["items"] = [without_ids(i.model_dump(exclude_none=True)) for i in items]
        except Exception as e:  # noqa: BLE001 - the reference is the failure itself
            case["items_error"] = type(e).__name__
        sent.clear()
        res = http.post("/v1/chat/completions", json={"messages": messages})
        case["chat_status"] = res.status_code
        if res.status_code == 200:
            case["sent"] = sent[-1]["messages"]
        out["requests"][name] = case

    for name, items in ITEMS.items():
        sent.clear()
        res = http.post("/v1/responses", json={"input": items})
        assert res.status_code == 200, res.text
        out["items"][name] = {"input": items, "sent": sent[-1]["messages"]}

    OUT.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT} (nemo-gym {out['nemo_gym']})")


if __name__ == "__main__":
    main()
