"""A worker's guest process (``isolation: process``): the environment's code runs there, the bus here.

Environment code that holds the GIL (Python's ``re`` on a quadratic pattern, a sync OpenEnv ``step``, native
code that never yields) stops every thread of its process. In the worker's own process that silenced the bus:
keepalives stopped and every call in flight on the worker became ``worker_lost``. In a guest process it stops
only the guest: the worker keeps answering, and when one call runs past ``call_timeout_s`` it kills the guest
and starts another. The call that overran fails as ``timeout`` (its rollout's row); the other calls in flight
there, and every later call to a session that lived there, fail as a retryable ``worker_lost``, so their
rollouts run again as new attempts; sessions opened after the restart are served as before.

Which call overran: the guest writes the id of the call whose code its event loop is running, and for each
thread running environment code (``resource.run_blocking``) its call's, into a page both processes map
(``guest_frames.Page``). When a call's time is up the worker looks at which of the guest's threads is running
(``/proc``: the one holding the GIL runs, the ones waiting for it sleep) and reads its call from the page
(``stuck_in``): a guest stuck in another call is that call's fault (the calls waiting behind it overran only
because of it); a guest stuck in none (it waits) is the fault of the call whose time is up.

``GuestSession`` stands for one session in the guest with the methods the worker calls on a ``Resource``
(``seed``, ``call_tool``, ``call_operation``, ``verify``, ``close``), so the worker serves both alike. An agent
worker's guest runs whole rollouts instead (``workers.guest_agent``): each is one call, whose model calls the
worker makes with that rollout's own context (``call(..., models=ctx)``), and whose time waiting for them does not
count: its deadline is ``call_timeout_s`` after its last model call was answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import mmap
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

import anyio
import anyio.abc
import msgspec

from gym_runtime.agent import in_repeat
from gym_runtime.errors import Failure, UserError, in_entry, observed
from gym_runtime.messages import ErrorInfo, Response, SandboxReply
from gym_runtime.observability import logs
from gym_runtime.observability.tracing import attached, current_context
from gym_runtime.resource import ModelClient, ToolArgumentsError, Verdict
from gym_runtime.sandboxes.client import Sandbox, Sandboxes
from gym_runtime.workers.crashes import rollout_digest
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
    Tool,
    Verify,
)

__all__ = ["Guest", "GuestCrash", "GuestError", "GuestFailure", "GuestSession", "ResourceCalls"]

log = logs.get("gym.resource")

GUEST_MODULE = "gym_runtime.workers.guest_main"
Call = Seed | Tool | Verify | Close | Rollout
WATCH_S = 0.25  # how often calls are checked against their deadline
STOPPED_S = 5.0  # a guest stopped (SIGSTOP: state T) this long, with calls waiting, is killed and started again
START_WAIT_S = 120.0  # a call waits this long (or call_timeout_s if longer) for a restarting guest's setup
STOP_GRACE_S = 5.0  # a stopping worker's guest gets this long to run its teardown before it is killed
SANDBOX_EXEC = "sandbox.exec"  # the runtime's operation on a session: a command in a sandbox its server holds


class ResourceCalls(Protocol):
    """A hosted server's calls to other resources servers by name, made over the worker's bus: the HTTP status
    and body its client reads, and the token naming the session used (``hosting.host.CalledSessions``)."""

    async def answer(self, server_name: str, path: str, body: Any, token: str) -> tuple[int, bytes, str]: ...


class GuestFailure(Failure):
    """The guest, not the environment's code, ended the call: it overran (``timeout``) or its process was lost
    (``worker_lost``, retryable). The worker passes it on as it is, never as the environment's own error."""

    observed = True  # the runtime's finding: the worker's clock, or the guest's process gone


class GuestCrash(GuestFailure):
    """The guest process died by itself while it ran this call, and no other (``Page.calls``): a retryable
    ``worker_lost`` the first time; the resource worker charges the same call's second crash to its input
    (``workers.crashes``)."""


class GuestError(Exception):
    """An exception of the environment's code in the guest; its subclasses carry the original type's name, so
    the messages rows show (``verify raised ValueError: ...``) read as they do in process."""


