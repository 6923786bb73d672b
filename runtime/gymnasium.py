"""Gymnasium-style environments on the Resource API: ``reset`` / ``step``.

A ``GymResource`` is a ``Resource`` (one instance = one session = one episode)
with two more hooks, after the Gymnasium API and NeMo Gym's ``GymnasiumServer``:

* ``reset(task) -> observation | (observation, info)``: start the episode. A
  non-empty observation is the first user turn (appended to the task's input).
* ``step(action) -> Step | (observation, reward, terminated, truncated, info)``:
  called after every *policy turn* (the policy's model calls and their tool calls,
  up to its answer). ``action.text`` is the text of the turn's assistant messages,
  ``action.output`` the turn's items. A non-empty observation is the next user
  turn; ``terminated`` ends the episode (goal reached or failed), ``truncated``
  cuts it (an environment time limit).

Tools (``@tool`` methods) work as on any Resource: the policy calls them during
its turn and ``step`` sees the state they left.

The reward of the episode is the sum of the step rewards (NeMo Gym's
``gymnasium_agent``). The default ``verify`` returns it, with the fields
NeMo Gym's gymnasium rows carry: ``terminated``, ``truncated`` and ``info`` (the
last step's). Override ``verify`` to score the whole trajectory instead, or to
support verification without steps (``gym-runtime reverify``).

Transport: ``reset`` and ``step`` travel as the session's operations ``gym.reset`` and
``gym.step`` (a ``ToolCall`` marked ``protocol``, sent by ``Session.operate``: agents use
``env_reset`` / ``env_step`` below), their results as JSON in the reply. A model's tool call
is never an operation, whatever its name: an agent may forward every call the policy makes,
and one named ``gym.step`` is an unknown tool (``Resource.call_operation``).
"""

from __future__ import annotations

import inspect
from typing import Any

import msgspec

from gym_runtime.messages import Item, Response
from gym_runtime.resource import OPERATION_PREFIXES, Resource, ToolArgumentsError, Verdict

__all__ = [
    "RESERVED_PREFIX",
    "RESET",
    "STEP",
    "Action",
    "EnvError",
    "GymResource",
    "Reset",
    "Step",
    "env_reset",
    "env_step",
    "is_reserved",
]

RESERVED_PREFIX = "gym."
RESET = "gym.reset"
STEP = "gym.step"


def is_reserved(tool_name: str) -> bool:
    """A name of the runtime's own operations (no tool has one; a model's call so named is an unknown tool)."""
    return tool_name.startswith(OPERATION_PREFIXES)


class Action(msgspec.Struct, kw_only=True):
    """One policy turn, as ``step`` receives it."""

    text: str  # the turn's assistant message text (what the user "hears")
    output: list[Item] = msgspec.field(default_factory=list)  # the turn's items, tool calls included
    turn: int = 1  # 1-based index of this policy turn
    incomplete: bool = False  # the turn was cut (max_output_tokens, or max_steps without an answer)


class Reset(msgspec.Struct, kw_only=True, omit_defaults=True):
    observation: str | None = None
    info: dict[str, Any] = msgspec.field(default_factory=dict)


class Step(msgspec.Struct, kw_only=True):
    """What ``step`` returns (a 5-tuple in Gymnasium order is accepted too)."""

    observation: str | None = None
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = msgspec.field(default_factory=dict)


class EnvError(RuntimeError):
    """``reset``/``step`` failed on the resource (or the resource is not a GymResource)."""


def _to_step(out: Any) -> Step:
    if isinstance(out, Step):
        return out
    if isinstance(out, tuple) and len(out) == 5:
        obs, reward, terminated, truncated, info = out
        return Step(
            observation=obs,
            reward=float(reward),
            terminated=bool(terminated),
            truncated=bool(truncated),
            info=dict(info or {}),
        )
    raise TypeError(f"step must return a Step or (observation, reward, terminated, truncated, info), got {out!r}")


def _to_reset(out: Any) -> Reset:
    if isinstance(out, Reset):
        return out
    if isinstance(out, tuple) and len(out) == 2:
        return Reset(observation=out[0], info=dict(out[1] or {}))
    if out is None or isinstance(out, str):
        return Reset(observation=out)
    raise TypeError(f"reset must return an observation, (observation, info) or Reset, got {out!r}")


class GymResource(Resource):
    """Base class of a gymnasium-style environment. Subclass it and implement ``step``.

    If you override ``seed``, call ``await super().seed(task)`` first: ``reset``
    receives the task stored there.
    """

    # Episode state, per session (instance attributes set in ``seed``).
    task: dict[str, Any]
    total_reward: float
    steps: int
    last_step: Step | None

    async def seed(self, task: dict[str, Any]) -> None:
        self.task = task
        self.total_reward = 0.0
        self.steps = 0
        self.last_step = None

    async def reset(self, task: dict[str, Any]) -> Any:
        """Start the episode; return the first observation (or None) and optionally info."""
        return None

    async def step(self, action: Action) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not implement step")

    def episode_fields(self) -> dict[str, Any]:
        """Row fields the default ``verify`` reports besides the reward (NeMo Gym's gymnasium rows)."""
        last = self.last_step or Step()
        return {"terminated": last.terminated, "truncated": last.truncated, "info": last.info}

    async def verify(self, task: dict[str, Any], response: Response) -> float | Verdict:
        if not getattr(self, "steps", 0):
            raise NotImplementedError(
                f"{type(self).__name__} scores episodes through step(); it has not stepped "
                "(override verify to score a response without an episode)"
            )
        return Verdict(reward=self.total_reward, fields=self.episode_fields())

    async def call_operation(self, name: str, arguments: str | bytes) -> str:
        if name == RESET:
            if not hasattr(self, "task"):
                raise RuntimeError(f"{type(self).__name__}.seed did not call super().seed(task); reset has no task")
            self.total_reward, self.steps, self.last_step = 0.0, 0, None
            out = self.reset(self.task)
            res = _to_reset(await out if inspect.isawaitable(out) else out)
            return msgspec.json.encode(res).decode()
        if name == STEP:
            try:
                action = msgspec.json.decode(arguments, type=Action)
            except (msgspec.ValidationError, msgspec.DecodeError) as e:
                raise ToolArgumentsError(f"{STEP}: invalid action: {e}") from None
            out = self.step(action)
            step = _to_step(await out if inspect.isawaitable(out) else out)
            self.steps += 1
            self.total_reward += step.reward
            self.last_step = step
            return msgspec.json.encode(step).decode()
        return await super().call_operation(name, arguments)


# ------------------------------------------------------------------ agent side


async def env_reset(session: Any) -> Reset:
    """Reset the episode of a GymResource session (``gym_runtime.agent.Session``)."""
    reply = await session.operate(RESET, "{}")
    if reply.is_error:
        raise EnvError(_explain(reply.output))
    return msgspec.json.decode(reply.output, type=Reset)


async def env_step(session: Any, action: Action) -> Step:
    reply = await session.operate(STEP, msgspec.json.encode(action).decode())
    if reply.is_error:
        raise EnvError(_explain(reply.output))
    return msgspec.json.decode(reply.output, type=Step)


def _explain(output: str) -> str:
    if "unknown operation 'gym." in output:
        return f"the resource is not a GymResource (it has no reset/step): {output}"
    return output
