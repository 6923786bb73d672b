"""Workers on the in-memory transport (``gym_runtime.testing.MemoryTransport``): no nats-server.

Unit tests of what each worker does with a message, each well under a second: a resource worker seeds a
session, runs a tool and verifies it; an agent worker runs a rollout against a model worker (the scripted
adapter, the LLM test double) and a resource worker, stores its result before it acks the task, and retries
a task whose verifier raises until it becomes a failure row. The same paths on a real server:
``tests/test_resource_worker.py``, ``tests/test_agent_worker.py`` and the end-to-end tests.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator

import anyio
import pytest

from gym_runtime.config import ModelConfig, ResourceConfig, config_from_dict, resolve_config
from gym_runtime.errors import Failure
from gym_runtime.messages import (
    CreateParams,
    ModelRequest,
    ModelResponse,
    RolloutResult,
    RolloutTask,
    SeedReply,
    SeedRequest,
    ToolCall,
    ToolReply,
    VerifyReply,
    VerifyRequest,
)
from gym_runtime.testing import MemoryBroker, MemoryTransport, text_response
from gym_runtime.transport.jetstream import task_msg_id
from gym_runtime.transport.model_calls import call_model
from gym_runtime.transport.subjects import Subjects
from gym_runtime.workers.agent_worker import AgentWorker
from gym_runtime.workers.control import send_pause, send_resume
from gym_runtime.workers.model_worker import ModelWorker
from gym_runtime.workers.resource_worker import ResourceWorker
from tests.helpers import FLAKY, ROWS, FailsFirst, resolved


@contextlib.asynccontextmanager
async def running(*workers: object) -> AsyncIterator[None]:
    """The workers served in this task group for the block, each ready (subscribed, pulling) before it."""
    async with anyio.create_task_group() as tg:
        for w in workers:
            await tg.start(w.run)  # type: ignore[attr-defined]
        yield
        tg.cancel_scope.cancel()


def weather_call(session: str, city: str = "Paris") -> ToolCall:
    return ToolCall(session=session, name="get_weather", arguments=json.dumps({"city": city}))


async def test_a_resource_worker_seeds_a_session_runs_its_tool_and_verifies_it() -> None:
    async with MemoryTransport() as bus:
        worker = ResourceWorker(
            bus, "weather", resolved(resources={"weather": ResourceConfig(server="resources.weather", max_sessions=3)})
        )
        with anyio.fail_after(10):
            async with running(worker):
                seed = await bus.request(
                    bus.subjects.seed("weather", bus.caller), SeedRequest(row=ROWS[0]), timeout=10, op="seed"
                )
                assert isinstance(seed, SeedReply) and seed.address == worker.address
                assert seed.session in worker.sessions
                tool = await bus.request(
                    Subjects.session_call(seed.address, "tool", bus.caller),
                    weather_call(seed.session),
                    timeout=10,
                    op="tool",
                )
                assert isinstance(tool, ToolReply) and "Paris" in tool.output
                answer = text_response("It is sunny in Paris.")
                verify = VerifyRequest(session=seed.session, row=ROWS[0], response=answer, close=True)
                verdict = await bus.request(
                    Subjects.session_call(seed.address, "verify", bus.caller), verify, timeout=10, op="verify"
                )
                assert isinstance(verdict, VerifyReply) and verdict.reward == 1.0
                assert verdict.served is not None  # who verified it (the ledger's provenance)
                assert seed.session not in worker.sessions  # closed with the verify


async def test_a_call_for_a_session_not_held_is_a_typed_worker_lost_error() -> None:
    async with MemoryTransport() as bus:
        worker = ResourceWorker(
            bus, "weather", resolved(resources={"weather": ResourceConfig(server="resources.weather")})
        )
        with anyio.fail_after(10):
            async with running(worker):
                with pytest.raises(Failure) as e:
                    await bus.request(
                        Subjects.session_call(worker.address, "tool", bus.caller),
                        weather_call("gone"),
                        timeout=10,
                        op="tool",
                    )
    assert e.value.info.error_class == "worker_lost" and e.value.info.retryable


def task(index: int, row: dict[str, object]) -> RolloutTask:
    return RolloutTask(batch="b", task_index=index, rollout_index=0, agent="agent", row=row)


async def results(bus: MemoryTransport, count: int) -> list[RolloutResult]:
    """The first ``count`` results stored for batch ``b``, waiting on the broker (never on a sleep)."""
    while True:
        changed = bus.broker.changed
        stored = bus.broker.messages(bus.subjects.result("agent", "b"))
        if len(stored) >= count:
            return [await bus.decode(m) for m in stored]
        await changed.wait()


async def test_an_agent_worker_runs_a_rollout_stores_its_row_and_acks_the_task() -> None:
    cfg = resolve_config(config_from_dict(FLAKY))
    broker = MemoryBroker()
    async with MemoryTransport(broker) as bus:
        model = ModelWorker(bus, "policy", cfg)
        env = ResourceWorker(bus, "env", cfg)
        agent = AgentWorker(bus, "agent", cfg)
        with anyio.fail_after(20):
            async with running(model, env, agent):
                for i, row in enumerate((ROWS[0], {**ROWS[1], "explode": True})):
                    await bus.js_publish(bus.subjects.task("agent", "b"), task(i, row), msg_id=task_msg_id("b", i, 0))
                got = sorted(await results(bus, 2), key=lambda r: r.task_index)
                while broker.messages(bus.subjects.task("agent", "b")):  # each task acked once its row is stored
                    await broker.changed.wait()
    ok, failed = got
    assert ok.error is None and ok.row is not None and ok.row["reward"] == 1.0
    kinds = [item["type"] for item in ok.row["response"]["output"]]
    assert "function_call" in kinds and "function_call_output" in kinds and kinds[-1] == "message"
    assert ok.row["agent_ref"] == {"type": "responses_api_agents", "name": "agent"}
    # the verifier always raises: retried (nak'd, delivered again) up to max_attempts, then a failure row
    assert failed.error is not None and failed.error.error_class == "verify_error" and failed.attempts == 2
    assert agent.completed == 2 and agent.failed == 1 and agent.retried == 1 and model.served >= 2


async def test_a_paused_model_worker_holds_a_call_in_its_queue_and_answers_it_once_resumed() -> None:
    cfg = resolve_config(config_from_dict(FLAKY))
    async with MemoryTransport() as bus:
        model = ModelWorker(bus, "policy", cfg)
        request = ModelRequest(params=CreateParams(input=[{"type": "message", "role": "user", "content": "hello"}]))
        with anyio.fail_after(10):
            async with running(model):
                first = await call_model(bus, "policy", request, timeout=5)
                assert isinstance(first, ModelResponse) and model.direct == 1  # a free slot: straight to it
                acks = await send_pause(bus, "policy", {model.worker_id}, timeout=5)
                assert [a.worker for a in acks] == [model.worker_id]
                answers: list[ModelResponse] = []
                async with anyio.create_task_group() as tg:

                    async def call() -> None:
                        answers.append(await call_model(bus, "policy", request, timeout=5))

                    tg.start_soon(call)
                    while not model.gate.held:  # refused direct (paused), queued, pulled, held at the gate
                        await anyio.sleep(0)
                    assert not answers and model.served == 1
                    await send_resume(bus, "policy")
                assert len(answers) == 1 and model.served == 2 and model.direct == 1  # the second came queued


async def test_a_direct_call_that_fails_is_answered_with_its_error_and_frees_its_slot() -> None:
    """At one slot, a failed direct call must give its slot back: else every later call would go to the queue."""
    cfg = resolved(models={"policy": ModelConfig(adapter="scripted", concurrency=1)})
    adapter = FailsFirst()
    async with MemoryTransport() as bus:
        model = ModelWorker(bus, "policy", cfg, adapter=adapter)
        request = ModelRequest(params=CreateParams(input=[{"type": "message", "role": "user", "content": "hello"}]))
        with anyio.fail_after(10):
            async with running(model):
                with pytest.raises(Failure) as failed:
                    await call_model(bus, "policy", request, timeout=5)
                assert failed.value.info.error_class == "model_error"
                for _ in range(3):
                    answer = await call_model(bus, "policy", request, timeout=5)
                    assert isinstance(answer, ModelResponse)
    assert adapter.calls == 4 and model.direct == 4 and model.served == 4  # each one direct: its slot was free
