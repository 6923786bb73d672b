"""A rollout's one ledger (``gym_runtime.rollout.ledger``) books the same turns, cost, policy versions, trajectory so
far (``partial``) and repeats whether its context runs in an agent worker on the in-memory bus or in this process
under ``testing.AgentEnvironment`` (issue 74 item 2): the same assertions, run on both. Under the forked context
``AgentEnvironment`` had before, ``partial()`` was always None and no policy version was booked."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from gym_runtime.config import config_from_dict, resolve_config
from gym_runtime.errors import Failure
from gym_runtime.messages import CreateParams, FunctionCall, FunctionCallOutput, Message, Response, RolloutTask
from gym_runtime.models.scripted import ScriptedModel
from gym_runtime.resources.weather import Weather
from gym_runtime.testing import AgentEnvironment, MemoryBroker, MemoryTransport, ScriptedPolicy
from gym_runtime.workers.agent_worker import AgentWorker
from gym_runtime.workers.control import publish_version
from gym_runtime.workers.model_worker import ModelWorker
from gym_runtime.workers.resource_worker import ResourceWorker
from tests.helpers import ROWS

VERSION = 3
TURNS = 2  # the scripted policy calls get_weather, then answers: one tool call between two model turns
CONFIG = {
    "namespace": "gym",
    "models": {"policy": {"adapter": "scripted"}},
    "resources": {"weather": {"server": "resources.weather"}},
    "agents": {
        "agent": {
            "agent": "tests.envs.ledger_agent",
            "model": "policy",
            "resource": "weather",
            "options": {"turns": TURNS},
            "max_attempts": 1,
        }
    },
}


class Booked:
    """What one ledger booked, read the same way from a worker's failure rows and from an in-process context."""

    def __init__(
        self,
        partials: list[Response | None],
        versions: list[list[int] | None],
        model_calls: list[int],
        calls: list[list[int]],
    ) -> None:
        self.partials, self.versions, self.model_calls, self.calls = partials, versions, model_calls, calls


def check(booked: Booked, repeats: int) -> None:
    """The assertions both ways share: each repeat's trajectory so far (its tool output too), its policy versions,
    each repeat's policy calls in its cost, and each call in order in ``calls`` (model, tool, model per repeat)."""
    assert len(booked.partials) == repeats
    for partial in booked.partials:
        assert partial is not None and partial.status == "incomplete"
        kinds = [type(i) for i in partial.output]
        assert kinds == [FunctionCall, FunctionCallOutput, Message]
        assert partial.output[0].name == "get_weather"  # type: ignore[union-attr]
        assert partial.usage is not None and partial.usage.output_tokens > 0
    assert booked.versions == [[VERSION, VERSION]] * repeats
    assert booked.model_calls == [TURNS] * repeats  # each repeat's own share of the cost
    assert [len(c) for c in booked.calls] == [4, 2, 4] * repeats


@contextlib.asynccontextmanager
async def running(*workers: Any) -> AsyncIterator[None]:
    async with anyio.create_task_group() as tg:
        for w in workers:
            await tg.start(w.run)
        yield
        tg.cancel_scope.cancel()


async def in_a_worker(group: int) -> Booked:
    cfg = resolve_config(config_from_dict(CONFIG))
    async with MemoryTransport(MemoryBroker()) as bus:
        await publish_version(bus, "policy", VERSION)
        model, env, agent = (
            ModelWorker(bus, "policy", cfg),
            ResourceWorker(bus, "weather", cfg),
            AgentWorker(bus, "agent", cfg),
        )
        with anyio.fail_after(20):
            async with running(model, env, agent):
                task = RolloutTask(batch="b", task_index=0, rollout_index=0, agent="agent", row=ROWS[0], group=group)
                await bus.js_publish(bus.subjects.task("agent", "b"), task, msg_id="b.0")
                while len(stored := bus.broker.messages(bus.subjects.result("agent", "b"))) < max(group, 1):
                    await bus.broker.changed.wait()
                rows = sorted([await bus.decode(m) for m in stored], key=lambda r: r.rollout_index)
    assert all(r.error is not None and r.error.error_class == "tool_error" for r in rows)
    assert all(r.cost is not None for r in rows) and rows[0].calls is not None
    costs = [r.cost.models["policy"].calls for r in rows]  # type: ignore[union-attr]
    return Booked([r.partial for r in rows], [r.policy_versions for r in rows], costs, rows[0].calls)


async def in_process(group: int) -> Booked:
    scripted = ScriptedModel()

    async def turn(params: CreateParams) -> Response:
        return await scripted.generate(params)

    env = AgentEnvironment(
        Weather,
        policy=ScriptedPolicy(turn),
        agent="tests.envs.ledger_agent",
        config={"options": {"turns": TURNS}},
        policy_version=VERSION,
    )
    with pytest.raises(Failure, match="the ledger agent stops here"):
        await (env.run_group(ROWS[0], group) if group > 1 else env.run(ROWS[0]))
    (ctx,) = env.contexts
    ledger = ctx.rollout.ledger
    each = [None] if group <= 1 else list(range(group))
    return Booked(
        [ctx.partial(j) for j in each],
        [ledger.versions(j) for j in each],
        [(ctx.cost if j is None else ledger.repeats[j].cost).models["policy"].calls for j in each],
        ctx.calls.log,
    )


@pytest.mark.parametrize("group", [0, 2], ids=["one rollout", "a group of 2"])
async def test_a_worker_and_agent_environment_book_the_same_ledger(group: int) -> None:
    worker = await in_a_worker(group)
    local = await in_process(group)
    check(worker, max(group, 1))
    check(local, max(group, 1))
    strip = lambda b: [[(type(i).__name__, getattr(i, "output", None)) for i in p.output] for p in b.partials]  # noqa: E731
    assert strip(worker) == strip(local)  # the same items: the tool's output as the environment answered it
