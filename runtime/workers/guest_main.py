"""A guest process: a resource's own code (``setup``, sessions' ``seed``, tools, ``verify``, ``close``), or an agent
module's (``setup``, each task's ``run`` or ``run_group``: a verifiers environment's whole rollout loop and rubric),
run for its worker over one socket (``guest_frames``), with no bus of its own.

Started by ``workers.guest`` as ``python -m gym_runtime.workers.guest_main SOCKET_FD RUNNING_FD``. Whatever
this process's code does with the GIL (a quadratic regex, a sync step, native code that never yields), the
worker's event loop, its keepalives and its other traffic run in another process; the worker kills this one
when a call overruns.
Standard output is sent to standard error: a print in environment code cannot corrupt the protocol.
"""

from __future__ import annotations

import asyncio
import itertools
import mmap
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Generator
from types import ModuleType
from typing import Any, Generic, Protocol, TypeVar

import anyio
import msgspec

from gym_runtime.agent import AgentContext, current_repeat
from gym_runtime.config import AgentConfig
from gym_runtime.errors import Failure, UserError
from gym_runtime.messages import (
    CreateParams,
    ErrorInfo,
    ModelRequest,
    ModelResponse,
    Response,
    RolloutTask,
    SandboxCall,
    SandboxReply,
)
from gym_runtime.nemo_gym.hosting.asgi import beside_main
from gym_runtime.nemo_gym.hosting.env import in_hosted_env
from gym_runtime.nemo_gym.hosting.host import ServerHost, called_reply, hosted_class
from gym_runtime.observability import logs
from gym_runtime.plugins import load_plugin
from gym_runtime.resource import (
    ENV_CALL,
    ENV_SESSION,
    ENV_THREAD,
    Resource,
    ToolArgumentsError,
    Verdict,
    load_resource_class,
    note_thread_call,
)
from gym_runtime.rollout import state
from gym_runtime.sandboxes.client import Sandboxes
from gym_runtime.workers.guest_frames import (
    GUEST_LOG_LEVEL,
    Called,
    CallResource,
    Close,
    Done,
    Frames,
    FromGuest,
    Generate,
    Generated,
    Page,
    Raised,
    Ready,
    Rollout,
    SandboxDone,
    SandboxOp,
    Seed,
    Start,
    ToGuest,
    Tool,
    Verify,
)


class _Answer(Protocol):
    """What every answer from the worker carries: the id of the request it answers."""

    @property
    def id(self) -> int: ...


A = TypeVar("A", bound=_Answer)


class _Asks(Generic[A]):
    """Requests this guest sends its worker over ``frames``, each waiting for the answer with its id
    (the worker answers them in any order; ``answered`` is called by the guest's reader)."""

    def __init__(self, frames: Frames) -> None:
        self._frames = frames
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[A]] = {}

    async def _ask(self, frame: Callable[[int], FromGuest]) -> A:
        """Send ``frame(id)`` and wait for its answer."""
        call_id = next(self._ids)
        answer: asyncio.Future[A] = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = answer
        try:
            self._frames.send(frame(call_id))
            return await answer
        finally:
            self._waiting.pop(call_id, None)

    def answered(self, reply: A) -> None:
        answer = self._waiting.get(reply.id)
        if answer is not None and not answer.done():
            answer.set_result(reply)


class WorkerModels(_Asks[Generated]):
    """``Resource.models`` in a guest: each model call goes to the worker, which makes it over its bus."""

    async def generate(self, params: CreateParams, *, model: str) -> Response:
        call, repeat = ENV_CALL.get(), current_repeat()
        reply = await self._ask(
            lambda call_id: Generate(id=call_id, model=model, params=params, call=call, repeat=repeat)
        )
        if reply.error is not None:
            raise Failure(reply.error)
        assert reply.response is not None
        return reply.response


class WorkerResources(_Asks[Called]):
    """A hosted server's calls to other resources servers by name, in a guest: each goes to the worker, which
    makes it over its bus as a session of its own (``hosting.host.CalledSessions``)."""

    async def call(self, server_name: str, url_path: str, body: Any, token: str) -> Any:
        reply = await self._ask(
            lambda call_id: CallResource(id=call_id, server_name=server_name, path=url_path, body=body, token=token)
        )
        return called_reply(reply.status, reply.body, reply.token)


