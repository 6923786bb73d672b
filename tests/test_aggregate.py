"""gym_runtime.data.aggregate: NeMo Gym style aggregate metrics, checked against hand-computed values."""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path

import pytest

from gym_runtime.data.aggregate import MetricsAccumulator, summary_lines

approx = pytest.approx

# Two tasks x four rollouts. Task 0: 3 of 4 right; task 1: 1 of 4 right.
REWARDS = {0: [1, 0, 1, 1], 1: [0, 0, 1, 0]}
ANSWERS = {0: ["4", "5", "4", "4"], 1: ["7", None, "3", "7"]}
LATENCY = {0: [1.0, 2.0, 3.0, 10.0], 1: [4.0, 4.0, 4.0, 4.0]}
T_975_DOF_7 = 2.3646242510102993  # Student-t 97.5 % quantile, 7 degrees of freedom (table value)


def _row(agent, task, rollout, reward, **extra):
    row = {
        "responses_create_params": {"input": [{"role": "user", "content": f"task {task}"}]},
        "reward": reward,
        "_ng_task_index": task,
        "_ng_rollout_index": rollout,
        "agent_ref": {"type": "responses_api_agents", "name": agent},
    }
    row.update(extra)
    return row


def _rows_a():
    rows = []
    for task, rewards in REWARDS.items():
        for rollout, reward in enumerate(rewards):
            rows.append(
                _row(
                    "agent_a",
                    task,
                    rollout,
                    float(reward),
                    extracted_answer=ANSWERS[task][rollout],
                    latency_s=LATENCY[task][rollout],
                    follows_format=rollout != 1,  # a boolean verifier field
                    expected_answer="4" if task == 0 else "3",
                    response={
                        "id": "resp",
                        "output": [{"type": "message", "content": [{"type": "output_text", "text": "x" * 100}]}],
                        "usage": {
                            "input_tokens": 10 * (rollout + 1),
                            "input_tokens_details": {"cached_tokens": 0},
                            "output_tokens": 100 + task,
                            "output_tokens_details": {"reasoning_tokens": 0},
                            "total_tokens": 10 * (rollout + 1) + 100 + task,
                        },
                    },
                )
            )
    return rows


def _entry(result, name):
    matches = [e for e in result if e["agent_ref"]["name"] == name]
    assert len(matches) == 1, result
    return matches[0]


@pytest.fixture
def result_a():
    acc = MetricsAccumulator(answer_field="extracted_answer")
    rows = _rows_a()
    random.Random(7).shuffle(rows)  # arrival order must not matter: rollouts are ordered by index
    for row in rows:
        acc.add(row)
    return acc.result()


def test_layout_is_nemo_gym_list_of_agent_entries(result_a):
    assert isinstance(result_a, list) and len(result_a) == 1
    entry = result_a[0]
    assert entry["agent_ref"] == {"name": "agent_a"}
    assert set(entry) == {
        "agent_ref",
        "num_rollouts",
        "num_tasks",
        "agent_metrics",
        "key_metrics",
        "group_level_metrics",
    }
    assert entry["num_rollouts"] == 8 and entry["num_tasks"] == 2
    json.dumps(result_a, allow_nan=False)  # plain, strict JSON


def test_pass_at_k_unbiased_estimator(result_a):
    m = result_a[0]["agent_metrics"]
    # task 0: n=4, c=3; task 1: n=4, c=1.  pass@k = 1 - C(n-c, k) / C(n, k), averaged, in percent.
    assert m["pass@1/reward"] == approx(100 * (0.75 + 0.25) / 2)  # 50
    assert m["pass@2/reward"] == approx(100 * (1.0 + (1 - 3 / 6)) / 2)  # 75
    assert m["pass@3/reward"] == approx(100 * (1.0 + (1 - 1 / 4)) / 2)  # 87.5
    assert m["pass@4/reward"] == approx(100.0)
    assert "pass@5/reward" not in m


