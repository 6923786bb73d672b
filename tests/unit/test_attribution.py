"""Failure attribution (issue 66, item 1): the rule covers every failure class, a timeout is split by where its
time went (ties and the unknown to the policy), and every failure row says who caused it; the advantages and the
bound the trainer adapters share (items 3, 4)."""

from __future__ import annotations

import math
import re
import typing
from pathlib import Path

import pytest

from gym_runtime.data.attribution import BY_CLASS, attribute
from gym_runtime.data.collector import failure_row
from gym_runtime.errors import ClientError
from gym_runtime.messages import ErrorClass, ErrorInfo, Response, RolloutResult, TimeSplit
from gym_runtime.trainers.failures import FailurePolicy, Tally, advantages, kind, reward_of, std


def test_every_error_class_has_an_attribution() -> None:
    classes = set(typing.get_args(ErrorClass))
    assert classes - set(BY_CLASS) == {"timeout"}  # the one split by its figures
    assert {attribute(c) for c in classes} <= {"policy", "environment", "infrastructure"}
    assert attribute("verify_error") == attribute("tool_error") == attribute("invalid_task") == "environment"
    assert attribute("worker_lost") == attribute("model_error") == attribute("sandbox_unavailable") == "infrastructure"
    assert attribute("storage_full") == attribute("lost") == "infrastructure"
    assert attribute("some_newer_class") == "infrastructure"


def test_the_docs_table_maps_every_error_class_as_the_rule_does() -> None:
    """docs/trainer.md's attribution table names every ErrorClass once, with the attribution BY_CLASS gives it."""
    text = (Path(__file__).parents[2] / "docs/trainer.md").read_text()
    table = text.split("| `error_class` | attribution | why |", 1)[1].split("\n\n", 1)[0]
    documented: dict[str, str] = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        for name in re.findall(r"`(\w+)`", cells[0]):
            assert name not in documented, name
            documented[name] = cells[1]
    assert set(documented) == set(typing.get_args(ErrorClass))
    for name, who in documented.items():
        assert who == (BY_CLASS[name] if name != "timeout" else "split by `time_split`"), name  # type: ignore[index]


def test_a_timeout_goes_where_its_time_went_and_a_tie_to_the_policy() -> None:
    stalled = TimeSplit(total_ms=10_000, generating_ms=500, model_wait_ms=200, tools_ms=9_000)  # a wait tool
    queued = TimeSplit(total_ms=10_000, generating_ms=500, model_wait_ms=9_000, tools_ms=100)  # the model fleet
    verifying = TimeSplit(total_ms=10_000, generating_ms=500, model_wait_ms=100, tools_ms=100)  # a slow verify
    tie = TimeSplit(total_ms=9_000, generating_ms=3_000, model_wait_ms=3_000, tools_ms=0)
    assert attribute("timeout", stalled) == "policy"
    assert attribute("timeout", queued) == "infrastructure"
    assert attribute("timeout", verifying) == "environment"
    assert attribute("timeout", tie) == "policy"
    assert attribute("timeout") == "policy"  # an older worker's row: no figures


def test_a_failure_row_says_who_caused_it_and_keeps_the_partial_trajectory() -> None:
    item = {
        "type": "message",
        "id": "m1",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": "hi", "annotations": []}],
        "prompt_token_ids": [1, 2],
        "generation_token_ids": [3],
        "generation_log_probs": [-0.5],
    }
    import msgspec

    partial = msgspec.convert({"id": "r", "created_at": 0.0, "output": [item], "status": "incomplete"}, Response)
    res = RolloutResult(
        batch="b",
        task_index=3,
        rollout_index=1,
        agent="a",
        error=ErrorInfo(error_class="timeout", message="rollout exceeded timeout_s=5"),
        time_split=TimeSplit(total_ms=5000, tools_ms=4800),
        partial=partial,
    )
    row = failure_row(res)
    assert row["failure_attribution"] == "policy" and row["partial"] is True
    assert row["response"]["status"] == "incomplete"
    assert row["response"]["output"][0]["generation_token_ids"] == [3]
    assert row["time_split"] == {"total_ms": 5000, "tools_ms": 4800}
    assert kind(row) == "policy" and reward_of(row, FailurePolicy(policy_failure_reward=-1.0)) == -1.0
    lost = failure_row(
        RolloutResult(
            batch="b",
            task_index=0,
            rollout_index=0,
            agent="a",
            error=ErrorInfo(error_class="worker_lost", message="gone"),
        )
    )
    assert lost["failure_attribution"] == "infrastructure" and "partial" not in lost and "response" not in lost
    assert kind(lost) == "excluded" and reward_of(lost, FailurePolicy()) is None


def test_advantages_neither_overflow_nor_nan_and_leave_the_excluded_out() -> None:
    got = advantages([1e200, 0.0, None])  # (1e200 - mean) ** 2 raised OverflowError
    assert all(math.isfinite(a) for a in got) and got[2] == 0.0 and got[0] > 0 > got[1]
    assert advantages([1.0, 0.0, None]) == pytest.approx(advantages([1.0, 0.0]) + [0.0])
    assert advantages([float("inf"), 1.0, 0.0])[0] == 0.0  # not finite: excluded
    assert advantages([None, None]) == [0.0, 0.0] and advantages([2.0, 2.0]) == [0.0, 0.0]
    assert math.isfinite(std([1e200, -1e200]))


def test_too_many_excluded_is_one_line_naming_the_tasks_and_classes() -> None:
    t = Tally()
    ok = {"reward": 1.0}
    bad = {"error_class": "verify_error", "failure_attribution": "environment", "_ng_task_index": 7}
    for row in (ok, bad, bad, ok):
        t.ended(row, t.saw(row))
    t.check(FailurePolicy(max_excluded=0.5), "rollout_func")  # 2 of 4: at the bound, not past it
    with pytest.raises(ClientError) as e:
        t.check(FailurePolicy(max_excluded=0.25), "rollout_func")
    text = str(e.value)
    assert "\n" not in text and "2 of 4 rollouts" in text and "task 7 (verify_error) x2" in text
    assert "verify_error 2" in text
    assert t.metrics()["gym_runtime/excluded"] == 2.0 and t.metrics()["gym_runtime/failed/environment"] == 2.0
    with pytest.raises(ClientError):
        FailurePolicy(policy_failure_reward=float("nan"))
