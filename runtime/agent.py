"""The agent author's API: a context that reaches models and resource sessions.

An agent is a module with ``async def run(ctx: AgentContext) -> Outcome``. It
asks ``ctx.generate`` for model turns and ``ctx.open_session`` for a resource
session; the runtime does the routing (model work queues, session-pinned
subjects), tracing and error typing. Agents never touch NATS.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import time
from collections.abc import Awaitable, Callable, Iterator
from contextvars import ContextVar
from typing import Any, Protocol, Unpack

import anyio
import msgspec

from gym_runtime.checkpoint import GENERATING_S, Checkpointer
from gym_runtime.config import AgentConfig
from gym_runtime.errors import Failure
from gym_runtime.messages import (
    Checkpoint,
    CloseSession,
    Cost,
    CreateParams,
    FunctionCall,
    FunctionCallOutput,
    GenerationProgress,
    HeldSandboxes,
    Item,
    ModelRequest,
    Response,
    Restore,
    RolloutTask,
    RowCheck,
    SeedReply,
    SeedRequest,
    SessionHandle,
    ToolCall,
    ToolReply,
    Usage,
    VerifyReply,
    VerifyRequest,
)
from gym_runtime.resource import RESUME_ALIVE, RESUME_RESTORE, RESUME_RESTORE_HELD
from gym_runtime.sandboxes.client import Sandboxes
from gym_runtime.sandboxes.spec import SandboxAsk
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.model_calls import PROGRESS_STREAM, call_model, cut_at
from gym_runtime.transport.rpc import NoResponders, pauses_counted
from gym_runtime.transport.subjects import Subjects

TOOL_TIMEOUT_S = 300.0
_progress_decoder = msgspec.msgpack.Decoder(GenerationProgress)
ABSENT_BACKOFF_S = (0.1, 0.2, 0.5, 1.0, 2.0)  # waits between seeds while a resource has no worker


# The repeat of a group task whose calls run in this context (``in_repeat``): None outside any (a single rollout, or
# a group's shared calls, e.g. a rubric's judge over all its repeats).
_REPEAT: ContextVar[int | None] = ContextVar("gym_repeat", default=None)


@contextlib.contextmanager
def in_repeat(index: int | None) -> Iterator[None]:
    """The model and tool calls made inside (and in the tasks started inside) are repeat ``index``'s of a group task
    (0 to size - 1): a ``run_group`` that runs its repeats concurrently says which is which, so a failed group's
    every row keeps its own repeat's trajectory so far and cost (``AgentContext.repeat`` is the same)."""
    token = _REPEAT.set(index)
    try:
        yield
    finally:
        _REPEAT.reset(token)


def current_repeat() -> int | None:
    """The repeat ``in_repeat`` named for this context (a guest's model call carries it to the worker)."""
    return _REPEAT.get()


def _widened(versions: list[int] | None, first: int, last: int) -> list[int]:
    """Policy versions ``[min, max]`` with a call's ``[first, last]`` added."""
    return [min(versions[0], first), max(versions[1], last)] if versions else [first, last]


class Turns:
    """What the policy produced in one rollout, or one repeat of a group task, and what its calls used: a failure
    row's trajectory so far (``partial``), its policy versions and its cost."""

    __slots__ = ("cost", "items", "usage", "last", "cut", "policy_versions", "trajectory")

    def __init__(self) -> None:
        self.cost = Cost()
        self.items: list[Item] = []  # every model turn's items in order (where no ``Trajectory`` keeps them)
        self.usage = Usage()
        self.last: Response | None = None
        self.cut: Response | None = None  # the generation the rollout's deadline stopped: its tokens so far
        self.policy_versions: list[int] | None = None
        self.trajectory: Trajectory | None = None  # the agent's, where it keeps one (its tool outputs too)

    def generated(self, response: Response, *, cut: bool = False) -> None:
        if cut:
            self.cut = response
        else:
            self.items.extend(response.output)
            self.last = response
        self.usage.add(response.usage)

    def partial(self) -> Response | None:
        """The trajectory so far as one ``Response`` (status ``incomplete``), None before the first model turn; a
        generation the rollout's deadline stopped (one that made a token) ends it (``incomplete_details.cut``)."""
        cut = self.cut if self.cut is not None and _generated_any(self.cut) else None
        last = self.last or cut
        if last is None:
            return None
        items = list(self.trajectory.outputs if self.trajectory is not None else self.items)
        details: dict[str, Any] = {"reason": "failed"}
        if cut is not None:
            items.extend(cut.output)
            details["cut"] = True
        return msgspec.structs.replace(
            last,
            output=items,
            usage=msgspec.structs.replace(self.usage),
            status="incomplete",
            incomplete_details=details,
        )


