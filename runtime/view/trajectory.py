"""A row as the trajectory page shows it: the input, then every output item in order (messages, reasoning,
tool calls with their arguments, tool outputs), each text whole; what the page cannot place, as JSON.

Plain data for the template (which escapes every string); nothing here is HTML.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

LONG_CHARS = 3000  # a text longer than this (or of more lines) is shown collapsed, whole
LONG_LINES = 40
SHOWN = {  # keys the page lays out itself; any other is listed under "other fields"
    "responses_create_params",
    "response",
    "reward",
    "agent_ref",
    "_ng_task_index",
    "_ng_rollout_index",
    "policy_versions",
    "cost",
    "provenance",
    "error_class",
    "error",
    "attempts",
}


@dataclass
class Text:
    """A text shown whole; ``long`` ones start collapsed, with their first line as the summary."""

    text: str
    long: bool = False
    head: str = ""

    @classmethod
    def of(cls, text: str) -> Text:
        long = len(text) > LONG_CHARS or text.count("\n") > LONG_LINES
        head = text[:200].split("\n", 1)[0] if long else ""
        return cls(text, long, head)


@dataclass
class Block:
    kind: str  # message, reasoning, call, output, input, item
    title: str
    texts: list[Text] = field(default_factory=list)
    prompt_tokens: int | None = None
    generation_tokens: int | None = None
    logprobs: list[tuple[int | str, float]] = field(default_factory=list)
    policy_version: int | None = None
    policy_version_ranges: list[Any] = field(default_factory=list)


def _json(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False)


def _content_texts(content: Any) -> list[Text]:
    if isinstance(content, str):
        return [Text.of(content)]
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                out.append(Text.of(part["text"]))
            else:
                out.append(Text.of(_json(part)))
        return out
    return [] if content is None else [Text.of(_json(content))]


def _arguments(raw: Any) -> Text:
    if isinstance(raw, str):
        try:
            return Text.of(_json(json.loads(raw)))
        except ValueError:
            return Text.of(raw)
    return Text.of(_json(raw))


def block(item: Any, where: str) -> Block:
    """One input or output item (Responses API shapes; anything else shown as JSON)."""
    if not isinstance(item, dict):
        return Block("item", where, [Text.of(item if isinstance(item, str) else _json(item))])
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        b = Block("message", f"{where} {item.get('role', '?')}", _content_texts(item.get("content")))
    elif kind == "reasoning":
        texts = [Text.of(s["text"]) for s in item.get("summary") or [] if isinstance(s, dict) and "text" in s]
        texts += _content_texts(item.get("content")) if item.get("content") else []
        b = Block("reasoning", f"{where} reasoning", texts)
    elif kind == "function_call":
        b = Block(
            "call",
            f"{where} tool call {item.get('name', '?')} ({item.get('call_id', '')})",
            [_arguments(item.get("arguments"))],
        )
    elif kind == "function_call_output":
        out = item.get("output")
        b = Block("output", f"{where} tool output ({item.get('call_id', '')})", _content_texts(out))
    else:
        return Block("item", f"{where} {kind or 'item'}", [Text.of(_json(item))])
    prompt, generated = item.get("prompt_token_ids"), item.get("generation_token_ids")
    b.prompt_tokens = len(prompt) if isinstance(prompt, list) else None
    b.generation_tokens = len(generated) if isinstance(generated, list) else None
    lps = item.get("generation_log_probs")
    if isinstance(lps, list):
        ids = generated if isinstance(generated, list) and len(generated) == len(lps) else ["?"] * len(lps)
        b.logprobs = [(t, lp) for t, lp in zip(ids, lps) if isinstance(lp, (int, float))]
    pv = item.get("policy_version")
    b.policy_version = pv if isinstance(pv, int) else None
    ranges = item.get("policy_version_ranges")
    b.policy_version_ranges = ranges if isinstance(ranges, list) else []
    return b


@dataclass
class Trajectory:
    inputs: list[Block]
    outputs: list[Block]
    tools: Text | None
    tool_names: list[str]
    usage: Text | None
    other: list[tuple[str, Text]]
    row: dict[str, Any]


def trajectory(row: dict[str, Any]) -> Trajectory:
    params = row.get("responses_create_params")
    if not isinstance(params, dict):  # a failure row keeps its task's row as ``input``
        task = row.get("input")
        params = task.get("responses_create_params") if isinstance(task, dict) else None
    params = params if isinstance(params, dict) else {}
    inputs = []
    if params.get("instructions"):
        inputs.append(Block("message", "instructions", _content_texts(params["instructions"])))
    given = params.get("input")
    for n, item in enumerate(given if isinstance(given, list) else [given] if given else []):
        inputs.append(block(item, f"input {n + 1}"))
    tools = Text.of(_json(params["tools"])) if params.get("tools") else None
    offered = params.get("tools")
    names = [_tool_name(t) for t in offered if isinstance(t, dict)] if isinstance(offered, list) else []
    response = row.get("response")
    output = response.get("output") if isinstance(response, dict) else None
    outputs = [block(item, f"turn {n + 1}") for n, item in enumerate(output if isinstance(output, list) else [])]
    usage = response.get("usage") if isinstance(response, dict) else None
    other = [(k, Text.of(v if isinstance(v, str) else _json(v))) for k, v in row.items() if k not in SHOWN]
    return Trajectory(inputs, outputs, tools, names, Text.of(_json(usage)) if usage else None, other, row)


def _tool_name(tool: dict[str, Any]) -> str:
    """A tool's name: the Responses API's ``name``, or Chat Completions' ``function.name``."""
    fn = tool.get("function")
    return str(tool.get("name") or (fn.get("name") if isinstance(fn, dict) else None) or "?")


