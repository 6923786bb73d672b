"""A test environment graded in a sandbox of the fleet, and an agent that uses one too (tests/e2e/test_sandboxes.py).

``Sandboxed`` offers the weather tool; ``verify`` writes the response into a sandbox and runs a grading
script there (reward 1.0 when the response has output). ``run`` (the agent) execs a command in a sandbox
of its own, then plays ``agents.simple``. Neither touches Docker or NATS.
"""

from __future__ import annotations

from typing import Any

import msgspec

from agents import simple
from gym_runtime.agent import AgentContext, Outcome
from gym_runtime.messages import Response
from gym_runtime.resource import Resource, tool

GRADER = "import json\nr = json.load(open('response.json'))\nprint(1.0 if r.get('output') else 0.0)\n"


class Sandboxed(Resource):
    @tool
    async def get_weather(self, city: str) -> dict[str, str]:
        return {"city": city, "weather_description": "cold"}

    async def verify(self, task: dict[str, Any], response: Response) -> float:
        async with self.sandbox(memory_mb=128) as box:
            await box.write("response.json", msgspec.json.encode(response))
            await box.write("grade.py", GRADER)
            r = await box.exec(["python3", "grade.py"], timeout_s=30)
            if r.exit_code != 0:
                raise RuntimeError(f"grader failed: {r.stderr.decode(errors='replace')}")
            return float(r.stdout)


async def run(ctx: AgentContext) -> Outcome:
    async with ctx.sandbox(cpu=0.5) as box:
        r = await box.exec("sleep 0.2; echo ready", timeout_s=30)
        assert r.stdout == b"ready\n", r
    return await simple.run(ctx)
