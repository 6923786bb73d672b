"""``openai`` / ``vllm``: any OpenAI-compatible endpoint, Responses or Chat Completions.

``cfg.api == "responses"`` posts the Responses request as is; ``cfg.api == "chat"``
converts it to Chat Completions and the completion back to Responses items, with
NeMo Gym's conversion semantics (its ``vllm_model`` server): reasoning travels
as ``<think>...</think>`` in assistant content, an assistant turn's text and its
function calls form one assistant message, tool outputs become ``tool`` messages.

Why our own retry loop: the policy (which errors, how many attempts, backoff) is
part of the runtime's failure model and must be testable, so the client runs with
``max_retries=0`` and ``generate`` retries 408/409/429/5xx, timeouts and
connection errors at most ``cfg.max_retries`` times with exponential backoff
(``Retry-After`` honoured). Other 4xx fail at once with ``retryable=False``.

The API key comes from ``cfg.api_key`` or ``OPENAI_API_KEY``; it is never logged
and is scrubbed from every error message this module produces.

Requests go through ``AsyncOpenAI.post(..., cast_to=object)``, which returns the
decoded JSON: no pydantic models on the hot path and vendor fields (vLLM's
``reasoning_content``, token ids) are kept.
"""

from __future__ import annotations

import os
import random
import re
import time
from typing import Any
from uuid import uuid4

import anyio
import msgspec
import openai

from models.base import ModelConfig, ModelError
from runtime import logs
from runtime.messages import (
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
    "OpenAIModel",
    "build_chat_body",
    "build_responses_body",
    "chat_completion_to_response",
    "chat_message_to_items",
    "responses_json_to_response",
    "responses_to_chat_messages",
    "responses_tools_to_chat",
    "split_think",
]

log = logs.get("gym.models.openai")

THINK_RE = re.compile(r"<think>(.*?)</think>", re.DOTALL)
RETRY_STATUS = frozenset({408, 409, 429})
MAX_BACKOFF_S = 30.0
MAX_RETRY_AFTER_S = 60.0

