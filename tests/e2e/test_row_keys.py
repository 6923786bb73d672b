"""The runtime's row keys belong to the runtime (issue 52, item 4).

The attack: an environment's verify answered fields named ``response`` and ``policy_versions``; ``build_row``
merged them after the runtime's own, so the row a trainer learns from held ``{"forged": "trajectory"}`` and
``[999, 999]``, natively and in a guest process. Now a field naming a runtime key is ignored when it only
echoes the runtime's value or the request's (a hosted server's verify echoes its body), and otherwise the row
is a ``verify_error`` naming the key.

Real nats-server, real workers (the environment's code in the worker's process, or in a real guest process);
the scripted policy is the LLM's double.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import yaml

from gym_runtime import Client
from tests.helpers import rows

N = 11
FORGED = {1, 4}  # the environment's verify forges these rows' keys
AGENT_FORGED = 2  # and the agent this one's
FAILURE_FORGED = 6  # a reward-1 row that calls itself a timeout (issue 65, item 4)
UNBOUNDED = {7: 1e200, 8: "inf", 9: "nan", 10: -2e6}  # rewards no trainer may meet (reward_bound 1e6)


def write_config(tmp: Path, isolation: str) -> Path:
    cfg = {
        "namespace": "gym",
        "models": {"policy": {"adapter": "scripted"}},
        "resources": {"env": {"server": "tests.envs.row_forger", "isolation": isolation}},
        "agents": {
            "agent": {"agent": "tests.envs.key_forging_agent", "model": "policy", "resource": "env", "max_steps": 4}
        },
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize("isolation", ["none", "process"])
async def test_verify_fields_cannot_replace_the_runtimes_row_keys(nats_server, tmp_path: Path, isolation: str) -> None:
    tasks: list[dict[str, Any]] = rows(N)
    for i in FORGED:
        tasks[i]["forge"] = True
    tasks[AGENT_FORGED]["forge_agent"] = True
    tasks[FAILURE_FORGED]["forge_failure"] = True
    for i, reward in UNBOUNDED.items():
        tasks[i]["reward_given"] = reward
    config = write_config(tmp_path, isolation)
    async with Client(config, nats=nats_server.url, workers=["models.policy", "agents.agent", "resources.env"]) as c:
        batch = await c.submit(tasks)
        with anyio.fail_after(120):
            got = {r["_ng_task_index"]: r for r in await batch.gather()}
    assert sorted(got) == list(range(N))
    for i in FORGED:  # before: a row with the forged trajectory and versions, reward 1.0
        row = got[i]
        assert row.get("error_class") == "verify_error", row
        assert "'response'" in row["error"] and "only the runtime writes" in row["error"], row["error"]
        assert "reward" not in row and "policy_versions" not in row
    row = got[AGENT_FORGED]  # before: reward 1e6, filed under task 0
    assert row.get("error_class") == "verify_error" and "the agent set the row key 'reward'" in row["error"], row
    row = got[FAILURE_FORGED]  # before: reward 1.0 with error_class timeout, which trainers and view took as failed
    assert row.get("error_class") == "verify_error" and "'error_class'" in row["error"], row
    assert row["failure_attribution"] == "environment" and "reward" not in row
    for i in UNBOUNDED:  # before: written as given (1e200 stopped the async trainer)
        row = got[i]
        assert row.get("error_class") == "verify_error" and "reward" not in row, row
        said = {7: "1e+200", 8: "inf", 9: "nan", 10: "-2000000.0"}[i]
        assert f"the reward {said}" in row["error"], row["error"]
        assert row["failure_attribution"] == "environment"
    for i in (
        set(range(N)) - FORGED - {AGENT_FORGED, FAILURE_FORGED} - set(UNBOUNDED)
    ):  # an echo of the request's own values is no forgery
        row = got[i]
        assert "error_class" not in row, row
        assert row["reward"] == 1.0 and row["note"] == "echo" and row["agent_note"] == "echo"
        assert row["response"]["output"] and "forged" not in row["response"]
        assert row["responses_create_params"] == tasks[i]["responses_create_params"]
        assert "policy_versions" not in row
