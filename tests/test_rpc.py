"""Core request-reply on the bus: a slow worker that keeps saying "still working" is waited for, a silent
one is given up as ``worker_lost`` long before the call's timeout, and a call that never ends times out.

Real nats-server; the responders are real bus handlers or plain subscriptions on their own connection.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from gym_runtime.errors import Failure
from gym_runtime.messages import ErrorInfo, ToolCall, ToolReply
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.headers import PROGRESS_HEADER
from gym_runtime.transport.rpc import NoResponders, Timings


@pytest.fixture
async def buses(nats_server: EmbeddedServer) -> AsyncIterator[tuple[Bus, Bus]]:
    caller = await Bus.connect(nats_server.url, namespace="gym", telemetry=Telemetry(), name="caller")
    worker = await Bus.connect(nats_server.url, namespace="gym", telemetry=Telemetry(), name="worker")
    yield caller, worker
    await caller.close()
    await worker.close()


CALL = ToolCall(session="s", name="x", arguments="{}")


async def call(caller: Bus, subject: str, *, timeout: float, liveness_s: float, on_output: Any = None) -> ToolReply:
    """``caller.request``, asked again while the server answers "no responders": about 1 in 60 times a
    subscription made and flushed on another connection is not yet matched (seen with nats-server 2.15)."""
    for _ in range(20):
        try:
            return await caller.request(
                subject, CALL, timeout=timeout, op="tool", liveness_s=liveness_s, on_output=on_output
            )
        except NoResponders:
            await anyio.sleep(0.05)
    raise AssertionError(f"nobody serves {subject}")


async def failed_call(caller: Bus, subject: str, *, timeout: float, liveness_s: float) -> tuple[ErrorInfo, float]:
    """Call ``subject``, which must fail: the error, and how long the call took to end."""
    t0 = time.monotonic()
    with pytest.raises(Failure) as e:
        await call(caller, subject, timeout=timeout, liveness_s=liveness_s)
    return e.value.info, time.monotonic() - t0


async def test_a_slow_handler_that_sends_keepalives_is_waited_for(buses: tuple[Bus, Bus]) -> None:
    caller, worker = buses
    # a keepalive every 0.2 s against a liveness of 1.5 s: only a stall of over a second of the one loop both
    # run on could cost a keepalive its turn (a 0.5 s liveness could be outlasted at a load of 30)
    worker.timings = Timings(keepalive_s=0.2)

    async def slow(call: ToolCall, _msg: object) -> ToolReply:
        await anyio.sleep(4.5)  # three times the caller's liveness
        return ToolReply(output=f"done {call.name}")

    async with anyio.create_task_group() as tg:
        await worker.serve(tg, "gym.slow", slow)
        await worker.flush()
        t0 = time.monotonic()
        out = await call(caller, "gym.slow", timeout=60, liveness_s=1.5)
        assert out.output == "done x"  # the reply itself: neither given up as lost nor timed out
        assert time.monotonic() - t0 > 4.4  # and it was waited for past three livenesses
        assert not caller._replies  # nothing left waiting
        tg.cancel_scope.cancel()


async def test_a_silent_worker_is_lost_after_liveness_not_at_the_timeout(buses: tuple[Bus, Bus]) -> None:
    caller, worker = buses
    got = anyio.Event()

    async def swallow(_msg: object) -> None:  # took the request, then died without a word
        got.set()

    await worker.nc.subscribe("gym.silent", cb=swallow)
    await worker.flush()
    error, took = await failed_call(caller, "gym.silent", timeout=60, liveness_s=0.6)
    assert got.is_set()
    assert error.error_class == "worker_lost" and error.retryable
    # liveness (0.6 s), not the 60 s timeout: the bound sits halfway, so only a run stalled for half a minute
    # could cross it; the error class says which of the two ended the call anyway
    assert 0.5 < took < 30, took
    assert not caller._replies


async def test_a_call_kept_alive_forever_times_out_at_its_deadline(buses: tuple[Bus, Bus]) -> None:
    caller, worker = buses

    async def forever_busy(msg) -> None:  # type: ignore[no-untyped-def]
        async def beat() -> None:
            while True:
                await worker.nc.publish(msg.reply, b"", headers={PROGRESS_HEADER: "1"})
                await anyio.sleep(0.1)

        worker._spawn(beat())

    await worker.nc.subscribe("gym.busy", cb=forever_busy)
    await worker.flush()
    # liveness 1 s against a beat every 0.1 s: the beats keep it alive even on a loaded machine, so what ends
    # the call is its deadline (3 s)
    error, took = await failed_call(caller, "gym.busy", timeout=3.0, liveness_s=1.0)
    assert error.error_class == "timeout" and "within 3s" in error.message, error
    assert 2.9 < took < 30, took  # kept alive forever, it would never end: any end at all is the deadline's
    for task in list(worker._background):
        task.cancel()


async def test_a_handler_cancelled_mid_call_stops_its_keepalives(buses: tuple[Bus, Bus]) -> None:
    """A worker that stops its handlers (but keeps its connection) must not keep its callers waiting."""
    caller, worker = buses
    worker.timings = Timings(keepalive_s=0.1)
    started = anyio.Event()

    async def stuck(_call: ToolCall, _msg: object) -> ToolReply:
        started.set()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async with anyio.create_task_group() as caller_tg:
        outcome: list[tuple[ErrorInfo, float]] = []

        async def make_call() -> None:
            outcome.append(await failed_call(caller, "gym.stuck", timeout=60, liveness_s=0.5))

        async with anyio.create_task_group() as worker_tg:
            await worker.serve(worker_tg, "gym.stuck", stuck)
            await worker.flush()
            caller_tg.start_soon(make_call)
            await started.wait()
            await anyio.sleep(0.3)  # a few keepalives go out
            worker_tg.cancel_scope.cancel()  # the handlers stop; the connection stays
    ((error, took),) = outcome
    assert error.error_class == "worker_lost", error
    assert took < 30, took  # liveness (0.5 s), not the 60 s timeout: halfway, so no load crosses it


async def test_a_handlers_output_parts_reach_the_caller_in_order_before_its_reply(buses: tuple[Bus, Bus]) -> None:
    """``send_output`` (a streamed exec's parts): each part once, in order, all before the reply; a caller that
    asked for none gets only the reply."""
    caller, worker = buses

    async def talky(call: ToolCall, _msg: object) -> ToolReply:
        for i in range(200):
            await worker.send_output(1 + i % 2, f"{i},".encode())
        return ToolReply(output="end")

    got: list[tuple[int, bytes]] = []
    async with anyio.create_task_group() as tg:
        await worker.serve(tg, "gym.talky", talky)
        await worker.flush()
        out = await call(caller, "gym.talky", timeout=30, liveness_s=10, on_output=lambda s, d: got.append((s, d)))
        assert out.output == "end"
        assert got == [(1 + i % 2, f"{i},".encode()) for i in range(200)]
        assert (await call(caller, "gym.talky", timeout=30, liveness_s=10)).output == "end"
        tg.cancel_scope.cancel()
