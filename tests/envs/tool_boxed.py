"""A test environment whose tool runs in a sandbox of the fleet, and an agent that calls it once
(tests/e2e/test_lease_wait_cost.py): ``hold`` opens a sandbox, sleeps ``seconds`` in it and closes it; against a
pool of ``max_live: 1`` a second rollout's tool waits for the first's lease. No model call."""

from __future__ import annotations

import json
import time
from typing import Any

from gym_runtime.agent import AgentContext, Outcome
from gym_runtime.messages import Response
from gym_runtime.resource import Resource, tool


class ToolBoxed(Resource):
    @tool
    async def hold(self, seconds: float) -> dict[str, Any]:
        async with self.sandbox() as box:
            r = await box.exec(f"sleep {float(seconds)}", timeout_s=60)
        return {"ok": r.ok}

    async def verify(self, task: dict[str, Any], response: Response) -> float:
        return 1.0


async def run(ctx: AgentContext) -> Outcome:
    async with await ctx.open_session() as session:
        reply = await session.call("hold", json.dumps({"seconds": float(ctx.row.get("hold_s", 0))}))
        response = Response(id="held", created_at=time.time())
        verdict = await session.verify(ctx.row, response)
    return Outcome(response=response, verdict=verdict, fields={"tool_output": reply.output})
