"""No count lowers a budget (issue 52, item 5): negative, non-finite and missing counts, and model entries that
report no usage."""

from __future__ import annotations

import math
from typing import Any

import msgspec

from gym_runtime.admission import Budget, Work
from gym_runtime.messages import Cost, Message, ModelCost, Response, RolloutResult, Usage


def _row(cost: dict[str, Any]) -> RolloutResult:
    return RolloutResult(batch="b", task_index=0, rollout_index=0, agent="a", row={"reward": 1.0, "cost": cost})


def _tokens(n: int) -> dict[str, Any]:
    return {"models": {"policy": {"calls": 1, "input_tokens": n, "output_tokens": 0}}}


def test_the_estimate_per_rollout_is_never_below_the_largest_rollout_seen() -> None:
    b = Budget(100, tokens=True)
    for n in (40, 0, 0, 0):  # mean 10, largest 40
        b.charge(Work(1))
        b.done(_row(_tokens(n)))
    assert b.room(Work(1)) == 1  # (100 - 40) / 40: before, (100 - 40) / 10 = 6


def test_negative_and_non_finite_counts_count_as_the_largest_seen() -> None:
    money = Budget(1.0, tokens=False)
    money.charge(Work(1))
    money.done(_row({"estimated_cost": 0.25}))
    for bad in (-1e9, math.inf, math.nan, "0.1"):
        money.charge(Work(1))
        money.done(_row({"estimated_cost": bad}))  # before: a negative estimate shrank what was spent
    assert money.spent == 1.25 and money.room(Work(1)) == 0
    tokens = Budget(100, tokens=True)
    tokens.charge(Work(1))
    tokens.done(_row(_tokens(30)))
    tokens.charge(Work(1))
    tokens.done(_row(_tokens(-(10**9))))  # before: skipped, so the mean fell to 15
    assert tokens.spent == 60 and tokens.room(Work(1)) == 1


def test_a_token_budget_stops_at_a_model_that_reports_no_usage_and_no_token_ids() -> None:
    b = Budget(10**6, tokens=True)
    cost = Cost()
    cost.add_call("policy", None, 5, Response(id="r", created_at=0))
    b.charge(Work(1))
    b.done(_row(msgspec.to_builtins(cost)))
    assert b.room(Work(1)) == 0  # before: 0 tokens a rollout, so no limit at all
    assert b.refused is not None and "model entry 'policy' reported no token usage" in b.refused


def test_calls_without_usage_are_counted_from_their_token_ids_and_no_count_is_negative() -> None:
    cost = Cost()
    item = Message(role="assistant", content="hi", prompt_token_ids=[1, 2, 3], generation_token_ids=[4, 5])
    cost.add_call("policy", None, 5, Response(id="r", created_at=0, output=[item]))
    cost.add_call("policy", Usage(input_tokens=-100, output_tokens=2), -7)
    cost.merge(Cost(models={"policy": ModelCost(calls=-3, input_tokens=-(10**9))}, sandbox_cpu_ms=-5))
    assert cost.models["policy"] == ModelCost(calls=2, input_tokens=3, output_tokens=4, call_ms=5)
    assert cost.sandbox_cpu_ms == 0
