"""A test-only agent that raises on rows marked ``"crash": true`` (a bug of the agent's own: an ``internal``
failure, which a new attempt would repeat). Every other row runs the simple agent."""

from __future__ import annotations

from agents import simple
from gym_runtime.agent import AgentContext, Outcome


async def run(ctx: AgentContext) -> Outcome:
    if ctx.row.get("crash"):
        raise RuntimeError("this agent always crashes on crashing rows")
    return await simple.run(ctx)