def _rebuilt(r: Raised, seen: list[ErrorInfo]) -> BaseException:
    if r.kind == "failure" and r.info is not None:
        # a failure this worker handed the call's code (a model call's, a sandbox's) is still the runtime's finding
        return observed(Failure(r.info)) if r.info in seen else Failure(r.info)
    if r.kind == "arguments":
        return ToolArgumentsError(r.message)
    error: BaseException = type(r.type_name, (GuestError,), {})(r.message)
    return error


class _Child:
    """One guest process: its frames, its generation (sessions opened in it carry it) and why it ended."""

    def __init__(self, process: anyio.abc.Process, frames: Frames, page: Page, generation: int) -> None:
        self.process = process
        self.frames = frames
        self.page = page
        self.generation = generation
        self.lost = ""  # why the worker killed it ("" while it is alive or when it died by itself)
        self.stopped_since: float | None = None  # when it was first seen stopped (``_watch``), while it stays so


class _Call:
    """A call sent to a guest and not answered yet."""

    __slots__ = (
        "answer",
        "generation",
        "deadline",
        "what",
        "session",
        "trace",
        "models",
        "session_models",
        "waiting",
        "seen",
    )

    def __init__(
        self,
        answer: asyncio.Future[Done | Raised],
        generation: int,
        deadline: float,
        what: str,
        models: ModelClient | None,
        session_models: ModelClient | None = None,
        session: str = "",
    ) -> None:
        self.answer = answer
        self.generation = generation
        self.deadline = deadline
        self.trace = current_context()  # the caller's span: the guest's model calls for this call go under it
        self.what = what
        self.session = session  # the guest session it runs in (its sandbox operations name it)
        self.seen: list[ErrorInfo] = []  # the runtime's failures this worker handed its code (``_rebuilt``)
        self.models = models  # who makes this call's model calls (a rollout's context); None: the guest's client
        # a resource session's own client (``GuestSession.models``): its judges' calls are its rollout's cost
        self.session_models = session_models
        self.waiting = 0  # its model calls in flight: a rollout waiting for the model runs no code of its own