def test_pass_at_1_avg_of_k_and_variance_across_runs(result_a):
    m = result_a[0]["agent_metrics"]
    assert m["pass@1[avg-of-1]/reward"] == approx(50.0)  # first rollouts: 1, 0
    assert m["pass@1[avg-of-2]/reward"] == approx(25.0)  # (1/2 + 0/2) / 2
    assert m["pass@1[avg-of-3]/reward"] == approx(50.0)  # (2/3 + 1/3) / 2
    assert m["pass@1[avg-of-4]/reward"] == approx(50.0)  # (3/4 + 1/4) / 2
    # run i = the i-th rollout of every task: [1,0] [0,0] [1,1] [1,0]
    assert m["per_sample_aggregate"]["reward"] == approx([50.0, 0.0, 100.0, 50.0])
    assert m["pass@1[avg-of-2]/reward/std_dev_across_runs"] == approx(math.sqrt(1250.0))
    assert m["pass@1[avg-of-2]/reward/std_err_across_runs"] == approx(25.0)
    assert m["pass@1[avg-of-4]/reward/std_dev_across_runs"] == approx(math.sqrt(5000 / 3))
    assert m["pass@1[avg-of-4]/reward/std_err_across_runs"] == approx(math.sqrt(5000 / 3) / 2)
    assert "pass@1[avg-of-1]/reward/std_dev_across_runs" not in m


def test_majority_at_k_with_answer_field(result_a):
    m = result_a[0]["agent_metrics"]
    # task 0 (answer, reward): (4,1) (5,0) (4,1) (4,1) -> k=1: 1, k=2: tie -> 0.5, k=3: 1, k=4: 1
    # task 1: (7,0) (None) (3,1) (7,0)                -> k=1: 0, k=2: 0,         k=3: tie -> 0.5, k=4: 0
    assert m["majority@1/reward"] == approx(50.0)
    assert m["majority@2/reward"] == approx(25.0)
    assert m["majority@3/reward"] == approx(75.0)
    assert m["majority@4/reward"] == approx(50.0)
    # no_answer is a score: task 1 has one rollout without an answer
    assert m["pass@1[avg-of-4]/no_answer"] == approx(12.5)
    assert m["pass@1/no_answer"] == approx(12.5)
    assert m["pass@4/no_answer"] == approx(50.0)
    # the answer field itself (a string) gets no stats
    assert not any(k.endswith("/extracted_answer") for k in m)


def test_float_field_stats_and_no_pass_at_k(result_a):
    m = result_a[0]["agent_metrics"]
    # values 1,2,3,10,4,4,4,4: sum 32, squared deviations 9+4+1+36 = 50
    assert m["mean/latency_s"] == approx(4.0)
    assert m["median/latency_s"] == approx(4.0)
    assert m["min/latency_s"] == approx(1.0)
    assert m["max/latency_s"] == approx(10.0)
    assert m["std/latency_s"] == approx(math.sqrt(50 / 7))
    half = T_975_DOF_7 * math.sqrt(50 / 7) / math.sqrt(8)
    assert m["ci_low_95/latency_s"] == approx(4.0 - half)
    assert m["ci_high_95/latency_s"] == approx(4.0 + half)
    assert not any(k.startswith(("pass@", "majority@")) and "latency_s" in k for k in m)
    assert "latency_s" not in m["per_sample_aggregate"]


def test_reward_stats_are_raw_not_percent(result_a):
    m = result_a[0]["agent_metrics"]
    assert m["mean/reward"] == approx(0.5)
    assert m["median/reward"] == approx(0.5)
    assert m["std/reward"] == approx(math.sqrt(2 / 7))
    assert m["min/reward"] == 0.0 and m["max/reward"] == 1.0


