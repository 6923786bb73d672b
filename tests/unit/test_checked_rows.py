"""Rows a publisher sends are checked once (issue 64): one pass says each row's route and refuses what ``validate``
refuses, and the tasks are laid out from those routes, never routed again."""

from __future__ import annotations

from typing import Any

import pytest

from gym_runtime.config import config_from_dict
from gym_runtime.data import validation
from gym_runtime.data.inputs import row_tasks
from gym_runtime.errors import InputError

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