class Guest:
    """The parent side: starts the guest, sends it calls, bounds each by ``call_timeout_s``, restarts it."""

    def __init__(
        self,
        start: Start,
        models: ModelClient,
        call_timeout_s: float,
        on_lost: Callable[[int], None] = lambda generation: None,
        *,
        python: str = sys.executable,
        env: dict[str, str] | None = None,
        resources: ResourceCalls | None = None,
        leases: Callable[[str], Sandboxes] | None = None,
        where: str = "",
    ) -> None:
        self.where = where or f"resources.{start.entry}"  # the config entry, as messages and rows name it
        self.on_lost = on_lost  # told the generation of each guest that is gone (its sessions went with it)
        self.start = start
        self.entry = start.entry
        self.python = python  # a hosted server's guest: its built environment's interpreter
        self.env = env  # added to the guest's environment (a hosted server's: HOSTED_ENV, its layer)
        self.resources = resources  # a hosted server's calls to other resources servers, over the worker's bus
        # a session's lease on the entry's sandbox pool (a hosted server's ``sandbox_provider: gym_runtime``)
        self.leases = leases
        self.sessions: dict[str, GuestSession] = {}  # open sessions with a lease, by the guest's session id
        self.models = models
        self.call_timeout_s = call_timeout_s
        self.traits = Ready()  # what the guest's class says of itself (its first Ready)
        self.outbound = 0  # the guest's model calls and calls to other resources this worker is making for it
        self.restarts = 0  # guests killed or lost and started again (status, tests)
        self._ids = itertools.count(1)
        self._waiting: dict[int, _Call] = {}
        self._child: _Child | None = None
        self._ready = anyio.Event()

    @property
    def pid(self) -> int | None:
        return self._child.process.pid if self._child is not None else None

    @property
    def generation(self) -> int | None:
        """The running guest's generation (None before the first has started)."""
        return self._child.generation if self._child is not None else None

    @property
    def running(self) -> int:
        """The call the guest's CPU-bound thread runs now (its loop's, or a ``run_blocking`` thread's); 0: none."""
        child = self._child
        return stuck_in(child.process.pid, child.page) if child is not None else 0

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Keep a guest running until cancelled; ``started`` once the first one has run ``setup``."""
        generation = 0
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watch)
            while True:
                generation += 1
                child = await self._spawn(generation)
                self._child = child
                self._ready.set()
                if generation == 1:
                    task_status.started()
                died = False
                try:
                    await self._read(child, tg)
                    died = True  # its socket closed: the guest ended by itself, or was killed (``child.lost``)
                finally:
                    with anyio.CancelScope(shield=True):
                        self._ready = anyio.Event()
                        await self._stop(child)
                        self._lose(child, died)
                        self.on_lost(child.generation)
                        await self._release(child.generation)
                self.restarts += 1
                log.warning("guest.restarted", entry=self.where, reason=child.lost or "the guest process exited")

    async def _spawn(self, generation: int) -> _Child:
        mine, theirs = socket.socketpair()
        with tempfile.TemporaryFile() as shared:
            shared.truncate(Page.SIZE)
            page = Page(mmap.mmap(shared.fileno(), Page.SIZE))  # zeros: no call runs
            try:
                process = await anyio.open_process(
                    [self.python, "-m", GUEST_MODULE, str(theirs.fileno()), str(shared.fileno())],
                    # logging configured as here (JSON at this level): unconfigured, structlog renders each
                    # exception a hosted app logs as a rich traceback, seconds of CPU apiece
                    env={**os.environ, **(self.env or {}), GUEST_LOG_LEVEL: logs.level()},
                    stdin=subprocess.DEVNULL,
                    stdout=None,
                    stderr=None,
                    pass_fds=(theirs.fileno(), shared.fileno()),
                )
            finally:
                theirs.close()
        child = _Child(process, await Frames.open(mine, FromGuest), page, generation)
        try:
            child.frames.send(self.start)
            ready = await child.frames.receive()
        except (EOFError, ConnectionError):
            await self._stop(child)
            raise RuntimeError(
                f"{self.where}: its guest process exited while starting (code {process.returncode})"
            ) from None
        if isinstance(ready, Raised):
            await self._stop(child)
            if ready.kind == "failure":
                role, _, name = self.where.partition(".")
                raise UserError(in_entry(ready.message, role, name))
            raise RuntimeError(f"{self.where}: setup raised {ready.type_name}: {ready.message}")
        if isinstance(ready, Ready):
            self.traits = ready
        return child

    async def _read(self, child: _Child, tg: anyio.abc.TaskGroup) -> None:
        """Hand each answer to its caller and serve the guest's model calls, until the guest is gone."""
        waiting = self._waiting
        while True:
            try:
                msg = await child.frames.receive()
            except EOFError:
                return
            if isinstance(msg, Generate):
                tg.start_soon(self._generate, child, msg)
                continue
            if isinstance(msg, CallResource):
                tg.start_soon(self._call_resource, child, msg)
                continue
            if isinstance(msg, SandboxOp):
                tg.start_soon(self._sandbox_op, child, msg)
                continue
            call = waiting.get(msg.id)
            if call is not None and not call.answer.done():
                call.answer.set_result(msg)

    async def _generate(self, child: _Child, req: Generate) -> None:
        self.outbound += 1
        origin = self._waiting.get(req.call)
        models = self.models
        if origin is not None:  # a rollout's context, else a session's own client, else the guest's
            models = origin.models if origin.models is not None else (origin.session_models or self.models)
        if origin is not None:
            origin.waiting += 1
        try:
            with attached(origin.trace) if origin is not None else contextlib.nullcontext(), in_repeat(req.repeat):
                response = await models.generate(req.params, model=req.model)
            reply = Generated(id=req.id, response=response)
        except Failure as e:
            reply = Generated(id=req.id, error=e.info)
            if origin is not None and e.observed:
                origin.seen.append(e.info)
        except Exception as e:  # noqa: BLE001 - the guest's judge sees a failed model call, as in process
            info = ErrorInfo(error_class="model_error", message=f"{type(e).__name__}: {e}")
            reply = Generated(id=req.id, error=info)
            if origin is not None:  # the worker's own model client failed: the runtime's finding
                origin.seen.append(info)
        finally:
            self.outbound -= 1
            if origin is not None:
                origin.waiting -= 1
                if origin.models is not None:  # a rollout: call_timeout_s for its own code from here on
                    origin.deadline = max(origin.deadline, time.monotonic() + self.call_timeout_s)
        try:
            child.frames.send(reply)
        except ConnectionError:
            pass  # that guest is gone; its caller was answered with worker_lost

    async def _call_resource(self, child: _Child, req: CallResource) -> None:
        self.outbound += 1
        try:
            await self._answer_resource_call(child, req)
        finally:
            self.outbound -= 1

    async def _answer_resource_call(self, child: _Child, req: CallResource) -> None:
        if self.resources is None:
            body = msgspec.json.encode({"error": {"message": "no calls to other resources from this guest"}})
            reply = Called(id=req.id, status=503, body=body)
        else:
            try:
                status, body, token = await self.resources.answer(req.server_name, req.path, req.body, req.token)
                reply = Called(id=req.id, status=status, body=body, token=token)
            except Exception as e:  # noqa: BLE001 - the server's client reads an HTTP error, as over HTTP
                body = msgspec.json.encode({"error": {"message": f"{req.server_name}: {type(e).__name__}: {e}"}})
                reply = Called(id=req.id, status=502, body=body)
        try:
            child.frames.send(reply)
        except ConnectionError:
            pass  # that guest is gone

    async def _sandbox_op(self, child: _Child, req: SandboxOp) -> None:
        """A hosted server's sandbox operation, made on the fleet under its session's lease."""
        self.outbound += 1  # the guest waits for the fleet, as for a model: its call is not stuck
        try:
            reply = SandboxDone(id=req.id, reply=await self._sandbox_reply(req))
        except Failure as e:
            reply = SandboxDone(id=req.id, error=e.info)
            if e.observed:  # the fleet's, seen by the runtime: still so if the server's code passes it on
                for call in self._waiting.values():
                    if call.session == req.session:
                        call.seen.append(e.info)
        except Exception as e:  # noqa: BLE001 - the server's provider raises it, as a provider's client would
            info = ErrorInfo(error_class="tool_error", message=f"{type(e).__name__}: {e}")
            reply = SandboxDone(id=req.id, error=info)
        finally:
            self.outbound -= 1
        try:
            child.frames.send(reply)
        except ConnectionError:
            pass  # that guest is gone; its sessions' leases end with it

    async def _sandbox_reply(self, req: SandboxOp) -> SandboxReply:
        session = self.sessions.get(req.session)
        if session is None:
            if self.leases is None:
                raise Failure("tool_error", f"no sandbox pool: set resources.{self.entry}.sandbox to a sandboxes entry")
            raise Failure("tool_error", "a sandbox asked outside an open session (at setup, or after it closed)")
        call, lease = req.call, session.lease
        if call.op == "create":
            assert call.spec is not None
            return SandboxReply(sandbox=(await lease.create(call.spec)).id)
        box = session.box(call.sandbox)
        if call.op == "exec":
            r = await box.exec(call.argv, timeout_s=call.timeout_s)
            return SandboxReply.of_exec(box.id, r)
        if call.op == "write":
            await box.write(call.path, call.data)
            return SandboxReply(sandbox=box.id)
        if call.op == "read":
            return SandboxReply(sandbox=box.id, data=await box.read(call.path))
        if call.op == "close":
            await box.close()
            return SandboxReply(sandbox=box.id)
        raise Failure("tool_error", f"sandbox operation {call.op!r} is not one a hosted server can ask")

    async def _release(self, generation: int) -> None:
        """The sessions that lived in a guest that is gone end their leases: their sandboxes are removed now."""
        # (a session whose seed was in flight there fails its seed, which ends its lease)
        ended = [s for s in self.sessions.values() if s.generation == generation]
        for session in ended:
            self.sessions.pop(session.session, None)
            await session.lease.close_all()
        if ended:  # sessions still open when their guest went (lost, or its worker stopping)
            log.info("guest.leases_ended", entry=self.where, sessions=len(ended))

    def _lose(self, child: _Child, died: bool = False) -> None:
        """Every call still waiting on ``child``: a retryable ``worker_lost`` (they were not at fault). ``died``: the
        guest ended by itself (not stopped by this worker); the one call it died running, when the page names one,
        gets a ``GuestCrash``."""
        why = child.lost or f"the guest process exited (code {child.process.returncode})"
        running = child.page.calls() if died and not child.lost else set()
        for call_id, call in list(self._waiting.items()):
            if call.generation == child.generation and not call.answer.done():
                if running == {call_id}:
                    message = f"{self.where}: its guest process died running this {call.what} call ({why})"
                    call.answer.set_exception(GuestCrash("worker_lost", message, retryable=True))
                else:
                    call.answer.set_exception(GuestFailure("worker_lost", f"{self.where}: {why}", retryable=True))

    async def _stop(self, child: _Child) -> None:
        """End ``child``: close its socket (it runs its teardown and exits), kill it if it does not."""
        child.frames.close()
        with anyio.move_on_after(0 if child.lost else STOP_GRACE_S):
            await child.process.wait()
        if child.process.returncode is None:
            child.process.kill()
            await child.process.wait()

    def _kill(self, child: _Child, why: str) -> None:
        if not child.lost and child.process.returncode is None:
            child.lost = why
            child.process.kill()  # its socket closes with it: ``_read`` ends, ``run`` starts another

    def stop(self, generation: int, why: str) -> None:
        """Kill the guest of ``generation`` if it still runs (its calls fail as ``worker_lost``; another starts)."""
        child = self._child
        if child is not None and child.generation == generation:
            self._kill(child, why)
            self._lose(child)

    async def call(
        self,
        make: Callable[[int], Call],
        generation: int | None,
        *,
        models: ModelClient | None = None,
        session_models: ModelClient | None = None,
    ) -> tuple[Done, int]:
        """Send one call and wait for its answer (and the generation of the guest that gave it). ``generation``:
        the session's guest; a call to a session of a guest that is gone fails at once (``worker_lost``).
        ``models``: who makes the model calls this call's code makes (default: the guest's client), a rollout's
        context; ``session_models``: a resource session's (its calls counted as in process, same time bounds)."""
        if not self._ready.is_set():
            with anyio.move_on_after(max(self.call_timeout_s, START_WAIT_S)):
                await self._ready.wait()  # a restarting guest is waited for (its imports and setup)
            if not self._ready.is_set():
                raise GuestFailure("worker_lost", f"{self.where}: its guest process is not started", retryable=True)
        child = self._child
        assert child is not None
        if (generation is not None and generation != child.generation) or child.lost:
            raise GuestFailure(
                "worker_lost",
                f"{self.where}: this session's guest process was restarted (another call overran)",
                retryable=True,
            )
        call_id = next(self._ids)
        msg = make(call_id)
        answer: asyncio.Future[Done | Raised] = asyncio.get_running_loop().create_future()
        deadline = time.monotonic() + self.call_timeout_s
        waiting = self._waiting[call_id] = _Call(
            answer, child.generation, deadline, type(msg).__name__.lower(), models, session_models, msg.session
        )
        try:
            try:
                child.frames.send(msg)
            except ConnectionError:
                pass  # the guest is gone: ``_lose`` answers this call
            reply = await answer  # ``_watch`` answers it when its time is up
        finally:
            self._waiting.pop(call_id, None)
        if isinstance(reply, Raised):
            raise _rebuilt(reply, waiting.seen)
        return reply, child.generation

    async def _watch(self) -> None:
        """Every ``WATCH_S``: a call past its deadline stops its guest (one asyncio timer for all calls, not a
        cancel scope per call)."""
        while True:
            await anyio.sleep(WATCH_S)
            now = time.monotonic()
            for call_id, call in list(self._waiting.items()):
                if call.deadline <= now and not call.answer.done() and not (call.models is not None and call.waiting):
                    self._overran(call_id, call)
            child = self._child
            if child is not None and self._waiting and not child.lost:
                self._if_stopped(child, now)

    def _if_stopped(self, child: _Child, now: float) -> None:
        """A guest stopped (``T`` in ``/proc``: SIGSTOP, a debugger) runs no call, however long ``call_timeout_s``:
        past ``STOPPED_S`` it is killed and started again, its calls ``worker_lost`` (none was at fault)."""
        if not _stopped(child.process.pid):
            child.stopped_since = None
            return
        if child.stopped_since is None:
            child.stopped_since = now
            return
        if now - child.stopped_since < STOPPED_S:
            return
        process = f"{socket.gethostname()}/{child.process.pid}"
        log.warning(
            "worker.silent",
            component=self.where,
            process=process,
            call=f"its guest process was stopped for {STOPPED_S:g}s with {len(self._waiting)} call(s) waiting",
            fix="the guest is killed and started again; its calls' rollouts run again",
        )
        self._kill(child, f"its guest process {process} was stopped for {STOPPED_S:g}s (SIGSTOP?)")
        self._lose(child)

    def _overran(self, call_id: int, call: _Call) -> None:
        """``call_id``'s time is up: stop its guest, and fail the call at fault as ``timeout`` (module docstring)."""
        child = self._child
        if child is None or child.generation != call.generation or child.lost:
            why = child.lost if child is not None and child.lost else "its guest process is gone"
            call.answer.set_exception(GuestFailure("worker_lost", f"{self.where}: {why}", retryable=True))
            return
        at_fault = stuck_in(child.process.pid, child.page)
        if not at_fault and self.outbound and not _running_threads(child.process.pid):
            # no thread of the guest runs: it waits for the model or resource calls this worker makes for it (an
            # LLM judge on a loaded model), which is not environment code holding it; the call gets more time
            call.deadline = time.monotonic() + self.call_timeout_s
            return
        culprit = self._waiting.get(at_fault)
        if culprit is None or culprit.generation != child.generation or culprit.answer.done():
            culprit = call  # stuck in no call (or a finished one): the call whose time is up is slow, not stuck
        culprit.answer.set_exception(
            GuestFailure(
                "timeout",
                f"{self.where}: the environment's {culprit.what} ran past "
                f"call_timeout_s={self.call_timeout_s:g} (its guest process was stopped)",
            )
        )
        self._kill(child, f"a {culprit.what} call ran past call_timeout_s={self.call_timeout_s:g}")
        self._lose(child)  # the others in it, at once


