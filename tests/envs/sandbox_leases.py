"""A test agent that opens a sandbox and leaves it open, then ends its rollout the way its row says
(``"end"``: ``scored``, ``failed`` or ``timeout``): whichever way, the runtime must remove the sandbox."""

from __future__ import annotations

import anyio

from agents import simple
from gym_runtime.agent import AgentContext, Outcome
from gym_runtime.errors import Failure


async def run(ctx: AgentContext) -> Outcome:
    box = await ctx.sandbox()  # never closed here
    assert (await box.exec("echo up")).stdout == b"up\n"
    end = ctx.row.get("end")
    if end == "failed":
        raise Failure("tool_error", "the agent gave up")
    if end == "timeout":
        await anyio.sleep(3600)
    return await simple.run(ctx)
