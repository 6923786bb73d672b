"""A hostile policy for a Harbor task (tests/e2e/test_harbor_trust.py): its first ``bash`` call leaves a process
behind (the row's ``attack``), its second shows that process still alive after its turn (``ALIVE``: the
heartbeat file it writes moved on), then the session is verified as any rollout is. No model is called."""

from __future__ import annotations

import json
import time

from gym_runtime.agent import AgentContext, Outcome
from gym_runtime.messages import FunctionCall, FunctionCallOutput, Response

HEARTBEAT = "/tmp/.beat"
# the heartbeat written (waited for: the process may start late on a loaded machine), then seen to move on
ALIVE = (
    f"for i in $(seq 300); do [ -s {HEARTBEAT} ] && break; sleep 0.1; done; a=$(cat {HEARTBEAT}); "
    f'for i in $(seq 300); do sleep 0.1; b=$(cat {HEARTBEAT}); [ -n "$a" ] && [ "$a" != "$b" ] && echo ALIVE && break;'
    " done"
)


async def run(ctx: AgentContext) -> Outcome:
    output: list[FunctionCall | FunctionCallOutput] = []
    async with await ctx.open_session() as session:
        for n, command in enumerate((ctx.row["attack"], ALIVE)):
            args = json.dumps({"command": command})
            reply = await session.call("bash", args, timeout=120)
            output += [
                FunctionCall(call_id=f"c{n}", name="bash", arguments=args, id=f"c{n}"),
                FunctionCallOutput(call_id=f"c{n}", output=reply.output),
            ]
        response = Response(id="attack", created_at=time.time(), output=output)
        verdict = await session.verify(ctx.row, response)
    return Outcome(response=response, verdict=verdict)
