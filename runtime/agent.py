"""The agent author's API: a context that reaches models and resource sessions.

An agent is a module with ``async def run(ctx: AgentContext) -> Outcome``. It
asks ``ctx.generate`` for model turns and ``ctx.open_session`` for a resource
session; the runtime does the routing (model work queues, session-pinned
subjects), tracing and error typing. Agents never touch NATS.

``AgentContext``, ``Session`` and ``Trajectory`` are faces: each holds a part of the rollout's state
(``gym_runtime.rollout``: its ledger, sessions, checkpoints and resume) and the port its calls go through, and
delegates to it. A worker builds the context on the bus (``AgentContext.on_bus``), ``testing.AgentEnvironment``
in this process: the same context either way.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, Protocol, Unpack

import msgspec

from gym_runtime.config import AgentConfig
from gym_runtime.messages import (
    CreateParams,
    FunctionCall,
    FunctionCallOutput,
    Item,
    Response,
    RolloutTask,
    SessionHandle,
    ToolCall,
    ToolReply,
    VerifyReply,
    VerifyRequest,
)
from gym_runtime.rollout import resume
from gym_runtime.rollout.ledger import Calls, TrajectoryState, Turns, current_repeat, in_repeat
from gym_runtime.rollout.port import BusPort, Port
from gym_runtime.rollout.session import SessionLink
from gym_runtime.rollout.state import Models, Rollout
from gym_runtime.sandboxes.client import Sandboxes
from gym_runtime.sandboxes.spec import SandboxAsk
from gym_runtime.transport.bus import Bus

TOOL_TIMEOUT_S = 300.0


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
    that now owns the session; later operations go straight to that worker.
    """

    __slots__ = ("link",)

    def __init__(self, port: Port | Bus, resource: str, row: dict[str, Any], **link: Any) -> None:
        """A session on ``resource`` seeded with ``row`` (opened by its first operation), its calls through ``port``
        (a bus: its workers'); ``link``: ``SessionLink``'s keywords."""
        self.link = SessionLink(BusPort(port) if isinstance(port, Bus) else port, resource, row, **link)

    @classmethod
    def of(cls, link: SessionLink) -> Session:
        session = cls.__new__(cls)
        session.link = link
        return session

    @property
    def id(self) -> str | None:
        return self.link.seed.session if self.link.seed else None

    @property
    def resource(self) -> str:
        return self.link.resource

    @property
    def snapshot(self) -> bytes | None:
        """The environment's last snapshot (``Resource.snapshot``), where a call asked for it."""
        return self.link.snapshot

    async def call(
        self, name: str, arguments: str, *, timeout: float = TOOL_TIMEOUT_S, id: str = "", snapshot: bool = False
    ) -> ToolReply:
        """A model's tool call: it reaches only a tool the environment declares, whatever its name. ``id``: the
        same on every attempt of its turn (the session answers a repeated one with its first reply);
        ``snapshot``: ask for the environment's snapshot after it (kept in ``self.snapshot``)."""
        call = ToolCall(session="", name=name, arguments=arguments, id=id, snapshot=snapshot)
        return await self.link.tool(call, timeout, f"tool {name}")

    def handle(self) -> SessionHandle | None:
        """What a checkpoint keeps of this session (None: never opened on a worker)."""
        return self.link.handle()

    async def resume(self, handle: SessionHandle) -> str:
        """Take up the session a checkpoint names: ``reattached``, ``restored`` or ``restarted``."""
        return await self.link.resume(handle)

    async def operate(self, op: str, arguments: str, *, timeout: float = TOOL_TIMEOUT_S) -> ToolReply:
        """One of the runtime's own session operations (``gym.reset``, ``gym.step``, ...), never a model's call."""
        return await self.link.tool(ToolCall(session="", name=op, arguments=arguments, protocol=True), timeout, op)

    async def verify(
        self, row: dict[str, Any], response: Response, *, timeout: float = TOOL_TIMEOUT_S, close: bool = True
    ) -> VerifyReply:
        """Score the response; by default the worker also closes the session (no extra message)."""
        link = self.link
        row = {**link.indices, **row} if link.indices else row
        ask = VerifyRequest(session="", row=row, response=response, close=close)
        reply: VerifyReply = await link.op(ask, "verify", timeout=timeout, op="verify")
        link.closed = link.closed or close
        return reply

    async def close(self) -> None:
        await self.link.close()

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AgentContext:
    """Everything one rollout may use: its task (``task``, ``row``, ``config``), model turns (``generate``),
    sessions (``open_session``), sandboxes (``sandbox``) and clock (``remaining``). Built per task by the agent
    worker (``on_bus``), or in this process by ``testing.AgentEnvironment``."""

    def __init__(self, rollout: Rollout[AgentConfig]) -> None:
        self.rollout = rollout
        self.task = rollout.task
        self.row = rollout.task.row
        self.config = rollout.config

    @classmethod
    def on_bus(
        cls,
        bus: Bus,
        task: RolloutTask,
        config: AgentConfig,
        models: Models,
        *,
        deadline: float,
    ) -> AgentContext:
        """A worker's: its calls over ``bus``, its sandboxes in the agent's pool under the rollout's lease."""
        where, grace = f"agents.{task.agent}", config.absent_grace_s  # its lease: a fresh secret (``sandboxes.leases``)
        boxes = Sandboxes(bus, config.sandbox, deadline=deadline, where=where, absent_grace_s=grace)
        return cls(Rollout(BusPort(bus, models.affinity), task, config, models, boxes))

    repeat = staticmethod(in_repeat)  # ``with ctx.repeat(i):`` in a ``run_group``: what is repeat i's

    @property
    def cost(self) -> Any:
        """What the rollout's calls used so far (the row's ``cost``)."""
        return self.rollout.ledger.cost

    @property
    def turns(self) -> list[str]:
        """The model entry of each call so far (``provenance.turns``)."""
        return self.rollout.ledger.turns

    @property
    def calls(self) -> Calls:
        """Each call's start, time and tokens (``explain``)."""
        return self.rollout.ledger.calls

    @property
    def policy_versions(self) -> list[int] | None:
        return self.rollout.ledger.policy_versions

    @property
    def task_attempt(self) -> int:
        """The delivery of the task this attempt is (1: its first)."""
        return self.rollout.attempt

    @property
    def sandboxes(self) -> Sandboxes:
        return self.rollout.sandboxes

    def sandbox(self, image: str | None = None, **ask: Unpack[SandboxAsk]) -> Any:
        """A sandbox of the agent's pool (``agents.NAME.sandbox``) for this rollout: ``async with
        ctx.sandbox(image=..., cpu=...) as box`` (the keywords: ``SandboxAsk``) then ``await box.exec(cmd)``,
        ``box.write``, ``box.read`` (docs/sandboxes.md). Whatever is left open is removed when the rollout ends.
        A resumed attempt is handed the sandbox its rollout held with the same keywords (reattached: the same
        container, its files intact), where its checkpoint names one."""
        resumed, boxes = self.rollout.resumed, self.rollout.sandboxes
        if resumed is not None and self.rollout.branching:  # another rollout's: forks of the copies kept at its turn
            if resumed.kept is not None:
                boxes.branch_from(resumed.kept)
        elif resumed is not None and resumed.sandboxes:
            boxes.take_up(resumed.sandboxes, resumed.sandbox_lease)
        return boxes.sandbox(image, **ask)

    def remaining(self) -> float:
        """Seconds left before the runtime cancels this rollout (``timeout_s``). Agents that can end early with a
        valid result (e.g. a conversation) check it between steps."""
        return self.rollout.remaining()

    async def generate(self, params: CreateParams, *, model: str | None = None) -> Response:
        """One model turn from ``model`` (default: the agent's policy), booked in the rollout's ledger."""
        return await self.rollout.generate(params, model or self.config.model)

    def partial(self, repeat: int | None = None) -> Response | None:
        """The trajectory so far as one ``Response`` (status ``incomplete``): what a failure row keeps of the policy's
        turns, with their token ids, logprobs and policy versions; None before the first model turn. A generation
        the rollout's deadline stopped (``cut``) ends it, its item ``status: "incomplete"`` and the response's
        ``incomplete_details`` saying ``cut``; any other turn the failure cut short is not in it (its call never
        answered): the completed turns are. ``repeat``: a group task's repeat's own (``in_repeat``; None where its
        agent did not say which calls were whose)."""
        return self.rollout.ledger.partial(repeat)

    def keep(self, trajectory: Trajectory) -> None:
        """A failure row keeps ``trajectory`` (its tool outputs too) as the rollout's (or its repeat's) so far."""
        self.rollout.ledger.keep(trajectory.state)

    async def open_session(self, resource: str | None = None, *, row: dict[str, Any] | None = None) -> Session:
        """Open a session on the named resource (default: the agent's); use ``async with``. ``row`` seeds
        it in place of the task's row (one repeat of a group task, with its own rollout index)."""
        return Session.of(self.rollout.open(resource or self.config.resource, row))