class Outcome(msgspec.Struct, kw_only=True):
    """What an agent returns: the whole-trajectory response and its verification."""

    response: Response
    verdict: VerifyReply
    fields: dict[str, Any] = msgspec.field(default_factory=dict)  # agent-side extras


# Raise from an agent to fail the rollout with an error class (retryable ones are
# retried as a new attempt): the one typed error, under the agent author's name.


class Session:
    """One resource session (an actor on one resource worker).

    Nothing is sent when the session is opened: its first operation travels with
    the seed request to the resource's queue group, and the reply names the worker
    that now owns the session; later operations go straight to that worker, each
    naming this bus's caller (the worker answers only the caller that seeded it).
    """

    __slots__ = (
        "_bus",
        "_seed_subject",
        "_row",
        "_seed",
        "_lock",
        "_closed",
        "_absent_grace_s",
        "_check",
        "_indices",
        "_cost",
        "_also",
        "_calls",
        "resource",
        "snapshot",
        "held",
    )

    def __init__(
        self,
        bus: Bus,
        seed_subject: str,
        row: dict[str, Any],
        *,
        absent_grace_s: float = 0.0,
        check: RowCheck | None = None,
        indices: dict[str, int] | None = None,
        cost: Cost | None = None,
        calls: Calls | None = None,
        resource: str = "",
        also: Cost | None = None,
    ) -> None:
        self._bus = bus
        self.resource = resource  # the environment's name (a checkpoint's handle of it)
        self.snapshot: bytes | None = None  # the environment's last snapshot (``Resource.snapshot``), if asked
        self.held: HeldSandboxes | None = None  # the session's sandboxes at that snapshot, and their lease
        self._cost = cost  # the rollout's: its tool calls' time is added there
        self._also = also  # ... and to its repeat's, for a group task's (``in_repeat``)
        self._calls = calls  # ... and each call's start and time
        self._check = check  # the row is checked by the resource worker at seed time (RolloutTask.check)
        self._absent_grace_s = absent_grace_s
        self._seed_subject = seed_subject
        # The rollout's place (``_ng_task_index``, ``_ng_rollout_index``) on the rows the resource gets at seed
        # and verify where the row has none, as NeMo Gym's runner puts them on every row its agents forward:
        # a server that scores a task's repeats together (genrm_compare's cohorts) reads them there.
        self._indices = indices or {}
        self._row = {**self._indices, **row} if self._indices else row
        self._seed: SeedReply | None = None
        self._lock = asyncio.Lock()
        self._closed = False

    @property
    def id(self) -> str | None:
        return self._seed.session if self._seed else None

    async def _op(self, first: ToolCall | VerifyRequest, kind: str, *, timeout: float, op: str) -> Any:
        if self._seed is None:
            async with self._lock:
                if self._seed is None:
                    reply: SeedReply = await self._first(first, timeout=timeout, op=op)
                    self._seed = reply
                    return reply.result
        seed = self._seed
        return await self._bus.request(
            Subjects.session_call(seed.address, kind, self._bus.caller),
            msgspec.structs.replace(first, session=seed.session),
            timeout=timeout,
            op=op,
        )

    async def _first(self, first: ToolCall | VerifyRequest, *, timeout: float, op: str) -> SeedReply:
        """The seed request; while no worker serves the resource at all (a pool restarting),
        wait with backoff up to ``absent_grace_s``: nothing was delivered, so asking again is safe
        and an absence is not a failed attempt."""
        give_up = time.monotonic() + self._absent_grace_s
        waits = 0
        while True:
            try:
                return await self._bus.request(
                    self._seed_subject,
                    SeedRequest(row=self._row, then=first, check=self._check),
                    timeout=timeout,
                    op=op,
                )
            except NoResponders:
                delay = ABSENT_BACKOFF_S[min(waits, len(ABSENT_BACKOFF_S) - 1)]
                if time.monotonic() + delay > give_up:
                    raise
                waits += 1
                await anyio.sleep(delay)

    async def call(
        self, name: str, arguments: str, *, timeout: float = TOOL_TIMEOUT_S, id: str = "", snapshot: bool = False
    ) -> ToolReply:
        """A model's tool call: it reaches only a tool the environment declares, whatever its name. ``id``: the
        same on every attempt of its turn (the session answers a repeated one with its first reply);
        ``snapshot``: ask for the environment's snapshot after it (kept in ``self.snapshot``)."""
        call = ToolCall(session="", name=name, arguments=arguments, id=id, snapshot=snapshot)
        reply = await self._tool(call, timeout, f"tool {name}")
        if snapshot and reply.snapshot is not None:
            self.snapshot, self.held = reply.snapshot, reply.held
        return reply

    def handle(self) -> SessionHandle | None:
        """What a checkpoint keeps of this session (None: never opened on a worker)."""
        seed = self._seed
        if seed is None or self._closed:
            return None
        return SessionHandle(
            resource=self.resource, session=seed.session, address=seed.address, snapshot=self.snapshot, held=self.held
        )

    async def resume(self, handle: SessionHandle) -> str:
        """Take up the session a checkpoint names: ``reattached`` (its worker still holds it), ``restored`` (a
        fresh session set back to the environment's snapshot), or ``restarted`` (a fresh session: the rollout
        starts over)."""
        self._seed = SeedReply(session=handle.session, address=handle.address)
        try:
            await self.operate(RESUME_ALIVE, "", timeout=30.0)
            self.snapshot, self.held = handle.snapshot, handle.held
            return "reattached"
        except (NoResponders, Failure):  # its worker is gone, or no longer holds it
            self._seed = None
        if handle.snapshot is not None:
            if handle.held is not None:  # its sandboxes, kept by their pool for its grace: taken up by their lease
                asked = msgspec.msgpack.encode(Restore(snapshot=handle.snapshot, held=handle.held))
                reply = await self.operate(RESUME_RESTORE_HELD, base64.b64encode(asked).decode())
            else:
                reply = await self.operate(RESUME_RESTORE, base64.b64encode(handle.snapshot).decode())
            if not reply.is_error:
                self.snapshot, self.held = handle.snapshot, handle.held
                return "restored"
            await self.close()  # it could not be set back: a fresh one below
            self._closed, self._seed = False, None
        return "restarted"

    async def abandon(self, handle: SessionHandle) -> None:
        """Close the session a checkpoint names without taking it up (its rollout starts over): its worker
        need not keep it until its ``session_ttl_s``."""
        with contextlib.suppress(Exception):  # best-effort, as ``close``: the worker reaps idle sessions
            close = CloseSession(session=handle.session)
            await self._bus.publish(Subjects.session_call(handle.address, "close", self._bus.caller), close)

    async def operate(self, op: str, arguments: str, *, timeout: float = TOOL_TIMEOUT_S) -> ToolReply:
        """One of the runtime's own session operations (``gym.reset``, ``gym.step``, ...), never a model's call."""
        return await self._tool(ToolCall(session="", name=op, arguments=arguments, protocol=True), timeout, op)

    async def _tool(self, call: ToolCall, timeout: float, op: str) -> ToolReply:
        started = time.perf_counter()
        with pauses_counted() as paused:
            try:
                reply: ToolReply = await self._op(call, "tool", timeout=timeout, op=op)
                return reply
            finally:
                if self._cost is not None:  # the round trip: the tool's time on its worker plus one hop each way
                    ms = round(1000 * (time.perf_counter() - started))
                    # less its waits for a sandbox lease (the row's sandbox_wait_s): waiting is not tool time
                    self._cost.tool_ms += max(0, ms - round(1000 * paused.total()))
                    if self._also is not None:
                        self._also.tool_ms += max(0, ms - round(1000 * paused.total()))
                    if self._calls is not None:
                        self._calls.tool(started, ms)

    async def verify(
        self, row: dict[str, Any], response: Response, *, timeout: float = TOOL_TIMEOUT_S, close: bool = True
    ) -> VerifyReply:
        """Score the response; by default the worker also closes the session (no extra message)."""
        row = {**self._indices, **row} if self._indices else row
        reply = await self._op(
            VerifyRequest(session="", row=row, response=response, close=close), "verify", timeout=timeout, op="verify"
        )
        self._closed = self._closed or close
        return reply

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._seed is None:
            return  # never opened on any worker
        try:
            close = CloseSession(session=self._seed.session)
            await self._bus.publish(Subjects.session_call(self._seed.address, "close", self._bus.caller), close)
        except Exception:  # closing is best-effort; the worker reaps idle sessions
            pass

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class Calls:
    """An attempt's model and tool calls in order (``RolloutResult.calls``): each one's start (ms from the
    attempt's), its time, and a model call's tokens. Lists of ints: nothing the row repeats."""

    __slots__ = ("t0", "log")

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.log: list[list[int]] = []

    def model(self, started: float, usage: Usage | None) -> None:
        now = time.perf_counter()
        at, ms = round(1000 * (started - self.t0)), round(1000 * (now - started))
        self.log.append([at, ms, usage.input_tokens, usage.output_tokens] if usage else [at, ms, 0, 0])

    def tool(self, started: float, ms: int) -> None:
        self.log.append([round(1000 * (started - self.t0)), ms])

    def ms(self) -> int:
        """The attempt's time so far."""
        return round(1000 * (time.perf_counter() - self.t0))