def test_boolean_field_counts_as_binary_score(result_a):
    m = result_a[0]["agent_metrics"]
    # follows_format is False only for rollout 1 of each task: n=4, c=3 in both tasks
    assert m["mean/follows_format"] == approx(0.75)
    assert m["pass@1/follows_format"] == approx(75.0)
    assert m["pass@2/follows_format"] == approx(100.0)


def test_usage_tokens_aggregated_and_index_fields_skipped(result_a):
    m = result_a[0]["agent_metrics"]
    assert m["mean/input_tokens"] == approx(25.0)  # 10, 20, 30, 40 in both tasks
    assert m["max/input_tokens"] == 40.0 and m["min/input_tokens"] == 10.0
    assert m["mean/output_tokens"] == approx(100.5)
    assert m["mean/total_tokens"] == approx(125.5)
    assert m["std/output_tokens"] == approx(math.sqrt(8 * 0.25 / 7))
    # tokens are never scores; nested usage details and _ng_* fields are not descended into / skipped
    assert not any(k.startswith("pass@") and "tokens" in k for k in m)
    assert not any("_details" in k or "cached_tokens" in k for k in m)
    assert not any("_ng_" in k for k in m)


def test_per_task_metrics(result_a):
    groups = result_a[0]["group_level_metrics"]
    assert [g["_ng_task_index"] for g in groups] == [0, 1]
    t0, t1 = groups
    assert t0["num_rollouts"] == 4 and t1["num_rollouts"] == 4
    assert t0["mean/reward"] == approx(0.75) and t1["mean/reward"] == approx(0.25)
    assert t0["median/reward"] == approx(1.0) and t1["median/reward"] == approx(0.0)
    assert t0["std/reward"] == approx(0.5) and t1["std/reward"] == approx(0.5)
    assert t0["mean/latency_s"] == approx(4.0) and t0["median/latency_s"] == approx(2.5)
    assert t0["std/latency_s"] == approx(math.sqrt(50 / 3))
    assert t1["std/latency_s"] == 0.0  # all equal: std 0 and no confidence interval
    assert "ci_low_95/latency_s" not in t1
    assert t0["mean/input_tokens"] == approx(25.0) and t1["mean/output_tokens"] == approx(101.0)


def test_key_metrics(result_a):
    key = result_a[0]["key_metrics"]
    assert key["mean/reward"] == approx(0.5)
    assert key["pass@4/reward"] == approx(100.0)
    assert key["pass@1[avg-of-4]/reward"] == approx(50.0)
    assert key["majority@4/reward"] == approx(50.0)
    assert "pass@1/reward" not in key  # highest k only
    assert "pass@4/no_answer" not in key and "majority@4/no_answer" not in key
    assert not any(k.endswith(("std_dev_across_runs", "std_err_across_runs")) for k in key)


def test_two_agents_kept_apart():
    acc = MetricsAccumulator()
    for row in _rows_a():
        acc.add(row)
    acc.add(_row("agent_b", 0, 0, 0.5, response={"usage": {"input_tokens": 7, "output_tokens": 3, "total_tokens": 10}}))
    result = acc.result()
    assert [e["agent_ref"]["name"] for e in result] == ["agent_a", "agent_b"]
    a, b = _entry(result, "agent_a"), _entry(result, "agent_b")
    assert a["agent_metrics"]["mean/reward"] == approx(0.5)
    assert a["agent_metrics"]["pass@4/reward"] == approx(100.0)
    assert a["agent_metrics"]["mean/input_tokens"] == approx(25.0)
    bm = b["agent_metrics"]
    assert b["num_rollouts"] == 1 and b["num_tasks"] == 1
    assert bm["mean/reward"] == 0.5 and bm["median/reward"] == 0.5
    assert bm["std/reward"] == 0.0  # a single rollout: std 0, no CI
    assert "ci_low_95/reward" not in bm
    assert bm["pass@1/reward"] == approx(50.0)  # continuous reward: max of the first k
    assert "pass@2/reward" not in bm
    assert bm["mean/input_tokens"] == 7.0
    assert "latency_s" not in json.dumps(b)
    # without answer_field there is no majority@k and no no_answer
    assert not any(k.startswith("majority@") or "no_answer" in k for k in a["agent_metrics"])


