"""Rollouts files for ``view``'s and ``diff``'s tests: rows in the shape ``run`` writes (NeMo Gym's row with
gym-runtime's ``cost`` and ``provenance``), a failures sidecar, and the hostile row."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HOSTILE = (
    "<script>alert('script')</script><img src=x onerror=\"alert('img')\">"
    '<a href="javascript:alert(\'link\')">click me</a><iframe src="https://example.invalid/"></iframe>'
    '<link rel="stylesheet" href="https://example.invalid/x.css"><style>body{display:none}</style>'
    ']]></pre></details></section><script src="https://example.invalid/x.js"></script>'
)
BIG = 5 * 1024 * 1024


def row(
    task: int,
    rollout: int,
    reward: float,
    *,
    agent: str = "weather_agent",
    answer: str = "It is sunny in Paris.",
    tool_output: str = '{"city": "Paris", "weather": "sunny"}',
    env: str = "a1b2c3d4e5f6",
    grader: str | None = None,
    config: str = "cfg000000001",
    version: int | None = None,
    ms: int = 100,
) -> dict[str, Any]:
    item_extra: dict[str, Any] = {}
    if version is not None:
        item_extra = {
            "prompt_token_ids": [1, 2, 3],
            "generation_token_ids": [11, 12, 13, 14],
            "generation_log_probs": [-0.1, -0.25, -1.5, -0.05],
            "policy_version": version,
            "policy_version_ranges": [[0, 4, version]],
        }
    out: dict[str, Any] = {
        "responses_create_params": {
            "input": [
                {"role": "system", "content": "You answer questions about the weather."},
                {"role": "user", "content": f"What is the weather in city {task}?"},
            ],
            "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
        },
        "response": {
            "output": [
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [{"type": "summary_text", "text": "I should call the tool."}],
                },
                {
                    "type": "function_call",
                    "name": "get_weather",
                    "arguments": json.dumps({"city": f"city {task}"}),
                    "call_id": f"call_{task}_{rollout}",
                    **item_extra,
                },
                {"type": "function_call_output", "call_id": f"call_{task}_{rollout}", "output": tool_output},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": answer, "annotations": []}],
                    **item_extra,
                },
            ],
            "usage": {"input_tokens": 120, "output_tokens": 30, "total_tokens": 150},
        },
        "reward": reward,
        "_ng_task_index": task,
        "_ng_rollout_index": rollout,
        "agent_ref": {"type": "responses_api_agents", "name": agent},
        "cost": {
            "models": {"policy": {"calls": 2, "input_tokens": 120, "output_tokens": 30, "call_ms": ms}},
            "tool_ms": 5,
            "estimated_cost": 0.001,
            "currency": "USD",
        },
        "provenance": {
            "runtime": "0.1.0",
            "config": config,
            "env": env,
            "turns": ["policy", "policy"],
            "attempt": 1,
            "workers": {"agent": ["w-agent-1"]},
        },
    }
    if grader is not None:
        out["provenance"]["grader"] = grader
    if version is not None:
        out["policy_versions"] = [version, version]
    return out


def failure(task: int, rollout: int, error_class: str = "timeout", message: str = "the model call timed out") -> dict:
    return {
        "_ng_task_index": task,
        "_ng_rollout_index": rollout,
        "agent_ref": {"type": "responses_api_agents", "name": "weather_agent"},
        "error_class": error_class,
        "error": message,
        "attempts": 3,
        "input": {"responses_create_params": {"input": row(task, rollout, 0.0)["responses_create_params"]["input"]}},
    }


def write(path: Path, rows: list[dict[str, Any]], failures: list[dict[str, Any]] | None = None) -> Path:
    """``path`` with its rows, and its ``_failures.jsonl`` when ``failures`` is given."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    if failures is not None:
        side = path.with_name(path.stem + "_failures.jsonl")
        side.write_text("".join(json.dumps(r) + "\n" for r in failures))
    return path


def sample_run(path: Path) -> Path:
    """Six tasks × two rollouts (rewards known), one of them slow, plus two failure rows."""
    rows = []
    for task in range(6):
        for r in range(2):
            reward = 1.0 if (task + r) % 3 else 0.0
            rows.append(row(task, r, reward, version=task % 2, ms=100 + 1000 * (task == 4 and r == 1)))
    rows.append(row(6, 0, 0.5, agent="other_agent", env="ffeeddccbbaa", answer="partly cloudy"))
    return write(path, rows, [failure(7, 0), failure(7, 1, "sandbox", "the sandbox exited with 137")])


def hostile_row() -> dict[str, Any]:
    """A row whose answer, tool output and other fields are markup, ``javascript:`` links, 5 MB of text and
    lone surrogates: valid JSON (``json.dumps`` writes ``\\ud800`` as an escape)."""
    big = ("A" * 1000 + "\n") * (BIG // 1001 + 1)
    r = row(
        99,
        0,
        1.0,
        answer=HOSTILE + " lone \ud800 surrogate \udfff end",
        tool_output=HOSTILE + big,
    )
    r["response"]["output"][1]["name"] = "<img src=x onerror=alert('name')>"
    r["agent_ref"]["name"] = "<script>alert('agent')</script>"
    r["notes"] = {"link": "javascript:alert('field')", "html": HOSTILE}
    return r
