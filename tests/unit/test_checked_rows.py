"""Rows a publisher sends are checked once (issue 64): one pass says each row's route and refuses what ``validate``
refuses, and the tasks are laid out from those routes, never routed again. One row router (issue 74):
``routing.Router`` is what ``Client.submit``, the CLI's file path (``run``, ``publish``) and ``validate`` route rows
with, and on the file path each row is checked and routed once: the check before anything starts, then its tasks
published to the route that check found (``Plan.owners``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest

from gym_runtime.config import config_from_dict
from gym_runtime.data import routing, validation
from gym_runtime.data.inputs import publish_tasks, row_tasks
from gym_runtime.errors import InputError
from gym_runtime.testing import MemoryTransport

CONFIG = {
    "models": {"policy": {"adapter": "scripted"}},
    "resources": {"weather": {"server": "resources.weather"}},
    "agents": {
        "a": {"agent": "agents.simple", "model": "policy", "resource": "weather"},
        "b": {"agent": "agents.simple", "model": "policy", "resource": "weather"},
    },
}


def _row(agent: str | None = None, **extra: Any) -> dict[str, Any]:
    row: dict[str, Any] = {"responses_create_params": {"input": "weather in Paris?"}, **extra}
    if agent is not None:
        row["agent_ref"] = {"type": "responses_api_agents", "name": agent}
    return row


def test_one_pass_gives_each_rows_route_and_the_tasks_are_laid_out_from_it(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config_from_dict(CONFIG)
    rows = [_row("b"), _row("a"), _row("b")]
    checks = []
    check = validation.TaskChecker.check

    def counted(self: validation.TaskChecker, row: Any) -> Any:
        checks.append(row)
        return check(self, row)

    monkeypatch.setattr(validation.TaskChecker, "check", counted)
    checked = validation.check_before_publish(cfg, ((f"row {i}", r) for i, r in enumerate(rows)))
    assert checked.routes == ["b", "a", "b"] and len(checks) == len(rows)
    assert [(s, e, a) for s, e, a in checked.owners().ranges()] == [(0, 1, "b"), (1, 2, "a"), (2, 3, "b")]
    # the tasks carry the routes the check found: rows without agent_ref in a two-agent config route nowhere by
    # themselves (``routing.Router`` would refuse them), so these tasks prove nothing routed the rows again
    bare = [_row(), _row()]
    tasks = list(row_tasks(bare, batch="b1", agents=["a", "b"], repeats=2, routes=["b", "a"]))
    assert [(t.task_index, t.rollout_index, t.agent) for t in tasks] == [
        (0, 0, "b"),
        (0, 1, "b"),
        (1, 0, "a"),
        (1, 1, "a"),
    ]


def test_every_problem_of_every_row_is_named_and_nothing_routes() -> None:
    cfg = config_from_dict(CONFIG)
    rows = [_row("a"), {"no": "params"}, _row("c"), "text"]
    with pytest.raises(InputError) as e:
        validation.check_before_publish(cfg, ((f"row {i}", r) for i, r in enumerate(rows)))
    text = "; ".join(e.value.problems)
    assert "row 1: missing required field 'responses_create_params'" in text
    assert "row 2: agent_ref.name 'c' is not an agent of this config" in text
    assert "row 3: a row must be a JSON object, got str" in text
    assert "row 0" not in text


def _counted(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    routed: list[Any] = []
    route = routing.Router.route

    def counted(self: routing.Router, row: dict[str, Any]) -> Any:
        routed.append(row)
        return route(self, row)

    monkeypatch.setattr(routing.Router, "route", counted)
    return routed


async def test_the_file_path_checks_and_routes_each_row_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in [_row("b"), _row("a"), _row("b")]))
    routed = _counted(monkeypatch)
    cfg = config_from_dict(CONFIG)
    plan = validation.plan_publish(cfg, rows)
    assert len(routed) == 3 and list(plan.owners.each()) == ["b", "a", "b"]
    async with MemoryTransport() as bus:
        with anyio.fail_after(10):
            sent = await publish_tasks(bus, plan, batch="b1", agents=["a", "b"], repeats=2)
    assert sent == 6 and len(routed) == 3  # published to the routes found: not routed again


def test_validate_and_the_file_path_say_the_same_of_a_row_that_routes_nowhere(tmp_path: Path) -> None:
    """One rule, so one message: an unknown agent_ref, a wrong agent_ref type, no agent_ref among several."""
    bad = [
        {**_row(), "agent_ref": {"type": "responses_api_agents", "name": "ghost"}},
        {**_row(), "agent_ref": {"type": "other", "name": "a"}},
        _row(),
    ]
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in bad))
    cfg = config_from_dict(CONFIG)
    report = validation.validate_files(cfg, [rows])
    with pytest.raises(InputError) as published:
        validation.plan_publish(cfg, rows)
    with pytest.raises(InputError) as submitted:
        validation.check_before_publish(cfg, ((f"{rows}:{i}", r) for i, r in enumerate(bad, 1)))
    assert report.problems == published.value.problems == submitted.value.problems
    assert [p.split(": ", 1)[1] for p in report.problems] == [
        "agent_ref.name 'ghost' is not an agent of this config (a, b); pass --agent NAME",
        "agent_ref.type must be 'responses_api_agents', got 'other'",
        "row names no agent_ref and the config has several agents (a, b); pass --agent",
    ]
