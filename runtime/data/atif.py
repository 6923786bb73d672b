"""Rows to and from ATIF, Harbor's Agent Trajectory Interchange Format (``ATIF-v1.8``), as plain dicts.

A row's input messages become ``system`` and ``user`` steps; its output items, ``agent`` steps: reasoning
(``reasoning_content``), the assistant's message, its tool calls (arguments parsed) and their outputs as
the step's observation, token ids and logprobs as the step's metrics. ATIF has no reward or task fields: ours
ride in ``extra["gym_runtime"]``, the row's other keys at the root and, per step, each output item less the
texts the step already holds, so ``from_atif`` gives our own exports back whole. A foreign trajectory comes
back as a row with its steps as items, no reward and no task fields (``view`` shows it; nothing regrades it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from gym_runtime.data.jsonlines import TOO_DEEP, json_value
from gym_runtime.errors import UserError

SCHEMA = "ATIF-v1.8"
KEY = "gym_runtime"
ROOT_KEYS = ("responses_create_params", "response")  # laid out as steps; every other row key rides in extra


def _obj(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return "" if content is None else json.dumps(content)


def _single_text(item: dict[str, Any]) -> bool:
    """A message whose content is one text part (or a string): its text is the step's message alone."""
    c = item.get("content")
    return isinstance(c, str) or (isinstance(c, list) and len(c) == 1 and isinstance(c[0], dict) and "text" in c[0])


def _args(raw: Any) -> tuple[dict[str, Any], bool]:
    """A call's arguments as ATIF's object, and whether the original string is exactly its JSON."""
    if isinstance(raw, dict):
        return raw, False
    try:
        parsed = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        return parsed, json.dumps(parsed) == raw
    return {"_raw": raw}, False


def _kept(item: dict[str, Any], **drop: bool) -> dict[str, Any]:
    """An output item less the texts its step holds (restored from the step on import)."""
    out = dict(item)
    if drop.get("content"):
        c = out["content"]
        out["content"] = [{**c[0], "text": None}] if isinstance(c, list) else None
    if drop.get("arguments"):
        del out["arguments"]
    if drop.get("output"):
        del out["output"]
    if drop.get("tokens"):
        for k in ("prompt_token_ids", "generation_token_ids", "generation_log_probs"):
            out.pop(k, None)
    return out


def _metrics(item: dict[str, Any]) -> dict[str, Any] | None:
    m = {
        "prompt_token_ids": item.get("prompt_token_ids"),
        "completion_token_ids": item.get("generation_token_ids"),
        "logprobs": item.get("generation_log_probs"),
    }
    lists: dict[str, list[Any]] = {k: v for k, v in m.items() if isinstance(v, list)}
    if not lists:
        return None
    out: dict[str, Any] = dict(lists)
    if "prompt_token_ids" in lists:
        out["prompt_tokens"] = len(lists["prompt_token_ids"])
    if "completion_token_ids" in lists:
        out["completion_tokens"] = len(lists["completion_token_ids"])
    return out


