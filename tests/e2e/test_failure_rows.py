"""A failure row says who caused it and keeps what the policy produced (issue 66, items 1-2): a policy that calls a
tool that runs its rollout's ``timeout_s`` out gets, on every repeat's row, ``failure_attribution: policy``, the
attempt's ``time_split`` and its turns so far as ``response`` (status ``incomplete``) with ``partial: true``, as
the client yields it; a verifier that raises is the environment's, and so is a tool that raises a timeout of its
own (an environment forging a failure the rollout's time split could charge to the policy), and so is whatever
class a tool or verifier raises (issue 73: a ``worker_lost``, a ``timeout``, a ``cancelled``).

Real nats-server, real workers; the scripted policy is the LLM's double (it calls every offered tool first)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio

from gym_runtime import Client

CONFIG = """
namespace: gym
models: {policy: {adapter: scripted}}
resources: {env: {server: tests.envs.say_word}}
agents:
  agent: {agent: agents.simple, model: policy, resource: env, max_steps: 3, timeout_s: 3.0, max_attempts: 1}
"""


def write_config(tmp: Path) -> Path:
    path = tmp / "config.yaml"
    path.write_text(CONFIG)
    return path


def task(**extra: Any) -> dict[str, Any]:
    tools = [{"type": "function", "name": "draw_word", "parameters": {"type": "object", "properties": {}}}]
    return {"responses_create_params": {"input": "say the word", "tools": tools}, "word": "apple", **extra}


async def test_every_repeats_failure_row_says_who_caused_it_and_keeps_the_policys_turns(
    nats_server, tmp_path: Path
) -> None:
    config = write_config(tmp_path)
    forged = [task(forge_class="worker_lost"), task(forge_verify="timeout"), task(forge_verify="cancelled")]
    tasks = [task(stall_s=300.0), task(explode=True), task(), task(forge_class="timeout"), *forged]
    async with Client(config, nats=nats_server.url, workers=["models.policy", "agents.agent", "resources.env"]) as c:
        await c.set_policy_version(7)  # the model worker stamps it on every call: the rows carry it
        batch = await c.submit(tasks, repeats=2)
        with anyio.fail_after(120):
            rows = await batch.gather()
    by_task: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        by_task.setdefault(r["_ng_task_index"], []).append(r)
    for row in by_task[0]:  # the stall: both repeats, each with its own trajectory so far
        assert row["error_class"] == "timeout" and row["failure_attribution"] == "policy", row
        assert row["partial"] is True and row["response"]["status"] == "incomplete"
        calls = [i for i in row["response"]["output"] if i["type"] == "function_call"]
        assert [c["name"] for c in calls] == ["draw_word"]  # the policy's call, whose tool ran the clock out
        split = row["time_split"]
        assert split["tools_ms"] > split["total_ms"] / 2 and split["total_ms"] >= 2900
        assert row["policy_versions"] == [7, 7]  # which policy made those turns, as a scored row says
    for row in by_task[1]:  # the verifier raised: the environment's, with the policy's answer kept
        assert row["error_class"] == "verify_error" and row["failure_attribution"] == "environment", row
        assert row["partial"] is True and row["response"]["output"]
    for row in by_task[2]:
        assert "error_class" not in row and "failure_attribution" not in row and "partial" not in row
    for row in by_task[3]:  # the environment's tool raised a timeout of its own: before, a timeout split by the
        # rollout's time (here the infrastructure's; the policy's wherever its turns took the longest)
        assert row["failure_attribution"] == "environment", (row["error_class"], row["failure_attribution"])
        assert row["error_class"] == "tool_error", row
        assert "raised a timeout of its own" in row["error"] and "says the environment" in row["error"]
    # issue 73: whatever class environment code raises is its own (a tool's worker_lost would have been kept out of
    # training; a verifier's timeout on a correct answer charged to the policy or the infrastructure by a few ms)
    for index, own, said in (
        (4, "tool_error", "environment"),
        (5, "verify_error", "verifier"),
        (6, "verify_error", "verifier"),
    ):
        for row in by_task[index]:
            assert (row["error_class"], row["failure_attribution"]) == (own, "environment"), row
            assert f"says the {said}" in row["error"], row
