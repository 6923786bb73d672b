"""multi_turn_gymnasium: scripted follow-up questions, then a check of the final answer.

Matches NeMo Gym's ``example_multi_turn_gymnasium`` resources server (a
``GymnasiumServer`` driven by its ``gymnasium_agent``). Task fields (top level, or
under ``verifier_metadata``):

- ``follow_ups``: user messages sent after each policy turn, in order;
- ``expected_answer``: a substring expected (case-insensitively) in the final answer.

``reset`` gives no observation (the prompt is the task's input). Each ``step``
returns the next follow-up (reward 0, not done) while there are any; the step
after the last follow-up checks whether ``expected_answer`` appears in the text of
that turn's messages and terminates with reward 1.0 or 0.0. The row carries
NeMo Gym's gymnasium fields: ``terminated``, ``truncated``, ``info``.

Run with ``agents.multi_turn`` and ``options.user: env`` (the config here). The
same tasks also run with ``user: follow_ups`` (the agent reads ``follow_ups``
itself) or with an LLM user simulator: ``verify`` without an episode scores the
last policy turn of the response (the messages after its last user message) the
same way, so those modes give the same reward for the same trajectory.
"""

from __future__ import annotations

from typing import Any

import msgspec

from gym_runtime.gymnasium import Action, GymResource, Step
from gym_runtime.messages import Item, Message, Response, output_text
from gym_runtime.resource import Verdict


def _task_field(task: dict[str, Any], name: str, default: Any) -> Any:
    if name in task:
        return task[name]
    meta = task.get("verifier_metadata")
    if isinstance(meta, dict) and name in meta:
        return meta[name]
    return default


def answer_reward(task: dict[str, Any], text: str) -> float:
    expected = _task_field(task, "expected_answer", "") or ""
    return 1.0 if expected and str(expected).lower() in text.lower() else 0.0


def last_turn(items: list[Item]) -> list[Item]:
    """The items after the last user message: the final policy turn of a trajectory."""
    for i in range(len(items) - 1, -1, -1):
        item = items[i]
        if isinstance(item, Message) and item.role == "user":
            return items[i + 1 :]
    return items


class MultiTurnTask(msgspec.Struct, kw_only=True):
    """The task fields reset and verify read (top level or under ``verifier_metadata``)."""

    expected_answer: str | None = None
    follow_ups: list[Any] | None = None
    verifier_metadata: dict[str, Any] | None = None


class MultiTurnGymnasium(GymResource):
    task_fields = MultiTurnTask

    async def reset(self, task: dict[str, Any]) -> None:
        self.turn = 0
        return None

    async def step(self, action: Action) -> Step:
        follow_ups = _task_field(self.task, "follow_ups", []) or []
        turn = getattr(self, "turn", 0)
        if turn < len(follow_ups):
            self.turn = turn + 1
            return Step(observation=str(follow_ups[turn]))
        return Step(reward=answer_reward(self.task, output_text(action.output)), terminated=True)

    async def verify(self, task: dict[str, Any], response: Response) -> float | Verdict:
        if self.steps:
            return await super().verify(task, response)
        # No episode (follow_ups or user-simulator mode, or re-verify): score the last turn.
        return Verdict(
            reward=answer_reward(task, output_text(last_turn(response.output))),
            fields={"terminated": True, "truncated": False, "info": {}},
        )
