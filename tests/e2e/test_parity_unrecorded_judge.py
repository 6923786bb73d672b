"""``gym-runtime parity`` on a server with a judge whose recordings hold no judge call (issue 57): the rows its
grader decides alone are replayed and compared, the rows whose replay called the judge are refused, and the
summary says how many of each. Before, the whole server was refused ("it has a judge, but no judge call is
recorded"), polymath included, whose five rows its grader decides without the judge.

Real parts: the real CLI, the server's own code hosted on the built NeMo Gym environment, the replay model.
The server (``tests/data/nemo_servers/judged``) and its recordings are built here, in polymath's shape.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from gym_runtime.nemo_gym.catalogue import NO_JUDGE_CALL, recordings
from tests.helpers import REPO, cli, write_jsonl
from tests.hosting import catalogue_root

JUDGED = REPO / "tests" / "data" / "nemo_servers" / "judged"
AGENT = "judged_simple_agent"
CONFIG = """\
judged:
  resources_servers:
    judged:
      entrypoint: app.py
      judge_model_server:
        type: responses_api_models
        name: policy_model
judged_simple_agent:
  responses_api_agents:
    simple_agent:
      entrypoint: app.py
      resources_server: {type: resources_servers, name: judged}
      model_server: {type: responses_api_models, name: policy_model}
"""


def _task(question: str) -> dict[str, Any]:
    return {"responses_create_params": {"input": [{"role": "user", "content": question}]}, "agent_ref": {"name": AGENT}}


def _rollout(i: int, question: str, answer: str, reward: float) -> dict[str, Any]:
    message = {
        "id": f"msg_{i}",
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": answer, "annotations": []}],
    }
    response = {
        "id": f"resp_{i}",
        "created_at": 0.0,
        "model": "recorded",
        "object": "response",
        "output": [message],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
    }
    return {**_task(question), "response": response, "reward": reward, "_ng_task_index": i, "_ng_rollout_index": 0}


def _server(root: Path, rollouts: list[tuple[str, str, float]]) -> Path:
    server = root / "judged_server"
    shutil.copytree(JUDGED, server)
    (server / "configs").mkdir()
    (server / "data").mkdir()
    (server / "configs" / "judged.yaml").write_text(CONFIG)
    write_jsonl(server / "data" / "example.jsonl", [_task(q) for q, _, _ in rollouts])
    write_jsonl(server / "data" / "example_rollouts.jsonl", [_rollout(i, *r) for i, r in enumerate(rollouts)])
    return server


def test_rows_that_needed_the_unrecorded_judge_are_refused_the_rest_replayed(tmp_path: Path) -> None:
    catalogue_root("--server", "example_single_tool_call")  # the NeMo Gym base layer, built if missing
    server = _server(
        tmp_path,
        [
            ("What is 2 + 2?", "Two and two: \\boxed{4}", 1.0),  # the grader decides
            ("What is 2 + 3?", "\\boxed{6}", 0.0),  # the grader decides
            ("What is 1 + 3?", "four, I think", 1.0),  # no boxed answer: its judge said EQUAL, not recorded
        ],
    )
    assert recordings(server) == (False, NO_JUDGE_CALL)  # the catalogue still calls them incomplete
    r = cli("parity", str(server), timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert f"{server}: parity 2/2 rewards; tool-output drift 0" in lines, r.stdout
    assert (
        f"{server}: 2 rows replayed, 1 refused (a row whose reward needed a judge call: the server has a judge and no"
        " call of it is recorded)" in lines
    ), r.stdout
    assert any(line.split()[:3] == ["2", "1", "refused"] for line in lines), r.stdout
    assert "Traceback" not in r.stderr

    # every row needs the judge: nothing to compare, so nothing is claimed (one line, exit 2)
    only_judged = _server(tmp_path / "all", [("What is 1 + 3?", "four", 1.0), ("What is 0 + 4?", "4!", 1.0)])
    r = cli("parity", str(only_judged), timeout=600)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == [
        f"gym-runtime: error: parity {only_judged}: its recordings cannot be replayed: every row's reward needed a"
        " judge call (2 rows), and no judge call is recorded"
    ]
    assert json.dumps(r.stdout) == '""'
