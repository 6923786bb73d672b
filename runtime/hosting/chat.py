"""Chat Completions served to foreign code hosted in our workers, from our model calls.

Hosted code that speaks Chat Completions (a verifiers environment's ``AsyncOpenAI``, a
NeMo Gym server's judge call to ``/v1/chat/completions``) gets its request turned into
our create params and our ``Response`` turned back into a ``chat.completion`` body, with
vLLM's token-id fields where the model gave ids. (The other direction, a Chat Completions
server behind a model adapter, is ``gym_runtime.chat``.)
"""

from __future__ import annotations

from typing import Any

import msgspec

from gym_runtime.errors import Failure
from gym_runtime.messages import (
    CreateParams,
    FunctionCall,
    FunctionCallOutput,
    Item,
    Message,
    Reasoning,
    Response,
    message_text,
)

__all__ = ["chat_body_to_params", "chat_to_items", "get_field", "response_to_chat"]


def get_field(obj: Any, key: str, default: Any = None) -> Any:
    if isinstance(obj, dict):
        return obj.get(key, default)
    return getattr(obj, key, default)


def _chat_content_to_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for p in content:
        text = get_field(p, "text")
        if isinstance(text, str):
            parts.append(text)
    return "".join(parts)


def _input_parts(content: Any) -> str | list[dict[str, Any]]:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    out: list[dict[str, Any]] = []
    for p in content:
        d = p if isinstance(p, dict) else p.model_dump()
        if d.get("type") == "text":
            out.append({"type": "input_text", "text": d.get("text", "")})
        else:
            out.append(d)
    return out


def chat_to_items(messages: list[Any]) -> list[Item]:
    """Chat Completions messages (dicts or verifiers' message models) -> Responses items."""
    items: list[Item] = []
    for m in messages:
        role = get_field(m, "role")
        if role == "assistant":
            reasoning = get_field(m, "reasoning_content")
            if isinstance(reasoning, str) and reasoning:
                items.append(Reasoning(summary=[{"type": "summary_text", "text": reasoning}]))
            text = _chat_content_to_text(get_field(m, "content"))
            if text:
                items.append(
                    Message(
                        role="assistant",
                        status="completed",
                        content=[{"annotations": [], "text": text, "type": "output_text"}],
                    )
                )
            for call in get_field(m, "tool_calls") or []:
                fn = get_field(call, "function")
                name = get_field(fn, "name") if fn is not None else get_field(call, "name")
                args = get_field(fn, "arguments") if fn is not None else get_field(call, "arguments")
                items.append(
                    FunctionCall(call_id=str(get_field(call, "id")), name=str(name), arguments=str(args or ""))
                )
        elif role == "tool":
            items.append(
                FunctionCallOutput(
                    call_id=str(get_field(m, "tool_call_id")), output=_chat_content_to_text(get_field(m, "content"))
                )
            )
        else:
            items.append(Message(role=str(role or "user"), content=_input_parts(get_field(m, "content"))))
    return items


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for t in tools:
        fn = t.get("function", t)
        tool = {"type": "function", "name": fn["name"], "description": fn.get("description") or ""}
        tool["parameters"] = fn.get("parameters") or {"type": "object", "properties": {}}
        if fn.get("strict") is not None:
            tool["strict"] = fn["strict"]
        out.append(tool)
    return out


_PARAM_KEYS = {"model", "messages", "tools", "temperature", "top_p", "tool_choice", "parallel_tool_calls"}


def chat_body_to_params(body: dict[str, Any]) -> CreateParams:
    """A Chat Completions request body -> our create params (sampling args the Struct lacks ride in ``extra``)."""
    if body.get("n", 1) not in (1, None):
        raise Failure("invalid_task", f"n={body['n']} completions per call were asked for; one is served")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    extra = {
        k: v
        for k, v in body.items()
        if k not in _PARAM_KEYS and k not in ("max_tokens", "max_completion_tokens", "n") and v is not None
    }
    return CreateParams(
        input=chat_to_items(body.get("messages") or []),
        tools=_chat_tools(body.get("tools")),
        temperature=body.get("temperature"),
        top_p=body.get("top_p"),
        max_output_tokens=max_tokens,
        tool_choice=body.get("tool_choice"),
        parallel_tool_calls=body.get("parallel_tool_calls"),
        extra=extra,
    )


def response_to_chat(resp: Response, model: str) -> dict[str, Any]:
    """Our ``Response`` -> a ``chat.completion`` body (vLLM's token-id fields where the model gave ids)."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    trained: Any = None
    for item in resp.output:
        if isinstance(item, Message):
            texts.append(message_text(item))
        elif isinstance(item, FunctionCall):
            calls.append(
                {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            )
        elif isinstance(item, Reasoning):
            reasoning.extend(p.get("text", "") for p in item.summary if isinstance(p, dict))
        if isinstance(item, (Message, FunctionCall, Reasoning)) and item.generation_token_ids is not msgspec.UNSET:
            trained = item
    incomplete = resp.status == "incomplete"
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "finish_reason": "length" if incomplete else ("tool_calls" if calls else "stop"),
        "logprobs": None,
    }
    body: dict[str, Any] = {
        "id": resp.id,
        "object": "chat.completion",
        "created": int(resp.created_at),
        "model": resp.model or model,
        "choices": [choice],
    }
    if resp.usage is not None:
        body["usage"] = {
            "prompt_tokens": resp.usage.input_tokens,
            "completion_tokens": resp.usage.output_tokens,
            "total_tokens": resp.usage.total_tokens,
        }
    if trained is not None:
        body["prompt_token_ids"] = list(trained.prompt_token_ids)
        choice["token_ids"] = list(trained.generation_token_ids)
        choice["logprobs"] = {
            "content": [
                {"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
                for t, lp in zip(trained.generation_token_ids, trained.generation_log_probs or [], strict=False)
            ]
        }
    return body