class SandboxFailed(Exception):
    """The fleet refused or failed a hosted server's sandbox operation: its error class and one line."""

    def __init__(self, info: ErrorInfo) -> None:
        super().__init__(f"{info.error_class}: {info.message}")
        self.info = info


class WorkerSandboxes(_Asks[SandboxDone]):
    """A hosted server's sandbox operations (``sandbox_provider: gym_runtime``), in a guest: each goes to the
    worker, which makes it on the fleet under the lease of the session whose request made it (``ENV_SESSION``)."""

    async def call(self, call: SandboxCall) -> SandboxReply:
        session = ENV_SESSION.get()
        reply = await self._ask(lambda call_id: SandboxOp(id=call_id, session=session, call=call))
        if reply.error is not None:
            raise SandboxFailed(reply.error)
        assert reply.reply is not None
        return reply.reply


def thread_mark(page: Page, call_id: int) -> Callable[[], Callable[[], None]]:
    """``ENV_THREAD`` for one call: a thread starting its code notes its call in its slot, and clears it when done."""

    def mark() -> Callable[[], None]:
        tid = threading.get_native_id()
        page.set_thread(tid, call_id)
        undo = note_thread_call(call_id)  # a model call made from this thread is traced under this call

        def clear() -> None:
            undo()
            page.clear_thread(tid, call_id)

        return clear

    return mark


class Marked:
    """Awaits a call's coroutine with its id in the shared ``running`` page while its code runs (every step
    between two awaits), and 0 otherwise: when the guest is stuck, the worker reads which call it is stuck in."""

    __slots__ = ("_coro", "_id", "_page")

    def __init__(self, coro: Coroutine[Any, Any, Any], call_id: int, page: Page) -> None:
        self._coro, self._id, self._page = coro, call_id, page

    def __await__(self) -> Generator[Any, Any, Any]:
        step, page, value, error = self._coro.__await__(), self._page, None, None
        while True:
            page.set_loop(self._id)
            try:
                yielded = step.send(value) if error is None else step.throw(error)
            except StopIteration as done:
                return done.value
            finally:
                page.set_loop(0)
            try:
                value, error = (yield yielded), None
            except BaseException as e:  # noqa: BLE001 - thrown in (a cancellation): passed to the call
                value, error = None, e


class Guest:
    """The sessions of one worker's resource, each an instance of its class, keyed by the worker's session id."""

    def __init__(
        self, cls: type[Resource], frames: Frames, page: Page, resources: WorkerResources, sandboxes: WorkerSandboxes
    ) -> None:
        self.cls = cls
        self.frames = frames
        self.page = page
        self.models = WorkerModels(frames)
        self.resources = resources
        self.sandboxes = sandboxes
        self.sessions: dict[str, Resource] = {}

    async def serve(self) -> None:
        """Answer calls, each in a task of its own (asyncio's: a call's whole cost on a cheap environment is a
        few of these), until the worker is gone; then the calls still running are cancelled."""
        loop = asyncio.get_running_loop()
        running: set[asyncio.Task[None]] = set()
        try:
            while True:
                try:
                    msg = await self.frames.receive()
                except EOFError:
                    return  # the worker is gone: so is this process
                if isinstance(msg, Generated):
                    self.models.answered(msg)
                elif isinstance(msg, Called):
                    self.resources.answered(msg)
                elif isinstance(msg, SandboxDone):
                    self.sandboxes.answered(msg)
                else:
                    task = loop.create_task(self._answer(msg))
                    running.add(task)
                    task.add_done_callback(running.discard)
                    self._started(msg, task)
        finally:
            for task in list(running):
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    def _started(self, msg: Seed | Tool | Verify | Close | Rollout, task: asyncio.Task[None]) -> None:
        """The task that answers ``msg`` was created (a rollout's is kept: a ``Close`` cancels it)."""

    async def _answer(self, msg: Seed | Tool | Verify | Close | Rollout) -> None:
        ENV_THREAD.set(thread_mark(self.page, msg.id))  # this task's own context: its threads carry it
        ENV_CALL.set(msg.id)
        ENV_SESSION.set(msg.session)
        try:
            reply: Done | Raised = await Marked(self._run(msg), msg.id, self.page)
        except Failure as e:
            reply = Raised(id=msg.id, kind="failure", type_name="Failure", message=str(e), info=e.info)
        except ToolArgumentsError as e:
            reply = Raised(id=msg.id, kind="arguments", type_name=type(e).__name__, message=str(e))
        except Exception as e:  # noqa: BLE001 - the worker turns it into the row's error class, as in process
            reply = Raised(id=msg.id, kind="error", type_name=type(e).__name__, message=str(e))
        try:
            self.frames.send(reply)
        except ConnectionError:
            pass  # the worker is gone

    async def _run(self, msg: Seed | Tool | Verify | Close | Rollout) -> Done:
        if isinstance(msg, Rollout):
            raise Failure("internal", "a resource's guest runs no rollouts")
        if isinstance(msg, Seed):
            inst = self.cls()
            inst.models = self.models
            self.sessions[msg.session] = inst
            try:
                await inst.seed(msg.row)
            except BaseException:
                self.sessions.pop(msg.session, None)
                raise
            return Done(id=msg.id)
        if isinstance(msg, Close):
            closing = self.sessions.pop(msg.session, None)
            if closing is not None:
                await closing.close()
            return Done(id=msg.id)
        held = self.sessions.get(msg.session)
        if held is None:  # the worker keeps its table in step with this one; a stale id is its bug
            raise Failure("worker_lost", f"session {msg.session} is not in this guest process", retryable=True)
        if isinstance(msg, Tool):
            run = held.call_operation if msg.protocol else held.call_tool
            output = await run(msg.name, msg.arguments)
            return Done(id=msg.id, output=output, episode_done=held.episode_done)
        try:
            out = await held.verify(msg.row, msg.response)
        finally:
            if msg.close and self.sessions.pop(msg.session, None) is not None:
                await held.close()
        verdict = out if isinstance(out, Verdict) else Verdict(reward=float(out))
        return Done(id=msg.id, verdict=verdict)