def to_atif(row: dict[str, Any], *, model_name: str | None = None) -> dict[str, Any]:
    """One row as one ATIF trajectory document."""
    params = _obj(row.get("responses_create_params"))
    steps: list[dict[str, Any]] = []

    def step(source: str, message: str, **more: Any) -> dict[str, Any]:
        s = {"step_id": len(steps) + 1, "source": source, "message": message, **more}
        steps.append(s)
        return s

    if params.get("instructions"):
        step("system", _text(params["instructions"]), extra={KEY: {"instructions": True}})
    given = params.get("input")
    inputs = given if isinstance(given, list) else ([{"role": "user", "content": given}] if given else [])
    for item in inputs:
        role = item.get("role") if isinstance(item, dict) else None
        if role in ("system", "developer", "user"):
            step("user" if role == "user" else "system", _text(item.get("content")), extra={KEY: {"input": item}})
        else:  # an earlier turn's assistant message or tool call: kept as it was
            step("system", "", extra={KEY: {"input": item}})
    response = _obj(row.get("response"))
    current: dict[str, Any] | None = None
    for item in response.get("output") or []:
        if not isinstance(item, dict):
            continue
        kind = item.get("type")
        if current is None or (kind in ("reasoning", "message") and (current["_msg"] or current.get("tool_calls"))):
            current = step("agent", "", extra={KEY: {"items": []}})
            current["_msg"] = False
        mine = current["extra"][KEY]
        items = mine["items"]
        metrics = _metrics(item)
        tokens = bool(metrics) and "metrics" not in current  # a step's metrics: its first item's token data
        if tokens:
            current["metrics"], mine["metrics_item"] = metrics, len(items)
        if kind == "reasoning":
            texts = [p.get("text", "") for p in item.get("summary") or [] if isinstance(p, dict)]
            current["reasoning_content"] = "\n".join(filter(None, [current.get("reasoning_content"), *texts]))
            items.append(_kept(item, tokens=tokens))  # (its summary parts as they were)
        elif kind == "message":
            current["message"], current["_msg"] = _text(item.get("content")), True
            items.append(_kept(item, content=_single_text(item), tokens=tokens))
        elif kind == "function_call":
            arguments, exact = _args(item.get("arguments"))
            call = {"tool_call_id": item.get("call_id") or f"call_{len(steps)}", "function_name": item.get("name", "")}
            current.setdefault("tool_calls", []).append({**call, "arguments": arguments})
            items.append(_kept(item, arguments=exact, tokens=tokens))
        elif kind == "function_call_output":
            holder = next((s for s in reversed(steps) if _calls(s, item.get("call_id"))), None)
            target = holder or current
            result = {"content": _text(item.get("output")), "source_call_id": item.get("call_id") if holder else None}
            target.setdefault("observation", {"results": []})["results"].append(result)
            items.append(_kept(item, output=isinstance(item.get("output"), str) and holder is not None, tokens=tokens))
        else:
            items.append(_kept(item, tokens=tokens))
    for s in steps:
        s.pop("_msg", None)
    fields = {k: v for k, v in row.items() if k not in ROOT_KEYS}
    agent_ref = row.get("agent_ref")
    name = agent_ref.get("name") if isinstance(agent_ref, dict) else None
    doc: dict[str, Any] = {
        "schema_version": SCHEMA,
        "session_id": f"task-{row.get('_ng_task_index')}-rollout-{row.get('_ng_rollout_index')}",
        "agent": {"name": str(name or "gym-runtime"), "version": _runtime(row), "model_name": model_name},
        "steps": steps,
        "extra": {
            KEY: {
                "row": fields,
                "responses_create_params": {k: v for k, v in params.items() if k != "input"},
                "response": {k: v for k, v in response.items() if k != "output"},
            }
        },
    }
    if params.get("tools"):
        doc["agent"]["tool_definitions"] = [t for t in params["tools"] if isinstance(t, dict)]
    usage = _obj(response.get("usage"))
    final = {"total_prompt_tokens": usage.get("input_tokens"), "total_completion_tokens": usage.get("output_tokens")}
    cost = _obj(row.get("cost"))
    if cost.get("currency") == "USD" and isinstance(cost.get("estimated_cost"), (int, float)):
        final["total_cost_usd"] = cost["estimated_cost"]
    final["total_steps"] = len(steps)
    doc["final_metrics"] = {k: v for k, v in final.items() if v is not None}
    if model_name is None:
        del doc["agent"]["model_name"]
    return doc


def _calls(step: dict[str, Any], call_id: Any) -> bool:
    return any(c.get("tool_call_id") == call_id for c in step.get("tool_calls") or [])


def _runtime(row: dict[str, Any]) -> str:
    prov = row.get("provenance")
    return str(prov.get("runtime")) if isinstance(prov, dict) and prov.get("runtime") else "unknown"


def is_atif(doc: Any) -> bool:
    return isinstance(doc, dict) and str(doc.get("schema_version", "")).startswith("ATIF-")


def is_ours(doc: dict[str, Any]) -> bool:
    """An ATIF document ``to_atif`` wrote (it carries the row's fields)."""
    extra = doc.get("extra")
    return isinstance(extra, dict) and isinstance(extra.get(KEY), dict)