def as_text(value: Any) -> Text:
    return Text.of(value if isinstance(value, str) else _json(value))


def _when(epoch: Any) -> str:
    if not isinstance(epoch, (int, float)):
        return ""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(epoch)) + f".{int(epoch % 1 * 1000):03d} UTC"


def _calls(calls: Any) -> list[str]:
    """``explain``'s calls, a phrase each: a model call ``[start_ms, ms, in, out]``, a tool call ``[start_ms, ms]``."""
    out = []
    for c in calls if isinstance(calls, list) else []:
        if isinstance(c, list) and len(c) >= 4:
            out.append(f"+{c[0]} ms model {c[1]} ms, {c[2]} in / {c[3]} out tokens")
        elif isinstance(c, list) and len(c) >= 2:
            out.append(f"+{c[0]} ms tool {c[1]} ms")
    return out


ORDER = {"attempt.start.v1": 0, "attempt.nak.v1": 1, "result": 2}


def kept_attempt(row: dict[str, Any]) -> int:
    """The attempt whose result a row is: its ``provenance.attempt`` (1 when left out), a failure row's ``attempts``."""
    if "error_class" in row and isinstance(row.get("attempts"), int):
        return int(row["attempts"])
    prov = row.get("provenance")
    return int(prov.get("attempt", 1)) if isinstance(prov, dict) else 1


def attempt_rows(records: list[dict[str, Any]], kept: int) -> list[dict[str, Any]]:
    """A slot's lines of the attempts sidecar by attempt, as the trajectory page lists them (strings; escaped
    there); ``kept``: the attempt whose result the slot keeps."""
    out = []
    records = sorted(records, key=lambda r: (r.get("attempt") or 0, ORDER.get(str(r.get("kind")), 3)))
    for r in records:
        kind = r.get("kind")
        row: dict[str, Any] = {"attempt": r.get("attempt"), "calls": _calls(r.get("calls")), "commands": []}
        if kind == "attempt.start.v1":
            row |= {"what": "started", "when": _when(r.get("at"))}
            row["detail"] = f"worker {r.get('worker')} on node {r.get('node')} (pid {r.get('pid')})"
        elif kind == "attempt.nak.v1":
            err: dict[str, Any] = r["error"] if isinstance(r.get("error"), dict) else {}
            row |= {"what": "given back", "when": _when(r.get("at"))}
            row["detail"] = f"{err.get('error_class')}: {err.get('message')} (worker {r.get('worker')}; runs again)"
        elif kind == "result":
            failed = r.get("error_class")
            row |= {"what": "failure row" if failed else "result", "when": ""}
            row["detail"] = (f"{failed}: {r.get('message')}" if failed else "a row") + (
                " (the slot's)" if r.get("attempt") == kept else " (not kept)"
            )
            row["commands"] = [c for c in r.get("commands") or [] if isinstance(c, dict)]
        else:
            row |= {"what": str(kind), "when": "", "detail": _json(r)}
        out.append(row)
    return out