class GuestPort:
    """A rollout's port in a guest: its model calls go to the worker, which makes them with the rollout's own context
    there (routing, token ids, policy versions, its ledger and trace); the guest has no bus, so no resource sessions
    (an agent that opens them runs with ``isolation: none``)."""

    def __init__(self, models: WorkerModels, agent: str) -> None:
        self._models, self._agent = models, agent

    async def model(self, name: str, request: ModelRequest, **_: Any) -> ModelResponse:
        return ModelResponse(response=await self._models.generate(request.params, model=name))

    def _no_bus(self) -> Failure:
        return Failure(
            "invalid_task", f"agents.{self._agent}: no resource sessions in a guest process (set isolation: none)"
        )

    async def seed(self, resource: str, request: Any, **_: Any) -> Any:
        raise self._no_bus()

    async def operate(self, address: str, kind: str, message: Any, **_: Any) -> Any:
        raise self._no_bus()

    async def close(self, address: str, session: str) -> None:
        return None


def guest_context(task: RolloutTask, config: AgentConfig, remaining_s: float, models: WorkerModels) -> AgentContext:
    """A rollout's ``AgentContext`` in a guest: the production context on a ``GuestPort``, on the worker's clock."""
    where = f"agents.{task.agent} (in a guest process: set isolation: none)"
    boxes = Sandboxes(None, "", where=where)
    room = state.Rollout(GuestPort(models, task.agent), task, config, state.Models(lambda _name: 0.0), boxes)
    room.deadline = time.monotonic() + remaining_s
    return AgentContext(room)


class AgentGuest(Guest):
    """An agent's rollouts, each a task of its own keyed by the worker's session id (its ``Close`` cancels it)."""

    def __init__(self, module: ModuleType, config: AgentConfig, frames: Frames, page: Page) -> None:
        super().__init__(Resource, frames, page, WorkerResources(frames), WorkerSandboxes(frames))
        self.module = module
        self.config = config
        self.rollouts: dict[str, asyncio.Task[None]] = {}

    def _started(self, msg: Seed | Tool | Verify | Close | Rollout, task: asyncio.Task[None]) -> None:
        if isinstance(msg, Rollout):
            session = msg.session
            self.rollouts[session] = task
            task.add_done_callback(lambda _: self.rollouts.pop(session, None))

    async def _run(self, msg: Seed | Tool | Verify | Close | Rollout) -> Done:
        if isinstance(msg, Close):  # the worker gave up on that rollout (its timeout_s): it stops here too
            running = self.rollouts.pop(msg.session, None)
            if running is not None:
                running.cancel()
            return Done(id=msg.id)
        if not isinstance(msg, Rollout):
            raise Failure("internal", f"an agent's guest has no sessions ({type(msg).__name__})")
        ctx = guest_context(msg.task, self.config, msg.remaining_s, self.models)
        if msg.size:
            outcomes = list(await self.module.run_group(ctx, msg.size))
        else:
            outcomes = [await self.module.run(ctx)]
        return Done(id=msg.id, outcomes=outcomes)


