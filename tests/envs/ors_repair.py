"""A small multi-step ORS environment written in the openreward SDK's own style, for
tests/e2e/test_openreward.py: every tool output carries its own reward.

A machine has one broken part (the task's). ``inspect`` looks at a part (0.05, once per part),
``fix`` repairs one (the task's ``weight`` when it is the broken part, else -0.1), ``submit`` ends the
episode (1.0 when the machine works, else 0.0). ``slow`` (a task flag) makes ``inspect`` hang.
"""

import asyncio
import sys

from openreward.environments import Environment, JSONObject, Server, TextBlock, ToolOutput, tool
from pydantic import BaseModel


class RepairTaskSpec(BaseModel):
    id: str
    broken: str
    weight: float
    slow: bool = False


class PartParams(BaseModel):
    part: str


TASKS = [
    {"id": "r0", "broken": "example", "weight": 0.25},
    {"id": "r1", "broken": "valve", "weight": 0.5},
    {"id": "r2", "broken": "example", "weight": 0.75},
]


class Repair(Environment):
    """Find the broken part, fix it, submit."""

    def __init__(self, task_spec: JSONObject = {}, secrets: dict[str, str] = {}):  # noqa: B006 - the SDK template
        super().__init__(task_spec)
        self.config = RepairTaskSpec.model_validate(task_spec)
        self.inspected: set[str] = set()
        self.fixed = False

    @classmethod
    def list_tasks(cls, split: str) -> list[JSONObject]:
        return TASKS

    @classmethod
    def list_splits(cls) -> list[str]:
        return ["train"]

    def get_prompt(self) -> list[TextBlock]:
        return [TextBlock(text="The machine is broken. Inspect parts, fix the broken one, then submit.")]

    @tool
    async def inspect(self, params: PartParams) -> ToolOutput:
        """Look at a part."""
        if self.config.slow:
            await asyncio.sleep(3600)
        first = params.part not in self.inspected
        self.inspected.add(params.part)
        state = "broken" if params.part == self.config.broken and not self.fixed else "fine"
        return ToolOutput(blocks=[TextBlock(text=f"{params.part}: {state}")], reward=0.05 if first else 0.0)

    @tool
    def fix(self, params: PartParams) -> ToolOutput:
        """Repair a part."""
        if params.part == self.config.broken:
            self.fixed = True
            return ToolOutput(blocks=[TextBlock(text=f"fixed {params.part}")], reward=self.config.weight)
        return ToolOutput(blocks=[TextBlock(text=f"{params.part} was not broken")], reward=-0.1)

    @tool
    async def submit(self) -> ToolOutput:
        """Hand the machine back. This finishes the episode."""
        return ToolOutput(
            blocks=[TextBlock(text="works" if self.fixed else "still broken")],
            reward=1.0 if self.fixed else 0.0,
            finished=True,
        )


if __name__ == "__main__":
    Server([Repair]).run(host="127.0.0.1", port=int(sys.argv[1]))