def from_atif(doc: dict[str, Any], n: int = 0) -> dict[str, Any]:
    """An ATIF document as a row: ours whole (from ``extra``); a foreign one's steps as items, task ``n``."""
    ours = doc["extra"][KEY] if is_ours(doc) else None
    inputs: list[Any] = []
    output: list[dict[str, Any]] = []
    instructions = None
    outputs = {  # every tool call's output by its id (a step's observation may answer an earlier step's call)
        r.get("source_call_id"): r
        for s in doc.get("steps") or []
        for r in (s.get("observation") or {}).get("results") or []
        if r.get("source_call_id") is not None
    }
    for s in doc.get("steps") or []:
        mine = (s.get("extra") or {}).get(KEY) if isinstance(s.get("extra"), dict) else None
        if s.get("source") in ("system", "user"):
            if isinstance(mine, dict) and mine.get("instructions"):
                instructions = s.get("message")
            elif isinstance(mine, dict) and "input" in mine:
                inputs.append(mine["input"])
            else:
                inputs.append(
                    {"role": "user" if s["source"] == "user" else "system", "content": _text(s.get("message"))}
                )
            continue
        output += _agent_items(s, mine, outputs)
    params: dict[str, Any] = {"input": inputs}
    if instructions is not None:
        params["instructions"] = instructions
    if isinstance(ours, dict):
        params = {**(ours.get("responses_create_params") or {}), **params}
        row = {"responses_create_params": params, "response": {**(ours.get("response") or {}), "output": output}}
        row.update(ours.get("row") or {})
        return row
    agent = _obj(doc.get("agent"))
    if agent.get("tool_definitions"):
        params["tools"] = agent["tool_definitions"]
    return {
        "responses_create_params": params,
        "response": {"output": output},
        "_ng_task_index": n,
        "_ng_rollout_index": 0,
        "agent_ref": {"type": "atif", "name": str(agent.get("name", "atif"))},
        "atif": {k: v for k, v in doc.items() if k in ("session_id", "trajectory_id", "notes", "final_metrics")},
    }


def _agent_items(s: dict[str, Any], mine: Any, outputs: dict[Any, Any]) -> list[dict[str, Any]]:
    """An agent step's output items: those our export kept, their texts restored; else made from the step."""
    calls = {c.get("tool_call_id"): c for c in s.get("tool_calls") or []}
    results = [r for r in (s.get("observation") or {}).get("results") or []]
    by_call = {r.get("source_call_id"): r for r in results if r.get("source_call_id") is not None}
    loose = [r for r in results if r.get("source_call_id") is None]
    metrics = _obj(s.get("metrics"))
    kept = mine.get("items") if isinstance(mine, dict) else None
    mine_index = mine.get("metrics_item") if isinstance(mine, dict) else None
    if kept is None:
        kept = []
        if s.get("reasoning_content"):
            kept.append({"type": "reasoning", "summary": [{"type": "summary_text", "text": s["reasoning_content"]}]})
        if _text(s.get("message")):  # the step's text, then its own tool calls (an agent says, then does)
            kept.append({"type": "message", "role": "assistant", "content": None})
        kept += [{"type": "function_call", "call_id": cid, "name": c.get("function_name")} for cid, c in calls.items()]
        kept += [{"type": "function_call_output", "call_id": cid} for cid in by_call]
        kept += [{"type": "function_call_output", "call_id": None, "output": _text(r.get("content"))} for r in loose]
    at = (
        mine_index
        if mine_index is not None
        else next((i for i, it in enumerate(kept) if it.get("type") in ("message", "function_call")), None)
    )
    out = []
    for i, item in enumerate(kept):
        item = dict(item)
        kind = item.get("type")
        if kind == "message" and (item.get("content") is None or _blank_part(item.get("content"))):
            c = item.get("content")
            text = _text(s.get("message"))
            item["content"] = (
                [{**c[0], "text": text}] if isinstance(c, list) else [{"type": "output_text", "text": text}]
            )
        elif kind == "function_call" and "arguments" not in item:
            args = (calls.get(item.get("call_id")) or {}).get("arguments", {})
            item["arguments"] = json.dumps(args)
        elif kind == "function_call_output" and "output" not in item:
            item["output"] = _text((outputs.get(item.get("call_id")) or {}).get("content"))
        if i == at and metrics:
            for ours, theirs in (
                ("prompt_token_ids", "prompt_token_ids"),
                ("generation_token_ids", "completion_token_ids"),
                ("generation_log_probs", "logprobs"),
            ):
                if isinstance(metrics.get(theirs), list):
                    item[ours] = metrics[theirs]
        out.append(item)
    return out