def test_continuous_reward_uses_max_of_k():
    acc = MetricsAccumulator()
    for rollout, reward in enumerate([0.2, 0.9, 0.5]):
        acc.add(_row("judge", 0, rollout, reward))
    m = acc.result()[0]["agent_metrics"]
    assert m["pass@1/reward"] == approx(20.0)
    assert m["pass@2/reward"] == approx(90.0)
    assert m["pass@3/reward"] == approx(90.0)
    assert m["pass@1[avg-of-2]/reward"] == approx(55.0)
    assert m["pass@1[avg-of-3]/reward"] == approx(100 * 1.6 / 3)
    assert m["mean/reward"] == approx(1.6 / 3)


def test_uneven_rollout_counts_skip_tasks_with_fewer_than_k():
    acc = MetricsAccumulator()
    for rollout, reward in enumerate([1, 0, 0, 0]):
        acc.add(_row("a", 0, rollout, float(reward)))
    for rollout, reward in enumerate([1, 1]):
        acc.add(_row("a", 1, rollout, float(reward)))
    m = acc.result()[0]["agent_metrics"]
    assert m["pass@1/reward"] == approx(100 * (0.25 + 1.0) / 2)
    assert m["pass@2/reward"] == approx(100 * ((1 - 3 / 6) + 1.0) / 2)
    assert m["pass@3/reward"] == approx(100 * (1 - 1 / 4))  # task 1 has only 2 rollouts: left out
    assert m["pass@4/reward"] == approx(100.0)
    assert m["pass@1[avg-of-4]/reward"] == approx(100 * (0.25 + 1.0) / 2)  # task 1 averages what it has


@pytest.mark.parametrize("n,correct", [(5, 0), (5, 2), (6, 3), (7, 6), (4, 4)])
def test_estimator_equals_mean_over_all_k_subsets(n, correct):
    rewards = [1.0] * correct + [0.0] * (n - correct)
    random.Random(n * 10 + correct).shuffle(rewards)
    acc = MetricsAccumulator()
    for rollout, reward in enumerate(rewards):
        acc.add(_row("a", 0, rollout, reward))
    m = acc.result()[0]["agent_metrics"]
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(rewards, k))
        assert m[f"pass@{k}/reward"] == approx(100 * sum(max(s) for s in subsets) / len(subsets))


def test_none_nan_and_non_numbers_are_absent():
    acc = MetricsAccumulator()
    acc.add(_row("a", 0, 0, 1.0, note="text", extra=None))
    acc.add(_row("a", 0, 1, None, note="more"))
    acc.add(_row("a", 0, 2, float("nan"), response=None))
    acc.add(_row("a", 0, 3, float("inf"), response={"usage": None}))
    result = acc.result()
    json.dumps(result, allow_nan=False)
    entry = result[0]
    m = entry["agent_metrics"]
    assert entry["num_rollouts"] == 4
    assert m["mean/reward"] == 1.0 and m["std/reward"] == 0.0
    assert m["pass@1/reward"] == approx(100.0)  # one value present: only pass@1
    assert "pass@2/reward" not in m
    assert m["pass@1[avg-of-4]/reward"] == approx(100.0)
    assert m["per_sample_aggregate"]["reward"] == [100.0]
    assert not any(k.endswith(("/note", "/extra")) for k in m)
    assert entry["group_level_metrics"][0]["num_rollouts"] == 4