def stuck_in(pid: int, page: Page, samples: int = 5) -> int:
    """The call whose code keeps one of the guest's threads running (``R`` in ``/proc``; the threads waiting for
    the GIL sleep), as the page names it: the loop's call for the main thread, a thread's own call for another;
    0 when no thread runs code of a call (the guest waits: a call that overran is slow, not stuck)."""
    seen: dict[int, int] = {}
    for i in range(samples):
        for tid in _running_threads(pid):
            # a thread's own call first: a hosted server's app loop is the main thread, noted per request step
            call_id = page.thread(tid) or (page.loop() if tid == pid else 0)
            if call_id:
                seen[call_id] = seen.get(call_id, 0) + 1
        if i + 1 < samples:
            time.sleep(0.002)
    return max(seen, key=seen.__getitem__) if seen else 0


def _stopped(pid: int) -> bool:
    """The process is stopped by a signal or traced (``T``/``t`` in ``/proc``; False without ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[-1].split()[:1] in (["T"], ["t"])
    except OSError:
        return False


def _running_threads(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:  # gone, or no /proc (not Linux): no thread is known to run
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", encoding="ascii") as f:
                stat = f.read()
        except OSError:
            continue
        if stat.rsplit(")", 1)[-1].split()[:1] == ["R"]:
            out.append(int(tid))
    return out


class _NoLease:
    """A guest session's ``sandboxes``: none (an entry with ``sandbox`` runs with ``isolation: none``)."""

    def held(self) -> list[Sandbox]:
        return []

    async def close_all(self) -> None:
        return None