def marked_tasks(page: Page) -> Any:
    """An asyncio task factory: a task created by a call's code (``asyncio.gather`` of a verifiers group, of a
    rubric's reward functions) has its steps marked as that call's too, so a guest stuck in one is blamed on it."""

    def factory(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], **kwargs: Any) -> asyncio.Task[Any]:
        call_id = ENV_CALL.get()
        return asyncio.Task(_marked(coro, call_id, page) if call_id else coro, loop=loop, **kwargs)

    return factory


async def _marked(coro: Coroutine[Any, Any, Any], call_id: int, page: Page) -> Any:
    return await Marked(coro, call_id, page)


async def serve_agent(start: Start, frames: Frames, page: Page) -> None:
    """An agent module's guest: its ``setup`` once, then each ``Rollout`` (``run`` or ``run_group``)."""
    try:
        config = msgspec.convert(start.options, AgentConfig)
        module = load_plugin("agent", start.server, "agents.*.agent")
        setup = getattr(module, "setup", None)
        if setup is not None:
            await setup(config)
    except Exception as e:  # noqa: BLE001 - the worker reports it (one line for a user's mistake) and stops
        user = isinstance(e, UserError)
        frames.send(Raised(id=0, kind="failure" if user else "error", type_name=type(e).__name__, message=str(e)))
        await frames.aclose()
        return
    frames.send(Ready())
    asyncio.get_running_loop().set_task_factory(marked_tasks(page))
    await AgentGuest(module, config, frames, page).serve()


async def serve(fd: int, running_fd: int) -> None:
    page = Page(mmap.mmap(running_fd, Page.SIZE))
    frames = await Frames.open(socket.socket(fileno=fd), ToGuest)
    start = await frames.receive()
    if not isinstance(start, Start):
        raise SystemExit(f"guest: expected Start first, got {type(start).__name__}")
    if start.agent:
        await serve_agent(start, frames, page)
        return
    resources = WorkerResources(frames)
    sandboxes = WorkerSandboxes(frames)
    try:
        if start.nemo_gym:  # a hosted NeMo Gym server, on its built environment's Python
            host = ServerHost(start.nemo_gym, start.entry, start.options, start.model_names, start.resource_names)
            cls = hosted_class(host)
            cls.host.resources_via = resources.call  # type: ignore[attr-defined]
            cls.host.sandboxes_via = sandboxes.call  # type: ignore[attr-defined]
        else:
            cls = load_resource_class(start.server, f"resources.{start.entry}.server", entry=start.entry)
            cls.build_validators()
        await cls.setup(dict(start.options))
    except Exception as e:  # noqa: BLE001 - the worker reports it (one line for a user's mistake) and stops
        user = isinstance(e, UserError)
        frames.send(Raised(id=0, kind="failure" if user else "error", type_name=type(e).__name__, message=str(e)))
        await frames.aclose()
        return
    frames.send(Ready(reverify=cls.reverify, answer_field=cls.answer_field, row_tools=cls.row_tools))
    guest = Guest(cls, frames, page, resources, sandboxes)
    try:
        await guest.serve()
    finally:
        with anyio.CancelScope(shield=True):  # the worker stopped: its sessions end here, then the class
            for inst in list(guest.sessions.values()):
                await inst.close()
            await cls.teardown()


def main(argv: list[str]) -> Any:
    os.dup2(2, 1)  # environment code's prints go to the worker's log stream, never into the protocol
    sys.stdout = sys.stderr
    logs.configure(os.environ.get(GUEST_LOG_LEVEL, "warning"))  # JSON lines on the worker's stream, as it logs
    if in_hosted_env():  # a hosted server's app keeps the main thread, as under uvicorn (signal.alarm needs it)
        beside_main(lambda signals: anyio.run(serve, int(argv[0]), int(argv[1])))
    else:
        anyio.run(serve, int(argv[0]), int(argv[1]))


if __name__ == "__main__":
    main(sys.argv[1:])
