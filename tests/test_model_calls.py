"""Model calls: direct to a replica with a free slot, else through the JetStream work queue.

Real nats-server, real model workers (in this process, or a child process that
is SIGKILLed), the scripted policy as the LLM.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import anyio
import pytest

from gym_runtime.config import config_from_dict, resolve_config
from gym_runtime.data.collector import Collector, CollectStats
from gym_runtime.data.inputs import publish_rows
from gym_runtime.errors import Failure
from gym_runtime.messages import CreateParams, ModelRequest, ModelResponse, parse_items
from gym_runtime.model import ModelAdapter, ModelConfig, model_config
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.service.runner import drain, make_workers, selected, start_workers
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.discovery import discover
from gym_runtime.transport.jetstream import message_count
from gym_runtime.transport.model_calls import call_model
from gym_runtime.transport.rpc import Timings
from gym_runtime.workers.model_worker import ModelWorker
from tests.helpers import REPO, ROWS, FailsFirst, put_batch, resolved

TOOL = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def request(text: str = "weather in sf?") -> ModelRequest:
    return ModelRequest(params=CreateParams(input=parse_items(text), tools=[TOOL]))


def scripted(*, concurrency: int, delay_s: float = 0.0) -> ModelConfig:
    return model_config({"adapter": "scripted", "concurrency": concurrency, "delay_s": delay_s})


async def stored_calls(bus: Bus) -> int:
    """Model calls the work queue ever stored (its last sequence number: acked calls are removed)."""
    info = await bus.js.stream_info(bus.subjects.model_stream)
    return int(info.state.last_seq)


async def until(check: Callable[[], Awaitable[bool]], *, within: float = 30) -> None:
    """Wait for a state the test can see (not a fixed time a loaded machine stretches); fail after ``within``."""
    with anyio.fail_after(within):
        while not await check():
            await anyio.sleep(0.02)


@contextlib.asynccontextmanager
async def serving(url: str, cfg: ModelConfig, adapter: ModelAdapter | None = None) -> AsyncIterator[ModelWorker]:
    """A model worker of ``policy`` on its own connection, in this process, for the block (``adapter``: in place
    of the one ``cfg`` names)."""
    wbus = await Bus.connect(url, namespace="gym", telemetry=Telemetry(), name="model")
    worker = ModelWorker(wbus, "policy", resolved(models={"policy": cfg}), adapter=adapter)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(worker.run)
            yield worker
            tg.cancel_scope.cancel()
    finally:
        await wbus.close()


async def call_many(
    bus: Bus, n: int, *, timeout: float, meanwhile: Callable[[], Awaitable[None]] | None = None
) -> list[ModelResponse]:
    """``n`` concurrent model calls (and ``meanwhile`` while they run); their replies."""
    replies: list[ModelResponse] = []

    async def one() -> None:
        replies.append(await call_model(bus, "policy", request(), timeout=timeout))

    async with anyio.create_task_group() as tg:
        for _ in range(n):
            tg.start_soon(one)
        if meanwhile is not None:
            await meanwhile()
    return replies


async def test_calls_go_direct_while_a_slot_is_free_and_the_queue_stores_nothing(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    async with serving(nats_server.url, scripted(concurrency=8)) as worker:
        replies = await call_many(bus, 8, timeout=10)
        assert len(replies) == 8
        assert all(r.response.output[0].name == "get_weather" for r in replies)  # the model's real answer
        assert worker.served == 8
        assert await stored_calls(bus) == 0  # not one call went through the queue


async def test_a_burst_larger_than_the_slots_of_a_fast_model_still_goes_direct(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    """64 calls arrive in one read at a worker with 4 slots and an instant model: the slots are
    held only by calls not yet scheduled, so none of them is sent to the queue (busy) for that."""
    async with serving(nats_server.url, scripted(concurrency=4)) as worker:
        replies = await call_many(bus, 64, timeout=10)
        assert len(replies) == 64 and worker.served == 64
        assert worker.direct == 64
        assert await stored_calls(bus) == 0


async def test_a_direct_call_that_fails_is_answered_with_its_error_and_frees_its_slot(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    """At one slot, a failed direct call must give its slot back: else every later call would go to the queue."""
    adapter = FailsFirst()
    async with serving(nats_server.url, scripted(concurrency=1), adapter) as worker:
        with anyio.fail_after(30):
            with pytest.raises(Failure) as failed:
                await call_model(bus, "policy", request(), timeout=10)
            assert failed.value.info.error_class == "model_error"
            for _ in range(3):
                assert isinstance(await call_model(bus, "policy", request(), timeout=10), ModelResponse)
        assert adapter.calls == 4 and worker.direct == 4 and worker.served == 4
    assert await stored_calls(bus) == 0  # not one call went through the queue


async def test_calls_beyond_the_free_slots_wait_in_the_queue(nats_server: EmbeddedServer, bus: Bus) -> None:
    most = 0

    async def backlog_seen() -> None:
        nonlocal most

        async def queued() -> bool:  # a call that found no free slot was stored (the count only grows)
            return await stored_calls(bus) > 0

        await until(queued)
        while worker.served < 6:
            most = max(most, worker.gate.active)
            await anyio.sleep(0.01)

    async with serving(nats_server.url, scripted(concurrency=2, delay_s=0.3)) as worker:
        replies = await call_many(bus, 6, timeout=20, meanwhile=backlog_seen)
        assert len(replies) == 6 and worker.served == 6
        assert most == 2  # direct and queued calls together never ran more than `concurrency` at once
        queued = await stored_calls(bus)
        assert 1 <= queued <= 4  # at least two went direct; the others waited in the queue

        async def acked() -> bool:  # an ack is a publish: the queue deletes the call when the server reads it
            return await message_count(bus, bus.subjects.model_stream) == 0

        await until(acked, within=10)  # and were all acked


async def test_a_paused_model_sends_direct_calls_to_the_queue_until_resumed(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    async with serving(nats_server.url, scripted(concurrency=8)) as worker:
        await worker.gate.pause()

        async def held_then_resumed() -> None:
            async def arrived() -> bool:  # refused direct (paused), it came through the queue to the gate
                return worker.gate.held > 0 or worker.served > 0

            await until(arrived)
            assert worker.served == 0  # held: not answered while paused...
            assert await stored_calls(bus) == 1  # ...and waiting in the queue, not in a worker's memory
            worker.gate.resume()

        with anyio.fail_after(30):
            got = await call_many(bus, 1, timeout=20, meanwhile=held_then_resumed)
        assert len(got) == 1 and worker.served == 1


async def test_a_direct_call_whose_worker_is_killed_is_answered_through_the_queue(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    """The replica that took the call dies (SIGKILL) mid-generation: the caller notices the silence
    and the call goes to the queue, where the next replica answers it. No error reaches the caller."""
    bus.timings = Timings(liveness_s=2.0)  # the caller's patience, shortened for the test
    config = tmp_path / "config.yaml"
    config.write_text(
        "namespace: gym\nmodels:\n  policy: {adapter: scripted, delay_s: 30}\nresources: {}\nagents: {}\n"
    )
    slow = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gym_runtime.cli",
            "start",
            str(config),
            "--nats",
            nats_server.url,
            "--only",
            "models.policy",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert slow.stdout is not None and "ready" in slow.stdout.readline()
        got: list[ModelResponse] = []
        async with anyio.create_task_group() as tg:

            async def one() -> None:
                got.append(await call_model(bus, "policy", request(), timeout=60))

            tg.start_soon(one)

            async def on_the_slow_replica() -> bool:  # its status says it holds a call
                return any(w.get("in_flight") for w in await discover(bus, wait_s=0.2) if w.get("role") == "model")

            await until(on_the_slow_replica)
            assert await stored_calls(bus) == 0  # it came direct: nothing is stored in the queue
            os.kill(slow.pid, signal.SIGKILL)
            killed = time.perf_counter()
            slow.wait(10)
            async with serving(nats_server.url, scripted(concurrency=4)) as worker:  # the next replica
                with anyio.fail_after(28):
                    while not got:
                        await anyio.sleep(0.05)
        assert got[0].response.output[0].name == "get_weather"
        assert worker.served == 1 and await stored_calls(bus) == 1  # answered from the queue
        # the caller's liveness (2 s), not the call's 30 s or timeout 60 s: anything under 28 s tells them apart,
        # so the bound leaves a loaded machine 26 s over the liveness to start the next replica and answer
        assert time.perf_counter() - killed < 28
    finally:
        if slow.poll() is None:
            slow.kill()


async def weather_on_one_slot(
    bus: Bus, tmp_path: Path, n: int, *, delay_s: float, model: dict[str, float], agent: dict[str, float]
) -> tuple[CollectStats, int]:
    """``n`` weather rollouts at once on one slot of ``delay_s`` calls, until the model's queue is empty
    (its calls run or skipped) and the last one taken has ended: the batch's stats and the calls the
    model ran."""
    entry = {"adapter": "scripted", "concurrency": 1, "delay_s": delay_s, **model}
    cfg = config_from_dict(
        {
            "namespace": "gym",
            "models": {"policy": entry},
            "resources": {"env": {"server": "resources.weather"}},
            "agents": {
                "agent": {"agent": "agents.simple", "model": "policy", "resource": "env", "concurrency": n, **agent}
            },
            "base_dir": str(REPO),
        }
    )
    workers = make_workers(bus, resolve_config(cfg), selected(cfg, None))
    (served,) = [w for w in workers if isinstance(w, ModelWorker)]
    async with anyio.create_task_group() as tg:
        await start_workers(tg, workers)
        await publish_rows(bus, [ROWS[i % len(ROWS)] for i in range(n)], batch="b", agents=["agent"])
        with anyio.fail_after(90):
            stats = await Collector(bus, await put_batch(bus, "b", n, agent="agent"), tmp_path / "out.jsonl").run()
            while await message_count(bus, bus.subjects.model_stream) or served.gate.active:
                await anyio.sleep(0.1)  # a queued call leaves the queue when it ends; a direct one is only active
        await drain(workers, timeout=5)
        tg.cancel_scope.cancel()
    return stats, served.served


async def test_a_call_queued_longer_than_its_budget_is_served_once_and_its_rollout_completes(
    bus: Bus, tmp_path: Path
) -> None:
    """A call's budget is for the call, not for its wait behind other rollouts' calls. 12 weather rollouts
    on one slot, 0.8 s per call: the last calls wait ~9 s in the queue, past the 7 s an agent gives a call
    (budget 0 + ack_wait 2 + 5). Every rollout completes and the model runs each of the 24 calls once (before:
    calls timed out in the queue, their rollouts were retried, and the orphaned calls still ran)."""
    stats, served = await weather_on_one_slot(
        bus, tmp_path, 12, delay_s=0.8, model={"budget_s": 0.0, "ack_wait_s": 2.0}, agent={"max_steps": 4}
    )
    assert (stats.rows, stats.failures) == (12, 0)
    assert served == 24


async def test_calls_left_in_the_queue_by_rollouts_that_timed_out_are_not_run(bus: Bus, tmp_path: Path) -> None:
    """8 weather rollouts with timeout_s 3 on one slot of 1 s calls: the calls still queued when their
    rollouts time out are answered by nobody, so the model skips them (before: it ran every one, a slot
    busy for ~5 s more for nobody, the wait of the next batch's calls)."""
    stats, served = await weather_on_one_slot(bus, tmp_path, 8, delay_s=1.0, model={}, agent={"timeout_s": 3.0})
    assert stats.failures >= 4  # the rollouts that timed out
    assert served <= 4  # 3 s of 1 s calls (+1 under way at the deadline): nothing after
