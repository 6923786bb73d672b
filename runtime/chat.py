"""Chat Completions ↔ Responses, with the semantics of NeMo Gym's own model servers (``vllm_model``).

One converter for both sides of the runtime: the model adapters that send Chat Completions requests and
read the answers (``openai`` with ``api: chat``, ``vllm``, ``vllm_engine``), and the hosting of foreign
code that speaks Chat Completions to our models (a NeMo Gym server's ``/v1/chat/completions``, a verifiers
environment's ``AsyncOpenAI``). So a rollout reads the same whichever way its model was reached:

* ``instructions`` → a leading ``system`` message; input messages keep their role;
* reasoning items ↔ ``<think>...</think>`` spans at the start of the assistant content. Read back, every
  span becomes one summary of one reasoning item and the text around them is kept verbatim; a reasoning
  parser's field (``reasoning_content``, or ``reasoning`` from vLLM 0.16) is read as a leading span, as
  ``vllm_model`` folds it into the content. Served to hosted NeMo Gym code, reasoning is ``<think>``
  spans in the content, as ``vllm_model``'s ``/v1/chat/completions`` answers (a verifiers environment
  gets the ``reasoning_content`` field, as from vLLM with a reasoning parser);
* an assistant turn's text and its ``function_call`` items ↔ ONE assistant message with ``tool_calls``;
  ``function_call_output`` ↔ ``tool`` messages. Tool-call arguments are JSON text: any other value is
  refused, as NeMo Gym's models refuse it (``ModelError`` for a model's answer, ``invalid_task`` for a
  request);
* ``max_output_tokens`` → ``max_tokens``; ``finish_reason: length`` → ``status: incomplete`` with
  ``incomplete_details.reason = max_output_tokens``; ``usage`` mapped field by field.

``tests/test_chat.py`` holds these to what NeMo Gym's server does (recorded in
``tests/compat/nemo_gym/vllm_model/chat_cases.json``).
"""

from __future__ import annotations

import re
import time
from typing import Any, Literal
from uuid import uuid4

import msgspec

from gym_runtime.errors import Failure, ModelError
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
    "chat_body_to_params",
    "chat_completion_to_response",
    "chat_message_to_items",
    "chat_to_items",
    "incomplete_response",
    "make_response",
    "response_to_chat",
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


