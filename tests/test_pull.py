"""transport.pull and transport.delivery: slot-based pulling from a real JetStream work queue.

A worker holds at most ``slots`` messages at once however many wait; what it sees of each is a
``Delivery`` (attempt, enqueue time, ack/nak/term), never a nats-py object.
"""

from __future__ import annotations

import asyncio
import gc
import time

import anyio

from gym_runtime.messages import ToolCall
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.delivery import Delivery
from gym_runtime.transport.jetstream import message_count
from gym_runtime.transport.pull import work_queue_puller
from gym_runtime.transport.subjects import Subjects


async def publish(bus: Bus, n: int) -> float:
    t0 = time.time()
    for i in range(n):
        await bus.js.publish(bus.subjects.task("a", "b1"), b"%d" % i)
    return t0


async def test_a_worker_never_holds_more_than_its_slots(bus: Bus) -> None:
    running = peak = 0
    done: list[bytes] = []
    all_done = anyio.Event()

    async def handle(d: Delivery) -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await anyio.sleep(0.05)
        running -= 1
        done.append(d.data)
        await d.ack()
        if len(done) == 20:
            all_done.set()

    puller = await work_queue_puller(bus, "task", "a", slots=3, ack_wait=5.0, handle=handle)
    await publish(bus, 20)
    async with anyio.create_task_group() as tg:
        tg.start_soon(puller.run)
        with anyio.fail_after(30):
            await all_done.wait()
        tg.cancel_scope.cancel()
    assert peak == 3 and sorted(done) == sorted(b"%d" % i for i in range(20))
    with anyio.fail_after(30):  # acked (acks are not waited for): the work queue empties
        while await message_count(bus, Subjects("gym").tasks_stream):
            await anyio.sleep(0.05)


async def test_a_delivery_knows_its_attempt_and_when_it_was_queued(bus: Bus) -> None:
    seen: list[tuple[int, float | None, str]] = []
    finished = anyio.Event()

    async def handle(d: Delivery) -> None:
        seen.append((d.attempt, d.enqueued_at, d.subject))
        if d.attempt < 3:
            await d.nak()  # again, at once
        else:
            await d.ack()
            finished.set()

    puller = await work_queue_puller(bus, "task", "a", slots=1, ack_wait=5.0, handle=handle)
    t0 = await publish(bus, 1)
    async with anyio.create_task_group() as tg:
        tg.start_soon(puller.run)
        with anyio.fail_after(30):
            await finished.wait()
        tg.cancel_scope.cancel()
    assert [a for a, _, _ in seen] == [1, 2, 3]
    assert all(s == "gym.task.a.b1" for _, _, s in seen)
    stored = {q for _, q, _ in seen}
    assert len(stored) == 1  # one message, stored once
    (queued,) = stored
    assert queued is not None and t0 - 1 < queued < time.time()


async def test_a_terminated_delivery_is_never_delivered_again(bus: Bus) -> None:
    attempts = 0
    delivered = anyio.Event()

    async def handle(d: Delivery) -> None:
        nonlocal attempts
        attempts += 1
        await d.term()
        delivered.set()

    puller = await work_queue_puller(bus, "task", "a", slots=2, ack_wait=1.0, handle=handle)
    await publish(bus, 1)
    async with anyio.create_task_group() as tg:
        tg.start_soon(puller.run)
        with anyio.fail_after(30):  # the first delivery: an event, however long a loaded machine takes
            await delivered.wait()
        # a span with nothing in it: three ack waits, in which a redelivery would have come (load only
        # stretches the span, which makes a redelivery likelier to show, never a false failure)
        await anyio.sleep(3.0)
        tg.cancel_scope.cancel()
    assert attempts == 1


async def test_a_core_request_arrives_as_a_delivery_of_attempt_one(bus: Bus) -> None:
    got: list[tuple[int, float | None, str]] = []

    async def handler(body: object, d: Delivery) -> None:
        got.append((d.attempt, d.enqueued_at, d.subject))

    async with anyio.create_task_group() as tg:
        await bus.serve(tg, "gym.core.test", handler)
        await bus.nc.flush()
        await bus.nc.publish(
            "gym.core.test", bus.codec.encode(ToolCall(session="s", name="x", arguments="{}")), reply=bus.nc.new_inbox()
        )
        with anyio.fail_after(10):
            while not got:
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    assert got == [(1, None, "gym.core.test")]


async def test_serve_runs_at_most_its_concurrency_and_the_rest_in_the_order_they_came(bus: Bus) -> None:
    """``serve`` takes each request as it is read: past its slots a request waits (not as a task) and the first
    slot freed goes to the oldest; every caller is answered."""
    running = peak = 0
    started: list[str] = []
    gate = anyio.Event()

    async def handler(body: ToolCall, d: Delivery) -> ToolCall:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        started.append(body.name)
        await gate.wait()
        running -= 1
        return body

    names = [f"t{i}" for i in range(12)]
    answers: dict[str, object] = {}
    async with anyio.create_task_group() as tg:
        await bus.serve(tg, "gym.core.slots", handler, concurrency=3)
        await bus.nc.flush()

        async def call(name: str) -> None:
            payload = ToolCall(session="s", name=name, arguments="{}")
            answers[name] = (await bus.request("gym.core.slots", payload, timeout=60, op="tool")).name

        async with anyio.create_task_group() as callers:
            for name in names:
                callers.start_soon(call, name)
                await bus.nc.flush()  # sent in this order
            with anyio.fail_after(30):
                while len(started) < 3:
                    await anyio.sleep(0.01)
            assert peak == 3 and len(started) == 3  # the other nine wait for a slot
            gate.set()
        tg.cancel_scope.cancel()
    assert peak == 3
    assert started == names  # each freed slot went to the oldest waiting
    assert answers == {n: n for n in names}


async def test_a_refused_call_whose_busy_answer_cannot_be_sent_leaves_nothing_for_asyncio_to_report(
    nats_server: EmbeddedServer,
) -> None:
    """A burst of direct calls refused while the serving connection closes: their busy answers cannot be sent
    (the connection is draining or closed). That is no error of anyone's: the callers' own clocks end their calls.
    It must not leave a failed task behind, which asyncio reports with a traceback ("Task exception was never
    retrieved": CI saw one on a CLI's stderr after Ctrl-C)."""
    loop = asyncio.get_running_loop()
    reported: list[dict[str, object]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    server = await Bus.connect(nats_server.url, namespace="gym", telemetry=Telemetry(), name="closing")
    caller = await Bus.connect(nats_server.url, namespace="gym", telemetry=Telemetry(), name="caller")
    try:

        async def never(body: object, d: Delivery) -> None:
            raise AssertionError("nothing is admitted")

        async def done() -> None: ...

        async with anyio.create_task_group() as tg:
            await server.serve_direct(
                tg, "gym.core.refused", never, queue="q", admit=lambda d: False, done=done, default_error="internal"
            )
            await server.nc.flush()
            for i in range(500):
                await caller.nc.publish("gym.core.refused", b"", reply=f"_INBOX.nobody.{i}")
            await caller.nc.flush()
            with anyio.fail_after(30):
                while server.nc.stats["in_msgs"] == 0:
                    await anyio.sleep(0)
            await server.close()  # while most of the burst still waits for its turn
            tg.cancel_scope.cancel()
        gc.collect()
        await anyio.sleep(0)
    finally:
        loop.set_exception_handler(previous)
        await caller.close()
    assert [c.get("message") for c in reported] == []
