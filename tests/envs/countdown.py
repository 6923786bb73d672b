"""A gymnasium-style test environment that ends the episode before ``max_turns``.

Task fields: ``stop_at`` (the policy turn whose step terminates the episode).
The policy may call ``tick`` during its turns; ``step`` sees the count (tools and
steps share the session's state). Each non-final step gives reward 0.25 and the
next user turn; the terminating step gives 1.0 and reports the tick count in
``info``.
"""

from __future__ import annotations

from typing import Any

from gym_runtime.gymnasium import Action, GymResource, Step
from gym_runtime.resource import tool


class Countdown(GymResource):
    async def reset(self, task: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        self.ticks = 0
        return f"You have {task['stop_at']} turns.", {"stop_at": task["stop_at"]}

    @tool
    async def tick(self) -> dict[str, int]:
        """Count one tick."""
        self.ticks += 1
        return {"ticks": self.ticks}

    async def step(self, action: Action) -> Step:
        if action.turn >= int(self.task["stop_at"]):
            return Step(reward=1.0, terminated=True, info={"ticks": self.ticks, "last_text": action.text})
        return Step(
            observation=f"Turn {action.turn} done; {int(self.task['stop_at']) - action.turn} to go.", reward=0.25
        )
