"""Responses API ↔ Chat Completions conversion, with NeMo Gym's ``vllm_model`` semantics.

Shared by the ``openai`` adapter (``api: chat``), the ``vllm`` adapter and the
in-process ``vllm_engine`` adapter, so all three build the same chat messages
from the same items and read the same items back:

* ``instructions`` → a leading ``system`` message; input messages keep their role;
* reasoning items ↔ ``<think>...</think>`` spans at the start of the assistant
  content (or vLLM's ``reasoning`` / ``reasoning_content`` field when a reasoning
  parser runs on the server);
* an assistant turn's text and its ``function_call`` items ↔ ONE assistant message
  with ``tool_calls``; ``function_call_output`` ↔ ``tool`` messages;
* ``max_output_tokens`` → ``max_tokens``; ``finish_reason: length`` →
  ``status: incomplete`` with ``incomplete_details.reason = max_output_tokens``;
  ``usage`` mapped field by field.

It also holds what the token-in path of the ``vllm`` adapter needs to read raw
generated text (``/v1/completions`` runs no server-side parser): a Hermes
tool-call parser with vLLM's ``hermes`` semantics and ``<think>`` normalisation.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any
from uuid import uuid4

import msgspec

from gym_runtime.errors import ModelError
from gym_runtime.messages import (
    TRAINING_FIELDS,
    CreateParams,
    FunctionCall,
    FunctionCallOutput,
    Item,
    Message,
    Reasoning,
    Response,
    Usage,
    assistant_message,
    message_text,
)

__all__ = [
    "INCOMPLETE_REASONS",
    "build_chat_body",
    "chat_completion_to_response",
    "chat_message_to_items",
    "incomplete_response",
    "make_response",
    "normalize_think",
    "parse_hermes_tool_calls",
    "responses_to_chat_messages",
    "responses_tools_to_chat",
    "split_think",
    "usage_from_chat",
]

THINK_RE = re.compile(r"<think>(.*?)</think>", re.DOTALL)

# Responses-API request fields that Chat Completions does not have (dropped in chat mode).
RESPONSES_ONLY = frozenset(
    {
        "include",
        "store",
        "truncation",
        "background",
        "previous_response_id",
        "prompt",
        "max_tool_calls",
        "conversation",
        "context_management",
        "metadata",
        "top_logprobs",
        "reasoning",
        "text",
        "instructions",
        "input",
        "max_output_tokens",
    }
)
NEVER_FORWARD = frozenset({"stream", "stream_options"})  # we never stream
_RESPONSES_ONLY = RESPONSES_ONLY
_NEVER_FORWARD = NEVER_FORWARD


# ====================================================== Responses → Chat Completions


def _chat_content(content: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Content of a user/system/developer message in chat form (parts converted)."""
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": part.get("text", "")})
        elif kind == "input_image":
            parts.append(
                {
                    "type": "image_url",
                    "image_url": {
                        "url": part.get("image_url") or "",
                        "detail": part.get("detail") or "auto",
                    },
                }
            )
        else:
            raise ModelError(f"chat conversion: unsupported content part type {kind!r}")
    return parts


def _reasoning_texts(item: Reasoning) -> list[str]:
    texts = [s.get("text", "") for s in item.summary]
    if not any(texts) and item.content:  # raw reasoning_text parts when no summary
        texts = [c.get("text", "") for c in item.content]
    return texts


