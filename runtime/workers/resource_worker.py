"""Hosts a Resource class on the bus: sessions are actors pinned to this worker.

``{ns}.res.{name}.seed.{role}.{pool}`` (queue group) creates a session here for that caller and answers with
this worker's address; ``{address}.tool|verify|close.{role}.{pool}`` reach the session, answered only for the
caller that seeded it;
``{ns}.res.{name}.verify`` (queue group) verifies without a session (re-verify).
If this worker dies, calls to its address get "no responders" at once, so a
rollout fails fast and is redelivered instead of hanging. Idle sessions are
closed after ``session_ttl_s`` so a dead agent cannot leak them.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
import uuid
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import Token
from typing import Any, cast

import anyio
import msgspec

from gym_runtime.config import ResolvedConfig
from gym_runtime.data.error_classes import as_environments
from gym_runtime.data.validation import row_problems
from gym_runtime.errors import ErrorClass, Failure, UserError
from gym_runtime.jail import CPU_SINK
from gym_runtime.messages import (
    CloseSession,
    Cost,
    CreateParams,
    HeldSandboxes,
    ModelRequest,
    Response,
    RestoreSession,
    ResumeReply,
    ResumeSession,
    SeedReply,
    SeedRequest,
    Served,
    ToolCall,
    ToolReply,
    VerifyReply,
    VerifyRequest,
    counted_ms,
)
from gym_runtime.observability import logs
from gym_runtime.plugins import code_identity
from gym_runtime.resource import (
    Resource,
    ToolArgumentsError,
    Verdict,
    check_requires,
    check_seed_once,
    load_resource_class,
    replay_calls,
)
from gym_runtime.sandboxes.client import Sandboxes
from gym_runtime.sandboxes.kept import keep as keep_copies
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.delivery import Delivery
from gym_runtime.transport.discovery import register
from gym_runtime.transport.model_calls import call_model
from gym_runtime.transport.rpc import process_tag
from gym_runtime.transport.subjects import Subjects
from gym_runtime.workers.crashes import Crashes, answer_digest
from gym_runtime.workers.guest import Guest, GuestCrash, GuestFailure, GuestSession
from gym_runtime.workers.guest_frames import Start
from gym_runtime.workers.sessions import Sessions, config_callers
from gym_runtime.workers.templates import Template, Templates, fork_for, task_key
from gym_runtime.workers.tool_replies import ToolReplies

log = logs.get("gym.resource")


class BusModels:
    """``Resource.models``: model calls through the models' work queues. One per session, so the calls its
    code makes (an LLM judge, a user simulator) are counted for that session's rollout (``cost``), and so is
    the CPU its code sandbox runs use (``count_sandbox_cpu``, the ``CPU_SINK`` around the session's calls).

    The counts are the model workers' (each reply's usage) and the code sandbox's: the environment's code reads
    a copy (``cost``) and cannot set them; its worker reads them from the instance it made (``_Book``)."""

    __slots__ = ("_bus", "_timeout_s", "_cost")

    def __init__(self, bus: Bus, timeout_s: float = 900.0) -> None:
        self._bus = bus
        self._timeout_s = timeout_s
        self._cost: Cost | None = None  # made at the first call: most environments call no model

    @property
    def cost(self) -> Cost | None:
        """What the session's model calls and code sandbox runs used so far (a copy)."""
        return None if self._cost is None else msgspec.convert(msgspec.to_builtins(self._cost), Cost)

    async def generate(self, params: CreateParams, *, model: str) -> Response:
        reply = await call_model(self._bus, model, ModelRequest(params=params), timeout=self._timeout_s)
        if self._cost is None:
            self._cost = Cost()
        self._cost.add_call(model, reply.response.usage, reply.took_ms, reply.response)
        return reply.response

    def count_sandbox_cpu(self, seconds: float) -> None:
        """One code sandbox run of this session ended, having used ``seconds`` of CPU."""
        if self._cost is None:
            self._cost = Cost()
        self._cost.sandbox_cpu_ms += counted_ms(seconds)


