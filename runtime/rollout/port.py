"""The two ways a rollout reaches the world: model calls and session operations (``Port``), over the bus
(``BusPort``: an agent worker's) or in this process (``LocalPort``: ``testing.AgentEnvironment``'s).

The rollout's context, sessions and ledger are the same whichever port they hold, as Temporal's
``ActivityEnvironment`` runs an activity's production context built from callables: nothing is subclassed and
nothing is None, so what a worker books (turns, cost, policy versions, ``partial``) is what a test sees.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import anyio
import msgspec

from gym_runtime.errors import Failure
from gym_runtime.messages import (
    CloseSession,
    CreateParams,
    ModelRequest,
    ModelResponse,
    SeedReply,
    SeedRequest,
)
from gym_runtime.transport.affinity import Affinity
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.model_calls import call_model
from gym_runtime.transport.subjects import Subjects

OnOutput = Callable[[int, bytes], None]


class Port(Protocol):
    """Where a rollout's calls go. ``model``: one model call (``wait_s``: how long it may queue; ``on_output``: the
    generation's tokens so far, where it sends them). ``seed``: open a session on ``resource`` with its first
    operation; ``operate``: one operation (``kind``: ``tool``, ``verify``, ``resume``) on the session a worker at
    ``address`` holds; ``close``: close it, best-effort."""

    async def model(
        self,
        name: str,
        request: ModelRequest,
        *,
        timeout: float,
        liveness_s: float | None,
        wait_s: float,
        on_output: OnOutput | None,
    ) -> ModelResponse: ...

    async def seed(self, resource: str, request: SeedRequest, *, timeout: float, op: str) -> SeedReply: ...

    async def operate(self, address: str, kind: str, message: Any, *, timeout: float, op: str, by: str = "") -> Any: ...

    async def close(self, address: str, session: str) -> None: ...


class BusPort:
    """A worker's: model calls direct to a replica or queued (``call_model``), a rollout's later turns first to
    the replica of its last turn where the model routes by affinity (``transport.affinity``; ``affinity``: the
    worker's, None where no model does), sessions on the environment's workers (a seed to its queue group as this
    bus's caller, then each operation to the worker that holds the session, naming that caller: the worker answers
    only the caller that seeded it)."""

    __slots__ = ("bus", "affinity")

    def __init__(self, bus: Bus, affinity: Affinity | None = None) -> None:
        self.bus = bus
        self.affinity = affinity

    async def model(
        self,
        name: str,
        request: ModelRequest,
        *,
        timeout: float,
        liveness_s: float | None,
        wait_s: float,
        on_output: OnOutput | None,
    ) -> ModelResponse:
        affinity = self.affinity
        if affinity is None or name not in affinity.load:  # no prefix cache to return to: nothing more per call
            return await call_model(
                self.bus, name, request, timeout=timeout, liveness_s=liveness_s, wait_s=wait_s, on_output=on_output
            )
        key = request.rollout_key or ""
        replica, route = affinity.choose(name, key)
        reply = await call_model(
            self.bus,
            name,
            request,
            timeout=timeout,
            liveness_s=liveness_s,
            wait_s=wait_s,
            on_output=on_output,
            replica=replica,
            route=route,
        )
        affinity.served(name, key, reply.worker)
        return reply

    async def seed(self, resource: str, request: SeedRequest, *, timeout: float, op: str) -> SeedReply:
        subject = self.bus.subjects.seed(resource, self.bus.caller)
        reply: SeedReply = await self.bus.request(subject, request, timeout=timeout, op=op)
        return reply

    async def operate(self, address: str, kind: str, message: Any, *, timeout: float, op: str, by: str = "") -> Any:
        subject = Subjects.session_call(address, kind, self.bus.caller)  # the worker answers only its seeder
        return await self.bus.request(subject, message, timeout=timeout, op=op, by=by)

    async def close(self, address: str, session: str) -> None:
        with contextlib.suppress(Exception):  # best-effort: the worker reaps idle sessions
            close = CloseSession(session=session)
            await self.bus.publish(Subjects.session_call(address, "close", self.bus.caller), close)


class LocalSession(Protocol):
    """One environment session in this process, as ``LocalPort`` serves it: ``run`` answers one operation (a
    ``ToolCall``, ``VerifyRequest`` or ``ResumeSession``) as a resource worker would; ``close`` ends it."""

    async def seed(self, row: dict[str, Any]) -> None: ...

    async def run(self, message: Any) -> Any: ...

    async def close(self) -> None: ...


Generate = Callable[[CreateParams, str], Awaitable[ModelResponse]]


class LocalPort:
    """In this process: each model call answered by ``generate(params, model)`` (its reply as a model worker's),
    each session a ``LocalSession`` that ``open(resource)`` makes (seeded with the row at its first operation, as a
    resource worker seeds one)."""

    def __init__(self, generate: Generate, open: Callable[[str], LocalSession]) -> None:
        self._generate = generate
        self._open = open
        self.sessions: dict[str, LocalSession] = {}

    async def model(
        self,
        name: str,
        request: ModelRequest,
        *,
        timeout: float,
        liveness_s: float | None,
        wait_s: float,
        on_output: OnOutput | None,
    ) -> ModelResponse:
        return await self._generate(request.params, name)

    async def seed(self, resource: str, request: SeedRequest, *, timeout: float, op: str) -> SeedReply:
        inst = self._open(resource)
        sid = os.urandom(8).hex()
        with anyio.fail_after(timeout):
            await inst.seed(request.row)
        self.sessions[sid] = inst
        result = None
        if request.then is not None:
            then = msgspec.structs.replace(request.then, session=sid)
            result = await self.operate("local", "", then, timeout=timeout, op=op)
        return SeedReply(session=sid, address="local", result=result)

    async def operate(self, address: str, kind: str, message: Any, *, timeout: float, op: str, by: str = "") -> Any:
        sid = message.session
        inst = self.sessions.get(sid)
        if inst is None:
            raise Failure("worker_lost", f"session {sid} is not held in this process", retryable=True)
        with anyio.fail_after(timeout):
            reply = await inst.run(message)
        if getattr(message, "close", False) is True:
            await self.close(address, sid)
        return reply

    async def close(self, address: str, session: str) -> None:
        inst = self.sessions.pop(session, None)
        if inst is not None:
            await inst.close()
