"""``scripted``: a deterministic offline policy — a TEST DOUBLE for the LLM.

It exists so the whole runtime (agents, resources, verify, collector, benchmarks)
can run without any model: given the offered tools, it first calls every tool it
has not called yet in this conversation, with arguments generated from the tool's
JSON schema, then answers with a message that quotes the last tool outputs.

It sits on the benchmark hot path at zero latency, so it is kept cheap: argument
JSON is computed once per (tool name, schema) and cached; no JSON round trips of
the conversation happen per call.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any, TypeGuard

import anyio
import msgspec

from gym_runtime.messages import (
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
from gym_runtime.model import AdapterOptions

__all__ = ["Options", "ScriptedModel", "create", "example_arguments", "example_value"]

_MAX_DEPTH = 8  # recursive ($ref) schemas stop here
_CACHE_MAX = 4096  # distinct (tool, schema) pairs kept; cleared wholesale when full

_STRING_FORMATS = {
    "date": "2024-01-01",
    "date-time": "2024-01-01T00:00:00Z",
    "time": "00:00:00",
    "email": "user@example.com",
    "uri": "https://example.com",
    "url": "https://example.com",
    "uuid": "00000000-0000-0000-0000-000000000000",
}
_WORD = "example"


def _resolve_ref(ref: str, root: dict[str, Any]) -> dict[str, Any]:
    """Resolve a local ``#/...`` JSON pointer (``$defs``, ``definitions``); else ``{}``."""
    if not ref.startswith("#/"):
        return {}
    node: Any = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return {}
        node = node[part]
    return node if isinstance(node, dict) else {}


def example_value(schema: Any, root: dict[str, Any] | None = None, depth: int = 0) -> Any:
    """A deterministic value valid for ``schema`` (the common JSON-schema subset).

    Covers what tool schemas use in practice: ``type`` (or a list of types),
    ``enum``/``const``/``default``, ``$ref`` into ``$defs``, ``anyOf``/``oneOf``
    (first non-null branch), ``allOf`` (merged), numeric bounds, string length and
    well-known formats, ``minItems``/``maxItems``. ``pattern`` is not honoured.
    """
    if not isinstance(schema, dict):
        return None
    root = schema if root is None else root
    if depth > _MAX_DEPTH:
        return None
    if "$ref" in schema:
        return example_value(_resolve_ref(schema["$ref"], root), root, depth + 1)
    if "const" in schema:
        return schema["const"]
    enum = schema.get("enum")
    if enum:
        return enum[0]
    if "default" in schema:
        return schema["default"]
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if branches:
            for branch in branches:
                if not (isinstance(branch, dict) and branch.get("type") == "null"):
                    return example_value(branch, root, depth + 1)
            return None
    if schema.get("allOf"):
        return example_value(_merged(schema, root), root, depth + 1)
    kind = _kind(schema)
    if kind is None:
        return _WORD  # unconstrained: any JSON value is valid
    make = _BY_KIND.get(kind)
    return make(schema, root, depth) if make else _WORD