def responses_to_chat_messages(
    items: list[Item], *, instructions: str | None = None, token_ids: bool = False
) -> list[dict[str, Any]]:
    """Responses input items → Chat Completions ``messages`` (NeMo Gym semantics).

    * ``instructions`` → a leading ``system`` message;
    * user / system / developer messages → same role (content parts converted);
    * reasoning → ``<think>text</think>`` prepended to the assistant content;
    * assistant messages and function calls of one turn → ONE assistant message
      (``content`` text, ``tool_calls``); ``content`` is ``None`` when empty;
    * function_call_output → a ``tool`` message.

    ``token_ids=True`` (training): the last ``prompt_token_ids`` /
    ``generation_token_ids`` / ``generation_log_probs`` seen on the items of an
    assistant turn ride on that assistant message, as NeMo Gym sends them.
    """
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    content = ""
    calls: list[dict[str, Any]] = []
    tokens: dict[str, Any] | None = None

    def flush() -> None:
        nonlocal content, calls, tokens
        if not (content or calls):
            return
        msg: dict[str, Any] = {"role": "assistant", "content": content or None}
        if calls:
            msg["tool_calls"] = calls
        if token_ids and tokens:
            msg.update(tokens)
        messages.append(msg)
        content, calls, tokens = "", [], None

    for i, item in enumerate(items):
        if isinstance(item, Message):
            if item.role == "assistant":
                content += message_text(item)
            elif item.role in ("user", "system", "developer"):
                flush()
                messages.append({"role": item.role, "content": _chat_content(item.content)})
            else:
                raise ModelError(f"chat conversion: input[{i}] has unsupported role {item.role!r}")
        elif isinstance(item, Reasoning):
            content += "".join(f"<think>{t}</think>" for t in _reasoning_texts(item) if t)
        elif isinstance(item, FunctionCall):
            calls.append(
                {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
            )
        elif isinstance(item, FunctionCallOutput):
            flush()
            messages.append({"role": "tool", "content": item.output, "tool_call_id": item.call_id})
        else:  # pragma: no cover - Item is a closed union
            raise ModelError(f"chat conversion: input[{i}] has unsupported item {type(item).__name__}")
        if token_ids and isinstance(getattr(item, "prompt_token_ids", None), list):
            tokens = {f: getattr(item, f) for f in TRAINING_FIELDS}
    flush()
    return messages


def responses_tools_to_chat(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Responses function tools → chat ``tools`` (``{"type": "function", "function": {...}}``)."""
    out: list[dict[str, Any]] = []
    for tool in tools or ():
        kind = tool.get("type", "function")
        if kind != "function":
            raise ModelError(f"chat conversion: tool type {kind!r} has no Chat Completions form")
        if isinstance(tool.get("function"), dict):  # already chat-shaped
            out.append({"type": "function", "function": tool["function"]})
            continue
        fn: dict[str, Any] = {"name": tool["name"]}
        for key in ("description", "parameters", "strict"):
            if tool.get(key) is not None:
                fn[key] = tool[key]
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _text_format_to_response_format(text: Any) -> dict[str, Any] | None:
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    return {"type": fmt["type"]}


def build_chat_body(
    params: CreateParams, *, model: str | None, extra_body: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The Chat Completions request body for ``params``.

    ``max_output_tokens`` → ``max_tokens``; ``reasoning.effort`` → ``reasoning_effort``;
    ``text.format`` → ``response_format``; ``tools``/``tool_choice``/
    ``parallel_tool_calls`` are omitted when no tools are offered (vLLM refuses a
    ``tool_choice`` without tools); other Responses-only fields are dropped; the
    rest of ``params.extra`` passes through; ``extra_body`` (config) wins.
    """
    body: dict[str, Any] = {"messages": responses_to_chat_messages(params.input, instructions=params.instructions)}
    if model:
        body["model"] = model
    tools = responses_tools_to_chat(params.tools)
    if tools:
        body["tools"] = tools
        if params.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(params.tool_choice)
        if params.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = params.parallel_tool_calls
    elif params.tool_choice not in (None, "auto", "none"):
        raise ModelError(f"tool_choice={params.tool_choice!r} needs at least one tool")
    if params.temperature is not None:
        body["temperature"] = params.temperature
    if params.top_p is not None:
        body["top_p"] = params.top_p
    if params.max_output_tokens is not None:
        body["max_tokens"] = params.max_output_tokens
    extra = params.extra
    if extra:
        reasoning = extra.get("reasoning")
        if isinstance(reasoning, dict) and reasoning.get("effort"):
            body["reasoning_effort"] = reasoning["effort"]
        response_format = _text_format_to_response_format(extra.get("text"))
        if response_format:
            body["response_format"] = response_format
        for k, v in extra.items():
            if v is None or k in _RESPONSES_ONLY or k in _NEVER_FORWARD or k in body:
                continue
            if k == "user" and not v:
                continue
            body[k] = v
    if extra_body:
        body.update(extra_body)
    return body


# ====================================================== Chat Completions → Responses


def split_think(content: str) -> tuple[list[str], str]:
    """``<think>...</think>`` spans of ``content`` and the content without them.

    Every span is taken, as NeMo Gym does; text outside them is kept verbatim.
    """
    if "<think>" not in content:
        return [], content
    return THINK_RE.findall(content), THINK_RE.sub("", content)


def chat_message_to_items(message: dict[str, Any]) -> list[Item]:
    """One chat assistant message → Responses output items.

    Order: a reasoning item (from ``reasoning_content`` / ``reasoning`` and any
    ``<think>`` spans), an assistant message (when there is text, or nothing
    else at all), then one function_call per tool call.
    """
    raw = message.get("content") or ""
    if isinstance(raw, list):
        raw = "".join(p.get("text", "") for p in raw if isinstance(p, dict))
    thoughts, text = split_think(raw)
    field_reasoning = message.get("reasoning_content") or message.get("reasoning")
    if isinstance(field_reasoning, str) and field_reasoning:
        thoughts.insert(0, field_reasoning)
    thoughts = [t for t in thoughts if t]
    tool_calls = message.get("tool_calls") or []

    items: list[Item] = []
    if thoughts:
        items.append(
            Reasoning(
                id=f"rs_{uuid4().hex}",
                summary=[{"text": t, "type": "summary_text"} for t in thoughts],
                status="completed",
            )
        )
    if text or not (items or tool_calls):
        items.append(assistant_message(text, id=f"msg_{uuid4().hex}"))
    for tc in tool_calls:
        fn = tc.get("function") or {}
        args = fn.get("arguments")
        if not isinstance(args, str):
            args = msgspec.json.encode(args if args is not None else {}).decode()
        call_id = tc.get("id") or f"call_{uuid4().hex}"
        items.append(
            FunctionCall(
                name=fn.get("name") or "",
                arguments=args,
                call_id=call_id,
                id=call_id,
                status="completed",
            )
        )
    return items


def usage_from_chat(raw: Any) -> Usage | None:
    if not isinstance(raw, dict):
        return None
    prompt = int(raw.get("prompt_tokens") or 0)
    completion = int(raw.get("completion_tokens") or 0)
    cached = (raw.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reasoning = (raw.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return Usage(
        input_tokens=prompt,
        output_tokens=completion,
        total_tokens=int(raw.get("total_tokens") or prompt + completion),
        input_tokens_details={"cached_tokens": cached},
        output_tokens_details={"reasoning_tokens": reasoning},
    )


INCOMPLETE_REASONS = {"length": "max_output_tokens", "content_filter": "content_filter"}


def make_response(params: CreateParams, **fields: Any) -> Response:
    """A ``Response`` echoing the request's settings, NeMo Gym's field set."""
    return Response(
        instructions=params.instructions,
        tools=list(params.tools or ()),
        temperature=params.temperature,
        top_p=params.top_p,
        max_output_tokens=params.max_output_tokens,
        parallel_tool_calls=params.parallel_tool_calls is not False,
        tool_choice=params.tool_choice if params.tool_choice is not None else "auto",
        **fields,
    )


def chat_completion_to_response(data: dict[str, Any], params: CreateParams) -> Response:
    """A ``chat.completion`` JSON body → our ``Response`` (first choice only).

    ``finish_reason == "length"`` → ``status="incomplete"`` with
    ``incomplete_details={"reason": "max_output_tokens"}`` (``content_filter`` likewise).
    """
    choices = data.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        raise ModelError("chat completion has no choices", retryable=True)
    choice = choices[0]
    output = chat_message_to_items(choice.get("message") or {})
    reason = INCOMPLETE_REASONS.get(choice.get("finish_reason") or "")
    return make_response(
        params,
        id=f"resp_{uuid4().hex}",
        created_at=float(data.get("created") or time.time()),
        model=str(data.get("model") or params.model or ""),
        output=output,
        status="incomplete" if reason else "completed",
        incomplete_details={"reason": reason} if reason else None,
        usage=usage_from_chat(data.get("usage")),
    )


def incomplete_response(params: CreateParams, *, model: str, reason: str = "max_output_tokens") -> Response:
    """An ``incomplete`` response with one empty assistant message (and no training fields).

    What a context-length or max-tokens refusal becomes, as in NeMo Gym: the rollout
    ends with a verifiable (empty) answer instead of failing.
    """
    return make_response(
        params,
        id=f"resp_{uuid4().hex}",
        created_at=time.time(),
        model=model,
        output=[assistant_message("", id=f"msg_{uuid4().hex}")],
        status="incomplete",
        incomplete_details={"reason": reason},
        usage=Usage(),
    )


# ============================================== raw generated text (token-in path)

_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(?!.*</tool_call>)(.*)", re.DOTALL)


def parse_hermes_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """vLLM's ``hermes`` tool parser on raw text: ``(content, tool_calls)``.

    ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks become chat
    ``tool_calls`` (arguments re-serialised with ``json.dumps(..., ensure_ascii=False)``
    as vLLM does); ``content`` is the text before the first block, ``None`` when
    empty. Text that does not parse stays content with no calls, as in vLLM.
    """
    if "<tool_call>" not in text:
        return text, []
    calls: list[dict[str, Any]] = []
    try:
        for m in _TOOL_CALL_RE.finditer(text):
            raw = (m.group(1) if m.group(1) is not None else m.group(2) or "").strip()
            obj = json.loads(raw)
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return text, []
            args = obj.get("arguments", obj.get("parameters", {}))
            calls.append(
                {
                    "id": f"chatcmpl-tool-{uuid4().hex[:16]}",
                    "type": "function",
                    "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)},
                }
            )
    except (ValueError, TypeError):
        return text, []
    content = text[: text.index("<tool_call>")]
    return (content or None), calls


def normalize_think(text: str) -> str:
    """Give a reasoning span whose ``<think>`` was opened by the chat template its tag back.

    Templates such as Qwen3's put ``<think>`` in the generation prompt, so the model's
    text holds only ``...</think>answer``; NeMo Gym's ``<think>`` convention needs both.
    """
    head, sep, _ = text.partition("</think>")
    if sep and "<think>" not in head:
        return "<think>" + text
    return text