class _Book:
    """A native session's model client and sandbox lease as its worker made them: its cost and images are read
    from these, never from what the instance holds by then (its code may replace its own attributes)."""

    __slots__ = ("inst", "models", "lease")

    def __init__(
        self, inst: Resource, models: BusModels, lease: Sandboxes, gone: Callable[[weakref.ref[Resource]], object]
    ) -> None:
        self.inst = weakref.ref(inst, gone)  # ``gone``: the instance was collected (its book is dropped)
        self.models = models
        self.lease = lease


def _counting(models: Any) -> Token[Any] | None:
    """Count the CPU of the code sandbox runs a call of a session starts (in this process) for it; the caller
    resets the token. A guest session's runs are in its guest, out of this worker's reach."""
    return CPU_SINK.set(models.count_sandbox_cpu) if isinstance(models, BusModels) else None


def _counted(token: Token[Any] | None) -> None:
    if token is not None:
        CPU_SINK.reset(token)


async def call_with(inst: Resource, req: ToolCall) -> ToolReply:
    """A session's tool call or operation: a model's call reaches only a tool of the environment, an operation
    only the runtime's; a tool's bug is shown to the model (as NeMo Gym's 500 body would be), a ``Failure``
    fails the rollout with its class (e.g. a foreign env's step)."""
    try:
        run = inst.call_operation if req.protocol else inst.call_tool
        output = await run(req.name, req.arguments)
        return ToolReply(output=output, done=inst.episode_done)
    except ToolArgumentsError as e:
        return ToolReply(output=f"Error: {e}", is_error=True)
    except Failure as e:
        # who is blamed is the runtime's finding: a class the environment's code chose (a ``timeout`` that the
        # rollout's time split would charge to the policy, a ``worker_lost`` kept out of training) is its own
        # ``tool_error``; what the runtime saw itself (a guest's ``call_timeout_s``, a lost worker) stays as it is
        own = as_environments(e, "tool_error", f"tool {req.name!r}")
        if own is e:
            raise
        raise own from None
    except Exception as e:
        log.warning("tool.failed", tool=req.name, error=repr(e))
        return ToolReply(output=f"Error: tool {req.name!r} failed: {type(e).__name__}: {e}", is_error=True)


@contextmanager
def environment_code(own: ErrorClass, where: str, *, retryable: bool = False) -> Iterator[None]:
    """Environment code at ``where`` (a seed, a restore, verify) fails as the environment's: a ``Failure`` stays as
    it is where the runtime found it (its guest overran or was lost) or the environment may raise its class (a
    judge's model failed, a row verify cannot grade); another class becomes ``own`` naming it
    (``data.error_classes``), and so does any other exception."""
    try:
        yield
    except Failure as e:
        typed = as_environments(e, own, where)
        if typed is e:
            raise
        raise typed from None
    except Exception as exc:
        raise Failure(own, f"{where} raised {type(exc).__name__}: {exc}", retryable=retryable) from exc


async def verify_with(inst: Resource, row: dict[str, Any], response: Any) -> VerifyReply:
    # retryable: a flaky verifier gets the task's remaining attempts, then a failure row
    with environment_code("verify_error", "verify", retryable=True):
        out = await inst.verify(row, response)
    if isinstance(out, Verdict):
        return VerifyReply(reward=float(out.reward), fields=out.fields, answer_field=inst.answer_field)
    return VerifyReply(reward=float(out), answer_field=inst.answer_field)


def leased_to(caller: str, rollout: str) -> str:
    """What a session's sandbox lease is bound to: the rollout it serves and the caller that seeded it (the caller
    a secured server checks in the seed's subject), as a digest; "" for a session of no rollout (never adopted)."""
    if not rollout:
        return ""
    return hashlib.blake2b(f"{caller}\0{rollout}".encode(), digest_size=12).hexdigest()