def test_missing_indices_and_agent_ref():
    acc = MetricsAccumulator()
    acc.add({"reward": 1.0, "agent_ref": {"name": "a"}})  # no _ng_* fields: task 0, arrival order
    acc.add({"reward": 0.0, "agent_ref": {"name": "a"}})
    acc.add({"reward": 1.0})  # no agent: skipped, counted
    assert acc.rows_skipped == 1
    entry = acc.result()[0]
    assert entry["num_tasks"] == 1 and entry["num_rollouts"] == 2
    assert entry["agent_metrics"]["pass@1[avg-of-1]/reward"] == approx(100.0)
    assert entry["agent_metrics"]["pass@2/reward"] == approx(100.0)


def test_empty_input():
    acc = MetricsAccumulator(answer_field="extracted_answer")
    assert acc.result() == []
    assert summary_lines(acc.result()) == ["no rollouts: no metrics"]


def test_rows_are_not_retained():
    acc = MetricsAccumulator()
    row = _row("a", 0, 0, 1.0, score=0.5)
    acc.add(row)
    row["reward"] = 0.0
    row["score"] = 99.0
    row["_ng_task_index"] = 5
    m = acc.result()[0]
    assert m["agent_metrics"]["mean/reward"] == 1.0 and m["agent_metrics"]["mean/score"] == 0.5
    assert m["group_level_metrics"][0]["_ng_task_index"] == 0


def test_summary_lines(result_a):
    lines = summary_lines(result_a)
    text = "\n".join(lines)
    assert lines[0].startswith("agent_a: 8 rollouts over 2 tasks, mean reward 0.5")
    assert "pass@1 50.00%" in text and "pass@4 100.00%" in text
    assert "pass@1[avg-of-4] 50.00%" in text and "majority@4 50.00%" in text
    assert "input 25" in text and "output 100.5" in text
    assert summary_lines(result_a[0]) == lines  # a single entry works too


def test_summary_lines_with_rewards_outside_0_1_show_mean_scores_not_percentages():
    """A reward of 1.8 (a score, not a pass) made the summary say ``pass@1 180.00%``: meaningless as a rate."""
    acc = MetricsAccumulator()
    for task, rewards in enumerate(([2.0, 1.6], [1.8, 1.8])):
        for i, r in enumerate(rewards):
            acc.add(_row("a", task, i, r))
    text = "\n".join(summary_lines(acc.result()))
    assert "%" not in text
    assert "pass@1[avg-of-2] 1.8 (" in text and "pass@2 1.9 |" in text
    assert text.endswith("(means of the rewards, not rates: rewards are not all in [0, 1])")


COMPAT = Path(__file__).resolve().parent / "compat" / "nemo_gym"


def test_recorded_nemo_gym_rollouts():
    rows = [
        json.loads(line)
        for line in (COMPAT / "example_multi_turn_gymnasium" / "example_rollouts.jsonl").read_text().splitlines()
        if line.strip()
    ]
    acc = MetricsAccumulator()
    for row in rows:
        acc.add(row)
    result = acc.result()
    json.dumps(result, allow_nan=False)
    total = sum(e["num_rollouts"] for e in result)
    assert total == len(rows)
    entry = result[0]
    agent_rows = [r for r in rows if r["agent_ref"]["name"] == entry["agent_ref"]["name"]]
    m = entry["agent_metrics"]
    assert m["mean/reward"] == approx(sum(r["reward"] for r in agent_rows) / len(agent_rows))
    assert m["mean/output_tokens"] == approx(
        sum(r["response"]["usage"]["output_tokens"] for r in agent_rows) / len(agent_rows)
    )
    assert "pass@1/reward" in m and "pass@1/terminated" in m  # booleans are binary scores
    assert summary_lines(result)


