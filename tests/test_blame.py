"""Who is blamed for a failure is the runtime's finding (issue 73, items 5 and 6).

Environment code that raises a ``Failure`` of any class from ``seed``, a tool or ``verify`` (a ``timeout`` the
rollout's time split would charge to the policy, a ``worker_lost`` or ``cancelled`` kept out of training) has raised
its own ``tool_error`` or ``verify_error``, its message kept, in its worker's process and in a guest process alike;
a failure the runtime saw itself (a judge's model that failed) keeps its class wherever the environment passes it
on. A tool call (or a verify's answer) that kills the guest is a retryable ``worker_lost`` the first time and,
when the same call of the same rollout kills it again, an ``input_crash``: the policy's, not retried; another
session lost with the guest stays ``worker_lost``, the infrastructure's.

Real nats-server, real resource and model workers (``tests.envs.broken_model``: the LLM's double, always failing),
the guest a real child process killed by the tool's input or the answer it verifies.
"""

from __future__ import annotations

import json
import typing
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio

from gym_runtime.config import ResourceConfig
from gym_runtime.data.attribution import attribute
from gym_runtime.errors import Failure
from gym_runtime.messages import (
    ErrorClass,
    SeedReply,
    SeedRequest,
    ToolCall,
    ToolReply,
    VerifyReply,
    VerifyRequest,
)
from gym_runtime.model import model_config
from gym_runtime.testing import text_response
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.subjects import Subjects
from gym_runtime.workers.model_worker import ModelWorker
from gym_runtime.workers.resource_worker import ResourceWorker
from tests.helpers import ROWS, resolved

SITES = ("seed", "tool", "verify")
ENVIRONMENTS = ("tool_error", "verify_error", "invalid_task")  # the classes environment code may raise as its own


@asynccontextmanager
async def serving(bus: Bus, isolation: str) -> AsyncIterator[ResourceWorker]:
    cfg = ResourceConfig(server="tests.envs.blame", isolation=isolation)  # type: ignore[arg-type]
    config = resolved(resources={"blame": cfg}, models={"judge": model_config({"adapter": "tests.envs.broken_model"})})
    worker = ResourceWorker(bus, "blame", config)
    async with anyio.create_task_group() as tg:
        await tg.start(ModelWorker(bus, "judge", config).run)
        await tg.start(worker.run)
        yield worker
        tg.cancel_scope.cancel()


async def outcome(coro: Any) -> Any:
    """The reply, or the failure's class, message and whether it is retryable."""
    try:
        return await coro
    except Failure as e:
        return (e.info.error_class, e.info.message, e.info.retryable)


async def seed(bus: Bus, row: dict[str, Any]) -> Any:
    return await outcome(
        bus.request(bus.subjects.seed("blame", bus.caller), SeedRequest(row=row), timeout=60, op="seed")
    )


async def tool(bus: Bus, opened: SeedReply, name: str, arguments: str = "{}") -> Any:
    call = ToolCall(opened.session, name, arguments)
    return await outcome(
        bus.request(Subjects.session_call(opened.address, "tool", bus.caller), call, timeout=60, op="tool")
    )


async def failed_at(bus: Bus, where: str, row: dict[str, Any]) -> Any:
    """What the rollout's agent gets when its environment fails at ``where``."""
    opened = await seed(bus, row)
    if where == "seed":
        return opened
    assert isinstance(opened, SeedReply), opened
    if where == "tool":
        return await tool(bus, opened, "act")
    req = VerifyRequest(session=opened.session, row=row, response=text_response("x"), close=True)
    return await outcome(
        bus.request(Subjects.session_call(opened.address, "verify", bus.caller), req, timeout=60, op="verify")
    )


async def test_every_class_environment_code_raises_is_its_own_and_what_the_runtime_saw_keeps_its_class(
    bus: Bus,
) -> None:
    """Every ErrorClass from every raise site, in process and in a guest: the class and attribution of the row."""
    classes: tuple[ErrorClass, ...] = typing.get_args(ErrorClass)
    for isolation in ("none", "process"):
        async with serving(bus, isolation):
            for where in SITES:
                own = "verify_error" if where == "verify" else "tool_error"
                for raised in classes:
                    row = {**ROWS[0], "raise_in": where, "raise_class": raised}
                    got = await failed_at(bus, where, row)
                    assert isinstance(got, tuple), (isolation, where, raised, got)
                    expected = raised if raised in ENVIRONMENTS else own
                    assert got[0] == expected, (isolation, where, raised, got)
                    assert f"the environment's {where} says so" in got[1], got  # its message kept
                    assert attribute(got[0]) == "environment", (isolation, where, raised, got)
                # a failure the runtime saw (the judge's model answered an error), passed on by the environment
                judged = await failed_at(bus, where, {**ROWS[0], "judge_in": where})
                assert isinstance(judged, tuple) and judged[0] == "model_error", (isolation, where, judged)
                assert "answered 503" in judged[1] and attribute(judged[0]) == "infrastructure"


