"""Issue 75: ``explain`` names each tool call of an attempt that stored no row of its own by the trajectory that holds
it (its failure row's partial one, or the row of the attempt that resumed it and replayed its calls), not ``tool ?``.
The records are the real messages ``explain`` reads from the bus."""

from __future__ import annotations

from typing import Any

import msgspec

from gym_runtime.cli.explain import render
from gym_runtime.data.batches import Manifest
from gym_runtime.data.history import Attempt, History
from gym_runtime.messages import AttemptRetried, ErrorInfo, Response, RolloutResult


def output(*names: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    for i, name in enumerate(names):
        items.append({"type": "function_call", "name": name, "arguments": "{}", "call_id": f"c{i}"})
        items.append({"type": "function_call_output", "call_id": f"c{i}", "output": "ok"})
    return items


MANIFEST = Manifest(batch="b", expected=1, tasks=1, repeats=1, agents={"agent": 1}, input="in.jsonl")
CALLS = [[0, 10, 5, 2], [12, 3], [16, 10, 5, 2], [28, 3]]  # model, tool, model, tool
ERR = ErrorInfo(error_class="model_error", message="the endpoint went away", retryable=True)


def tools_of(lines: list[str]) -> list[str]:
    return [line.split("tool  ", 1)[1].split()[0] for line in lines if "tool  " in line]


def test_a_given_back_attempts_calls_are_named_by_the_row_that_resumed_them() -> None:
    kept = RolloutResult(
        batch="b",
        task_index=0,
        rollout_index=0,
        agent="agent",
        row={
            "reward": 1.0,
            "resumed_how": "reattached",
            "resumed_from_turn": 2,
            "response": {"output": output("get_weather", "get_time", "get_news")},
        },
        calls=[[0, 10, 5, 2], [12, 3]],
        calls_from=[2, 2],
    )
    retried = AttemptRetried(task_index=0, rollout_index=0, attempt=1, worker="w1", error=ERR, calls=CALLS, at=1.0)
    h = History(
        batch="b",
        task=0,
        rollout=0,
        agent="agent",
        attempts=[Attempt(number=1, retried=retried), Attempt(number=2, results=[kept])],
        kept=kept,
    )
    text = render(MANIFEST, h)
    assert "tool  ?" not in "\n".join(text), text
    assert tools_of(text) == ["get_weather", "get_time", "get_news"], text


def test_a_failure_rows_calls_are_named_by_its_partial_trajectory() -> None:
    failed = RolloutResult(
        batch="b",
        task_index=0,
        rollout_index=0,
        agent="agent",
        error=ERR,
        calls=CALLS,
        partial=msgspec.convert(
            {
                "id": "r",
                "created_at": 0,
                "model": "m",
                "output": output("get_weather", "get_time"),
                "status": "incomplete",
            },
            Response,
        ),
    )
    h = History(
        batch="b", task=0, rollout=0, agent="agent", attempts=[Attempt(number=1, results=[failed])], kept=failed
    )
    text = render(MANIFEST, h)
    assert tools_of(text) == ["get_weather", "get_time"], text