def same_holder(own: str, named: str) -> bool:
    """Whether a restore may take up the sandboxes leased under ``named``: this environment leased them to the same
    rollout of the same caller as the fresh session's own lease ``own`` (``{leased_to}:{secret}``)."""
    mine, theirs = own.split(":"), named.split(":")
    return len(mine) == len(theirs) == 2 and mine[0] != "" and mine[0] == theirs[0]


async def _close(inst: Resource) -> None:
    """End a session: the environment's own ``close``, then its sandboxes' lease."""
    try:
        await inst.close()
    finally:
        await inst.sandboxes.close_all()


class ResourceWorker:
    """resources.NAME of a resolved config: its class, or a hosted server's (``config.hosting``), and its
    fingerprint come from the config; the other entries' names are the ones its code may call."""

    def __init__(self, bus: Bus, name: str, config: ResolvedConfig) -> None:
        self.bus = bus
        self.name = name
        self.cfg = cfg = config.resources[name]
        self.fingerprint = config.fingerprints[("resource", name)]
        self.fields = config.fields[("resource", name)]
        where = f"resources.{name}.server"
        model_names, resource_names, agent_names = list(config.models), list(config.resources), list(config.agents)
        hosting: Any = config.hosting  # gym_runtime.nemo_gym.hosting.resource, loaded by name when a resource is hosted
        self.worker_id = uuid.uuid4().hex[:12]
        self.address = bus.subjects.session(name, self.worker_id)
        self.process = process_tag()  # named in each seed's reply: a session call it leaves unanswered names it
        # max_sessions per caller: one pool's flood of seeds closes its own sessions, not another's
        self.sessions: Sessions[Resource] = Sessions(cfg.max_sessions, config_callers(agent_names, resource_names))
        self._subs: list[Any] = []
        self.seeded = 0  # sessions opened here (status, tests)
        self.evicted = 0  # sessions closed because max_sessions were open
        self.models = BusModels(bus)
        self.crashes = Crashes()  # the tool calls that killed this worker's guest (``workers.crashes``)
        self._books: dict[int, _Book] = {}  # native sessions' ledgers, by ``id`` of their instance (``_book``)
        self._replies: dict[str, ToolReplies[ToolReply]] = {}  # sessions' tool replies by call id (``ToolCall.id``)
        self.guest: Guest | None = None
        # seed_once: each task's seeded session, which its repeats start from (``workers.templates``)
        self.templates: Templates[Resource] = Templates(cfg.seed_once_idle_s)
        self.called: Any = None  # a hosted server's sessions on other resources (hosting's CalledSessions)
        if cfg.hosted and hosting is None:  # a bug: resolve_models (publishing) loads no plugin
            raise TypeError(f"resources.{name}: a hosted server's workers need resolve_config, not resolve_models")
        if cfg.hosted and cfg.isolation != "none":
            # NeMo Gym's own server code in a guest on its built environment's Python; the bus stays here, and its
            # calls by name to the config's models and other resources come back over the guest wire
            env = hosting.env(cfg.nemo_gym)
            start = Start(
                server="",
                entry=name,
                options=dict(cfg.options),
                nemo_gym=cfg.nemo_gym,
                model_names=model_names,
                resource_names=resource_names,
            )
            self.code: str = hosting.identity(cfg.nemo_gym, env.server_dir)
            self.called = hosting.CalledSessions(bus)
            self.guest = Guest(
                start,
                self.models,
                cfg.call_timeout_s,
                on_lost=self._guest_lost,
                python=env.python,
                env={hosting.HOSTED_ENV: env.prefix},
                resources=self.called,
                leases=self._lease if cfg.sandbox else None,
            )
            self.cls: type[Resource] = Resource  # the guest's traits once it is ready (``_traits``)
            return
        if cfg.hosted:  # isolation: none: in this process, which runs in the server's built environment
            # its calls by name to the config's models and other resources go over this worker's bus
            host = hosting.ServerHost(cfg.nemo_gym, name, cfg.options, model_names, resource_names, bus)
            self.cls = hosting.hosted_class(host)
            self.code = hosting.identity(cfg.nemo_gym, None)
        else:
            self.cls = load_resource_class(cfg.server, where, entry=name)
            check_requires(self.cls, where)
            self.code = code_identity(sys.modules[self.cls.__module__])  # what verifies: rows' provenance.env
        # where the environment's code runs: a guest process (the bus stays here) or this one
        isolation = "none" if cfg.hosted else (cfg.isolation or self.cls.isolation)
        if isolation == "process" and cfg.sandbox:  # its sandbox client lives on the bus, not in the guest
            raise UserError(f"resources.{name}: isolation: process with a sandbox pool is not supported yet")
        if cfg.seed_once:
            check_seed_once(self.cls, isolation, f"resources.{name}.seed_once")
        if isolation == "process":
            start = Start(server=cfg.server, entry=name, options=dict(cfg.options))
            self.guest = Guest(start, self.models, cfg.call_timeout_s, on_lost=self._guest_lost)

    def _traits(self) -> None:
        """A hosted server's class lives only in its guest: the worker reads what the guest says of it."""
        assert self.guest is not None
        t = self.guest.traits
        attrs = {"reverify": t.reverify, "answer_field": t.answer_field, "row_tools": t.row_tools}
        self.cls = type(f"Guest_{self.name}", (Resource,), attrs)

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        if self.guest is None:
            self.cls.build_validators()
            await self.cls.setup(dict(self.cfg.options))
        async with anyio.create_task_group() as tg:
            if self.guest is not None:  # its setup runs there; it closes its sessions and tears down when it stops
                await tg.start(self.guest.run)
                if self.called is not None:
                    self._traits()
            conc = self.cfg.concurrency
            self._subs = [
                await self.bus.serve(
                    tg,
                    self.bus.subjects.seed(self.name, "*.*"),
                    self._seed,
                    queue=self.bus.subjects.resource_group(self.name),
                    concurrency=conc,
                ),
                await self.bus.serve(
                    tg, Subjects.session_call(self.address, "*", "*.*"), self._session_op, concurrency=conc
                ),
                await self.bus.serve(
                    tg,
                    self.bus.subjects.stateless_verify(self.name),
                    self._stateless_verify,
                    queue=self.bus.subjects.resource_group(self.name),
                    concurrency=conc,
                    default_error="verify_error",
                ),
            ]
            await self.bus.flush()
            tg.start_soon(self._reap)
            if self.cfg.seed_once:
                tg.start_soon(self._reap_templates)
            svc = await register(
                self.bus,
                "resource",
                self.name,
                self.worker_id,
                self.stats,
                fingerprint=self.fingerprint,
                fields=dict(self.fields),
            )
            self.bus.telemetry.meters.track("resource", self.name, self)
            log.info("resource.ready", resource=self.name, worker=self.worker_id)
            task_status.started()
            try:
                await anyio.sleep_forever()
            finally:
                self.bus.telemetry.meters.untrack(self)
                log.info("resource.stopped", resource=self.name, worker=self.worker_id, seeded=self.seeded)
                with anyio.CancelScope(shield=True):
                    await svc.stop()
                    if self.called is not None:  # its sessions on other resources servers
                        await self.called.close_all()
                    if self.guest is None:  # a guest closes its sessions and tears down when it stops
                        for inst in [*self.sessions.pop_all(), *self.templates.pop_all()]:
                            await _close(inst)
                        await self.cls.teardown()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"sessions": len(self.sessions), "seeded": self.seeded}
        if self.cfg.seed_once:
            out["templates"] = len(self.templates)
        if self.guest is not None:
            out["guest_restarts"] = self.guest.restarts
        return out

    async def drain(self) -> None:
        """Stop taking new sessions and return; existing sessions keep being served."""
        if self._subs:
            await self._subs[0].unsubscribe()
            await self._subs[2].unsubscribe()

    def _guest_lost(self, generation: int) -> None:
        """A guest process is gone, and the sessions that lived in it: later calls to them are worker_lost."""
        self.sessions.pop_where(lambda inst: getattr(inst, "generation", None) == generation)

    def _lease(self, session: str = "", bound: str = "") -> Sandboxes:
        """A session's lease on the entry's sandbox pool: its sandboxes end with it (or at ``session_ttl_s``). Its
        secret is random (``sandboxes.leases``), never derived from ``session`` (a guest's id, which it knows);
        ``bound``: the rollout and caller it is leased to (``leased_to``), said before the secret, which a restore
        must name again (``same_holder``)."""
        lease = Sandboxes(
            self.bus,
            self.cfg.sandbox,
            bound=bound,
            deadline=time.time() + self.cfg.session_ttl_s,
            where=f"resources.{self.name}",
        )
        # a wait for a lease inside a seed, tool or verify stops its caller's clock (the rollout's timeout_s)
        lease.on_acquire = self.bus.pause_caller
        return lease

    def _new(self, bound: str = "") -> Resource:
        if self.guest is not None:  # duck-typed: the methods of a session this worker calls, run in the guest
            # with its own BusModels, as below: the judge calls its code makes in the guest are its rollout's cost
            return cast(Resource, GuestSession(self.guest, self.cls.answer_field, BusModels(self.bus)))
        inst = self.cls()
        inst.models = models = BusModels(self.bus)  # its own: the session's model calls are its rollout's cost
        inst.sandboxes = lease = self._lease(bound=bound)
        key, books = id(inst), self._books
        try:  # its ledger, kept apart from the instance, dropped with it (a weak reference's callback: what
            # ``weakref.finalize`` did, with none of its registry)
            books[key] = _Book(inst, models, lease, lambda _ref: books.pop(key, None))
        except TypeError:  # an instance that takes no weak reference: its own attributes are read
            pass
        return inst

    def _book(self, inst: Resource) -> tuple[Any, Any]:
        """The session's model client and lease as this worker made them (a guest session's are the worker's
        own objects: its code runs in another process)."""
        book = self._books.get(id(inst))
        if book is not None and book.inst() is inst:
            return book.models, book.lease
        return getattr(inst, "models", None), getattr(inst, "sandboxes", None)

    async def _seed(self, req: SeedRequest, msg: Delivery) -> SeedReply:
        if not msg.reply:  # no one to learn the session (e.g. a server's answer borrowed onto this subject): none
            self.bus.count_junk(self.address, "seed requests without a reply (nothing opened)")
            raise Failure("invalid_task", "a seed request without a reply subject")
        if req.check is not None:  # its publisher could not check the row: check it as validate would
            params = req.row.get("responses_create_params")
            problems = row_problems(self.cls, self.name, req.row, params, any_tools=req.check.any_tools)
            if problems:
                raise Failure("invalid_task", "; ".join(problems))
        caller = self.bus.subjects.seed_caller(msg.subject)  # the only one its operations are answered for
        bound = leased_to(caller, req.rollout)
        # a resumed attempt's restore sets its session back itself: seeded as without seed_once
        key = task_key(caller, req.rollout, req.row) if self.cfg.seed_once else None
        if key is None or isinstance(req.then, RestoreSession):
            inst = self._new(bound)
            await self._seeded(inst, req.row)
        else:
            inst = await self.templates.use(key, lambda: self._template(req.row), lambda t: self._from(t, bound))
        if self.cfg.sandbox and isinstance(lease := self._book(inst)[1], Sandboxes):
            lease.rollout = req.rollout  # the batch its branch points' copies go with (``sandboxes.kept``)
        sid = os.urandom(16).hex()  # as random as a uuid4's hex, in one call
        self.seeded += 1
        for old in self.sessions.open(sid, inst, caller):  # the caller's least recently used, past its limit
            self.evicted += 1
            self.bus.count_junk(self.address, "sessions over max_sessions (least recently used closed)")
            await _close(old)
        result = None
        if req.then is not None:
            try:
                result = await self._session_op(msgspec.structs.replace(req.then, session=sid), msg, caller)
            except Exception:
                opened = self.sessions.pop(sid)  # the caller never learns this session
                if opened is not None:
                    await _close(opened)
                raise
        return SeedReply(session=sid, address=self.address, result=result, by=self.process)

    async def _seeded(self, inst: Resource, row: dict[str, Any]) -> None:
        """``inst``'s seed, a failure of it typed as the environment's."""
        counting = _counting(self._book(inst)[0])
        try:
            with environment_code("tool_error", "seed"):  # as a tool's failure is typed
                await inst.seed(row)
        finally:
            _counted(counting)

    async def _template(self, row: dict[str, Any]) -> tuple[Resource, bytes]:
        """A task's template (seed_once): a session seeded with its row, and its snapshot. Its sandboxes are leased
        to no rollout; they end with it (``Templates.idle``, the worker's stop), else at its ``session_ttl_s``."""
        inst = self._new()
        try:
            await self._seeded(inst, row)
            try:
                snap = await inst.snapshot()
            except Exception as exc:
                raise Failure("tool_error", f"snapshot after seed raised {type(exc).__name__}: {exc}") from exc
            if snap is None:
                raise Failure("tool_error", "seed_once: snapshot() after seed returned None (nothing to restore)")
        except BaseException:
            with anyio.CancelScope(shield=True):
                await _close(inst)
            raise
        return inst, snap

    async def _from(self, tpl: Template[Resource], bound: str) -> Resource:
        """A repeat's session: fresh, holding forks of the template's sandboxes (each handed to the first create
        that asks for its spec, as a restore's reattached ones are), set back to its snapshot."""
        assert tpl.session is not None
        inst = self._new(bound)
        try:
            parents = self._book(tpl.session)[1]
            lease = self._book(inst)[1]
            if isinstance(parents, Sandboxes) and isinstance(lease, Sandboxes) and parents.held():
                forked: list[Any] = []
                for box in parents.held():
                    forked += await fork_for(box, lease)
                lease.adopt(forked)
            counting = _counting(self._book(inst)[0])
            try:
                with environment_code("tool_error", "restore (seed_once)"):
                    await inst.restore(tpl.snapshot)
            finally:
                _counted(counting)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await _close(inst)
            raise
        return inst

    def _session(self, sid: str) -> Resource:
        inst = self.sessions.use(sid)
        if inst is None:
            raise Failure("worker_lost", f"session {sid} is not on worker {self.worker_id}", retryable=True)
        return inst

    async def _session_op(self, req: Any, msg: Delivery, caller: str | None = None) -> Any:
        """Every operation on a session is dispatched here (a seed's first one too: ``caller``, its seed's; else
        the caller its subject names, ``Subjects.session_call``), and answered only for the caller that seeded
        the session. On a secured bus the server lets each pool name only itself; on another bus the caller is
        what the message says (a check in depth: a client that names another caller passes it). Refused as a
        session not held here is: no answer tells a session that exists from one that does not."""
        if caller is None:
            caller = self.bus.subjects.session_caller(msg.subject)
        sid = getattr(req, "session", None)
        if sid and self.sessions.caller(sid) not in (None, caller):
            self.bus.count_junk(self.address, "session operations by a caller that did not seed it (refused)")
            raise Failure("worker_lost", f"session {sid} is not on worker {self.worker_id}", retryable=True)
        if not self.bus.telemetry.meters.enabled or not isinstance(req, (ToolCall, VerifyRequest)):
            return await self._session_op_inner(req, msg, caller)
        started = time.perf_counter()
        try:
            return await self._session_op_inner(req, msg, caller)
        finally:
            stage = "tool_call" if isinstance(req, ToolCall) else "verify"
            self.bus.telemetry.meters.stage_time(stage, self.name, time.perf_counter() - started)

    async def _session_op_inner(self, req: Any, msg: Delivery, caller: str) -> Any:
        if isinstance(req, ToolCall):
            inst = self._session(req.session)
            if req.id:  # the same on every attempt of its turn: answered once (``ToolReplies``)
                replies = self._replies.get(req.session)
                if replies is None:
                    replies = self._replies[req.session] = ToolReplies()
                return await replies.once(req.id, lambda: self._tool(inst, req))
            return await self._tool(inst, req)
        if isinstance(req, VerifyRequest):
            if req.close:
                self._replies.pop(req.session or "", None)
            return await self._verify(req, msg)
        if isinstance(req, (ResumeSession, RestoreSession)):
            return await self._resume(req, caller)
        if isinstance(req, CloseSession):
            self._replies.pop(req.session, None)
            closing = self.sessions.pop(req.session)
            if closing is not None:
                await _close(closing)
            return None
        raise Failure("internal", f"unexpected message {type(req).__name__} on {msg.subject}")

    async def _resume(self, req: ResumeSession | RestoreSession, caller: str) -> ResumeReply:
        """A resumed rollout's own messages (never tool calls): its session is still held here (``_session`` finds
        it, else ``worker_lost``), or a fresh session (the restore rode its seed) set back to its snapshot
        (``Resource.restore``), taking up the sandboxes held at it by their lease; a branch's, holding forks of the
        copies kept at its branch point where they were leased to its parent rollout of the same ``caller``."""
        inst = self._session(req.session)
        if isinstance(req, ResumeSession):
            return ResumeReply(ok=True)
        restore = getattr(inst, "restore", None)
        if restore is None:  # a guest's session (its code in another process): none
            return ResumeReply(ok=False, reason="this environment cannot restore a snapshot")
        lease = self._book(inst)[1]
        if req.held is not None and isinstance(lease, Sandboxes):  # the dead session's sandboxes, by their lease
            if not same_holder(lease.lease, req.held.lease):
                log.warning("restore.refused", resource=self.name, why="sandboxes leased to another rollout or caller")
                return ResumeReply(
                    ok=False, reason="the sandboxes named were not leased to this rollout of this caller"
                )
            lease.lease = req.held.lease
            lease.take_up(req.held.sandboxes)
        if req.kept is not None and isinstance(lease, Sandboxes):  # a branch's: its own forks of the copies
            if not req.branch_of or req.kept.lease.partition(":")[0] != leased_to(caller, req.branch_of):
                log.warning("restore.refused", resource=self.name, why="copies kept for another rollout or caller")
                return ResumeReply(ok=False, reason="the sandboxes named were not kept for that rollout of this caller")
            await lease.fork_kept(req.kept)
        try:
            await restore(req.snapshot)
        except NotImplementedError as e:
            return ResumeReply(ok=False, reason=str(e) or "this environment cannot restore a snapshot")
        except Exception as e:  # a snapshot it cannot take back: the rollout starts over
            log.warning("restore.failed", error=repr(e))
            return ResumeReply(ok=False, reason=f"restore raised {type(e).__name__}: {e}")
        return ResumeReply(ok=True)

    async def _tool(self, inst: Resource, req: ToolCall) -> ToolReply:
        """One tool call or operation of a session (``call_with``), counted for it, with the environment's
        snapshot after it when asked (a snapshot that raises is none: the rollout restarts if it must)."""
        counting = _counting(self._book(inst)[0])
        try:
            try:
                reply = await call_with(inst, req)
            except GuestCrash as e:  # its guest died running this call: the second time, its input's doing
                raise self.crashes.charge(e, cast(GuestSession, inst).rollout, req.name, req.arguments) from None
            # the base's snapshot is None: an environment that does not define its own is not asked
            if req.snapshot and getattr(type(inst), "snapshot", Resource.snapshot) is not Resource.snapshot:
                try:
                    reply.snapshot = await inst.snapshot()
                except Exception as e:  # noqa: BLE001 - the environment's bug costs a restore, not the call
                    log.warning("snapshot.failed", error=repr(e))
                lease = self._book(inst)[1]
                if reply.snapshot is not None and isinstance(lease, Sandboxes) and lease.held():
                    reply.held = HeldSandboxes(lease=lease.lease, sandboxes=lease.handles())
                    if req.keep_s > 0:  # a branch point: the sandboxes as they are now, copied (``sandboxes.kept``)
                        reply.kept = await keep_copies(lease, req.keep_s)
            return reply
        finally:
            _counted(counting)

    async def _verify(self, req: VerifyRequest, msg: Delivery) -> VerifyReply:
        if not req.session:
            return await self._stateless_verify_inner(req, msg)
        inst = self._session(req.session)
        if req.close and isinstance(inst, GuestSession):  # one message: its guest closes it once verified
            self.sessions.pop(req.session)
            inst.close_on_verify = True
            return self._served(inst, await self._verified(inst, req))
        counting = _counting(self._book(inst)[0])
        try:
            verdict = await self._verified(inst, req)
            if req.close:  # before the verdict is sent: what its closing counts (its sandboxes) is in it
                closing = self.sessions.pop(req.session)
                if closing is not None:
                    await _close(closing)
        finally:
            _counted(counting)
        return self._served(inst, verdict)

    async def _verified(self, inst: Resource, req: VerifyRequest) -> VerifyReply:
        """A session's verify (``verify_with``); the policy's answer that killed its guest again is its own."""
        try:
            return await verify_with(inst, req.row, req.response)
        except GuestCrash as e:
            raise self.crashes.charge(e, cast(GuestSession, inst).rollout, "", answer_digest(req.response)) from None

    async def _stateless_verify(self, req: VerifyRequest, msg: Delivery) -> VerifyReply:
        if not self.bus.telemetry.meters.enabled:
            return await self._stateless_verify_inner(req, msg)
        started = time.perf_counter()
        try:
            return await self._stateless_verify_inner(req, msg)
        finally:
            self.bus.telemetry.meters.stage_time("verify", self.name, time.perf_counter() - started)

    async def _stateless_verify_inner(self, req: VerifyRequest, msg: Delivery) -> VerifyReply:
        inst = self._new()
        counting = _counting(self._book(inst)[0])
        try:
            try:
                await inst.seed(req.row)
                if self.cls.reverify == "replay":
                    await replay_calls(inst, req.response)
            except GuestFailure:
                raise
            except Exception as exc:
                raise Failure("verify_error", f"rebuilding the session raised {type(exc).__name__}: {exc}") from exc
            try:
                verdict = await verify_with(inst, req.row, req.response)
            finally:
                await _close(inst)
            return self._served(inst, verdict)
        finally:
            _counted(counting)

    def _served(self, inst: Resource, reply: VerifyReply) -> VerifyReply:
        """The verdict with who gave it: this worker, its code, and what its session used: the model calls it
        made (judges), its code sandbox runs' CPU, and its fleet sandboxes' exec time and CPU (those closed by
        now: a session closed with its verify has closed them all)."""
        models, lease = self._book(inst)
        cost: Cost | None = models.cost if isinstance(models, BusModels) else None
        served = Served(worker=self.worker_id, code=self.code, cost=cost)
        if isinstance(lease, Sandboxes) and lease.asked:
            cost = served.cost = Cost() if cost is None else cost
            cost.sandbox_ms += counted_ms(lease.exec_s)
            cost.sandbox_cpu_ms += counted_ms(lease.cpu_s)
            served.images = [i or f"{lease.pool}:default" for i in lease.images]
            served.image_ids = list(lease.image_ids)
        reply.served = served
        return reply

    async def _reap(self) -> None:
        while True:
            await anyio.sleep(min(60.0, self.cfg.session_ttl_s))
            for inst in self.sessions.idle_since(time.monotonic() - self.cfg.session_ttl_s):
                await _close(inst)
            for sid in [s for s in self._replies if s not in self.sessions]:  # sessions closed any other way
                del self._replies[sid]

    async def _reap_templates(self) -> None:
        """Close the templates no repeat took for ``seed_once_idle_s`` (their group is done)."""
        while True:
            await anyio.sleep(min(30.0, max(0.2, self.cfg.seed_once_idle_s / 4)))
            for inst in self.templates.idle():
                await _close(inst)