async def test_a_tool_call_that_kills_its_guest_twice_is_the_policys_and_a_session_lost_with_it_is_not(
    bus: Bus, tmp_path: Path
) -> None:
    holding, release = tmp_path / "holding", tmp_path / "release"
    places = {"holding": str(holding), "release": str(release)}
    crasher_row = {**ROWS[0], "_ng_task_index": 0, "_ng_rollout_index": 0, **places}
    bystander_row = {**ROWS[1], "_ng_task_index": 1, "_ng_rollout_index": 0, **places}
    die = json.dumps({"how": "die"})
    async with serving(bus, "process") as worker:
        guest = worker.guest
        assert guest is not None
        crasher, bystander = await seed(bus, crasher_row), await seed(bus, bystander_row)
        assert isinstance(crasher, SeedReply) and isinstance(bystander, SeedReply)
        results: dict[str, Any] = {}

        async def call(key: str, opened: SeedReply, name: str, arguments: str = "{}") -> None:
            results[key] = await tool(bus, opened, name, arguments)

        async with anyio.create_task_group() as tg:
            tg.start_soon(call, "held", bystander, "hold")  # in flight in the guest when it dies
            tg.start_soon(call, "crashed", crasher, "crash", die)  # waits for the hold, then kills its process
        crashed, held = results["crashed"], results["held"]
        assert crashed[0] == "worker_lost" and crashed[2] is True, crashed  # once: maybe the machine's
        assert "died running this tool call" in crashed[1], crashed
        assert held[0] == "worker_lost" and held[2] is True and "died running" not in held[1], held
        assert guest.restarts == 1

        # the retry it costs: the same rollout's new session, the same call, killing the guest again
        again = await seed(bus, crasher_row)
        assert isinstance(again, SeedReply), again
        second = await tool(bus, again, "crash", die)
        assert second[0] == "input_crash" and second[2] is False, second
        assert "killed the environment's guest process again" in second[1], second
        assert attribute(second[0]) == "policy"

        # the session lost with it runs again and is served (the crash touched its release); another rollout's
        # first crash is not the policy's, and the same rollout's other input is no crash
        assert release.exists()
        retried = await seed(bus, bystander_row)
        assert isinstance(retried, SeedReply), retried
        served = await tool(bus, retried, "hold")
        assert isinstance(served, ToolReply) and served.output == "released", served
        other = await seed(bus, {**crasher_row, "_ng_rollout_index": 1})
        assert isinstance(other, SeedReply), other
        first = await tool(bus, other, "crash", die)
        assert first[0] == "worker_lost" and first[2] is True, first
        alive = await seed(bus, crasher_row)
        assert isinstance(alive, SeedReply)
        lives = await tool(bus, alive, "crash", json.dumps({"how": "live"}))
        assert isinstance(lives, ToolReply) and lives.output == "alive", lives


async def test_an_answer_that_kills_its_verifiers_guest_twice_is_the_policys(bus: Bus) -> None:
    row = {**ROWS[0], "_ng_task_index": 0, "_ng_rollout_index": 0, "crash_verify": True}

    async def verify(answer: str, attempt: int) -> Any:
        opened = await seed(bus, row)
        assert isinstance(opened, SeedReply), opened
        response = text_response(answer, id=f"attempt-{attempt}")  # each attempt's own ids
        req = VerifyRequest(session=opened.session, row=row, response=response, close=True)
        return await outcome(
            bus.request(Subjects.session_call(opened.address, "verify", bus.caller), req, timeout=60, op="verify")
        )

    async with serving(bus, "process"):
        first = await verify("I die", 1)
        assert first[0] == "worker_lost" and first[2] is True and "died running this verify call" in first[1], first
        second = await verify("I die", 2)
        assert second[0] == "input_crash" and second[2] is False and "the policy's answer" in second[1], second
        third = await verify("I live", 3)
        assert isinstance(third, VerifyReply) and third.reward == 1.0, third