def _blank_part(content: Any) -> bool:
    return (
        isinstance(content, list)
        and len(content) == 1
        and isinstance(content[0], dict)
        and content[0].get("text") is None
    )


# ------------------------------------------------------------------ reading a file of them: one reader for all


class _Result(msgspec.Struct):
    source_call_id: str | int | None = None
    content: Any = None


class _Observation(msgspec.Struct):
    results: list[_Result] | None = None


class _ToolCall(msgspec.Struct):
    tool_call_id: str | int | None = None
    function_name: str | None = None
    arguments: Any = None


class _StepMine(msgspec.Struct):
    items: list[dict[str, Any]] | None = None
    metrics_item: int | None = None
    instructions: bool | None = None
    input: Any = None


class _StepExtra(msgspec.Struct):
    mine: _StepMine | None = msgspec.field(default=None, name=KEY)


class _Step(msgspec.Struct):
    source: str | None = None
    message: Any = None
    reasoning_content: str | None = None
    tool_calls: list[_ToolCall] | None = None
    observation: _Observation | None = None
    metrics: dict[str, Any] | None = None
    extra: _StepExtra | None = None


class _Agent(msgspec.Struct):
    name: str | None = None
    tool_definitions: list[Any] | None = None


class _Ours(msgspec.Struct):
    row: dict[str, Any] | None = None
    responses_create_params: dict[str, Any] | None = None
    response: dict[str, Any] | None = None


class _DocExtra(msgspec.Struct):
    ours: _Ours | None = msgspec.field(default=None, name=KEY)


class _Doc(msgspec.Struct):
    """What ``from_atif`` reads of a document, with the types it reads them as (the rest is left alone)."""

    schema_version: str
    steps: list[_Step]
    agent: _Agent | None = None
    extra: _DocExtra | None = None


def is_atif_file(path: Path) -> bool:
    """Whether ``path`` holds ATIF trajectories (a document, a list of them, or one a line), from its start."""
    with path.open("rb") as f:
        head = f.read(4096).lstrip()
    return head[:1] in (b"{", b"[") and b'"schema_version"' in head and b'"ATIF-' in head


def read_atif(path: Path) -> list[dict[str, Any]]:
    """The ATIF documents of ``path`` (one JSON value, a document or a list, else one a line), each checked
    against what ``from_atif`` reads: one that cannot be read is the user's mistake, one line naming it.
    ``view``, ``export`` and ``reverify`` all read ATIF files here."""
    data = path.read_bytes()
    try:
        whole = json.loads(data)
    except RecursionError:
        raise UserError(f"{path}:1: {TOO_DEEP}; not an ATIF trajectory view can read") from None
    except ValueError:  # not one JSON value: one a line
        found = []
        for number, line in enumerate(data.split(b"\n"), 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            found.append(_checked(json_value(line, where, "an ATIF file holds trajectories"), where))
        return found
    if isinstance(whole, list):
        return [_checked(doc, f"{path}: trajectory {i + 1}") for i, doc in enumerate(whole)]
    return [_checked(whole, f"{path}:1")]


def _checked(doc: Any, where: str) -> dict[str, Any]:
    if not is_atif(doc):
        raise UserError(f"{where} is not an ATIF document (no schema_version ATIF-...)")
    try:
        msgspec.convert(doc, _Doc)
    except msgspec.ValidationError as e:
        raise UserError(f"{where}: not an ATIF trajectory this reader can read ({e})") from None
    except RecursionError:
        raise UserError(f"{where}: {TOO_DEEP}; not an ATIF trajectory view can read") from None
    return dict(doc)
