"""A native environment whose ``verify`` can hold the GIL for minutes, for tests/e2e/test_isolation.py.

Weather's tool and reward, except that a row with ``hog_kb`` has its verify run NeMo Gym's kind of
grader regex (imo_proofbench_judge's, quadratic on repeated ``\\(``) on an answer of that many KB, as a
model's long answer would make it: Python's ``re`` never releases the GIL while it searches. For
tests/test_guest.py, rows and a tool that fail in each way environment code can (``seed_raises``, ``broken``,
``verify_raises``) and a verify that asks a model (``judge``: an LLM judge's call, made over the worker's bus).
"""

from __future__ import annotations

import re
from typing import Any

from gym_runtime.errors import Failure
from gym_runtime.messages import Response, create_params, output_text
from gym_runtime.resource import Resource, Verdict, tool

# a \( ... \) span, lazily: on "\(" repeated it tries every start and scans to the end from each
SPAN = re.compile(r"\\\((.*?)\\\)", re.S)


def hog(kb: int) -> None:
    SPAN.search("\\(" * (kb * 512))


class GilHog(Resource):
    tool_arguments = "nemo_gym"

    @tool
    async def get_weather(self, city: str) -> dict[str, str]:
        """Get the current weather in a city."""
        return {"city": city, "weather_description": f"The weather in {city} is cold."}

    @tool
    async def broken(self, n: int) -> str:
        """A tool that fails."""
        raise ValueError(f"broken {n}")

    async def seed(self, task: dict[str, Any]) -> None:
        if task.get("seed_raises"):
            raise RuntimeError("no such task")

    async def verify(self, task: dict[str, Any], response: Response) -> float | Verdict:
        if task.get("hog_kb"):
            hog(int(task["hog_kb"]))
        if task.get("verify_raises") == "invalid":
            raise Failure("invalid_task", "this row cannot be graded")
        if task.get("verify_raises"):
            raise KeyError("expected_answer")
        if task.get("judge"):
            said = await self.models.generate(create_params({"input": "grade: 42"}), model=task["judge"])
            return Verdict(reward=1.0, fields={"judge_said": output_text(said.output)})
        return 1.0