def _merged(schema: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with its ``allOf`` parts merged in (properties and required lists joined)."""
    merged: dict[str, Any] = {k: v for k, v in schema.items() if k != "allOf"}
    for part in schema["allOf"]:
        if isinstance(part, dict) and "$ref" in part:
            part = _resolve_ref(part["$ref"], root)
        if isinstance(part, dict):
            for k, v in part.items():
                if k in ("properties",) and k in merged:
                    merged[k] = {**merged[k], **v}
                elif k == "required" and k in merged:
                    merged[k] = [*merged[k], *v]
                else:
                    merged.setdefault(k, v)
    return merged


def _kind(schema: dict[str, Any]) -> str | None:
    """The schema's type (the first non-null of a list; guessed from its keys where unsaid), None: unconstrained."""
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind is None:
        if "properties" in schema:
            return "object"
        if "items" in schema or "prefixItems" in schema:
            return "array"
    return kind


def _string(schema: dict[str, Any], root: dict[str, Any], depth: int) -> str:
    fmt = schema.get("format")
    text = _STRING_FORMATS.get(fmt, _WORD) if isinstance(fmt, str) else _WORD
    lo, hi = schema.get("minLength"), schema.get("maxLength")
    if isinstance(lo, int) and len(text) < lo:
        text = text + "x" * (lo - len(text))
    if isinstance(hi, int) and len(text) > hi:
        text = text[:hi]
    return text


def _is_number(x: Any) -> TypeGuard[float]:
    """A JSON number (a bool is not one)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _bounded(schema: dict[str, Any]) -> float:
    """1, moved inside the schema's ``minimum``/``maximum`` (exclusive or not)."""
    lo, xlo = schema.get("minimum"), schema.get("exclusiveMinimum")
    hi, xhi = schema.get("maximum"), schema.get("exclusiveMaximum")
    value: float = 1
    if _is_number(lo):
        value = lo
    elif _is_number(xlo):
        value = xlo + 1
    if _is_number(hi) and value > hi:
        value = hi
    elif _is_number(xhi) and value >= xhi:
        value = xhi - 1
    return value


def _integer(schema: dict[str, Any], root: dict[str, Any], depth: int) -> int:
    value = _bounded(schema)
    return int(value) if float(value).is_integer() else int(value) + 1


def _array(schema: dict[str, Any], root: dict[str, Any], depth: int) -> list[Any]:
    prefix = schema.get("prefixItems")
    if isinstance(prefix, list) and prefix:
        return [example_value(s, root, depth + 1) for s in prefix]
    lo, hi = schema.get("minItems"), schema.get("maxItems")
    n = max(1, lo) if isinstance(lo, int) else 1
    if isinstance(hi, int):
        n = min(n, hi)
    items = schema.get("items", {})
    return [example_value(items, root, depth + 1) for _ in range(n)]


def _object(schema: dict[str, Any], root: dict[str, Any], depth: int) -> dict[str, Any]:
    props = schema.get("properties") or {}
    wanted = list(schema.get("required") or [])
    if schema.get("additionalProperties") is False:
        wanted += [p for p in props if p not in wanted]
    return {
        name: example_value(props.get(name, {}), root, depth + 1)
        for name in dict.fromkeys(wanted)  # dedupe, keep order
    }


_BY_KIND: dict[str, Callable[[dict[str, Any], dict[str, Any], int], Any]] = {
    "string": _string,
    "integer": _integer,
    "number": lambda schema, root, depth: float(_bounded(schema)),
    "boolean": lambda schema, root, depth: True,
    "null": lambda schema, root, depth: None,
    "array": _array,
    "object": _object,
}


def example_arguments(parameters: Any) -> str:
    """The JSON ``arguments`` string for a tool whose parameter schema is ``parameters``."""
    value = example_value(parameters) if isinstance(parameters, dict) else {}
    if not isinstance(value, dict):
        value = {}
    return msgspec.json.encode(value).decode()


def _words(text: str) -> int:
    """Roughly the whitespace-separated words (C-speed counts, no list built)."""
    return text.count(" ") + text.count("\n") + 1 if text else 0


def _item_words(item: Item) -> int:
    if isinstance(item, Message):
        return _words(message_text(item))
    if isinstance(item, FunctionCall):
        return _words(item.arguments) + 1
    if isinstance(item, FunctionCallOutput):
        return _words(item.output)
    if isinstance(item, Reasoning):
        return sum(_words(s.get("text", "")) for s in item.summary)
    return 0


def _item_ids(items: list[Item]) -> list[int]:
    """Made-up token ids of ``items``: one per word (its length, so ids are small and the same for the same text),
    and one that ends each item."""
    ids: list[int] = []
    for item in items:
        if isinstance(item, Message):
            text = message_text(item)
        elif isinstance(item, FunctionCall):
            text = f"{item.name} {item.arguments}"
        elif isinstance(item, FunctionCallOutput):
            text = item.output
        else:
            text = ""
        ids += [len(w) for w in text.split()]
        ids.append(0)
    return ids


def _add_token_ids(items: list[Item], output: list[Item]) -> None:
    """Token ids and logprobs on the last output item, as a token-in adapter puts them: the prompt is the last
    turn's prompt and generation, then the ids of the items since it."""
    seen: list[int] = []
    since = 0
    for k in range(len(items) - 1, -1, -1):
        item = items[k]
        if isinstance(item, (Message, FunctionCall, Reasoning)) and isinstance(item.generation_token_ids, list):
            seen = [*(item.prompt_token_ids or ()), *item.generation_token_ids]
            since = k + 1
            break
    generated = _item_ids(output)
    last = output[-1]
    assert isinstance(last, (Message, FunctionCall))
    last.prompt_token_ids = seen + _item_ids(items[since:])
    last.generation_token_ids = generated
    last.generation_log_probs = [-0.5] * len(generated)


def _forced_tool(tool_choice: Any) -> str | None:
    """The function name a ``tool_choice`` object forces (Responses or chat shape)."""
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function")
        return (fn or {}).get("name") if isinstance(fn, dict) else tool_choice.get("name")
    return None


class Options(AdapterOptions, kw_only=True, forbid_unknown_fields=True):
    """``adapter: scripted`` keys."""

    model: str | None = None  # the model name put on responses
    delay_s: float = 0.0  # simulated latency per call
    budget_s: float = 480.0  # how long one call may take (its callers' patience): small in tests of slow calls
    # The final message's text by the prompt: the first key (in the order given) found in the text of the
    # request's last message; "" matches any. For hosting code that parses what its model says (a judge's
    # JSON verdict, a game's move tag), which "OK" would fail. No key found: the default answer.
    answers: dict[str, str] = msgspec.field(default_factory=dict)
    # As a token-in adapter: each response's last item carries prompt and generation token ids and logprobs
    # (one made-up id per word, each turn's prompt the turns before it and then what came since), so trainer
    # adapters run on it (``tests/bench/instructions.py --with-trl-adapter``).
    token_ids: bool = False
    # Route as if each replica held a prefix cache (``affinity_load``): for tests and benchmarks of the routing,
    # whose stand-in engines keep one; the scripted model itself has none, so by default nothing is routed.
    prefix_cache: bool = False

    def call_budget_s(self) -> float:
        return self.budget_s

    def holds_prefix_cache(self) -> bool:
        return self.prefix_cache


class ScriptedModel:
    """Calls each offered tool once (schema-valid arguments), then answers.

    TEST DOUBLE for the LLM: deterministic, offline, no tokenizer. Behaviour per call:

    * tools offered (``params.tools``, Responses function tools) that have no
      ``function_call`` with that name in ``params.input`` yet → one ``function_call``
      per such tool, in tool order, all in this response (only the first when
      ``parallel_tool_calls`` is false; none when ``tool_choice`` is ``"none"``);
    * otherwise → an assistant message: the first of ``answers`` whose key is in the
      text of the input's last message, else one quoting the trailing
      ``function_call_output`` items of the input (joined by newlines), or ``"OK"``
      if there are none.

    ``call_id`` is ``call_{len(input)}_{i}``: unique within a conversation and the
    same for the same conversation. Usage counts (roughly) whitespace-separated words.
    ``delay_s > 0`` sleeps that long per call (simulated model latency).
    """

    def __init__(self, cfg: Options | None = None, *, concurrency: int = 64, base_dir: str | None = None) -> None:
        self.cfg = cfg or Options()
        self._delay = float(self.cfg.delay_s or 0.0)
        self._model = self.cfg.model or "scripted"
        self._ids = itertools.count(1)
        self._args_cache: dict[tuple[str, bytes], str] = {}

    def _arguments(self, name: str, parameters: Any) -> str:
        try:
            key = (name, msgspec.json.encode(parameters))
        except (TypeError, msgspec.EncodeError):
            return example_arguments(parameters)
        args = self._args_cache.get(key)
        if args is None:
            if len(self._args_cache) >= _CACHE_MAX:
                self._args_cache.clear()
            args = self._args_cache[key] = example_arguments(parameters)
        return args

    def _answer(self, items: list[Item]) -> str:
        """The configured answer for this prompt, else the tool outputs quoted, else ``"OK"``."""
        if self.cfg.answers:
            last = next((message_text(i) for i in reversed(items) if isinstance(i, Message)), "")
            for key, text in self.cfg.answers.items():
                if key in last:
                    return text
        outputs: list[str] = []
        for item in reversed(items):
            if not isinstance(item, FunctionCallOutput):
                break
            outputs.append(item.output)
        return "\n".join(reversed(outputs)) if outputs else "OK"

    async def generate(self, params: CreateParams, *, rollout_key: str | None = None) -> Response:
        if self._delay > 0:
            await anyio.sleep(self._delay)
        n = next(self._ids)
        items = params.input
        output: list[Item] = []

        tools = params.tools or ()
        if tools and params.tool_choice != "none":
            called = {i.name for i in items if isinstance(i, FunctionCall)}
            pos = len(items)
            only = _forced_tool(params.tool_choice)
            for tool in tools:
                if tool.get("type", "function") != "function":
                    continue  # built-in tools (web_search, ...) are never called
                fn = tool["function"] if isinstance(tool.get("function"), dict) else tool
                name = fn.get("name")
                if not name or name in called or (only is not None and name != only):
                    continue
                called.add(name)
                call_id = f"call_{pos}_{len(output)}"
                output.append(
                    FunctionCall(
                        name=name,
                        arguments=self._arguments(name, fn.get("parameters")),
                        call_id=call_id,
                        id=f"fc_{pos}_{len(output)}",
                        status="completed",
                    )
                )
                if params.parallel_tool_calls is False:
                    break

        if not output:
            output.append(assistant_message(self._answer(items), id=f"msg_scripted_{n}"))

        if self.cfg.token_ids:
            _add_token_ids(items, output)
        in_tokens = sum(_item_words(i) for i in items) + 1
        out_tokens = sum(_item_words(i) for i in output) + 1
        return Response(
            id=f"resp_scripted_{n}",
            created_at=time.time(),
            model=self._model,
            output=output,
            tools=list(tools),
            temperature=params.temperature,
            top_p=params.top_p,
            max_output_tokens=params.max_output_tokens,
            parallel_tool_calls=params.parallel_tool_calls is not False,
            tool_choice=params.tool_choice if params.tool_choice is not None else "auto",
            usage=Usage(
                input_tokens=in_tokens,
                output_tokens=out_tokens,
                total_tokens=in_tokens + out_tokens,
            ),
        )

    async def aclose(self) -> None:
        return None


create = ScriptedModel
