"""A rollout's one ledger: its model turns, each call's start and time, its cost, the policy versions that served
it, each repeat's share of a group task's, and the trajectory so far that a failure row keeps (``partial``).

Every model call and tool call of a rollout is booked here once, wherever the call went (a worker's bus or this
process: ``rollout.port``); a checkpoint is read from it and a resumed attempt takes it up (``resume_from``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import msgspec

from gym_runtime.messages import Checkpoint, Cost, FunctionCallOutput, Item, ModelResponse, Response, Usage

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


def widened(versions: list[int] | None, first: int, last: int) -> list[int]:
    """Policy versions ``[min, max]`` with a call's ``[first, last]`` added."""
    return [min(versions[0], first), max(versions[1], last)] if versions else [first, last]


class TrajectoryState:
    """An agent's growing trajectory (``agent.Trajectory`` is its face): the prompt, every item so far, the usage
    summed over turns, the turns made, and where the last generation stands for a checkpoint (``rollout.resume``)."""

    __slots__ = (
        "params",
        "prompt",
        "offered",
        "outputs",
        "usage",
        "steps",
        "last",
        "checkpointed",
        "unsettled",
        "last_from",
    )

    def __init__(self, params: Any) -> None:
        self.params = params
        self.prompt = params.input
        # the tools it was made with: a generation that echoes this very list leaves it out of its checkpoint (a
        # resumed attempt's trajectory is made with the same); an agent that changes its tools gives a new list
        self.offered: list[Any] | None = getattr(params, "tools", None)
        self.outputs: list[Item] = []
        self.usage = Usage()
        self.steps = 0
        self.last: Response | None = None
        # this turn's generation was checkpointed: its calls carry ids, the last asks for the environment's
        # snapshot, its answered turn is checkpointed too (a turn before the first checkpoint: none of it)
        self.checkpointed = False
        self.unsettled = False  # its checkpoint may not be stored yet: its first call waits for it
        self.last_from = 0  # where the last generation's items start in ``outputs``


class Turns:
    """What the policy produced in one rollout, or one repeat of a group task, and what its calls used: a failure
    row's trajectory so far (``partial``), its policy versions and its cost."""

    __slots__ = ("cost", "items", "usage", "last", "cut", "policy_versions", "trajectory")

    def __init__(self) -> None:
        self.cost = Cost()
        self.items: list[Item] = []  # every model turn's items in order (where no trajectory keeps them)
        self.usage = Usage()
        self.last: Response | None = None
        self.cut: Response | None = None  # the generation the rollout's deadline stopped: its tokens so far
        self.policy_versions: list[int] | None = None
        self.trajectory: TrajectoryState | None = None  # the agent's, where it keeps one (its tool outputs too)

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


class Ledger:
    """The rollout's books, kept once: what its model and tool calls used (the row's ``cost``), the model entry of
    each call (``entry@version`` once a trainer set one: ``provenance.turns``), the model workers that served them,
    each call's start and time (``explain``), the policy versions ``[min, max]`` (None: none stamped), and what the
    policy produced so far (``partial``), a group task's per repeat too (``in_repeat``; None: outside any)."""

    __slots__ = ("group", "cost", "turns", "model_workers", "calls", "policy_versions", "whole", "repeats", "from_")

    def __init__(self, group: int = 0) -> None:
        self.group = group
        self.cost = Cost()
        self.turns: list[str] = []
        self.model_workers: list[str] = []
        self.calls = Calls()
        self.policy_versions: list[int] | None = None
        self.whole = Turns()
        self.repeats: dict[int | None, Turns] = {}
        self.from_: list[int] | None = None  # a resumed attempt's: model and tool calls made before it

    def repeat(self) -> Turns | None:
        """The books of the repeat this context runs (``in_repeat``) of a group task; None for a single rollout."""
        if self.group <= 1:
            return None
        index = _REPEAT.get()
        turns = self.repeats.get(index)
        if turns is None:
            turns = self.repeats[index] = Turns()
        return turns

    def model_call(self, name: str, reply: ModelResponse, started: float, *, policy: bool) -> None:
        """Book one model call: its cost, its time and tokens, its policy versions, and (the policy's, not a user
        simulator's) its turn in the trajectory so far; one the rollout's deadline stopped is ``cut``."""
        repeat = self.repeat()
        v = reply.policy_version
        if v is not None:
            last = v if reply.policy_version_last is None else reply.policy_version_last
            self.policy_versions = widened(self.policy_versions, v, last)
            if repeat is not None:
                repeat.policy_versions = widened(repeat.policy_versions, v, last)
        usage = reply.response.usage
        self.cost.add_call(name, usage, reply.took_ms, reply.response)
        if repeat is not None:
            repeat.cost.add_call(name, usage, reply.took_ms, reply.response)
        self.calls.model(started, usage)
        if policy:
            self.whole.generated(reply.response, cut=reply.cut)
            if repeat is not None:
                repeat.generated(reply.response, cut=reply.cut)
        self.turns.append(name if v is None else f"{name}@{v}")
        if reply.worker and reply.worker not in self.model_workers:
            self.model_workers.append(reply.worker)

    def tool_call(self, started: float, ms: int, also: Cost | None) -> None:
        """Book one tool call's round trip (less its waits for a sandbox lease), to its repeat's too (``also``)."""
        self.cost.tool_ms += ms
        if also is not None:
            also.tool_ms += ms
        self.calls.tool(started, ms)

    def keep(self, trajectory: TrajectoryState) -> None:
        """A failure row keeps ``trajectory`` (its tool outputs too) as the rollout's (or its repeat's) so far."""
        self.whole.trajectory = trajectory
        if (turns := self.repeat()) is not None:
            turns.trajectory = trajectory

    def partial(self, repeat: int | None = None) -> Response | None:
        """The trajectory so far as one ``Response`` (``Turns.partial``); ``repeat``: a group task's repeat's own."""
        if repeat is None:
            return self.whole.partial()
        turns = self.repeats.get(repeat)
        return turns.partial() if turns is not None else None

    def versions(self, repeat: int | None = None) -> list[int] | None:
        """The policy versions of the rollout, or of a group task's repeat."""
        if repeat is None:
            return self.policy_versions
        turns = self.repeats.get(repeat)
        return turns.policy_versions if turns is not None else None

    def resume_from(self, cp: Checkpoint) -> None:
        """Take up a checkpoint's books: its cost, turns and policy versions (counted once: this attempt adds only
        its own calls), and what earlier attempts made (``explain``)."""
        tools = sum(isinstance(i, FunctionCallOutput) for i in cp.response.output)
        self.from_ = [len(cp.turns), tools]
        self.cost.merge(cp.cost)
        self.turns = list(cp.turns)
        self.policy_versions = list(cp.policy_versions) if cp.policy_versions else None


def _generated_any(response: Response) -> bool:
    """A cut generation that made at least one token (one cut before its first token adds nothing to a row)."""
    return any(getattr(item, "generation_token_ids", None) for item in response.output)
