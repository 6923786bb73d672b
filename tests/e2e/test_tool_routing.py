"""A policy's tool call reaches only a tool its environment declares (issue 33, "Names").

The policy is the adversary: it names its calls. Before, calls named ``verify``, ``seed_session``,
``aggregate_metrics`` or ``nemo_gym.http`` reached those endpoints of a hosted NeMo Gym server (``verify``
answered a reward: an oracle), and ``gym.reset``/``gym.step`` reached a gymnasium environment's episode
through any agent that forwards every call. The runtime's own session operations now travel as
operations (``ToolCall.protocol``, set only by ``Session.operate``), never as tools, and a name the
environment does not declare gets the answer its own runner gives an unknown tool: ours for native
environments, OpenEnv's for OpenEnv, FastAPI's 404 body for a NeMo Gym server (whose simple agent shows
the model that body), under our agents and under NeMo Gym's own simple_agent alike.

Real parts: a real nats-server and resource workers (native), the real CLI with hosted servers in their
built environments; the replay model (a recorded hostile policy) is the only test double.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from gym_runtime.agent import Session
from gym_runtime.config import ResourceConfig
from gym_runtime.gymnasium import Action, env_reset, env_step
from gym_runtime.transport.bus import Bus
from gym_runtime.workers.resource_worker import ResourceWorker
from tests.e2e.test_hosted_nemo_gym_servers import call, message
from tests.helpers import REPO, ROWS, cli, read_jsonl, resolved, write_jsonl
from tests.hosting import catalogue_root

NOT_FOUND = '{"detail":"Not Found"}'  # FastAPI's answer to a path that is not a route
PROTOCOL = ["verify", "seed_session", "aggregate_metrics", "close", "reset", "step", "nemo_gym.http", "gym.step"]


@asynccontextmanager
async def serving(bus: Bus, name: str, cfg: ResourceConfig) -> AsyncIterator[ResourceWorker]:
    worker = ResourceWorker(bus, name, resolved(resources={name: cfg}))
    async with anyio.create_task_group() as tg:
        await tg.start(worker.run)
        yield worker
        tg.cancel_scope.cancel()


def arguments(name: str) -> str:
    """What a hostile policy sends: a verify request for the gymnasium and passthrough ones, an action for steps."""
    if name == "nemo_gym.http":
        return json.dumps({"path": "/verify", "body": {"response": {"output": []}}})
    if name.endswith("step"):
        return msgspec.json.encode(Action(text="done", turn=9)).decode()
    return "{}"


async def test_a_native_environment_answers_every_protocol_name_as_an_unknown_tool(bus: Bus) -> None:
    async with serving(bus, "weather", ResourceConfig(server="resources.weather")):
        async with Session(bus, "weather", ROWS[0]) as s:
            for name in PROTOCOL:
                reply = await s.call(name, arguments(name))
                assert reply.is_error and reply.output == f"Error: unknown tool {name!r}; available tools: get_weather"
            assert "Paris" in (await s.call("get_weather", '{"city": "Paris"}')).output


async def test_a_policy_cannot_drive_a_gymnasium_episode(bus: Bus) -> None:
    """An agent that forwards every call (NeMo Gym's simple agent does): gym.reset and gym.step from the policy
    are unknown tools; the agent's own env_reset/env_step (operations) drive the episode."""
    row = {"responses_create_params": {"input": "count"}, "stop_at": 1}
    async with serving(bus, "countdown", ResourceConfig(server="tests.envs.countdown")):
        async with Session(bus, "countdown", row) as s:
            for name in ("gym.reset", "gym.step", "nemo_gym.http"):
                reply = await s.call(name, arguments(name))
                assert reply.is_error and reply.output.startswith(
                    f"Error: unknown tool {name!r}; available tools: tick"
                )
            assert (await env_reset(s)).observation == "You have 1 turns."
            step = await env_step(s, Action(text="done", turn=1))
            assert step.terminated and step.reward == 1.0
            assert (await s.call("tick", "{}")).output == '{"ticks": 1}'


async def test_a_policy_cannot_drive_an_openenv_episode(bus: Bus) -> None:
    cfg = ResourceConfig(server="resources.openenv", options={"env": "tests.envs.openenv_counter:CountEnv"})
    async with serving(bus, "counter", cfg):
        async with Session(bus, "counter", {"responses_create_params": {"input": "add"}}) as s:
            for name in ("gym.reset", "gym.step", "nemo_gym.http"):
                reply = await s.call(name, arguments(name))
                assert reply.is_error and reply.output == f"Error: unknown tool {name!r}; available tools: step"
            assert json.loads((await s.call("step", '{"delta": 2}')).output)["observation"]["total"] == 2


# ------------------------------------------------------------------------------------------------ hosted


@pytest.fixture(scope="module")
def catalogue() -> Path:
    return catalogue_root("--server", "mcqa", "--agent", "simple_agent")


HOSTILE = [*PROTOCOL, "close_session", "verify?x=1", "verify/", "ng-rollout/verify", "./verify", "%76erify"]
CATCHALL = REPO / "tests" / "data" / "nemo_servers" / "catchall"


def run_policy(
    tmp_path: Path, resource: dict[str, Any], agent: dict[str, Any], task: dict[str, Any], calls: list[Any]
) -> list[tuple[str, str, float]]:
    """One rollout per ``(name, arguments)`` of ``calls``: a recorded policy that calls it once and then
    answers ``no``. (name, the tool output the model read, the rollout's reward) of each."""
    rows, rollouts = [], []
    for n, (name, body) in enumerate(calls):
        row = json.loads(json.dumps(task))
        row["responses_create_params"]["input"][-1]["content"] += f" ({n})"
        output = [
            call(name, json.dumps(body)),
            {"type": "function_call_output", "call_id": "call_0", "output": "{}"},
            message("no"),
        ]
        rows.append(row)
        recorded = {"id": "r", "created_at": 0.0, "model": "m", "object": "response", "output": output}
        rollouts.append({"responses_create_params": row["responses_create_params"], "response": recorded})
    write_jsonl(tmp_path / "rollouts.jsonl", rollouts)
    write_jsonl(tmp_path / "rows.jsonl", rows)
    cfg = tmp_path / "config.yaml"
    entry = {"model": "policy", "resource": "env", "max_steps": 4, "max_attempts": 1, **agent}
    policy = {"adapter": "replay", "rollouts": str(tmp_path / "rollouts.jsonl")}
    cfg.write_text(json.dumps({"models": {"policy": policy}, "resources": {"env": resource}, "agents": {"a": entry}}))
    r = cli("run", str(cfg), "-i", str(tmp_path / "rows.jsonl"), "-o", str(tmp_path / "out.jsonl"), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = sorted(read_jsonl(tmp_path / "out.jsonl"), key=lambda row: row["_ng_task_index"])
    assert len(got) == len(calls)
    out = []
    for (name, _), row in zip(calls, got):
        (tool_output,) = [o["output"] for o in row["response"]["output"] if o["type"] == "function_call_output"]
        out.append((name, tool_output, row["reward"]))
    return out


def verify_request(task: dict[str, Any], answer: str) -> dict[str, Any]:
    """A whole verify request that grades ``answer``: what a policy probing /verify sends."""
    response = {"id": "r", "created_at": 0, "model": "m", "object": "response", "output": [message(answer)]}
    return {**task, "response": {**response, "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}}


def probes(task: dict[str, Any], answer: str, names: list[str]) -> list[tuple[str, Any]]:
    probe = verify_request(task, answer)
    return [(name, {"path": "/verify", "body": probe} if name == "nemo_gym.http" else probe) for name in names]


@pytest.mark.parametrize("agent", [{"agent": "agents.simple"}, {"nemo_gym": "simple_agent"}], ids=["ours", "nemo_gym"])
def test_a_hosted_servers_endpoints_are_not_tools(catalogue: Path, tmp_path: Path, agent: dict[str, Any]) -> None:
    """mcqa's /verify grades a whole response: a policy calling it with its candidate answer learned the reward.
    Every protocol name (and paths that normalise to one) now reads FastAPI's 404, and the rollout's own verify
    still grades its final answer."""
    task = {k: v for k, v in read_jsonl(catalogue / "mcqa" / "data" / "example.jsonl")[0].items() if k != "agent_ref"}
    got = run_policy(
        tmp_path, {"nemo_gym": "mcqa"}, agent, task, probes(task, f"\\boxed{{{task['expected_answer']}}}", HOSTILE)
    )
    assert got == [(name, NOT_FOUND, 0.0) for name in HOSTILE]  # the reward: its own final answer's, graded once


def test_a_catch_all_servers_tools_stay_open_and_its_endpoints_closed(catalogue: Path, tmp_path: Path) -> None:
    """A server that declares its tools by one ``POST /{tool_name}`` route (its rows name them) still gets every
    other name and answers unknown ones itself; its protocol stays out of reach."""
    task = {"responses_create_params": {"input": [{"role": "user", "content": "what is the secret?"}]}}
    refused = [
        "verify",
        "verify?x=1",
        "seed_session",
        "aggregate_metrics",
        "nemo_gym.http",
        "gym.step",
        "a/b",
        "%76erify",
    ]
    calls = [("lookup", {}), ("xyz", {}), *probes(task, "the secret", refused)]
    got = run_policy(tmp_path, {"nemo_gym": str(CATCHALL)}, {"agent": "agents.simple"}, task, calls)
    answers = [('{"tool":"lookup"}', 0.0), ('{"detail":"no tool xyz"}', 0.0), *[(NOT_FOUND, 0.0) for _ in refused]]
    assert got == [(name, *answer) for (name, _), answer in zip(calls, answers)]