class Trajectory:
    """One rollout's growing trajectory: every model turn sees the prompt plus all output so far.

    ``generate`` makes the next turn and keeps its items and usage; ``append``
    adds what the agent answers (tool outputs); ``response()`` is the whole
    trajectory as one ``Response`` (the last turn's, with every item and the
    usage summed over turns).

    Resume at the last turn (``gym_runtime.rollout.resume``): ``generate`` checkpoints a turn with tool calls before
    they run, ``call`` runs one under an id that is the same on every attempt of its turn, ``answered`` checkpoints
    the turn once its calls are answered, and a redelivered attempt's ``resume`` takes the rollout up at its
    checkpoint (the simple agent's loop shows the pattern; docs/operations.md#resume-at-the-last-turn).
    """

    __slots__ = ("state",)

    def __init__(self, params: CreateParams) -> None:
        self.state = TrajectoryState(params)

    params = property(lambda self: self.state.params)
    prompt = property(lambda self: self.state.prompt)
    outputs = property(lambda self: self.state.outputs)
    usage = property(lambda self: self.state.usage)
    steps = property(lambda self: self.state.steps)

    async def generate(self, ctx: AgentContext) -> Response:
        state = self.state
        ctx.keep(self)  # a failure row keeps it (``AgentContext.partial``)
        state.steps += 1
        state.params.input = state.prompt + state.outputs
        resp = await ctx.generate(state.params)
        state.usage.add(resp.usage)
        state.last_from = len(state.outputs)
        state.outputs.extend(resp.output)
        state.last = resp
        resume.generated(ctx.rollout, state, resp)
        return resp

    def append(self, item: Item) -> None:
        self.state.outputs.append(item)

    async def call(
        self, ctx: AgentContext, session: Session, call: FunctionCall, index: int, *, last: bool
    ) -> ToolReply:
        """Run the ``index``-th tool call of this turn (``last``: its turn's last) and append its output. In a
        checkpointed turn: after the turn's checkpoint is stored, under an id that is the same on every attempt
        of the turn, the last one asking for the environment's snapshot (kept with the next checkpoint)."""
        if not self.state.checkpointed:
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
        return await resume.call_id(ctx.rollout, self.state, index, call)

    def answered(self, ctx: AgentContext) -> None:
        """The turn's calls are answered: checkpoint it (the next attempt starts at the next turn)."""
        resume.answered(ctx.rollout, self.state)

    async def resume(self, ctx: AgentContext, session: Session) -> Response | None:
        """Take up a redelivered attempt's checkpoint, if any (``rollout.resume.take_up``): the last generation
        when its tool calls are still to run (each answered once: ``call``), else None."""
        return await resume.take_up(ctx.rollout, self.state, session.link)

    @staticmethod
    def hit_token_limit(resp: Response) -> bool:
        """The turn stopped at ``max_output_tokens``: the model cannot go on."""
        details = resp.incomplete_details
        return bool(details and details.get("reason") == "max_output_tokens")

    def response(self) -> Response:
        last = self.state.last
        assert last is not None, "no model turn yet"
        return msgspec.structs.replace(last, output=self.state.outputs, usage=self.state.usage)


class AgentFn(Protocol):
    def __call__(self, ctx: AgentContext) -> Awaitable[Outcome]: ...


__all__ = [
    "AgentContext",
    "AgentFn",
    "Calls",
    "Outcome",
    "Session",
    "Trajectory",
    "Turns",
    "current_repeat",
    "in_repeat",
]
