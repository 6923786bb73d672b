"""A native environment whose ``verify`` can hold the GIL for minutes, for tests/e2e/test_isolation.py.

Weather's tool and reward, except that a row with ``hog_kb`` has its verify run NeMo Gym's kind of
grader regex (imo_proofbench_judge's, quadratic on repeated ``\\(``) on an answer of that many KB, as a
model's long answer would make it: Python's ``re`` never releases the GIL while it searches.
"""

from __future__ import annotations

import re
from typing import Any

from gym_runtime.messages import Response
from gym_runtime.resource import Resource, tool

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

    async def verify(self, task: dict[str, Any], response: Response) -> float:
        if task.get("hog_kb"):
            hog(int(task["hog_kb"]))
        return 1.0
