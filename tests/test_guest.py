"""A resource in a guest process (``isolation: process``) answers as it does in the worker's own process.

Every way environment code answers or fails (a tool's output, a tool that raises, arguments that do not fit,
a seed that raises, a verify that raises or refuses its row, an LLM judge's model call) reads the same to
the caller with ``isolation: none`` and ``process``; a guest stuck in a call is stopped, the call at fault is
a ``timeout``, a session that lived in the stopped guest is ``worker_lost`` (retryable), and new sessions are
served by the next guest. Real nats-server, real resource and model workers (the scripted model: the LLM's
test double), the guest a real child process.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import msgspec

from gym_runtime.config import ResourceConfig
from gym_runtime.errors import Failure
from gym_runtime.messages import SeedReply, SeedRequest, ToolCall, ToolReply, VerifyReply, VerifyRequest
from gym_runtime.model import model_config
from gym_runtime.testing import text_response
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.subjects import Subjects
from gym_runtime.workers.model_worker import ModelWorker
from gym_runtime.workers.resource_worker import ResourceWorker
from tests.helpers import ROWS, resolved


@asynccontextmanager
async def serving(
    bus: Bus, isolation: str, call_timeout_s: float = 60.0, judge_delay_s: float = 0.0
) -> AsyncIterator[ResourceWorker]:
    cfg = ResourceConfig(server="tests.envs.gil_hog", isolation=isolation, call_timeout_s=call_timeout_s)  # type: ignore[arg-type]
    judge = model_config({"adapter": "scripted", "delay_s": judge_delay_s})
    config = resolved(resources={"hog": cfg}, models={"judge": judge})
    worker = ResourceWorker(bus, "hog", config)
    async with anyio.create_task_group() as tg:
        await tg.start(ModelWorker(bus, "judge", config).run)
        await tg.start(worker.run)
        yield worker
        tg.cancel_scope.cancel()


async def outcome(coro: Any) -> Any:
    """What the caller gets: the reply, or the failure's class, message and whether it is retryable."""
    try:
        return await coro
    except Failure as e:
        return (e.info.error_class, e.info.message, e.info.retryable)


async def seed(bus: Bus, row: dict[str, Any]) -> Any:
    return await outcome(bus.request(bus.subjects.seed("hog", bus.caller), SeedRequest(row=row), timeout=30, op="seed"))


async def everything(bus: Bus) -> list[Any]:
    opened = await seed(bus, ROWS[0])
    assert isinstance(opened, SeedReply)
    sid, at = opened.session, opened.address

    async def tool(name: str, arguments: str) -> Any:
        return await outcome(
            bus.request(
                Subjects.session_call(at, "tool", bus.caller), ToolCall(sid, name, arguments), timeout=30, op="tool"
            )
        )

    async def verify(**extra: Any) -> Any:
        req = VerifyRequest(session=sid, row={**ROWS[0], **extra}, response=text_response("42"))
        return await outcome(bus.request(Subjects.session_call(at, "verify", bus.caller), req, timeout=30, op="verify"))

    return [
        await tool("get_weather", json.dumps({"city": "Oslo"})),
        await tool("broken", json.dumps({"n": 3})),
        await tool("broken", json.dumps({"n": "three"})),
        await tool("nope", "{}"),
        await seed(bus, {**ROWS[0], "seed_raises": True}),
        await verify(verify_raises="key"),
        await verify(verify_raises="invalid"),
        await verify(judge="judge"),
        await verify(),
    ]


def untimed(reply: Any) -> Any:
    """A reply less what two workers differ in: the verifying worker's id and the time its judge took. The code's
    identity stays, and so does the cost of the session's judge calls: their number and tokens."""
    if not isinstance(reply, VerifyReply) or reply.served is None:
        return reply
    served = msgspec.to_builtins(reply.served)
    served.pop("worker", None)
    for used in served.get("cost", {}).get("models", {}).values():
        used.pop("call_ms", None)
    return msgspec.structs.replace(reply, served=None), served


