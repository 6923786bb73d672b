"""Harbor's oracle agent: the task's ``solution/solve.sh`` as the policy (the parity check: it must score the
task's full reward). No model is called: the session's ``harbor.oracle`` operation (``resources.harbor``) copies
the solution into the task's container and runs it there, then the session is verified as any rollout is.
"""

from __future__ import annotations

import json
import time

from gym_runtime.agent import AgentContext, Outcome
from gym_runtime.messages import FunctionCall, FunctionCallOutput, Response

ORACLE = "harbor.oracle"  # the operation resources.harbor serves


async def run(ctx: AgentContext) -> Outcome:
    async with await ctx.open_session() as session:
        reply = await session.operate(ORACLE, "{}", timeout=max(ctx.remaining(), 1.0))
        call = FunctionCall(call_id="oracle", name="solve.sh", arguments=json.dumps({}), id="oracle")
        response = Response(
            id="oracle",
            created_at=time.time(),
            output=[call, FunctionCallOutput(call_id="oracle", output=reply.output)],
        )
        verdict = await session.verify(ctx.row, response)
    return Outcome(response=response, verdict=verdict)
