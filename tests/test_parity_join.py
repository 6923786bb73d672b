"""How `gym-runtime parity` reads a NeMo Gym server's recordings: rows joined, judge calls found, config chosen.

Real files in a temporary server directory shaped as the catalogue's (data/*.jsonl, configs/*.yaml);
the cases are the ones the whole-catalogue run found (string_match, aegis_v4_safety, arena).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gym_runtime.nemo_gym import parity


def _jsonl(path: Path, rows: list[Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def _rollout(text: str, **fields: Any) -> dict[str, Any]:
    return {
        "responses_create_params": {"input": [{"role": "user", "content": [{"text": text, "type": "input_text"}]}]},
        "response": {"output": [{"type": "message", "role": "assistant", "content": []}]},
        "reward": 1.0,
        **fields,
    }


def test_rows_join_their_task_whatever_the_key_order_of_content_parts(tmp_path: Path) -> None:
    """string_match's example.jsonl writes content parts as {type, text}, its recordings as {text, type}: the
    task (with its extraction_mode) must still join, else the server grades with its default mode."""
    task = {
        "responses_create_params": {
            "input": [
                {"role": "user", "type": "message", "content": [{"type": "input_text", "text": "Largest ocean?"}]}
            ]
        },
        "expected_answer": "Pacific Ocean",
        "extraction_mode": "last_line",
    }
    _jsonl(tmp_path / "data" / "example.jsonl", [task])
    rows = parity.inputs(tmp_path, [_rollout("Largest ocean?", expected_answer="Pacific Ocean")])
    assert rows[0]["extraction_mode"] == "last_line"


def test_placeholder_lines_are_not_rows(tmp_path: Path) -> None:
    _jsonl(tmp_path / "r.jsonl", ["<PLACEHOLDER ROW>", _rollout("q"), "<PLACEHOLDER ROW>"])
    assert len(parity.read_rows(tmp_path / "r.jsonl")) == 1


def test_judge_calls_recorded_under_any_field_are_found() -> None:
    call = {"responses_create_params": {"input": "judge this"}, "response": {"output": []}}
    rows = [
        _rollout("a", judge_evaluation=call),  # aegis_v4_safety
        _rollout("b", games=[call, call]),  # arena: two swapped games
        _rollout("c", judge_evaluations=[call]),
        _rollout("d", judge_output="CORRECT"),  # the judge's text only: nothing to answer a request with
    ]
    assert len(parity.judge_recordings(rows)) == 4


def test_options_come_from_the_config_file_the_recordings_were_made_with(tmp_path: Path) -> None:
    """arena ships lmarena_v2.yaml and lmarena_v3.yaml; its rows name lmarena_v3_benchmark_agent."""
    (tmp_path / "configs").mkdir()
    for v, weight in (("v2", 3), ("v3", 1)):
        (tmp_path / "configs" / f"lmarena_{v}.yaml").write_text(
            f"lmarena_{v}:\n  resources_servers:\n    {tmp_path.name}:\n      entrypoint: app.py\n"
            f"      verdict_weight: {weight}\n      judge_url: ${{judge_url}}\n"
        )
    got = parity.recorded_options(tmp_path, [_rollout("q", agent_ref={"name": "lmarena_v3_benchmark_agent"})])
    assert got == {"verdict_weight": 1}
    assert parity.recorded_options(tmp_path, [_rollout("q")]) == {}


def test_a_row_that_joins_nothing_sends_only_task_fields_back(tmp_path: Path) -> None:
    """iheval's recorded task 2 is not in example.jsonl: its rollout row carries the task and the verifier's
    outputs (`row_id`, `generation`), which the server refuses to receive again (duplicate keyword)."""
    task = {"responses_create_params": _rollout("another")["responses_create_params"], "id": 7, "task": "t"}
    _jsonl(tmp_path / "data" / "example.jsonl", [task])
    rows = parity.inputs(tmp_path, [_rollout("q", id=1, task="x", row_id="1", generation="...", reward=0.5)])
    assert set(rows[0]) == {"responses_create_params", "id", "task"}


def _image_task(image: str, answer: str) -> dict[str, Any]:
    parts = [{"type": "input_image", "image_url": image, "detail": "auto"}, {"type": "input_text", "text": "Point"}]
    return {"responses_create_params": {"input": [{"role": "user", "content": parts}]}, "expected_answer": answer}


def test_tasks_with_the_same_text_over_different_images_join_their_own_rows(tmp_path: Path) -> None:
    """gui_coordinate's tasks 0 and 1 ask the same text over two images: rollout 3 (task 0's image) joined
    task 1 and was graded against task 1's point (0.0607 replayed, 0.0667 recorded)."""
    tasks = [_image_task("data:a", "0.66,0.84"), _image_task("data:b", "0.53,0.71")]
    _jsonl(tmp_path / "data" / "example.jsonl", tasks)
    rollouts = [{"responses_create_params": t["responses_create_params"], "response": {"output": []}} for t in tasks]
    rows = parity.inputs(tmp_path, rollouts[::-1])
    assert [r["expected_answer"] for r in rows] == ["0.53,0.71", "0.66,0.84"]


