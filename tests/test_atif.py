"""``gym-runtime export --format atif``: rows as Harbor's trajectory format (ATIF v1.8), each document checked
with the ``atif`` package's pydantic models of the spec (a third party's); our own exports read back whole by
``view`` and ``diff``; a foreign ATIF file opened in ``view``."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from gym_runtime.data.atif import from_atif, to_atif
from tests.helpers import REPO, cli, read_jsonl
from tests.test_view import serve
from tests.view_rows import hostile_row, row, sample_run, write

atif = pytest.importorskip("atif", reason="the atif package is in the dev extra")


def multi_turn() -> dict[str, Any]:
    """Two tool calls answered in later items, a message with two parts, and instructions."""
    r = row(3, 1, 0.5, version=2)
    out = r["response"]["output"]
    second = {"type": "function_call", "name": "get_weather", "arguments": '{"city":"Rome"}', "call_id": "c2"}
    out[3:3] = [second, {"type": "function_call_output", "call_id": "c2", "output": "rainy"}]
    out.append(
        {
            "type": "message",
            "role": "assistant",
            "content": [
                {"type": "output_text", "text": "Paris: sun. "},
                {"type": "output_text", "text": "Rome: rain."},
            ],
        }
    )
    r["responses_create_params"]["instructions"] = "Be brief."
    return r


ROWS = [row(0, 0, 1.0), row(1, 0, 0.0, version=1), multi_turn(), hostile_row()]


@pytest.mark.parametrize("r", ROWS, ids=["plain", "tokens", "multi-turn", "hostile"])
def test_a_row_exports_as_a_valid_atif_document_and_comes_back_whole(r: dict[str, Any]) -> None:
    doc = to_atif(r, model_name="tiny")
    checked = atif.Trajectory.model_validate(doc)  # the spec's models: extra="forbid" at every level
    assert checked.schema_version == "ATIF-v1.8" and checked.agent.model_name == "tiny"
    assert doc["extra"]["gym_runtime"]["row"]["reward"] == r["reward"]
    assert from_atif(json.loads(json.dumps(doc))) == r


def test_what_atif_readers_see_of_a_row(tmp_path: Path) -> None:
    doc = to_atif(ROWS[1])
    steps = doc["steps"]
    assert [s["source"] for s in steps] == ["system", "user", "agent", "agent"]
    call_step = steps[2]
    assert call_step["reasoning_content"] == "I should call the tool."
    assert call_step["tool_calls"] == [
        {"tool_call_id": "call_1_0", "function_name": "get_weather", "arguments": {"city": "city 1"}}
    ]
    assert call_step["observation"]["results"] == [
        {"content": '{"city": "Paris", "weather": "sunny"}', "source_call_id": "call_1_0"}
    ]
    assert call_step["metrics"]["completion_token_ids"] == [11, 12, 13, 14]
    assert call_step["metrics"]["logprobs"] == [-0.1, -0.25, -1.5, -0.05]
    assert steps[3]["message"] == "It is sunny in Paris."
    assert doc["final_metrics"] == {
        "total_prompt_tokens": 120,
        "total_completion_tokens": 30,
        "total_cost_usd": 0.001,
        "total_steps": 4,
    }


def test_export_then_view_and_diff_read_it_whole(tmp_path: Path) -> None:
    src = sample_run(tmp_path / "out.jsonl")
    out = tmp_path / "out.atif.jsonl"
    done = cli("export", "--format", "atif", str(src), "-o", str(out))
    assert done.returncode == 0 and "13 trajectories written" in done.stdout, done.stderr
    for line in out.read_text().splitlines():
        atif.Trajectory.model_validate_json(line)
    diff = cli("diff", str(src), str(out), "--json")
    assert diff.returncode == 0, diff.stderr
    d = json.loads(diff.stdout)
    assert d["common"] == 13 and d["classes"] == {"REUSE": 13, "REGRADE": 0, "RERUN": 0}
    assert all(r["delta"] in (0, None) for r in d["rows"])
    for site in serve(str(src), str(out)):
        _, _, page = site.get("/")
        runs = page.decode().split("<tbody>", 1)[1].split("</tbody>", 1)[0].split("<tr>")[1:]
        cells = [re.findall(r"<td[^>]*>(.*?)</td>", tr, re.S) for tr in runs]
        assert cells[0][1] == cells[1][1] == "13" and cells[0][3] == cells[1][3] == "0.654"  # rows, mean reward


def test_a_real_runs_rows_round_trip(tmp_path: Path) -> None:
    out = tmp_path / "w.jsonl"
    done = cli("run", "weather", "-o", str(out), "--log-level", "warning")
    assert done.returncode == 0, done.stderr[-2000:]
    exported = tmp_path / "w.atif.jsonl"
    assert cli("export", "--format", "atif", str(out), "-o", str(exported)).returncode == 0
    docs = [json.loads(line) for line in exported.read_text().splitlines()]
    for r, doc in zip(read_jsonl(out), docs, strict=True):
        atif.Trajectory.model_validate(doc)
        assert doc["agent"]["name"] == "weather_agent" and doc["extra"]["gym_runtime"]["row"]["reward"] == r["reward"]
        assert from_atif(doc) == r
    # reverify reads the export as the rows it carries: the same rows out as from the JSONL itself
    for src, dst in ((out, "re.jsonl"), (exported, "re_atif.jsonl")):
        redone = cli("reverify", "weather", "-i", str(src), "-o", str(tmp_path / dst), "--log-level", "warning")
        assert redone.returncode == 0, redone.stderr[-2000:]
    assert read_jsonl(tmp_path / "re_atif.jsonl") == read_jsonl(tmp_path / "re.jsonl")
    foreign = write(tmp_path / "foreign.jsonl", [FOREIGN])
    refused = cli("reverify", "weather", "-i", str(foreign), "-o", str(tmp_path / "x.jsonl"))
    assert refused.returncode == 2 and "no task to grade" in refused.stderr


FOREIGN = {
    "schema_version": "ATIF-v1.8",
    "session_id": "harbor-trial-7",
    "agent": {"name": "terminus-2", "version": "2.0.0", "model_name": "some-model"},
    "steps": [
        {"step_id": 1, "source": "system", "message": "You are a shell agent."},
        {"step_id": 2, "source": "user", "message": "List the files <b>now</b>."},
        {
            "step_id": 3,
            "source": "agent",
            "message": "I will run ls.",
            "reasoning_content": "ls is the command.",
            "tool_calls": [{"tool_call_id": "t1", "function_name": "bash", "arguments": {"cmd": "ls"}}],
            "observation": {"results": [{"source_call_id": "t1", "content": "README.md\nsrc"}]},
            "metrics": {
                "prompt_tokens": 50,
                "completion_tokens": 3,
                "completion_token_ids": [5, 6, 7],
                "logprobs": [-0.5, -0.1, -2.0],
            },
        },
        {"step_id": 4, "source": "agent", "message": "Two files."},
    ],
    "final_metrics": {"total_prompt_tokens": 50, "total_completion_tokens": 3, "total_steps": 4},
}


def test_a_foreign_atif_file_opens_in_view_as_trajectories(tmp_path: Path) -> None:
    atif.Trajectory.model_validate(FOREIGN)
    path = tmp_path / "trajectory.json"
    path.write_text(json.dumps(FOREIGN, indent=2))  # Harbor writes one pretty-printed document per trial
    for site in serve(str(path)):
        status, _, body = site.get("/rollout/0/0/0")
        assert status == 200
        page = body.decode()
        for text in (
            "You are a shell agent.",
            "List the files &lt;b&gt;now&lt;/b&gt;.",
            "ls is the command.",
            "I will run ls.",
        ):
            assert text in page, text
        assert "tool call bash (t1)" in page and "README.md\nsrc" in page and "Two files." in page
        assert "3 generated tokens" in page and "-2.0000" in page and "terminus-2" in page
        assert '<dd id="reward">–</dd>' in page  # no reward: ATIF has none
    lines = tmp_path / "many.jsonl"
    write(lines, [FOREIGN, {**FOREIGN, "session_id": "harbor-trial-8"}])
    for site in serve(str(lines)):
        _, _, body = site.get("/rollouts")
        assert "2 rollouts" in body.decode()


def test_a_foreign_atif_file_is_read_one_way_by_view_export_and_reverify(tmp_path: Path) -> None:
    """Harbor's pretty-printed ``trajectory.json``: ``view`` opens it, ``export`` reads it (not "not JSON"),
    ``reverify`` says in one line there is no task to grade; the step's text shows before its own tool call."""
    path = tmp_path / "trajectory.json"
    path.write_text(json.dumps(FOREIGN, indent=2))
    out = cli("export", str(path), "-o", str(tmp_path / "again.atif.jsonl"))
    assert out.returncode == 0 and "1 trajectories written" in out.stdout, out.stderr
    (doc,) = [json.loads(line) for line in (tmp_path / "again.atif.jsonl").read_text().splitlines()]
    atif.Trajectory.model_validate(doc)
    redo = cli("reverify", "weather", "-i", str(path), "-o", str(tmp_path / "x.jsonl"))
    lines = redo.stderr.strip().splitlines()
    assert redo.returncode == 2 and len(lines) == 1 and "no task to grade" in lines[0], redo.stderr
    for site in serve(str(path)):
        page = site.get("/rollout/0/0/0")[2].decode()
        assert page.index("I will run ls.") < page.index("tool call bash (t1)") < page.index("README.md")
        runs = site.get("/")[2].decode()
        assert str(path) in runs and "gym-view-atif" not in runs  # the file given, not the converted rows


def test_a_file_that_is_not_atif_or_jsonl_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps([FOREIGN, {"schema_version": "other"}]))
    out = cli("view", str(bad), "--port", "0")
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        f"gym-runtime: error: {bad}: trajectory 2 is not an ATIF document (no schema_version ATIF-...)"
    ]
    assert not (REPO / "t.json").exists()