def _text(content: Any) -> str:
    """The text of a chat message's content: a string, or the ``text`` of each of its parts."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return content if isinstance(content, str) else ""


def chat_message_to_items(message: dict[str, Any], *, ids: bool = True) -> list[Item]:
    """One chat assistant message → Responses items (``ids``: mint ``rs_``/``msg_`` ids, as for an answer).

    Order: one reasoning item (the ``reasoning_content`` or ``reasoning`` field first, then every
    ``<think>`` span), an assistant message (when there is text, or nothing else at all), then one
    function_call per tool call. Arguments that are not a string raise ``ModelError``.
    """
    thoughts, text = split_think(_text(message.get("content")))
    field_reasoning = message.get("reasoning_content") or message.get("reasoning")
    if isinstance(field_reasoning, str) and field_reasoning:
        thoughts.insert(0, field_reasoning)
    thoughts = [t for t in thoughts if t]
    tool_calls = message.get("tool_calls") or []

    items: list[Item] = []
    if thoughts:
        items.append(
            Reasoning(
                id=f"rs_{uuid4().hex}" if ids else None,
                summary=[{"text": t, "type": "summary_text"} for t in thoughts],
                status="completed",
            )
        )
    if text or not (items or tool_calls):
        items.append(assistant_message(text, id=f"msg_{uuid4().hex}" if ids else None))
    for tc in tool_calls:
        fn = tc.get("function") or tc  # or flat, as verifiers' ToolCall model is
        name, args = fn.get("name") or "", fn.get("arguments")
        if not isinstance(args, str):
            raise ModelError(
                f"tool call {name!r}: arguments must be a JSON string, not {type(args).__name__} "
                "(as Chat Completions sends them; NeMo Gym refuses these too)"
            )
        call_id = tc.get("id") or f"call_{uuid4().hex}"
        items.append(FunctionCall(name=name, arguments=args, call_id=call_id, id=call_id, status="completed"))
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


# ================================================ serving Chat Completions from our model calls


def _as_dict(obj: Any, where: str) -> dict[str, Any]:
    """A message or part as a dict: hosted code may hand us dicts or pydantic models (verifiers, openai)."""
    if isinstance(obj, dict):
        return obj
    dump = getattr(obj, "model_dump", None)
    if callable(dump):
        return dict(dump())
    raise Failure("invalid_task", f"{where}: expected an object, not {type(obj).__name__}")


def _input_parts(content: Any) -> str | list[dict[str, Any]]:
    if content is None or isinstance(content, str):
        return content or ""
    out: list[dict[str, Any]] = []
    for part in content:
        d = _as_dict(part, "a content part")
        out.append({"type": "input_text", "text": d.get("text", "")} if d.get("type") == "text" else d)
    return out


def chat_to_items(messages: list[Any]) -> list[Item]:
    """Chat Completions messages (dicts or message models) → Responses items, without ids.

    Assistant turns read as a model's answer does (``chat_message_to_items``: ``<think>`` spans and the
    reasoning fields become a reasoning item); ``tool`` messages become ``function_call_output`` items.
    """
    items: list[Item] = []
    for i, raw in enumerate(messages):
        m = _as_dict(raw, f"messages[{i}]")
        role = m.get("role")
        if role == "assistant":
            try:
                items += chat_message_to_items(m, ids=False)
            except ModelError as e:
                raise Failure("invalid_task", f"messages[{i}]: {e}") from None
        elif role == "tool":
            items.append(FunctionCallOutput(call_id=str(m.get("tool_call_id")), output=_text(m.get("content"))))
        else:
            items.append(Message(role=str(role or "user"), content=_input_parts(m.get("content"))))
    return items


def _responses_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
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
    """A Chat Completions request body → our create params (sampling args the Struct lacks ride in ``extra``)."""
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
        tools=_responses_tools(body.get("tools")),
        temperature=body.get("temperature"),
        top_p=body.get("top_p"),
        max_output_tokens=max_tokens,
        tool_choice=body.get("tool_choice"),
        parallel_tool_calls=body.get("parallel_tool_calls"),
        extra=extra,
    )


def response_to_chat(resp: Response, model: str, *, reasoning: Literal["think", "field"] = "think") -> dict[str, Any]:
    """Our ``Response`` → a ``chat.completion`` body (vLLM's token-id fields where the model gave ids).

    The message is the assistant turn as ``responses_to_chat_messages`` sends it to a server. Reasoning is
    ``<think>`` spans in its content (``"think"``: what ``vllm_model`` answers NeMo Gym's hosted code with),
    or the ``reasoning_content`` field (``"field"``: what vLLM with a reasoning parser answers, which is what
    a verifiers environment reads when it runs on its own)."""
    output: list[Item] = [i for i in resp.output if not isinstance(i, FunctionCallOutput)]
    thoughts = [t for i in output if isinstance(i, Reasoning) for t in _reasoning_texts(i) if t]
    if reasoning == "field":
        output = [i for i in output if not isinstance(i, Reasoning)]
    turn = responses_to_chat_messages(output)
    message: dict[str, Any] = turn[-1] if turn else {"role": "assistant", "content": None}
    calls = message.get("tool_calls") or []
    if message["content"] is None and not calls:
        message["content"] = ""
    if reasoning == "field" and thoughts:
        message["reasoning_content"] = "".join(thoughts)
    trained: Any = None  # the last item with the model's token ids
    for item in resp.output:
        if not isinstance(item, FunctionCallOutput) and item.generation_token_ids is not msgspec.UNSET:
            trained = item
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "finish_reason": "length" if resp.status == "incomplete" else ("tool_calls" if calls else "stop"),
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
