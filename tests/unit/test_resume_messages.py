"""Resume speaks typed messages (issue 74 item 3): a resumed rollout's questions are ``ResumeSession`` and
``RestoreSession``, served by the resource worker's own handler, never tool calls with reserved names and encoded
arguments; an operation or a tool named ``gym.resume.*`` is the environment's, as any other name is."""

from __future__ import annotations

import base64
import contextlib
from collections.abc import AsyncIterator

import anyio
import pytest

from gym_runtime.agent import Session
from gym_runtime.config import ResourceConfig
from gym_runtime.errors import Failure
from gym_runtime.messages import RestoreSession, ResumeReply, ResumeSession, SessionHandle
from gym_runtime.testing import MemoryTransport
from gym_runtime.transport.subjects import Subjects
from gym_runtime.workers.resource_worker import ResourceWorker
from tests.helpers import resolved

ROW = {"responses_create_params": {"input": "hi"}}
NAMES = ("gym.resume.alive", "gym.resume.restore", "gym.resume.restore_held", "gym.resume.x")


@contextlib.asynccontextmanager
async def serving(bus: MemoryTransport, server: str) -> AsyncIterator[ResourceWorker]:
    worker = ResourceWorker(bus, "env", resolved(resources={"env": ResourceConfig(server=server)}))
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            await tg.start(worker.run)
            yield worker
            tg.cancel_scope.cancel()


async def test_an_operation_named_gym_resume_is_the_environments_own() -> None:
    """Before, the worker answered ``gym.resume.alive`` itself ("alive") and restored from ``gym.resume.restore``'s
    base64 arguments: an agent's operation under those names never reached the environment."""
    async with MemoryTransport() as bus, serving(bus, "tests.envs.named_operations"):
        async with Session(bus, "env", ROW) as s:
            for name in NAMES:
                reply = await s.operate(name, base64.b64encode(b"snapshot").decode())
                assert (reply.output, reply.is_error) == (f"the environment's {name}", False)
            for name in NAMES:  # a model's call by that name: a tool the environment does not declare
                reply = await s.call(name, "{}")
                assert reply.is_error and reply.output.startswith(f"Error: unknown tool {name!r}")


async def test_resume_and_restore_are_typed_messages_with_their_own_handler() -> None:
    async with MemoryTransport() as bus, serving(bus, "tests.envs.named_operations") as worker:
        async with Session(bus, "env", ROW) as s:
            assert (await s.call("echo", '{"text": "a"}')).output == "a"
            assert s.id is not None
            subject = Subjects.session_call(worker.address, "resume", bus.caller)
            alive = await bus.request(subject, ResumeSession(session=s.id), timeout=10, op="resume")
            assert alive == ResumeReply(ok=True)
            with pytest.raises(Failure) as gone:  # a session the worker does not hold: lost
                await bus.request(subject, ResumeSession(session="0" * 32), timeout=10, op="resume")
            assert gone.value.info.error_class == "worker_lost"
            # an environment without ``restore``: refused, with why (the rollout restarts clean)
            ask = RestoreSession(session=s.id, snapshot=b"x")
            refused = await bus.request(subject, ask, timeout=10, op="restore")
            assert isinstance(refused, ResumeReply) and not refused.ok and "cannot restore" in refused.reason
            # a resumed session takes its handle up by these messages: still held here, so reattached
            handle = SessionHandle(resource="env", session=s.id, address=worker.address)
            assert await Session(bus, "env", ROW).resume(handle) == "reattached"
            lost = SessionHandle(resource="env", session="0" * 32, address=worker.address, snapshot=b"x")
            assert await Session(bus, "env", ROW).resume(lost) == "restarted"
