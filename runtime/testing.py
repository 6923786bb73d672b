"""Helpers for environment and agent authors' tests.

An environment's tests open a session and verify (``new_session``, ``verify_once``, ``text_response``), often
against rollouts recorded elsewhere (NeMo Gym's): join rollout rows with their task rows by input messages
(``joined_rollouts``), turn a recorded ``response`` into a ``Response``, replay its tool calls (a whole file's:
``replay_rollouts``) and check the reward comes out the same (``reverify_rollouts``). With the one test double
environments need (``ScriptedJudge``, standing in for an LLM judge), and the in-memory transport workers are
unit-tested on (``MemoryTransport``). This repository's own differential tests against its copy of NeMo Gym's data
(``tests/compat``) keep their helpers beside them, in ``tests/differential.py``.
"""

from __future__ import annotations

import inspect
import json
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import anyio

from gym_runtime.agent import AgentContext, AgentFn, Outcome
from gym_runtime.config import AgentConfig
from gym_runtime.data.reverify import parse_response
from gym_runtime.data.validation import row_problems
from gym_runtime.errors import UserError
from gym_runtime.messages import (
    CreateParams,
    FunctionCall,
    FunctionCallOutput,
    Item,
    Message,
    ModelResponse,
    Reasoning,
    Response,
    RestoreSession,
    ResumeReply,
    RolloutTask,
    ToolCall,
    VerifyRequest,
    assistant_message,
)
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.plugins import load_plugin
from gym_runtime.resource import ModelClient, Resource, Verdict
from gym_runtime.rollout.port import LocalPort
from gym_runtime.rollout.state import Models, Rollout
from gym_runtime.sandboxes.client import Sandboxes
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.memory import MemoryBroker, MemoryMessage, MemoryWire, subject_matches
from gym_runtime.transport.rpc import Timings
from gym_runtime.workers.resource_worker import call_with, verify_with

__all__ = [
    "AgentEnvironment",
    "ScriptedPolicy",
    "tool_calls_response",
    "MemoryBroker",
    "MemoryMessage",
    "MemoryTransport",
    "MemoryWire",
    "ROLLOUT_KEYS",
    "ScriptedJudge",
    "input_key",
    "joined_rollouts",
    "new_session",
    "read_jsonl",
    "recorded_response",
    "replay_rollouts",
    "replay_tool_calls",
    "reverify_rollouts",
    "split_verdict",
    "subject_matches",
    "text_response",
    "verify_once",
]

