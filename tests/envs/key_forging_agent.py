"""A test-only agent whose extras name the runtime's row keys on rows marked ``"forge_agent"`` (issue 52,
item 4); every row runs the simple agent, and the others' extras only echo the row's own values."""

from __future__ import annotations

from agents import simple
from gym_runtime.agent import AgentContext, Outcome


async def run(ctx: AgentContext) -> Outcome:
    out = await simple.run(ctx)
    if ctx.row.get("forge_agent"):
        out.fields = {"reward": 1e6, "_ng_task_index": 0}
    else:
        out.fields = {"responses_create_params": ctx.row.get("responses_create_params"), "agent_note": "echo"}
    return out
