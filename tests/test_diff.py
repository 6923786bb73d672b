"""``gym-runtime diff A B``: reward deltas, flips, provenance changes and each row's class (REUSE, REGRADE,
RERUN), from files whose changes are known, and from real runs whose environment code or model entry changed
(rows' per-part digests, ``provenance.parts``)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from gym_runtime.config import config_from_dict
from gym_runtime.config.fingerprints import agent_parts
from gym_runtime.view.diff import REGRADE, RERUN, REUSE, classify
from tests.e2e.test_ledger import env_copy
from tests.helpers import cli, read_jsonl, write_jsonl
from tests.test_atif import FOREIGN
from tests.test_view import serve
from tests.view_rows import failure, row, write


def test_a_rows_class_follows_which_parts_of_its_provenance_changed() -> None:
    base = {"agent": "a1", "model.policy": "m1", "resource": "r1", "env": "e1"}
    assert classify(base, dict(base)) == (REUSE, [])
    assert classify(base, {**base, "env": "e2"}) == (REGRADE, ["env"])
    assert classify(base, {**base, "resource": "r2", "grader": "judge:x"}) == (REGRADE, ["grader", "resource"])
    assert classify(base, {**base, "model.policy": "m2", "env": "e2"}) == (RERUN, ["env", "model.policy"])
    assert classify(base, {**base, "images": "sha"}) == (RERUN, ["images"])
    assert classify({"config": "c1", "env": "e1"}, {**base})[0] == RERUN  # an old row's one hash: cannot tell
    assert classify({}, {}) == (RERUN, [])  # no provenance: nothing says it can be reused


def test_a_parts_digest_changes_only_with_its_own_entry() -> None:
    raw = {
        "models": {"policy": {"adapter": "scripted"}, "judge": {"adapter": "scripted"}},
        "resources": {"weather": {"server": "resources.weather"}},
        "agents": {"weather_agent": {"agent": "agents.simple", "model": "policy", "resource": "weather"}},
    }

    def parts(**change: Any) -> dict[str, str]:
        cfg = json.loads(json.dumps(raw))
        for path, value in change.items():
            section, name, key = path.split("__")
            cfg[section][name][key] = value
        from gym_runtime.config import resolve_config

        return agent_parts(resolve_config(config_from_dict(cfg)).config, "weather_agent")

    base = parts()
    assert set(base) == {"agent", "model.policy", "resource"}
    assert parts(models__policy__model="other") == {
        **base,
        "model.policy": parts(models__policy__model="other")["model.policy"],
    }
    assert parts(models__policy__model="other")["model.policy"] != base["model.policy"]
    assert parts(models__judge__model="other") == base  # not this agent's model
    assert parts(models__policy__replicas=4) == base  # scaling is not what is served
    changed = parts(agents__weather_agent__max_steps=3)
    assert changed["agent"] != base["agent"] and {k: v for k, v in changed.items() if k != "agent"} == {
        k: v for k, v in base.items() if k != "agent"
    }


def runs_with_flips(tmp_path: Path) -> tuple[Path, Path]:
    """A: tasks 0-3 × 2; B: the same, task 0/0 fail→pass, task 1/1 pass→fail, task 2's grader changed, task 3/0
    a failure row in B, and a task 4 only in B."""
    a = [row(t, r, 1.0 if r == 1 else 0.0) for t in range(4) for r in range(2)]
    b = []
    for t in range(4):
        for r in range(2):
            if (t, r) == (3, 0):
                continue
            reward = 1.0 if r == 1 else 0.0
            reward = 1.0 if (t, r) == (0, 0) else 0.0 if (t, r) == (1, 1) else reward
            b.append(row(t, r, reward, grader="judge:0123456789ab" if t == 2 else None))
    b.append(row(4, 0, 1.0))
    return write(tmp_path / "a.jsonl", a), write(tmp_path / "b.jsonl", b, [failure(3, 0)])


def test_diff_prints_the_flips_and_classes_as_a_table_and_as_json(tmp_path: Path) -> None:
    a, b = runs_with_flips(tmp_path)
    out = cli("diff", str(a), str(b), "--json")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert (d["common"], d["only_a"], d["only_b"]) == (8, 0, 1)
    assert d["flips"] == {"pass→fail": 1, "fail→pass": 1}  # (3/0 failed in A too: no flip)
    by = {(r["task"], r["rollout"]): r for r in d["rows"]}
    assert by[(0, 0)]["flip"] == "fail→pass" and by[(0, 0)]["delta"] == 1.0 and by[(0, 0)]["class"] == REUSE
    assert by[(1, 1)]["flip"] == "pass→fail" and by[(1, 1)]["delta"] == -1.0
    assert by[(2, 0)]["class"] == by[(2, 1)]["class"] == REGRADE and by[(2, 0)]["changed"] == ["grader"]
    assert by[(3, 0)]["failure_b"] == "timeout" and by[(3, 0)]["class"] == RERUN  # a failure row records none
    assert d["classes"] == {REUSE: 5, REGRADE: 2, RERUN: 1}

    table = cli("diff", str(a), str(b))
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert "8 rollouts in common (0 only in A, 1 only in B)" in lines[1]
    assert "pass->fail 1, fail->pass 1; REUSE 5, REGRADE 2, RERUN 1" in lines[2]
    assert any(line.split()[:2] == ["0", "0"] and "fail->pass" in line for line in lines)
    assert not any(line.split()[:2] == ["3", "1"] for line in lines[3:])  # unchanged rows left out...
    assert any(line.split()[:2] == ["3", "1"] for line in cli("diff", str(a), str(b), "--all").stdout.splitlines())


def test_two_runs_with_no_task_in_common_are_one_line(tmp_path: Path) -> None:
    a = write(tmp_path / "a.jsonl", [row(0, 0, 1.0)])
    b = write(tmp_path / "b.jsonl", [row(1, 0, 1.0)])
    out = cli("diff", str(a), str(b))
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0 and "no task in common" in out.stderr
    assert "Traceback" not in out.stderr


def test_real_runs_diffed_after_a_code_change_regrade_and_after_a_model_change_rerun(tmp_path: Path) -> None:
    pkg, config = env_copy(tmp_path)
    data = tmp_path / "tasks.jsonl"
    write_jsonl(data, read_jsonl(pkg / "data" / "example.jsonl")[:3])

    def run(out: str, *more: str) -> Path:
        done = cli("run", str(config), "-i", str(data), "-o", str(tmp_path / out), "--log-level", "warning", *more)
        assert done.returncode == 0, done.stderr[-3000:]
        return tmp_path / out

    first = run("first.jsonl")
    parts = read_jsonl(first)[0]["provenance"]["parts"]
    assert set(parts) == {"agent", "model.policy", "resource"}
    same = run("same.jsonl")
    code = pkg / "__init__.py"
    code.write_text(code.read_text() + "\n# a changed line of code\n")
    regrade = run("regrade.jsonl")
    rerun = run("rerun.jsonl", "--set", "models.policy.delay_s=0.001")

    def classes(other: Path) -> dict[str, Any]:
        out = cli("diff", str(first), str(other), "--json")
        assert out.returncode == 0, out.stderr
        d = json.loads(out.stdout)
        return {"classes": d["classes"], "changed": sorted({c for r in d["rows"] for c in r["changed"]})}

    assert classes(same) == {"classes": {REUSE: 3, REGRADE: 0, RERUN: 0}, "changed": []}
    assert classes(regrade) == {"classes": {REUSE: 0, REGRADE: 3, RERUN: 0}, "changed": ["env"]}
    assert classes(rerun) == {"classes": {REUSE: 0, REGRADE: 0, RERUN: 3}, "changed": ["env", "model.policy"]}


def rows_of(out: Any) -> dict[tuple[Any, ...], dict[str, Any]]:
    return {(r.get("agent"), r["task"], r["rollout"]): r for r in json.loads(out.stdout)["rows"]}


def test_diff_of_a_run_where_every_rollout_failed(tmp_path: Path) -> None:
    """The run a user most wants to compare: its rows file empty, every rollout in its failures file."""
    a = write(tmp_path / "a.jsonl", [row(t, 0, 1.0) for t in range(3)])
    b = write(tmp_path / "b.jsonl", [], [failure(t, 0, "timeout") for t in range(3)])
    out = cli("diff", str(a), str(b), "--json")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["common"] == 3 and d["flips"] == {"pass→fail": 3, "fail→pass": 0}
    assert {r["failure_b"] for r in d["rows"]} == {"timeout"} and all(r["agent"] == "weather_agent" for r in d["rows"])
    assert [t[-1] for t in d["flipped_tasks"]["pass→fail"]] == [0, 1, 2]
    for site in serve(str(a), str(b)):
        status, _, page = site.get("/diff?a=0&b=1")
        assert status == 200 and b"pass\xe2\x86\x92fail 3" in page


def test_each_part_of_a_run_names_its_own_agents(tmp_path: Path) -> None:
    """B's rows by one agent, its failures by another: each id looked up in its own file's names."""
    a = write(tmp_path / "a.jsonl", [row(0, 0, 1.0), row(1, 0, 1.0, agent="other_agent")])
    b = write(tmp_path / "b.jsonl", [row(0, 0, 1.0)], [{**failure(1, 0), "agent_ref": {"name": "other_agent"}}])
    out = cli("diff", str(a), str(b), "--json")
    assert out.returncode == 0 and "agents differ" not in out.stderr, out.stderr
    assert set(rows_of(out)) == {("weather_agent", 0, 0), ("other_agent", 1, 0)}


def other_tasks(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for r in rows:
        r["responses_create_params"]["input"][-1]["content"] = f"Count to {r['_ng_task_index']}."
    return rows


def test_unrelated_runs_are_refused_and_other_agents_or_environments_warned(tmp_path: Path) -> None:
    """weather against counter (the same task indices, other tasks), ours against a foreign ATIF file: not
    paired by index; the same tasks run by another agent: compared, with a warning."""
    weather = write(tmp_path / "weather.jsonl", [row(t, 0, 1.0) for t in range(5)])
    counter = write(tmp_path / "counter.jsonl", other_tasks([row(t, 0, 0.0, agent="counter_agent") for t in range(5)]))
    for x, y in ((weather, counter), (counter, weather)):
        out = cli("diff", str(x), str(y))
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and "no task in common: task 0's input differs" in lines[0]
        assert "give the outputs of two runs of the same input file" in lines[0], lines  # issue 75: how to pair
    atif = tmp_path / "trajectory.json"
    atif.write_text(json.dumps(FOREIGN, indent=2))
    out = cli("diff", str(weather), str(atif))
    assert out.returncode == 2 and "no task in common" in out.stderr and "Traceback" not in out.stderr
    assert "another tool's pair by their order in the file (the n-th is task n)" in out.stderr, out.stderr
    other = write(tmp_path / "other.jsonl", [row(t, 0, 0.0, agent="other_agent", env="ffeeddccbbaa") for t in range(5)])
    out = cli("diff", str(weather), str(other))
    assert out.returncode == 0, out.stderr
    warned = out.stderr.strip().splitlines()
    assert warned == [
        "gym-runtime: warning: the agents differ (A: weather_agent; B: other_agent)",
        "gym-runtime: warning: the environments differ (A: a1b2c3d4e5f6; B: ffeeddccbbaa)",
    ]
    assert "tasks pass->fail: 5 (0, 1, 2, 3, 4)" in out.stdout  # (by task alone: the agents differ)
    for site in serve(str(weather), str(other), str(counter)):
        page = site.get("/diff?a=0&b=1")[2].decode()
        assert '<p class="notice warning">the agents differ (A: weather_agent; B: other_agent)</p>' in page
        status, _, body = site.get("/diff?a=0&b=2")
        assert status == 200 and b"task 0&#39;s input differs" in body
    half = write(
        tmp_path / "half.jsonl", [row(t, 0, 0.0) for t in range(2)] + other_tasks([row(t, 0, 0.0) for t in range(2, 5)])
    )
    out = cli("diff", str(weather), str(half), "--json")
    d = json.loads(out.stdout)
    assert out.returncode == 0 and d["common"] == 2 and d["other_tasks"] == 3 and "another task's input" in out.stderr


def test_diff_states_the_difference_with_a_95_percent_interval(tmp_path: Path) -> None:
    """Four tasks, two rollouts each: per-task pass rates A (0, 0, 1, .5), B (1, 0, 1, 1): differences 1, 0, 0,
    .5; mean .375, sd .4787; the paired t interval .375 +- 3.182 * .4787 / 2."""
    ra = {0: (0, 0), 1: (0, 0), 2: (1, 1), 3: (1, 0)}
    rb = {0: (1, 1), 1: (0, 0), 2: (1, 1), 3: (1, 1)}
    a = write(tmp_path / "a.jsonl", [row(t, r, float(v)) for t, vs in ra.items() for r, v in enumerate(vs)])
    b = write(tmp_path / "b.jsonl", [row(t, r, float(v)) for t, vs in rb.items() for r, v in enumerate(vs)])
    out = cli("diff", str(a), str(b), "--json")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    e = d["estimates"]["mean reward"]
    half = 3.182 * statistics.stdev([1, 0, 0, 0.5]) / 2
    assert e["delta"] == pytest.approx(0.375) and e["tasks"] == 4
    assert (e["lo"], e["hi"]) == (pytest.approx(0.375 - half), pytest.approx(0.375 + half))
    assert d["estimates"]["pass@1"]["delta"] == pytest.approx(0.375)
    p2 = d["estimates"]["pass@2"]  # solved at all: A (0, 0, 1, 1), B (1, 0, 1, 1)
    assert (p2["a"], p2["b"], p2["delta"]) == (0.5, 0.75, 0.25)
    assert d["flipped_tasks"] == {"pass→fail": [], "fail→pass": [["weather_agent", 0]]}
    assert "paired t" in d["interval"]
    table = cli("diff", str(a), str(b)).stdout
    assert f"mean reward 0.375 -> 0.75: +0.375 (95% CI {0.375 - half:+.4g} to {0.375 + half:+.4g}, 4 tasks)" in table
    assert "pass@2 50.0% -> 75.0%: +25.0 points" in table and "tasks fail->pass: 1 (weather_agent/0)" in table
    for site in serve(str(a), str(b)):
        status, _, page = site.get("/diff?a=0&b=1")
        assert status == 200 and b'id="estimates"' in page and b"+37.5 points" in page
        assert b'<dd id="tasks-fail-pass">1: weather_agent/0</dd>' in page


def test_the_same_tasks_written_by_another_writer_pair(tmp_path: Path) -> None:
    """NeMo Gym's writer (json.dumps: spaces, \\u escapes) and ours (compact UTF-8) write one input apart."""
    rows = [row(t, 0, 1.0) for t in range(3)]
    for r in rows:
        r["responses_create_params"]["input"][-1]["content"] += " à Paris, s'il vous plaît"
    a = write(tmp_path / "a.jsonl", rows)
    b = tmp_path / "b.jsonl"
    b.write_text("".join(json.dumps(r, separators=(",", ":"), ensure_ascii=False) + "\n" for r in rows))
    out = cli("diff", str(a), str(b), "--json")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["common"] == 3 and d["other_tasks"] == 0 and not d["warnings"]
