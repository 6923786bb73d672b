"""The rule for what ``why`` flags (``ops.why.judge``, pure) and how a call's subject names its stage."""

from __future__ import annotations

from typing import Any

from gym_runtime.ops.why import judge, render
from gym_runtime.transport.subjects import Subjects
from gym_runtime.workers.waits import classify, silence_bound

MODEL = {"role": "model", "name": "policy", "worker": "m1", "process": "n/11"}


def agent(*waits: dict[str, Any], went_silent: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"role": "agent", "name": "a", "worker": "a1", "process": "n/10", "in_flight": len(waits),
            "waits": list(waits), "went_silent": went_silent or []}  # fmt: skip


def generating(silent_s: float, by: str = "n/11", for_s: float = 40.0) -> dict[str, Any]:
    return {"batch": "b", "task_index": 0, "rollout_index": 0, "attempt": 1, "rollout_s": 50.0,
            "stage": "generating", "what": "generating on model policy", "component": "models.policy",
            "for_s": for_s, "by": by, "silent_s": silent_s, "silent_bound_s": silence_bound(2.0)}  # fmt: skip


def test_a_slow_generation_that_beats_is_not_flagged_however_long() -> None:
    r = judge([agent(generating(silent_s=1.0, for_s=600.0)), MODEL], [], batch=None, ns="gym")
    assert r["late"] == 0 and r["look_at"] == []
    assert "on model policy worker m1 (n/11)" in render(r)


def test_a_silent_call_names_its_process_and_says_it_does_not_answer() -> None:
    r = judge([agent(generating(silent_s=9.0))], [], batch=None, ns="gym")  # the model worker did not answer
    assert r["look_at"] == ["models.policy process n/11"]
    assert "did not answer status" in r["rollouts"][0]["late"]


def test_a_call_moved_to_the_queue_names_the_process_it_went_silent_on() -> None:
    queued = {**generating(0.0), "stage": "queued_generating", "what": "queued: generating on model policy"}
    del queued["by"], queued["silent_s"], queued["silent_bound_s"]
    silent = [{"process": "n/11", "what": "generating on model policy", "component": "models.policy", "ago_s": 3.0}]
    r = judge([agent(queued, went_silent=silent)], [], batch=None, ns="gym")
    assert r["look_at"] == ["models.policy process n/11"]
    assert "went silent on process n/11" in r["rollouts"][0]["late"]
    # once that process answers again (SIGCONT), nothing is flagged
    assert judge([agent(went_silent=silent), MODEL], [], batch=None, ns="gym")["look_at"] == []


def test_a_paused_model_is_a_weight_update_not_a_stall() -> None:
    r = judge([agent(generating(silent_s=1.0)), {**MODEL, "paused": True}], [], batch=None, ns="gym")
    assert r["rollouts"][0]["stage"] == "paused" and r["late"] == 0


def test_the_oldest_wait_comes_first_and_a_batch_filters() -> None:
    a = agent(generating(1.0, for_s=5.0), {**generating(1.0, for_s=50.0), "batch": "c"})
    assert [e["for_s"] for e in judge([a, MODEL], [], batch=None, ns="gym")["rollouts"]] == [50.0, 5.0]
    assert [e["batch"] for e in judge([a, MODEL], [], batch="b", ns="gym")["rollouts"]] == ["b"]


def test_subjects_name_their_stage() -> None:
    s = Subjects("gym")
    assert classify(s, s.model_direct("policy"))[0] == "generating"
    assert classify(s, s.model_queue("policy"))[2] == "models.policy"
    tool = Subjects.session_call(s.session("weather", "w7"), "tool", "agent.a")
    assert classify(s, tool) == ("tool", "in a tool of environment weather on worker w7", "resources.weather")
    verify = Subjects.session_call(s.session("weather", "w7"), "verify", "agent.a")
    assert classify(s, verify)[0] == "verify"
    assert classify(s, s.sandbox_create("box", "agent.a"))[0] == "sandbox_wait"
    assert classify(s, Subjects.sandbox_op(s.sandbox_worker("box", "s1"), "exec", "agent.a"))[0] == "sandbox"


def test_an_endpoint_out_of_service_is_named_with_why() -> None:
    cause = "answered nothing for 12 s with 3 calls in flight, nor GET /models within 10 s"
    model = {**MODEL, "endpoints_out": {"http://gpu1:8000/v1": cause}}
    r = judge([agent(generating(silent_s=1.0)), model], [], batch=None, ns="gym")
    assert r["look_at"] == ["models.policy endpoint http://gpu1:8000/v1"]
    assert f"  out of service: models.policy endpoint http://gpu1:8000/v1: {cause}" in render(r).splitlines()