# Responses-API request fields that Chat Completions does not have (dropped in chat mode).
_RESPONSES_ONLY = frozenset(
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
_NEVER_FORWARD = frozenset({"stream", "stream_options"})  # we never stream


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
    body: dict[str, Any] = {
        "messages": responses_to_chat_messages(params.input, instructions=params.instructions)
    }
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


def _usage_from_chat(raw: Any) -> Usage | None:
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


_INCOMPLETE_REASONS = {"length": "max_output_tokens", "content_filter": "content_filter"}


def _response(params: CreateParams, **fields: Any) -> Response:
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
    reason = _INCOMPLETE_REASONS.get(choice.get("finish_reason") or "")
    return _response(
        params,
        id=f"resp_{uuid4().hex}",
        created_at=float(data.get("created") or time.time()),
        model=str(data.get("model") or params.model or ""),
        output=output,
        status="incomplete" if reason else "completed",
        incomplete_details={"reason": reason} if reason else None,
        usage=_usage_from_chat(data.get("usage")),
    )


# ================================================================= Responses API

_OUTPUT_TYPES: dict[str, type] = {
    "message": Message,
    "function_call": FunctionCall,
    "reasoning": Reasoning,
}


def build_responses_body(
    params: CreateParams, *, model: str | None, extra_body: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The Responses ``create`` body: params as given; items lose nulls and training fields."""
    items = [
        {k: v for k, v in d.items() if v is not None and k not in TRAINING_FIELDS}
        for d in msgspec.to_builtins(params.input)
    ]
    for d in items:
        kind = d.get("type")
        if kind == "message":
            d.setdefault("content", "")  # omit_defaults drops an empty content
        elif kind == "reasoning":
            d.setdefault("summary", [])
    body: dict[str, Any] = {"input": items}
    if model:
        body["model"] = model
    for key in ("instructions", "temperature", "top_p", "max_output_tokens", "tool_choice",
                "parallel_tool_calls"):
        value = getattr(params, key)
        if value is not None:
            body[key] = value
    if params.tools:
        body["tools"] = params.tools
    for k, v in (params.extra or {}).items():
        if v is not None and k not in body and k not in _NEVER_FORWARD:
            body[k] = v
    if extra_body:
        body.update(extra_body)
    return body


def _no_nones(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def responses_json_to_response(data: dict[str, Any], params: CreateParams) -> Response:
    """A Responses-API ``response`` JSON body → our ``Response``.

    Output items of types other than message / function_call / reasoning (e.g.
    ``web_search_call``) raise ``ModelError`` naming the type: the runtime's agents
    cannot act on them, and dropping them silently would corrupt the trajectory.
    """
    if data.get("status") == "failed":
        err = data.get("error") or {}
        raise ModelError(
            f"response failed: {err.get('code')}: {err.get('message')}",
            retryable=err.get("code") == "server_error",
        )
    output: list[Item] = []
    for i, d in enumerate(data.get("output") or []):
        kind = d.get("type") if isinstance(d, dict) else None
        cls = _OUTPUT_TYPES.get(kind)  # type: ignore[arg-type]
        if cls is None:
            raise ModelError(
                f"responses API returned output[{i}] of type {kind!r}; the runtime handles"
                " message, function_call and reasoning items only"
            )
        try:
            output.append(msgspec.convert(_no_nones(d), cls))
        except msgspec.ValidationError as e:
            raise ModelError(f"responses API output[{i}] ({kind}): {e}") from None
    usage = None
    if isinstance(data.get("usage"), dict):
        try:
            usage = msgspec.convert(_no_nones(data["usage"]), Usage)
        except msgspec.ValidationError:
            usage = None
    return _response(
        params,
        id=str(data.get("id") or f"resp_{uuid4().hex}"),
        created_at=float(data.get("created_at") or time.time()),
        model=str(data.get("model") or params.model or ""),
        output=output,
        status=data.get("status") or "completed",
        incomplete_details=data.get("incomplete_details"),
        usage=usage,
    )


# ==================================================================== the adapter


def _is_context_overflow(err: openai.APIStatusError, body: dict[str, Any]) -> bool:
    """A 400 that means "the conversation no longer fits" (vLLM / OpenAI wording)."""
    if err.status_code != 400:
        return False
    text = f"{err.message} {err.body}".lower()
    if "context length" in text or "context_length_exceeded" in text:
        return True
    # vLLM clamps max_tokens to the room left; a full context then reads like this.
    asked = body.get("max_tokens")
    return "max_tokens must be at least 1" in text and not (isinstance(asked, int) and asked < 1)


def _retry_after(err: openai.APIStatusError) -> float | None:
    try:
        value = err.response.headers.get("retry-after")
        return min(float(value), MAX_RETRY_AFTER_S) if value is not None else None
    except (TypeError, ValueError, AttributeError):
        return None


class OpenAIModel:
    """Generation through an OpenAI-compatible HTTP endpoint (OpenAI, vLLM, ...).

    ``cfg.model`` names the served model (it overrides ``params.model``);
    ``cfg.extra_body`` is merged into every request body; ``cfg.timeout_s`` bounds
    each attempt. A 400 that says the context is full (``context length``, or
    vLLM's ``max_tokens must be at least 1`` when the prompt fills the context)
    yields an ``incomplete`` response with an empty assistant message instead of an
    error, as NeMo Gym's vLLM server does, so the rollout ends and is verified.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        if cfg.api not in ("responses", "chat"):
            raise ValueError(f"models.*.api: {cfg.api!r} is not 'responses' or 'chat'")
        self.cfg = cfg
        key = cfg.api_key or os.environ.get("OPENAI_API_KEY")
        if not key:
            if not cfg.base_url:
                raise ValueError(
                    "openai adapter: no API key (set api_key in the model config or OPENAI_API_KEY)"
                )
            key = "EMPTY"  # local OpenAI-compatible servers (vLLM) accept any key
        self._secret = key
        self._model = cfg.model
        self._path = "/responses" if cfg.api == "responses" else "/chat/completions"
        self._client = openai.AsyncOpenAI(
            api_key=key,
            base_url=cfg.base_url or None,
            timeout=cfg.timeout_s,
            max_retries=0,
        )
        self._where = cfg.base_url or "api.openai.com"

    def __repr__(self) -> str:
        return f"OpenAIModel(base_url={self._where!r}, api={self.cfg.api!r}, model={self._model!r})"

    def _scrub(self, text: str) -> str:
        return text.replace(self._secret, "***") if self._secret != "EMPTY" else text

    def _body(self, params: CreateParams) -> dict[str, Any]:
        model = self._model or params.model
        if self.cfg.api == "chat":
            return build_chat_body(params, model=model, extra_body=self.cfg.extra_body)
        return build_responses_body(params, model=model, extra_body=self.cfg.extra_body)

    async def generate(self, params: CreateParams, *, rollout_key: str | None = None) -> Response:
        body = self._body(params)
        attempts = self.cfg.max_retries + 1
        for attempt in range(attempts):
            failure: str
            wait: float | None = None
            try:
                # httpx's timeout bounds each phase (connect, read, ...); this bounds the attempt.
                with anyio.fail_after(self.cfg.timeout_s):
                    data = await self._client.post(self._path, cast_to=object, body=body)
            except openai.APIStatusError as e:
                status = e.status_code
                if _is_context_overflow(e, body):
                    log.info("model.context_overflow", endpoint=self._where, path=self._path)
                    return _response(
                        params,
                        id=f"resp_{uuid4().hex}",
                        created_at=time.time(),
                        model=self._model or params.model or "",
                        output=[assistant_message("", id=f"msg_{uuid4().hex}")],
                        status="incomplete",
                        incomplete_details={"reason": "max_output_tokens"},
                        usage=Usage(),
                    )
                failure = self._scrub(f"HTTP {status} from {self._where}{self._path}: {e.message}"[:1000])
                if not (status in RETRY_STATUS or status >= 500):
                    raise ModelError(failure, retryable=False) from None
                wait = _retry_after(e)
            except (openai.APITimeoutError, TimeoutError):
                failure = f"timed out after {self.cfg.timeout_s}s waiting for {self._where}{self._path}"
            except openai.APIConnectionError as e:
                failure = self._scrub(f"cannot reach {self._where}{self._path}: {e}")
            else:
                if not isinstance(data, dict):
                    raise ModelError(
                        f"{self._where}{self._path} answered with a non-JSON-object body", retryable=True
                    )
                if self.cfg.api == "chat":
                    return chat_completion_to_response(data, params)
                return responses_json_to_response(data, params)

            if attempt + 1 >= attempts:
                raise ModelError(
                    f"{failure} (gave up after {attempts} attempt{'s' if attempts > 1 else ''})",
                    retryable=True,
                )
            backoff = min(self.cfg.retry_backoff_s * (2**attempt), MAX_BACKOFF_S)
            backoff *= 0.5 + random.random() / 2  # jitter: concurrent rollouts spread out
            if wait is not None:
                backoff = max(backoff, wait)
            log.warning(
                "model.retry",
                error=failure,
                retry=attempt + 1,
                of=attempts - 1,
                backoff_s=round(backoff, 3),
            )
            await anyio.sleep(backoff)
        raise AssertionError("unreachable")  # pragma: no cover

    async def aclose(self) -> None:
        await self._client.close()