R = TypeVar("R", bound=Resource)
# What a recorded rollout row holds besides the verifier's extra fields.
ROLLOUT_KEYS = ("responses_create_params", "response", "reward")


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def input_key(row: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """How a rollout finds its task row: the role and content of its system/developer/user messages."""
    items = row["responses_create_params"]["input"]
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    return tuple(
        (m["role"], json.dumps(m["content"])) for m in items if m.get("role") in ("system", "developer", "user")
    )


def joined_rollouts(tasks_path: str | Path, rollouts_path: str | Path) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(task row, rollout row) pairs for rollout files that lack the task fields (see NOTICE.md)."""
    tasks = {input_key(t): t for t in read_jsonl(tasks_path)}
    rollouts = read_jsonl(rollouts_path)
    assert len(tasks) == len(rollouts), "rollouts and tasks should correspond one to one"
    return [(tasks[input_key(r)], r) for r in rollouts]


def recorded_response(raw: dict[str, Any]) -> Response:
    """A recorded ``response`` dict as the ``Response`` a verifier receives."""
    return parse_response(raw, "recorded response")


async def replay_tool_calls(inst: Resource, response: Response) -> int:
    """Run each recorded call in order; each output must equal the recorded one. Returns the count."""
    produced = {
        item.call_id: await inst.call_tool(item.name, item.arguments)
        for item in response.output
        if isinstance(item, FunctionCall)
    }
    recorded = {i.call_id: i.output for i in response.output if isinstance(i, FunctionCallOutput)}
    assert produced == recorded
    return len(produced)


async def replay_rollouts(cls: type[Resource], rollouts_path: str | Path) -> int:
    """``replay_tool_calls`` for each recorded rollout in the file, each in a new session of ``cls``: for
    rollouts recorded without their task rows (nothing to verify). Returns how many calls were replayed."""
    count = 0
    for rollout in read_jsonl(rollouts_path):
        count += await replay_tool_calls(await new_session(cls), recorded_response(rollout["response"]))
    return count


async def reverify_rollouts(
    cls: type[R], pairs: list[tuple[dict[str, Any], dict[str, Any]]], fields: Iterable[str] | None = None
) -> list[tuple[R, int]]:
    """Replay each recorded rollout's tool calls in a session seeded with its task row, then verify: the
    reward and the extra fields (``fields``; by default all the row's keys but ``ROLLOUT_KEYS``) must be the
    recorded ones, compared as JSON (which tells True from 1 and 1.0 from 1). Returns each rollout's session
    and how many calls it replayed, for further checks."""
    sessions = []
    for i, (task, rollout) in enumerate(pairs):
        inst = await new_session(cls, row=task)
        response = recorded_response(rollout["response"])
        replayed = await replay_tool_calls(inst, response)
        reward, fields = split_verdict(await inst.verify(task, response))
        assert isinstance(reward, float)
        assert reward == rollout["reward"], f"rollout {i}"
        keys = [k for k in rollout if k not in ROLLOUT_KEYS] if fields is None else fields
        extras = {k: rollout[k] for k in keys}
        assert json.dumps(fields, sort_keys=True) == json.dumps(extras, sort_keys=True), f"rollout {i}"
        sessions.append((inst, replayed))
    return sessions


def split_verdict(out: float | Verdict) -> tuple[float, dict[str, Any]]:
    """(reward, extra fields) of whatever ``verify`` returned."""
    return (out.reward, out.fields) if isinstance(out, Verdict) else (float(out), {})


def text_response(*texts: str, reasoning: str | None = None, refusal: str | None = None, id: str = "r") -> Response:
    """A response of one assistant message per text (``output_text`` parts), after one
    reasoning item with a ``summary_text`` when ``reasoning`` is given. A ``refusal`` part opens
    the last message when ``refusal`` is given: what a reader of the answer's text must skip,
    like the reasoning, while joining the messages' ``output_text`` parts."""
    output: list[Item] = []
    if reasoning is not None:
        output.append(Reasoning(summary=[{"type": "summary_text", "text": reasoning}]))
    output += [assistant_message(t) for t in texts]
    if refusal is not None and texts:
        last = texts[-1]
        output[-1] = Message(
            role="assistant", content=[{"type": "refusal", "refusal": refusal}, {"type": "output_text", "text": last}]
        )
    return Response(id=id, created_at=0.0, output=output)


async def new_session(
    cls: type[R],
    options: dict[str, Any] | None = None,
    *,
    row: dict[str, Any] | None = None,
    seed: bool = True,
    models: Any = None,
) -> R:
    """``cls.setup(options)``, a new instance (``models`` as its ``self.models``), seeded with ``row``."""
    await cls.setup(dict(options or {}))
    inst = cls()
    if models is not None:
        inst.models = models
    if seed:
        await inst.seed(row if row is not None else {})
    return inst


async def verify_once(
    cls: type[Resource], row: dict[str, Any], response: Response, options: dict[str, Any] | None = None
) -> Verdict:
    """Verify ``response`` for ``row`` in a fresh session set up with ``options``; the class is
    set up with defaults again afterwards, so options do not leak into the next test."""
    try:
        inst = await new_session(cls, options, row=row)
        out = await inst.verify(row, response)
    finally:
        if options:
            await cls.setup({})
    assert isinstance(out, Verdict)
    return out


class ScriptedJudge:
    """TEST DOUBLE for an LLM judge (``Resource.models``): replays scripted replies in order.

    It checks that the environment asks the configured judge model, records every
    request (``calls``, ``prompts()``) and fails the test when asked more often than scripted.
    """

    def __init__(self, replies: list[Response], model: str = "judge") -> None:
        self.replies = list(replies)
        self.model = model
        self.calls: list[CreateParams] = []

    async def generate(self, params: CreateParams, *, model: str) -> Response:
        assert model == self.model, f"judge asked under {model!r}, configured {self.model!r}"
        self.calls.append(params)
        assert self.replies, "the judge was asked more often than the test scripted"
        return self.replies.pop(0)

    def prompts(self) -> list[str]:
        """The text of each request's last input message."""
        return [str(c.input[-1].content) for c in self.calls]  # type: ignore[union-attr]


# ---------------------------------------------------------------------------------------------------------
# One agent (or one environment) tested in this process, as Temporal's ``ActivityEnvironment`` tests one activity:
# the agent's ``run(ctx)`` with a scripted policy and the environment's sessions opened here; no bus, no workers.
# ---------------------------------------------------------------------------------------------------------


def tool_calls_response(*calls: tuple[str, dict[str, Any] | str], id: str = "r") -> Response:
    """A model turn that calls tools: ``("name", {arguments})`` each, in order (call ids ``call_1``, ...)."""
    output: list[Item] = [
        FunctionCall(call_id=f"call_{i}", name=name, arguments=args if isinstance(args, str) else json.dumps(args))
        for i, (name, args) in enumerate(calls, 1)
    ]
    return Response(id=id, created_at=0.0, output=output)


class ScriptedPolicy:
    """TEST DOUBLE for the policy LLM: each model turn of the rollout is the next scripted ``Response``, or what
    ``turn(params)`` answers (a function of the request, sync or async: it sees the conversation so far).
    ``calls`` records every request; asked more often than scripted, the test fails."""

    def __init__(self, turns: list[Response] | Callable[[CreateParams], Response | Awaitable[Response]]) -> None:
        self._turns = turns if callable(turns) else list(turns)
        self.calls: list[CreateParams] = []

    async def generate(self, params: CreateParams, *, model: str) -> Response:
        self.calls.append(params)
        if callable(self._turns):
            out = self._turns(params)
            return await out if inspect.isawaitable(out) else out
        assert self._turns, f"the policy ({model!r}) was asked for more turns than the test scripted"
        return self._turns.pop(0)


class AgentEnvironment:
    """An agent's rollout run in this process (``await env.run(row)``): its model turns answered by ``policy``
    (``ScriptedPolicy``, or any ``generate(params, *, model)``), its sessions opened on ``resource``, a
    ``Resource`` class set up once with ``options``; ``judge`` is the environment's ``self.models`` (an LLM
    judge's test double). ``agent``: the agent's module, its ``run``, or a name as a config names it
    (``"agents.simple"``); ``config``: the agent's entry beyond that (``max_steps``, ``timeout_s``,
    ``options``). No bus, worker or server: a failing step raises where it failed, under a debugger.

    The rows are checked as ``validate`` checks them (task fields, tools of the environment); a tool call and a
    verify behave as a resource worker's (``workers.resource_worker.call_with``, ``verify_with``: a tool's bug is
    shown to the model, a verifier's raises ``Failure("verify_error")``). ``contexts`` keeps each rollout's
    ``AgentContext``: the production one on an in-process port (``rollout.port.LocalPort``), so its ``turns``,
    ``cost``, ``calls``, ``policy_versions`` and ``partial()`` are what a worker's row would hold."""

    def __init__(
        self,
        resource: type[Resource] | None,
        *,
        policy: ModelClient,
        agent: AgentFn | ModuleType | str = "agents.simple",
        options: dict[str, Any] | None = None,
        judge: ModelClient | None = None,
        config: dict[str, Any] | None = None,
        policy_version: int | None = None,
    ) -> None:
        module = load_plugin("agent", agent, "agent") if isinstance(agent, str) else agent
        self.run_agent: AgentFn = module.run if isinstance(module, ModuleType) else module
        self._run_group = getattr(module, "run_group", None)  # a group task's (``run_group(ctx, size)``)
        self.policy_version = policy_version  # stamped on each policy call, as a trainer's set version would be
        self.resource = resource
        self.policy = policy
        self.judge = judge
        self.options = dict(options or {})
        self.config = AgentConfig(
            agent=agent if isinstance(agent, str) else "in_process",
            model="policy",
            resource="resource",
            **(config or {}),
        )
        self.contexts: list[AgentContext] = []
        self._set_up = False

    def _open(self, resource: str) -> _InProcess:
        """A session of the environment's class, in this process."""
        if self.resource is None:
            raise UserError("this agent opened a session: give AgentEnvironment the environment's class")
        inst = self.resource()
        if self.judge is not None:
            inst.models = self.judge
        return _InProcess(inst)

    async def run(self, row: dict[str, Any], *, rollout: int = 0) -> Outcome:
        """One rollout of ``row`` (its ``rollout``-th repeat), within the agent's ``timeout_s``."""
        ctx = await self._context(row, rollout, 0)
        with anyio.fail_after(self.config.timeout_s):
            return await self.run_agent(ctx)

    async def run_group(self, row: dict[str, Any], size: int) -> list[Outcome]:
        """A group task of ``size`` repeats of ``row`` (the agent's ``run_group``), within its ``timeout_s``."""
        if self._run_group is None:
            raise UserError("this agent cannot run group tasks (its module has no run_group)")
        ctx = await self._context(row, 0, size)
        with anyio.fail_after(self.config.timeout_s):
            return list(await self._run_group(ctx, size))

    async def _context(self, row: dict[str, Any], rollout: int, group: int) -> AgentContext:
        """The production context of one task of ``row``, on an in-process port (kept in ``contexts``)."""
        if self.resource is not None:
            problems = row_problems(
                self.resource, self.resource.__name__, row, row.get("responses_create_params"), any_tools=False
            )
            if problems:
                raise UserError("the row is not one this environment takes: " + "; ".join(problems))
            if not self._set_up:
                await self.resource.setup(self.options)
                self._set_up = True
        index, config = len(self.contexts), self.config
        task = RolloutTask(batch="local", task_index=index, rollout_index=rollout, agent="agent", row=row, group=group)
        boxes = Sandboxes(None, "", where="AgentEnvironment")
        room = Rollout(
            LocalPort(self._generate, self._open), task, config, Models(lambda _model: config.timeout_s), boxes
        )
        ctx = AgentContext(room)
        self.contexts.append(ctx)
        return ctx

    async def _generate(self, params: CreateParams, model: str) -> ModelResponse:
        """A model turn of ``policy``: the policy's stamped with ``policy_version``, as a model worker stamps it."""
        started = time.perf_counter()
        response = await self.policy.generate(params, model=model)
        version = self.policy_version if model == self.config.model else None
        took = round(1000 * (time.perf_counter() - started))
        return ModelResponse(response=response, policy_version=version, took_ms=took)


class _InProcess:
    """One environment session of ``AgentEnvironment`` (a ``rollout.port.LocalSession``): an instance of this process,
    each tool call and verify answered as a resource worker answers them (``call_with``, ``verify_with``); a resume
    finds it held (a restore: its ``restore``), as a worker that still holds it would."""

    def __init__(self, inst: Resource) -> None:
        self.inst = inst

    async def seed(self, row: dict[str, Any]) -> None:
        await self.inst.seed(row)

    async def run(self, message: Any) -> Any:
        if isinstance(message, ToolCall):
            return await call_with(self.inst, message)
        if isinstance(message, VerifyRequest):
            return await verify_with(self.inst, message.row, message.response)
        if isinstance(message, RestoreSession):
            restore = getattr(self.inst, "restore", None)
            if restore is None:
                return ResumeReply(ok=False, reason="this environment cannot restore a snapshot")
            await restore(message.snapshot)
        return ResumeReply(ok=True)

    async def close(self) -> None:
        try:
            await self.inst.close()
        finally:
            await self.inst.sandboxes.close_all()


# ---------------------------------------------------------------------------------------------------------
# The in-memory transport: workers and the collector's parts unit-tested without a nats-server. It is the
# ``Bus`` itself on the in-memory wire (``transport.memory``: what it does and leaves out), as httpx ships
# ``MockTransport`` beside its real one.
# ---------------------------------------------------------------------------------------------------------


class MemoryTransport(Bus):
    """A ``Bus`` on a ``MemoryWire``: workers run on it as on NATS. Several on one ``MemoryBroker`` are several
    connections to one server. ``async with MemoryTransport() as bus``: its subscriptions end with the block."""

    def __init__(
        self,
        broker: MemoryBroker | None = None,
        *,
        namespace: str = "gym",
        telemetry: Telemetry | None = None,
        timings: Timings | None = None,
        max_payload: int = 1 << 20,
    ) -> None:
        self.broker = broker or MemoryBroker()
        wire = MemoryWire(self.broker, namespace=namespace, max_payload=max_payload)
        super().__init__(wire, namespace=namespace, telemetry=telemetry or Telemetry(), timings=timings)