async def test_every_answer_and_failure_reads_the_same_in_a_guest(bus: Bus) -> None:
    got = {}
    for isolation in ("none", "process"):
        async with serving(bus, isolation) as worker:
            got[isolation] = await everything(bus)
            assert (worker.guest is not None) == (isolation == "process")
    assert [untimed(r) for r in got["process"]] == [untimed(r) for r in got["none"]]
    weather, broken, bad_args, unknown, seed_raised, key, invalid, judged, plain = got["process"]
    assert isinstance(weather, ToolReply) and "Oslo" in weather.output
    assert isinstance(broken, ToolReply) and broken.is_error and "ValueError: broken 3" in broken.output
    assert isinstance(bad_args, ToolReply) and bad_args.is_error and "do not match" in bad_args.output
    assert isinstance(unknown, ToolReply) and "unknown tool 'nope'" in unknown.output
    assert seed_raised == ("tool_error", "seed raised RuntimeError: no such task", False)
    assert key[0] == "verify_error" and "KeyError" in key[1] and key[2] is True
    assert invalid == ("invalid_task", "this row cannot be graded", False)
    assert isinstance(judged, VerifyReply) and judged.fields["judge_said"]  # the judge's words, over the bus
    assert judged.served is not None and judged.served.cost is not None  # its one judge call, counted for it
    assert judged.served.cost.models["judge"].calls == 1 and judged.served.cost.models["judge"].output_tokens > 0
    assert isinstance(plain, VerifyReply) and plain.reward == 1.0


async def test_a_stuck_guest_is_stopped_and_the_next_serves(bus: Bus) -> None:
    """The call the guest is stuck in is the ``timeout``; a call of another session that waited behind it, and
    any later call to a session of the stopped guest, is a retryable ``worker_lost``; new sessions are served."""
    async with serving(bus, "process", call_timeout_s=2) as worker:
        guest = worker.guest
        assert guest is not None
        first_pid = guest.pid
        hog, bystander = await seed(bus, ROWS[0]), await seed(bus, ROWS[1])
        assert isinstance(hog, SeedReply) and isinstance(bystander, SeedReply)
        hog_verify = VerifyRequest(session=hog.session, row={**ROWS[0], "hog_kb": 200}, response=text_response("x"))
        waits = ToolCall(bystander.session, "get_weather", json.dumps({"city": "Rome"}))
        results: dict[str, Any] = {}

        async def call(key: str, subject: str, req: Any) -> None:
            results[key] = await outcome(bus.request(subject, req, timeout=30, op=key))

        async with anyio.create_task_group() as tg:
            tg.start_soon(call, "hog", Subjects.session_call(hog.address, "verify", bus.caller), hog_verify)
            with anyio.fail_after(10):
                while not guest.running:  # until the guest is stuck in the hog's verify
                    await anyio.sleep(0.01)
            tg.start_soon(call, "bystander", Subjects.session_call(bystander.address, "tool", bus.caller), waits)
        assert results["hog"][0] == "timeout" and "call_timeout_s=2" in results["hog"][1], results
        assert results["bystander"][0] == "worker_lost" and results["bystander"][2] is True, results
        with anyio.fail_after(60):
            while guest.restarts < 1:  # the stopped guest is reaped and its sessions dropped
                await anyio.sleep(0.01)
        assert hog.session not in worker.sessions and bystander.session not in worker.sessions  # gone with it
        lost = await outcome(
            bus.request(Subjects.session_call(bystander.address, "tool", bus.caller), waits, timeout=30, op="tool")
        )
        assert lost[0] == "worker_lost" and lost[2] is True
        fresh = await seed(bus, ROWS[2])
        assert isinstance(fresh, SeedReply)
        again = ToolCall(fresh.session, "get_weather", json.dumps({"city": "Rome"}))
        served = await bus.request(
            Subjects.session_call(fresh.address, "tool", bus.caller), again, timeout=30, op="tool"
        )
        assert isinstance(served, ToolReply) and "Rome" in served.output
        assert guest.restarts == 1 and guest.pid != first_pid


async def test_a_verify_waiting_on_its_judge_past_call_timeout_s_is_not_stopped(bus: Bus) -> None:
    """call_timeout_s bounds environment code, not the model calls the worker makes for it: a verify whose LLM
    judge answers after 3 s, with call_timeout_s=1, is graded, and its guest is never restarted."""
    async with serving(bus, "process", call_timeout_s=1, judge_delay_s=3) as worker:
        opened = await seed(bus, ROWS[0])
        assert isinstance(opened, SeedReply)
        req = VerifyRequest(session=opened.session, row={**ROWS[0], "judge": "judge"}, response=text_response("42"))
        judged = await outcome(
            bus.request(Subjects.session_call(opened.address, "verify", bus.caller), req, timeout=30, op="verify")
        )
        assert isinstance(judged, VerifyReply) and judged.fields["judge_said"], judged
        assert worker.guest is not None and worker.guest.restarts == 0
