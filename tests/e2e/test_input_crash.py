"""A crash the policy's input causes is the policy's (issue 73, item 6): a policy whose tool call kills its
environment's guest process (``isolation: process``) on its attempt and again on the one retry it costs gets a
scored ``input_crash`` row, ``failure_attribution: policy``, its turns so far kept; a rollout of another task whose
session was lost with the guest both times runs again and is scored. Before, the crashing rollout was
``worker_lost`` on every attempt, the infrastructure's, kept out of training: an escape hatch for hard tasks.

Real nats-server, real workers and guest processes (killed by SIGKILL from the tool's own code); the scripted
policy is the LLM's double (it calls every offered tool first, an enum's first value as its argument)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio

from gym_runtime import Client
from gym_runtime.trainers.failures import FailurePolicy, kind, reward_of

CONFIG = """
namespace: gym
models: {policy: {adapter: scripted}}
resources: {env: {server: tests.envs.blame, isolation: process}}
agents:
  agent: {agent: agents.simple, model: policy, resource: env, max_steps: 3, timeout_s: 60.0, max_attempts: 3}
"""


def task(tool: dict[str, Any], places: dict[str, str]) -> dict[str, Any]:
    return {"responses_create_params": {"input": "go", "tools": [{"type": "function", **tool}]}, **places}


CRASH = {
    "name": "crash",
    "parameters": {
        "type": "object",
        "properties": {"how": {"type": "string", "enum": ["die", "live"]}},
        "required": ["how"],
    },
}
HOLD = {"name": "hold", "parameters": {"type": "object", "properties": {}}}


async def test_a_tool_call_that_crashes_its_guest_on_the_retry_is_a_scored_policy_failure(
    nats_server: Any, tmp_path: Path
) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG)
    places = {"holding": str(tmp_path / "holding"), "release": str(tmp_path / "release")}
    # the crash waits for the other task's call to be in flight in the same guest, then kills it
    tasks = [task(CRASH, places), task(HOLD, places)]
    async with Client(config, nats=nats_server.url, workers=["models.policy", "agents.agent", "resources.env"]) as c:
        batch = await c.submit(tasks)
        with anyio.fail_after(180):
            rows = await batch.gather()
    by_task = {r["_ng_task_index"]: r for r in rows}
    crashed, held = by_task[0], by_task[1]
    assert (crashed["error_class"], crashed["failure_attribution"]) == ("input_crash", "policy"), crashed
    assert crashed["attempts"] == 2, crashed  # the one retry it cost, then not retried
    assert "killed the environment's guest process again" in crashed["error"], crashed
    assert crashed["partial"] is True  # the policy's turn that made the call is kept
    calls = [i for i in crashed["response"]["output"] if i["type"] == "function_call"]
    assert [c["name"] for c in calls] == ["crash"] and "die" in calls[0]["arguments"], calls
    assert kind(crashed) == "policy" and reward_of(crashed, FailurePolicy(policy_failure_reward=-1.0)) == -1.0
    assert "error_class" not in held and held["reward"] == 1.0, held  # lost with the guest, retried, scored