class AgentContext:
    """Everything one rollout may use. Built per task by the agent worker."""

    def __init__(
        self,
        bus: Bus,
        task: RolloutTask,
        config: AgentConfig,
        *,
        model_timeout_s: Callable[[str], float],
        model_fingerprint: Callable[[str], str | None] | None = None,
        model_liveness_s: Callable[[str], float | None] | None = None,
        cuttable: frozenset[str] = frozenset(),
    ) -> None:
        self._bus = bus
        self.task = task
        self.row = task.row
        self.config = config
        self._model_timeout_s = model_timeout_s
        self._model_fingerprint = model_fingerprint
        self._model_liveness_s = model_liveness_s
        self._cuttable = cuttable  # models whose generations stop at the rollout's deadline, their tokens kept
        # Policy versions that served this rollout's model calls: [min, max] (None: none stamped).
        self.policy_versions: list[int] | None = None
        # The rollout's ledger: what its model and tool calls used (the row's ``cost``), the model entry of each
        # call (``entry@version`` once a trainer set one) and the model workers that served them (``provenance``)
        self.cost = Cost()
        self.turns: list[str] = []
        self.model_workers: list[str] = []
        self.calls = Calls()  # each call's start, time and tokens (``explain``)
        # what the policy produced so far, kept for a failure row (``partial``); a group task's per repeat too
        # (``in_repeat``; None: the calls made outside any repeat)
        self._turns = Turns()
        self.repeats: dict[int | None, Turns] = {}
        self.generating_since: float | None = None  # the policy's model call in flight: its start
        self.continuing: GenerationProgress | None = None  # a checkpoint's generation: the next policy call goes on
        self._progressing = False  # the policy's call in flight sends its tokens so far (``_on_progress``)
        self.rollout_key = f"{task.batch}:{task.task_index}:{task.rollout_index}"
        # When the runtime cancels this rollout (``timeout_s`` after the context was
        # built, on ``time.monotonic()``'s clock). Agents that can end early with a
        # valid result (e.g. a conversation) check ``remaining()`` between steps.
        self.deadline = time.monotonic() + config.timeout_s
        # the rollout's sandboxes: one lease (a random secret; a resumed attempt's: its checkpoint's), ended by the
        # worker when the rollout ends
        self.sandboxes = Sandboxes(
            bus,
            config.sandbox,
            deadline=time.time() + config.timeout_s,
            where=f"agents.{task.agent}",
            absent_grace_s=config.absent_grace_s,
        )
        # Resume at the last turn (``gym_runtime.checkpoint``): the rollout's checkpoints (None: not written), the
        # one a redelivered attempt read back, and how it resumed from it (the row's ``resumed_*`` keys)
        self.checkpoints: Checkpointer | None = None
        self.resumed: Checkpoint | None = None
        self.resumed_how: str | None = None
        self.resumed_from_turn = 0
        self.on_restart: Callable[[], None] | None = None  # the worker's: a restarted attempt gets a fresh clock
        self.sessions: list[Session] = []  # the sessions it opened (a checkpoint's handles)
        self.task_attempt = 1  # the delivery this attempt is (set by the worker)
        self.calls_from: list[int] | None = None  # a resumed attempt's: model and tool calls made before it

    repeat = staticmethod(in_repeat)  # ``with ctx.repeat(i):`` in a ``run_group``: what is repeat i's

    def _repeat_turns(self) -> Turns | None:
        """The ledger of the repeat this context runs (``in_repeat``) of a group task; None for a single rollout."""
        if self.task.group <= 1:
            return None
        index = _REPEAT.get()
        turns = self.repeats.get(index)
        if turns is None:
            turns = self.repeats[index] = Turns()
        return turns

    @property
    def trajectory(self) -> Trajectory | None:
        """The agent's ``Trajectory``, where it keeps one (``keep``: its ``generate`` hands it over)."""
        return self._turns.trajectory

    def keep(self, trajectory: Trajectory) -> None:
        """A failure row keeps ``trajectory`` (its tool outputs too) as the rollout's (or its repeat's) so far."""
        self._turns.trajectory = trajectory
        if (turns := self._repeat_turns()) is not None:
            turns.trajectory = trajectory

    def sandbox(self, image: str | None = None, **ask: Unpack[SandboxAsk]) -> Any:
        """A sandbox of the agent's pool (``agents.NAME.sandbox``) for this rollout: ``async with
        ctx.sandbox(image=..., cpu=...) as box`` (the keywords: ``SandboxAsk``) then ``await box.exec(cmd)``,
        ``box.write``, ``box.read`` (docs/sandboxes.md). Whatever is left open is removed when the rollout ends.
        A resumed attempt is handed the sandbox its rollout held with the same keywords (reattached: the same
        container, its files intact), where its checkpoint names one."""
        if self.resumed is not None and self.resumed.sandboxes:
            self.sandboxes.take_up(self.resumed.sandboxes, self.resumed.sandbox_lease)
        return self.sandboxes.sandbox(image, **ask)

    def remaining(self) -> float:
        """Seconds left before the runtime cancels this rollout (``timeout_s``)."""
        return self.deadline - time.monotonic()

    def checkpoint(self, trajectory: Trajectory, phase: str, generating: GenerationProgress | None = None) -> bool:
        """Write the rollout's checkpoint now when its mode says one is due (``checkpoint``): its trajectory so
        far, turn, cost and the handles of its sessions; ``generating``: the next turn's generation so far (its
        turn answered, that generation still running). In the background; True when one was asked."""
        box = self.checkpoints
        if box is None or trajectory._last is None:
            return False
        elapsed = self.config.timeout_s - self.remaining()
        turn = trajectory.steps - (generating is not None)  # a generation in flight is not a turn made yet
        if not box.due(turn, elapsed):
            return False
        last = trajectory._last
        partial = msgspec.structs.replace(last, output=list(trajectory.outputs), usage=trajectory.usage)
        partial.status = "incomplete"  # the shape of a failure row's partial trajectory
        box.write(
            Checkpoint(
                turn=turn,
                phase="generated" if phase == "generated" and generating is None else "answered",
                response=partial,
                last_status=last.status,
                last_from=trajectory._from,
                cost=self.cost,
                turns=self.turns,
                policy_versions=self.policy_versions,
                elapsed_s=max(0.0, elapsed),
                sessions=[h for h in (s.handle() for s in self.sessions) if h is not None],
                attempt=self.task_attempt,
                sandboxes=(handles := self.sandboxes.handles()),
                sandbox_lease=self.sandboxes.lease if handles else "",
                generating=generating,
            )
        )
        return True

    def _progress_s(self) -> float | None:
        """How often the policy's generation in flight sends its tokens so far, for the checkpoint to keep them
        (None: it is not checkpointed: no checkpoints, no completed turn yet, or a model that cannot stop)."""
        traj = self.trajectory
        if self.checkpoints is None or traj is None or traj._last is None:
            return None
        return GENERATING_S

    def _on_progress(self, stream: int, data: bytes) -> None:
        """The generation in flight sent its tokens so far: checkpoint them (a resumed attempt continues them)."""
        traj = self.trajectory
        if stream != PROGRESS_STREAM or traj is None or not self._progressing:
            return  # late: its call answered already (a checkpoint of the turn after it may be written)
        try:
            progress = _progress_decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        self.checkpoint(traj, "answered", generating=progress)

    def resume_from(self, cp: Checkpoint, how: str) -> None:
        """Take up a checkpoint's ledger: its cost, turns and policy versions (counted once: this attempt adds
        only its own calls), the rest of its clock, and the generation it was making (continued by the next)."""
        self.resumed_how, self.resumed_from_turn = how, cp.turn
        self.continuing = cp.generating
        tools = sum(isinstance(i, FunctionCallOutput) for i in cp.response.output)
        self.calls_from = [len(cp.turns), tools]  # what earlier attempts made (``explain``)
        self.cost.merge(cp.cost)  # its sessions add their tool time to this one
        self.turns = list(cp.turns)
        self.policy_versions = list(cp.policy_versions) if cp.policy_versions else None

    def restarted(self, cp: Checkpoint) -> None:
        """A checkpoint whose sessions could be neither reattached nor restored: the rollout starts over, with
        a fresh clock."""
        self.resumed_how, self.resumed_from_turn = "restarted", 0
        if self.on_restart is not None:
            self.on_restart()

    async def generate(self, params: CreateParams, *, model: str | None = None) -> Response:
        name = model or self.config.model
        started = time.perf_counter()
        policy = name == self.config.model
        cuttable = policy and name in self._cuttable  # its generation can be stopped and continued
        progress_s = self._progress_s() if cuttable else None
        continuing = None
        if policy:
            self.generating_since = started  # a failure while it runs charges its time to the policy (``attribution``)
            continuing, self.continuing = self.continuing, None
            self._progressing = progress_s is not None
        reply = await call_model(
            self._bus,
            name,
            ModelRequest(
                params=params,
                rollout_key=self.rollout_key,
                fingerprint=self._model_fingerprint(name) if self._model_fingerprint else None,
                # the policy's generation stops as the rollout runs out, its tokens kept (``generation_cut``)
                cut_at=cut_at(self.remaining(), self.config.timeout_s) if cuttable else None,
                progress_s=progress_s,
                continue_from=continuing,
            ),
            timeout=self._model_timeout_s(name),
            liveness_s=self._model_liveness_s(name) if self._model_liveness_s else None,
            wait_s=max(0.0, self.remaining()),  # queued behind other rollouts' calls: as long as the rollout may
            on_output=self._on_progress if progress_s is not None else None,
        )
        self.generating_since, self._progressing = None, False
        repeat = self._repeat_turns()
        v = reply.policy_version
        if v is not None:
            last = v if reply.policy_version_last is None else reply.policy_version_last
            self.policy_versions = _widened(self.policy_versions, v, last)
            if repeat is not None:
                repeat.policy_versions = _widened(repeat.policy_versions, v, last)
        self.cost.add_call(name, reply.response.usage, reply.took_ms, reply.response)
        if repeat is not None:
            repeat.cost.add_call(name, reply.response.usage, reply.took_ms, reply.response)
        self.calls.model(started, reply.response.usage)
        if policy:  # the policy's turns (not a user simulator's); one the rollout's deadline stopped: ``cut``
            self._turns.generated(reply.response, cut=reply.cut)
            if repeat is not None:
                repeat.generated(reply.response, cut=reply.cut)
        self.turns.append(name if v is None else f"{name}@{v}")
        if reply.worker and reply.worker not in self.model_workers:
            self.model_workers.append(reply.worker)
        if reply.cut:  # stopped at the rollout's deadline: the rollout ends as its clock would have ended it
            raise Failure("timeout", f"rollout exceeded timeout_s={self.config.timeout_s:g}")
        return reply.response

    def partial(self, repeat: int | None = None) -> Response | None:
        """The trajectory so far as one ``Response`` (status ``incomplete``): what a failure row keeps of the policy's
        turns, with their token ids, logprobs and policy versions; None before the first model turn. A generation
        the rollout's deadline stopped (``cut``) ends it, its item ``status: "incomplete"`` and the response's
        ``incomplete_details`` saying ``cut``; any other turn the failure cut short is not in it (its call never
        answered): the completed turns are. ``repeat``: a group task's repeat's own (``in_repeat``; None where its
        agent did not say which calls were whose)."""
        if repeat is None:
            return self._turns.partial()
        turns = self.repeats.get(repeat)
        return turns.partial() if turns is not None else None

    async def open_session(self, resource: str | None = None, *, row: dict[str, Any] | None = None) -> Session:
        """Open a session on the named resource (default: the agent's); use ``async with``. ``row`` seeds
        it in place of the task's row (one repeat of a group task, with its own rollout index)."""
        name = resource or self.config.resource
        task = self.task
        session = Session(
            self._bus,
            self._bus.subjects.seed(name, self._bus.caller),
            self.row if row is None else row,
            absent_grace_s=self.config.absent_grace_s,
            check=task.check,
            # a group's repeat (``row``) carries its own indices; the task's row gets the task's
            indices=None
            if row is not None
            else {"_ng_task_index": task.task_index, "_ng_rollout_index": task.rollout_index},
            cost=self.cost,
            calls=self.calls,
            resource=name,
            also=turns.cost if (turns := self._repeat_turns()) is not None else None,
        )
        self.sessions.append(session)
        return session


