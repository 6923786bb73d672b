"""Token-in helpers shared by the ``vllm`` and ``vllm_engine`` adapters.

Both build later turns of a rollout token-contiguously (the rollout's ids, then
the chat template's ids after the previous turn's end token: ``splice_prompt``;
the construction is explained in ``gym_runtime.models.vllm``'s docstring), find
the turn-end token the same way and turn raw generated text back into a chat
message as vLLM's chat endpoint would (``/v1/completions`` runs no server-side
parser: a Hermes tool-call parser with vLLM's ``hermes`` semantics and ``<think>``
normalisation are here). ``TOKEN_FIELDS`` are the option keys both
adapters read; this module imports without vLLM installed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any
from uuid import uuid4

import msgspec

from gym_runtime.errors import ModelError
from gym_runtime.messages import FunctionCall, Item, Message, Reasoning

__all__ = [
    "TOKEN_FIELDS",
    "find_end_token",
    "last_token_turn",
    "message_from_raw_text",
    "normalize_think",
    "parse_hermes_tool_calls",
    "splice_prompt",
    "tool_choice_structured_outputs",
]

# (name, type, default) of the option keys for training data and parsing, in
# both vLLM adapters' ``Options`` (msgspec.defstruct: Structs allow one base with fields).
TOKEN_FIELDS: list[tuple[str, Any, Any]] = [
    # prompt/generation token ids + logprobs on the last item
    ("return_token_ids", bool, False),
    # later turns send the rollout's token ids (contiguous prompts)
    ("token_in", bool, True),
    # the turn-end token; found from the chat template if unset
    ("eos_token_id", int | None, None),
    # parses raw text on the token-in path / in-process
    ("tool_call_parser", str | None, "hermes"),
    # vllm: the server runs one (history reasoning goes in the `reasoning` field);
    # vllm_engine: the vLLM reasoning parser to run (unset: <think> spans)
    ("reasoning_parser", str | None, None),
    ("chat_template_kwargs", dict[str, Any], msgspec.field(default_factory=dict)),
]


def last_token_turn(items: list[Item]) -> int | None:
    """Index of the last input item carrying token ids (the previous call's last item)."""
    for i in range(len(items) - 1, -1, -1):
        item = items[i]
        if isinstance(item, (Message, FunctionCall, Reasoning)) and isinstance(item.prompt_token_ids, list):
            return i
    return None


def tool_choice_structured_outputs(body: dict[str, Any]) -> dict[str, Any] | None:
    """What vLLM's chat endpoint does for ``tool_choice`` named / required, for raw prompts:
    named → the function's parameters as a JSON schema (the output is the arguments);
    required → a JSON array of ``{"name", "parameters"}`` calls."""
    choice = body.get("tool_choice")
    tools = {t["function"]["name"]: t["function"] for t in body.get("tools") or ()}
    if isinstance(choice, dict) and tools:
        fn = tools.get((choice.get("function") or {}).get("name"))
        if fn is None:
            raise ModelError(f"tool_choice names {choice!r}, which is not among the tools")
        return {"json": fn.get("parameters") or {"type": "object"}}
    if choice == "required" and tools:
        return {
            "json": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "anyOf": [
                        {
                            "type": "object",
                            "properties": {"name": {"enum": [n]}, "parameters": f.get("parameters") or {}},
                            "required": ["name", "parameters"],
                        }
                        for n, f in tools.items()
                    ]
                },
            }
        }
    return None


def message_from_raw_text(
    text: str,
    body: dict[str, Any],
    *,
    parse_tools: Callable[[str], tuple[str | None, list[dict[str, Any]]]] | None,
    think: bool = True,
) -> dict[str, Any]:
    """Raw generated text → a chat assistant message, as vLLM's chat endpoint would build it.

    ``tool_choice`` named: the text is the arguments; required: a JSON array of calls;
    auto: ``parse_tools`` (e.g. Hermes); none / no tools: all text. ``think``: give a
    ``</think>`` whose ``<think>`` the template opened its tag back.
    """
    tools = body.get("tools")
    choice = body.get("tool_choice", "auto" if tools else "none")
    calls: list[dict[str, Any]] = []
    content: str | None = text
    if tools and isinstance(choice, dict):
        calls = [
            {
                "id": _tool_call_id(),
                "type": "function",
                "function": {"name": choice["function"]["name"], "arguments": text},
            }
        ]
        content = None
    elif tools and choice == "required":
        try:
            calls = [
                {
                    "id": _tool_call_id(),
                    "type": "function",
                    "function": {"name": c["name"], "arguments": msgspec.json.encode(c["parameters"]).decode()},
                }
                for c in msgspec.json.decode(text)
            ]
            content = None
        except (msgspec.DecodeError, TypeError, KeyError):
            calls = []
    elif tools and choice != "none" and parse_tools is not None:
        content, calls = parse_tools(text)
    if content and think:
        content = normalize_think(content)
    return {"role": "assistant", "content": content, "tool_calls": calls}


def _tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid4().hex[:16]}"


def splice_prompt(rollout: list[int], template_ids: list[int], eos: int) -> list[int]:
    """The contiguous prompt: the rollout's ids, then the template's ids after the previous turn.

    ``template_ids`` is the chat template's tokenization of the whole conversation
    (with the generation prompt). The previous assistant turn ends at its k-th
    ``eos``, k = the number of ``eos`` in the rollout (the turn-end appended first
    when the previous generation was cut short). See the module docstring.
    """
    prefix = rollout if rollout and rollout[-1] == eos else [*rollout, eos]
    turns = prefix.count(eos)
    seen = 0
    for i, t in enumerate(template_ids):
        if t == eos:
            seen += 1
            if seen == turns:
                return prefix + template_ids[i + 1 :]
    raise ModelError(
        f"token-in: the chat template renders {seen} turn ends but the rollout so far has {turns};"
        " cannot find the new messages' ids"
    )


def find_end_token(head: list[int], turn: list[int], word: list[int]) -> int | None:
    """The turn-end token: in ``turn`` (``[user, assistant "ok"]`` rendered without a generation
    prompt), the token right after ``word`` (``"ok"`` tokenized alone), past ``head`` (the
    ``[user]`` rendering with the generation prompt)."""
    start = len(head) if turn[: len(head)] == head else 0
    for i in range(start, len(turn) - len(word)):
        if turn[i : i + len(word)] == word:
            return turn[i + len(word)]
    return None


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