def test_costs_are_totalled_per_agent_with_failed_rollouts_apart():
    """Rows' ``cost`` (gym-runtime's key) adds up per agent; failure rows' cost is totalled apart; rows
    without one add no ``cost`` entry (NeMo Gym's layout stays as it was)."""
    acc = MetricsAccumulator()
    ref = {"name": "a"}

    def cost(calls, inp, out, est):
        return {
            "models": {"policy": {"calls": calls, "input_tokens": inp, "output_tokens": out}},
            "tool_ms": 5,
            "estimated_cost": est,
            "currency": "USD",
        }

    acc.add({"agent_ref": ref, "reward": 1.0, "_ng_task_index": 0, "cost": cost(2, 100, 10, 0.25)})
    acc.add({"agent_ref": ref, "reward": 0.0, "_ng_task_index": 1, "cost": cost(3, 50, 5, 0.5)})
    acc.add_cost({"agent_ref": ref, "error_class": "timeout", "cost": cost(1, 7, 1, 0.125)}, failed=True)
    acc.add({"agent_ref": {"name": "b"}, "reward": 1.0, "_ng_task_index": 0})
    a, b = acc.result()
    assert a["cost"] == {
        "rollouts": {
            "models": {"policy": {"calls": 5, "input_tokens": 150, "output_tokens": 15}},
            "tool_ms": 10,
            "estimated_cost": 0.75,
            "currency": "USD",
        },
        "failed": {
            "models": {"policy": {"calls": 1, "input_tokens": 7, "output_tokens": 1}},
            "tool_ms": 5,
            "estimated_cost": 0.125,
            "currency": "USD",
        },
        "failed_rollouts": 1,
    }
    assert "cost" not in b and "mean/cost" not in a["agent_metrics"]
    lines = summary_lines(a)
    assert "  cost: policy 5 calls, 150 in / 15 out tokens; tools 0.01 s; estimated 0.75 USD" in lines
    assert any(line.startswith("  cost of 1 failed rollouts: policy 1 calls") for line in lines), lines


def _varied_rows() -> list[dict]:
    """Rows with each shape ``add`` reads differently: a bool reward, extra numbers, a usage count of None, a
    response that is null or a number, an answer that is a string or None, no agent, a task key that is a string,
    a ``cost`` that is a dict or not, numbers in many tasks of several rollouts."""
    rows = []
    for i in range(120):
        row = _row("agent_a" if i % 4 else "agent_b", i // 3, i % 3, [0.0, 1.0, 0.5][i % 3] if i % 7 else True)
        row["response"] = {
            "id": f"resp_{i}",
            "output": [{"type": "message", "content": [{"type": "output_text", "text": "é" * i}]}],
            "usage": {"input_tokens": i, "output_tokens": None if i % 17 == 0 else 3, "input_tokens_details": {}},
        }
        row["cost"] = {"models": {"policy": {"calls": 2, "input_tokens": i}}, "tool_ms": i} if i % 31 else "bad"
        if i % 5 == 0:
            row["latency_s"], row["flag"] = i * 1.5, i % 2 == 0
        if i % 11 == 0:
            row["response"] = None
        if i % 13 == 0:
            row["response"] = 3
        if i % 19 == 0:
            row["extracted_answer"] = "x" if i % 2 else None
        if i % 23 == 0:
            del row["agent_ref"]
        if i % 29 == 0:
            row["_ng_task_index"] = f"t{i}"
        rows.append(row)
    return rows


@pytest.mark.parametrize("answer_field", [None, "extracted_answer", "reward", "response"])
def test_a_line_counts_as_its_decoded_row(tmp_path: Path, answer_field: str | None) -> None:
    """``add_line`` (the collector's: only the values the metrics read are built) writes the same metrics file,
    byte for byte, as ``add`` of each whole decoded row."""
    whole, lines = MetricsAccumulator(answer_field=answer_field), MetricsAccumulator(answer_field=answer_field)
    for row in _varied_rows():
        line = json.dumps(row, ensure_ascii=False).encode()
        whole.add(json.loads(line))
        lines.add_line(line)
    whole.write_json(tmp_path / "whole.json")
    lines.write_json(tmp_path / "lines.json")
    assert lines.rows_skipped == whole.rows_skipped > 0
    assert (tmp_path / "lines.json").read_bytes() == (tmp_path / "whole.json").read_bytes()