class Trajectory:
    """One rollout's growing trajectory: every model turn sees the prompt plus all output so far.

    ``generate`` makes the next turn and keeps its items and usage; ``append``
    adds what the agent answers (tool outputs); ``response()`` is the whole
    trajectory as one ``Response`` (the last turn's, with every item and the
    usage summed over turns).

    Resume at the last turn: ``generate`` checkpoints a turn with tool calls before they run, ``call`` runs one
    under an id that is the same on every attempt of its turn, ``answered`` checkpoints the turn once its calls
    are answered, and a redelivered attempt's ``resume`` takes the rollout up at its checkpoint (the simple
    agent's loop shows the pattern; docs/operations.md#resume-at-the-last-turn).
    """

    def __init__(self, params: CreateParams) -> None:
        self.params = params
        self.prompt = params.input
        self.outputs: list[Item] = []
        self.usage = Usage()
        self.steps = 0
        self._last: Response | None = None
        # this turn's generation was checkpointed: its calls carry ids, the last asks for the environment's
        # snapshot, its answered turn is checkpointed too (a turn before the first checkpoint: none of it)
        self._checkpointed = False
        self._unsettled = False  # its checkpoint may not be stored yet: its first call waits for it
        self._from = 0  # where the last generation's items start in ``outputs``

    async def generate(self, ctx: AgentContext) -> Response:
        ctx.keep(self)  # a failure row keeps it (``AgentContext.partial``)
        self.steps += 1
        self.params.input = self.prompt + self.outputs
        resp = await ctx.generate(self.params)
        self.usage.add(resp.usage)
        self._from = len(self.outputs)
        self.outputs.extend(resp.output)
        self._last = resp
        calls = any(isinstance(o, FunctionCall) for o in resp.output)
        self._checkpointed = self._unsettled = calls and ctx.checkpoint(self, "generated")
        return resp

    def append(self, item: Item) -> None:
        self.outputs.append(item)

    async def call(
        self, ctx: AgentContext, session: Session, call: FunctionCall, index: int, *, last: bool
    ) -> ToolReply:
        """Run the ``index``-th tool call of this turn (``last``: its turn's last) and append its output. In a
        checkpointed turn: after the turn's checkpoint is stored, under an id that is the same on every attempt
        of the turn, the last one asking for the environment's snapshot (kept with the next checkpoint)."""
        if not self._checkpointed:
            reply = await session.call(call.name, call.arguments)
        else:
            call_id = await self.call_id(ctx, index, call)
            reply = await session.call(call.name, call.arguments, id=call_id, snapshot=last)
        self.append(FunctionCallOutput(call_id=call.call_id, output=reply.output))
        return reply

    async def call_id(self, ctx: AgentContext, index: int, call: FunctionCall) -> str:
        """For an agent's own tool (run in its own sandbox, not the session's): the ``index``-th call of this
        turn's id, the same on every attempt of the turn, once the turn's checkpoint is stored ("" in a turn
        before the first checkpoint: nothing replays it). Passed to ``box.exec(..., id=)``, the call runs once."""
        if not self._checkpointed:
            return ""
        if self._unsettled and ctx.checkpoints is not None:
            self._unsettled = False
            await ctx.checkpoints.settled()  # a resume replays these calls, never samples new ones
        return _call_id(self.steps, index, call)

    def answered(self, ctx: AgentContext) -> None:
        """The turn's calls are answered: checkpoint it (the next attempt starts at the next turn), where its
        generation was (so the snapshot kept with it is this turn's)."""
        if self._checkpointed:
            ctx.checkpoint(self, "answered")

    async def resume(self, ctx: AgentContext, session: Session) -> Response | None:
        """Take up a redelivered attempt's checkpoint (``ctx.resumed``), if any: the agent's own sandboxes
        reattached (``ctx.sandbox`` hands each to the create that asks for it again), its session reattached or
        restored (else the rollout starts over, in fresh sandboxes) and its trajectory, turn and ledger. Returns
        the last generation when its tool calls are still to run (each answered once: ``call``), else None."""
        cp = ctx.resumed
        if cp is None:
            return None
        handle = next((h for h in cp.sessions if h.resource == session.resource), None)
        if handle is not None and handle.held is not None and cp.phase == "generated":
            # its calls may have run in the session's containers after the snapshot: a restore takes up only
            # containers as the snapshot left them (an answered turn's), else it starts from fresh ones
            handle = msgspec.structs.replace(handle, held=None)
        if cp.sandboxes:
            ctx.sandboxes.take_up(cp.sandboxes, cp.sandbox_lease)
        boxes = await ctx.sandboxes.reattach()  # all of them, or none (one is gone: the rollout starts over)
        if not boxes:
            how = "restarted"
        elif handle is not None:
            how = await session.resume(handle)
        else:  # no session was open yet (its first call is its seed): only the agent's own sandboxes hold state
            how = "reattached" if cp.sandboxes and not cp.sessions else "restarted"
        if how == "restarted":
            if handle is not None and not boxes:  # its session holds state of a trajectory that starts over
                await session.abandon(handle)
            await ctx.sandboxes.drop_reattached()
            ctx.restarted(cp)
            return None
        ctx.resume_from(cp, how)
        self.outputs = list(cp.response.output)
        self.usage = cp.response.usage or Usage()
        self.steps = cp.turn
        self._last = msgspec.structs.replace(cp.response, status=cp.last_status)
        if cp.phase != "generated":
            return None
        self._from, self._checkpointed = cp.last_from, True  # its calls replayed under their ids
        return msgspec.structs.replace(self._last, output=self.outputs[cp.last_from :])

    @staticmethod
    def hit_token_limit(resp: Response) -> bool:
        """The turn stopped at ``max_output_tokens``: the model cannot go on."""
        details = resp.incomplete_details
        return bool(details and details.get("reason") == "max_output_tokens")

    def response(self) -> Response:
        assert self._last is not None, "no model turn yet"
        return msgspec.structs.replace(self._last, output=self.outputs, usage=self.usage)


def _generated_any(response: Response) -> bool:
    """A cut generation that made at least one token (one cut before its first token adds nothing to a row)."""
    return any(getattr(item, "generation_token_ids", None) for item in response.output)


def _call_id(turn: int, index: int, call: FunctionCall) -> str:
    """A tool call's id, the same on every attempt of its turn: the turn, its place in it, and a digest of the call
    (a turn sampled again from an older checkpoint, with other calls, is never answered with this one's reply)."""
    digest = hashlib.blake2b(f"{call.name}\0{call.arguments}".encode(), digest_size=6).hexdigest()
    return f"{turn}.{index}.{digest}"


class AgentFn(Protocol):
    def __call__(self, ctx: AgentContext) -> Awaitable[Outcome]: ...


__all__ = ["AgentContext", "AgentFn", "Outcome", "Session", "Trajectory", "Turns", "current_repeat", "in_repeat"]