def test_tasks_sharing_a_prompt_join_the_one_whose_fields_the_rollout_holds(tmp_path: Path) -> None:
    """Two tasks with one prompt and different answers: each rollout row carries its task's answer."""
    params = _rollout("same")["responses_create_params"]
    _jsonl(
        tmp_path / "data" / "example.jsonl", [{"responses_create_params": params, "expected_answer": a} for a in "12"]
    )
    rows = parity.inputs(tmp_path, [_rollout("same", expected_answer="2"), _rollout("same", expected_answer="1")])
    assert [r["expected_answer"] for r in rows] == ["2", "1"]


def _server_with_agents(tmp_path: Path, agents: dict[str, str]) -> Path:
    """A server directory whose configs define one agent instance per YAML file ({file stem: agent impl})."""
    sdir = tmp_path / "my_server"
    (sdir / "configs").mkdir(parents=True)
    (sdir / "app.py").write_text("class S: ...\n")
    for stem, impl in agents.items():
        (sdir / "configs" / f"{stem}.yaml").write_text(
            f"{stem}_agent:\n  responses_api_agents:\n    {impl}:\n      entrypoint: app.py\n"
        )
    return sdir


def test_a_tool_simulation_servers_recordings_are_replayed_by_that_agent_not_agents_simple(tmp_path: Path) -> None:
    """single_step_tool_use_with_argument_comparison records with tool_simulation_agent: one model call whose
    tool call is the answer, never run. Under agents.simple the call ran and the model was asked again, which
    the recording does not hold (rollout 1: "the conversation is longer than the recording")."""
    sdir = _server_with_agents(tmp_path, {"a_variant": "simple_agent", "my_server": "tool_simulation_agent"})
    agent = parity.run_config("my_server", sdir, {}, {})["agents"]["env_agent"]
    assert agent == {"nemo_gym": "tool_simulation_agent", "model": "policy", "resource": "env"}


def test_the_agent_the_rows_name_wins_and_simple_agent_stays_ours(tmp_path: Path) -> None:
    sdir = _server_with_agents(tmp_path, {"my_server": "tool_simulation_agent", "other": "simple_agent"})
    _jsonl(sdir / "data" / "example_rollouts.jsonl", [_rollout("q", agent_ref={"name": "other_agent"})])
    agent = parity.run_config("my_server", sdir, {}, {})["agents"]["env_agent"]
    assert agent["agent"] == "agents.simple" and "nemo_gym" not in agent


def test_a_server_recorded_with_its_own_protocols_agent_runs_under_that_agent_hosted(tmp_path: Path) -> None:
    """toolsandbox records with toolsandbox_agent, whose /seed_session, /step and /close speak the server's
    own protocol (env_id): under agents.simple its verify refused every row (HTTP 422: response.env_id
    missing)."""
    sdir = _server_with_agents(tmp_path, {"my_server": "toolsandbox_agent"})
    agent = parity.run_config("my_server", sdir, {}, {})["agents"]["env_agent"]
    assert agent == {"nemo_gym": "toolsandbox_agent", "model": "policy", "resource": "env"}


