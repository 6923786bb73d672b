"""Issue 77 item 3's rule (``trainers.waiting``, pure): when a training step says why it waits, when it gives up,
and what its line says, from ``why``'s report."""

from __future__ import annotations

from typing import Any

import pytest

from gym_runtime.errors import ClientError
from gym_runtime.ops.why import judge
from gym_runtime.trainers.waiting import StepWait, WaitPolicy, line, wait_policy
from gym_runtime.workers.waits import silence_bound

MODEL = {"role": "model", "name": "policy", "worker": "m1", "process": "n/11"}


def agent(*waits: dict[str, Any]) -> dict[str, Any]:
    return {"role": "agent", "name": "a", "worker": "a1", "process": "n/10", "in_flight": len(waits),
            "waits": list(waits), "went_silent": []}  # fmt: skip


def generating(batch: str, silent_s: float, for_s: float, task: int = 0) -> dict[str, Any]:
    return {"batch": batch, "task_index": task, "rollout_index": 0, "attempt": 1, "rollout_s": for_s,
            "stage": "generating", "what": "generating on model policy", "component": "models.policy",
            "for_s": for_s, "by": "n/11", "silent_s": silent_s, "silent_bound_s": silence_bound(2.0)}  # fmt: skip


def test_the_line_comes_at_the_threshold_then_every_as_long_and_the_bound_fails() -> None:
    w = StepWait(WaitPolicy(say_after_s=60, bound_s=300), now=0.0)
    assert w.due(now=59.9) is None and w.next_check(now=0.0) == 60.0
    assert w.due(now=60.0) == "say"
    w.said(now=61.0)
    assert w.due(now=100.0) is None and w.due(now=121.0) == "say"
    assert w.next_check(now=100.0) == pytest.approx(21.0)
    assert w.due(now=300.0) == "fail"
    assert "gave up at WaitPolicy(bound_s=300)" in w.failing("x")
    w.restart(now=300.0)  # the async worker: a sample handed over is a new wait
    assert w.due(now=330.0) is None


def test_no_bound_waits_forever_but_still_says_why() -> None:
    w = StepWait(WaitPolicy(say_after_s=5, bound_s=None), now=0.0)
    assert w.due(now=1e9) == "say"


def test_a_frozen_model_worker_is_named_first_and_only_the_steps_batches_count() -> None:
    a = agent(generating("mine", silent_s=9.0, for_s=40.0), generating("other", silent_s=9.0, for_s=90.0, task=5))
    report = judge([a], [], batch=None, ns="gym")  # the model worker does not answer: frozen
    said = line(report, {"mine"}, 65.2)
    assert said.startswith("the training step has waited 65s for its rollouts: look at models.policy process n/11")
    assert (
        "1 in flight (1 past their bound)" in said
        and "mine task 0 #0 generating on model policy by n/11 for 40s (no keepalive" in said
    )
    assert "task 5" not in said and "\n" not in said


def test_a_healthy_slow_step_says_where_it_is_without_blaming_anyone() -> None:
    report = judge([agent(generating("mine", silent_s=1.0, for_s=40.0)), MODEL], [], batch=None, ns="gym")
    said = line(report, {"mine"}, 61)
    assert "look at" not in said and "0 past their bound" in said and "on model policy worker m1 (n/11)" in said


def test_no_rollout_running_says_what_the_queues_and_the_silent_agents_say() -> None:
    consumers = [{"consumer": "agent_a", "pending": 0, "ack_pending": 2}]
    report = judge([], consumers, batch=None, ns="gym")  # the agent worker does not answer
    said = line(report, {"mine"}, 61)
    assert "none of them is running on an agent worker that answers" in said
    assert "2 task(s) of agent a held by workers that did not answer" in said


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ({"say_after_s": 0}, "say_after_s is a number of seconds > 0"),
        ({"bound_s": "10"}, "bound_s is a number of seconds > 0"),
        ({"say_after_s": 60, "bound_s": 30}, "bound_s (30) is below say_after_s (60)"),
        ({"bound": 30}, "WaitPolicy has no field 'bound'; did you mean 'bound_s'?"),
    ],
)
def test_a_wrong_policy_is_one_line_naming_the_fix(given: dict[str, Any], says: str) -> None:
    with pytest.raises(ClientError) as e:
        wait_policy(given)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_the_default_policy_bounds_the_wait() -> None:
    p = wait_policy(None)
    assert p.say_after_s == 60.0 and p.bound_s == 3600.0
