"""A long multi-turn environment of plain Python, as an outside one looks to the runtime
(tests/bench/checkpoint_turns.py, tests/e2e/test_incremental_checkpoints.py).

It offers up to ``STEPS`` tools, ``step_000`` ... (a task offers the first ``tools`` of them with
``parallel_tool_calls: false``, so the scripted policy, a TEST DOUBLE for the LLM, calls one a turn: a rollout of
``tools`` + 1 model turns, or ``max_steps`` where the agent stops sooner). Each answers its name and how many steps
ran so far; ``verify`` rewards a session in which the task's ``steps`` ran, each exactly once. With the option
``restorable``, ``snapshot``/``restore`` keep the count of each step (a snapshot that grows by a step a turn).
"""

from __future__ import annotations

import json
from typing import Any

from gym_runtime.messages import Response
from gym_runtime.resource import Resource, Verdict, tool

STEPS = 200


def step_name(i: int) -> str:
    return f"step_{i:03d}"


def task(steps: int, tools: int | None = None, **fields: Any) -> dict[str, Any]:
    """A task of ``steps`` steps, one a turn, offering the first ``tools`` tools (default: ``steps``; more where the
    agent's ``max_steps`` stops it at ``steps``)."""
    offered = [
        {"type": "function", "name": step_name(i), "parameters": {"type": "object", "properties": {}}}
        for i in range(steps if tools is None else tools)
    ]
    return {
        "responses_create_params": {
            "input": [{"role": "user", "content": "run every step"}],
            "tools": offered,
            "parallel_tool_calls": False,
        },
        "steps": steps,
        **fields,
    }


class ManySteps(Resource):
    async def seed(self, task: dict[str, Any]) -> None:
        self.counts: dict[str, int] = {}

    async def step(self, name: str) -> dict[str, Any]:
        self.counts[name] = self.counts.get(name, 0) + 1
        return {"step": name, "ran": sum(self.counts.values())}

    async def verify(self, task: dict[str, Any], response: Response) -> Verdict:
        once = len(self.counts) == int(task["steps"]) and set(self.counts.values()) == {1}
        return Verdict(reward=1.0 if once else 0.0, fields={"counts": self.counts})

    async def snapshot(self) -> bytes | None:
        return json.dumps(self.counts).encode() if self.options.get("restorable") else None

    async def restore(self, data: bytes) -> None:
        if not self.options.get("restorable"):
            raise NotImplementedError("not restorable")
        self.counts = json.loads(data)


def _step_tool(i: int) -> Any:
    name = step_name(i)

    async def step(self: ManySteps) -> dict[str, Any]:
        return await self.step(name)

    step.__name__ = name
    return tool(step, name=name, description=f"step {i}")


# the class the workers serve: ManySteps with its STEPS tools
resource = type(
    "ManyStepsTools", (ManySteps,), {"__module__": __name__, **{step_name(i): _step_tool(i) for i in range(STEPS)}}
)
