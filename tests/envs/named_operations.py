"""An environment with operations of its own under any name (``call_operation``), ``gym.resume.*`` included, and a
tool: it answers each operation with its name, so a test sees which code answered (test_resume_messages.py)."""

from __future__ import annotations

from typing import Any

from gym_runtime.messages import Response
from gym_runtime.resource import Resource, tool


class NamedOperations(Resource):
    row_tools = "any"

    @tool
    async def echo(self, text: str) -> str:
        return text

    async def call_operation(self, op: str, arguments: str | bytes) -> str:
        return f"the environment's {op}"

    async def verify(self, task: dict[str, Any], response: Response) -> float:
        return 1.0