class GuestSession:
    """One session in the guest, with the methods the worker calls on a ``Resource`` instance. With a sandbox
    pool, its lease: the sandboxes its server's code creates (``sandbox_provider: gym_runtime``) belong to this
    session, and are removed when it closes (its rollout ended) or its guest is lost."""

    __slots__ = (
        "_guest",
        "session",
        "generation",
        "answer_field",
        "close_on_verify",
        "sandboxes",
        "lease",
        "episode_done",
        "models",
        "rollout",
    )

    def __init__(self, guest: Guest, answer_field: str | None, models: ModelClient | None = None) -> None:
        self._guest = guest
        # its own client, as an in-process session's ``Resource.models``: the model calls its code makes in the
        # guest (an LLM judge) are made by it, so they count for this session's rollout (``BusModels.cost``)
        self.models = models
        self.session = uuid.uuid4().hex
        self.generation: int | None = None  # the guest it lives in, once seeded
        self.answer_field = answer_field
        self.close_on_verify = False  # the worker dropped it: the guest closes it once verified (one message)
        self.episode_done = False  # the session's Resource.episode_done, as its last tool call left it
        self.sandboxes: Sandboxes | _NoLease = _NoLease()
        self.rollout = b""  # which rollout it serves, once seeded (``crashes.rollout_digest``)
        if guest.leases is not None:
            self.lease = self.sandboxes = guest.leases(self.session)
            guest.sessions[self.session] = self

    def box(self, sandbox: str) -> Sandbox:
        """One of this session's open sandboxes (the only one when ``sandbox`` is empty)."""
        held = self.lease.held()
        if not sandbox and len(held) == 1:
            return held[0]
        for box in held:
            if box.id == sandbox:
                return box
        which = f"sandbox {sandbox[:12]}" if sandbox else f"which sandbox ({len(held)} are open)"
        raise Failure("tool_error", f"{which}: not an open sandbox of this session")

    async def _release(self) -> None:
        """End this session's lease (idempotent), cancelled or not."""
        if self._guest.sessions.pop(self.session, None) is not None:
            with anyio.CancelScope(shield=True):
                await self.lease.close_all()

    async def seed(self, row: dict[str, Any]) -> None:
        self.rollout = rollout_digest(row)
        try:
            _, self.generation = await self._guest.call(
                lambda i: Seed(id=i, session=self.session, row=row), None, session_models=self.models
            )
        except BaseException:
            await self._release()  # never opened: what its seed created ends now
            raise

    async def call_tool(self, name: str, arguments: str | bytes) -> str:
        return await self._tool(name, arguments, protocol=False)

    async def call_operation(self, op: str, arguments: str | bytes) -> str:
        return await self._tool(op, arguments, protocol=True)

    async def _tool(self, name: str, arguments: str | bytes, *, protocol: bool) -> str:
        text = arguments.decode() if isinstance(arguments, bytes) else arguments
        if protocol and name == SANDBOX_EXEC and self._guest.leases is not None:
            return await self._sandbox_exec(text)
        done, _ = await self._guest.call(
            lambda i: Tool(id=i, session=self.session, name=name, arguments=text, protocol=protocol),
            self.generation,
            session_models=self.models,
        )
        self.episode_done = done.episode_done
        return done.output

    async def _sandbox_exec(self, arguments: str) -> str:
        """``sandbox.exec``: an agent's command in a sandbox this session's server holds (as NeMo Gym's sandboxed
        agents reach the server's sandbox by its handle). Arguments ``{"command", "sandbox"?, "timeout_s"?}``."""
        try:
            args = json.loads(arguments or "{}")
            command, timeout_s = args["command"], args.get("timeout_s")
            if not isinstance(command, str) or not isinstance(timeout_s, (int, float, type(None))):
                raise TypeError("command must be a string, timeout_s a number")
        except (ValueError, KeyError, TypeError) as e:
            raise ToolArgumentsError(f"{SANDBOX_EXEC} takes {{'command': str, 'sandbox'?, 'timeout_s'?}}: {e}") from e
        box = self.box(str(args.get("sandbox") or ""))
        r = await box.exec(command, timeout_s=timeout_s)
        out = {"sandbox": box.id, "exit_code": r.exit_code, "stdout": r.text, "timed_out": r.timed_out}
        return json.dumps({**out, "stderr": r.stderr.decode("utf-8", "replace")})

    async def verify(self, task: dict[str, Any], response: Response) -> Verdict:
        try:
            # the server's verify may grade in the sandbox the policy's commands ran in (terminal_bench's test.sh):
            # no process the policy left there may touch it (its files are kept; the provider offers the server
            # no background processes of its own to lose)
            for box in self.sandboxes.held():
                await box.restart()
            done, _ = await self._guest.call(
                lambda i: Verify(id=i, session=self.session, row=task, response=response, close=self.close_on_verify),
                self.generation,
                session_models=self.models,
            )
        finally:
            if self.close_on_verify:  # closed by that one message: its rollout ended, and its lease with it
                await self._release()
        assert done.verdict is not None
        return done.verdict

    async def close(self) -> None:
        try:
            if self.generation is not None:
                await self._guest.call(
                    lambda i: Close(id=i, session=self.session), self.generation, session_models=self.models
                )
        except GuestFailure:
            pass  # its guest is gone, and the session with it
        finally:
            await self._release()