def test_a_judge_named_by_base_url_is_pointed_at_our_judge_model(tmp_path: Path) -> None:
    """verifif's own OpenAI client takes its judge's URL from `judge_base_url` (no `*_model_server` key): it
    was left at its default, api.openai.com, and every replay waited on it until the catalogue's timeout."""
    sdir = _server_with_agents(tmp_path, {"my_server": "simple_agent"})
    (sdir / "app.py").write_text("class Config:\n    judge_base_url: str | None = None\n")
    assert parity.judge_options(sdir) == {"judge_base_url": "http://judge.models.gym-runtime.invalid/v1"}
    (sdir / "configs" / "judged.yaml").write_text(
        "x:\n  resources_servers:\n    my_server:\n      judge_model_server: {}\n"
    )
    assert parity.judge_options(sdir) == {"judge_model_server": {"type": "responses_api_models", "name": "judge"}}


def test_a_row_holding_a_unicode_line_separator_is_one_row(tmp_path: Path) -> None:
    """JSON leaves U+2028 unescaped inside strings; gdpval's rows carry it (rubric text), and reading lines with
    str.splitlines cut such a row in two, so the catalogue counted 4 rows of 5 and called the server not running."""
    rows = [_rollout("a\u2028b"), _rollout("c")]
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    assert [parity._prompt(r) for r in parity.read_rows(tmp_path / "r.jsonl")] == [
        parity._prompt(_rollout("a\u2028b")),
        parity._prompt(_rollout("c")),
    ]


def test_parity_names_drift_when_the_recordings_carry_provenance() -> None:
    """Recordings gym-runtime wrote carry ``provenance``: a replay whose environment code (or grader) differs
    says so, from what to what; NeMo Gym's recordings (no provenance) and an unchanged replay say nothing."""

    def row(i: int, env: str | None, grader: str | None = None) -> dict:
        prov = {"runtime": "0.1.0", "env": env, **({"grader": grader} if grader else {})}
        return {"_ng_task_index": i, "reward": 1.0, "response": {"output": []}, **({"provenance": prov} if env else {})}

    recorded = [row(0, "aaa", "judge:111"), row(1, "aaa", "judge:111")]
    drifted = parity.compare("env", recorded, [row(0, "bbb", "judge:111"), row(1, "bbb", "judge:222")]).lines()
    assert [line for line in drifted if "drift:" in line] == [
        "warning: drift: the environment code of env differs from the one these rows were made with "
        "(aaa -> bbb, 2 rows): rewards may differ for that reason",
        "warning: drift: the grader of env differs from the one these rows were made with "
        "(judge:111 -> judge:222, 1 row): rewards may differ for that reason",
    ]
    assert not [x for x in parity.compare("env", recorded, [row(0, "aaa", "judge:111")]).lines() if "drift:" in x]
    assert not [x for x in parity.compare("env", [row(0, None)], [row(0, "bbb")]).lines() if "drift:" in x]


def test_a_replayed_row_that_called_the_unrecorded_judge_is_refused_not_compared() -> None:
    """With no judge call recorded, a row whose replay called the judge (its ``cost``) got a scripted verdict: it is
    refused; the others are compared, and the summary counts both."""
    recorded = [_rollout("a", reward=1.0), _rollout("b", reward=0.0), _rollout("c", reward=1.0)]
    judged = {"models": {"policy": {"calls": 1}, "judge": {"calls": 1}}}
    replayed = [
        {"_ng_task_index": 0, "reward": 1.0, "cost": {"models": {"policy": {"calls": 1}}}},
        {"_ng_task_index": 1, "reward": 0.0},
        {"_ng_task_index": 2, "reward": 0.0, "cost": judged},
    ]
    report = parity.compare("s", recorded, replayed, judge_unrecorded=True)
    assert report.ok and report.matched == 2 and [i for i, _ in report.refused] == [2]
    assert report.lines()[-2:] == [
        "s: parity 2/2 rewards; tool-output drift 0",
        "s: 2 rows replayed, 1 refused (a row whose reward needed a judge call: the server has a judge and no call of"
        " it is recorded)",
    ]
    # with judge calls recorded, a row that called the judge is compared as any other
    assert not parity.compare("s", recorded, replayed).ok
