"""An agent for the one-ledger test (tests/unit/test_one_ledger.py): the simple agent's loop for ``options.turns``
model turns, then a failure of its own, so its row keeps the trajectory so far; ``run_group`` runs each repeat in
its own ``ctx.repeat(i)`` on its own session, then fails the same way."""

from __future__ import annotations

from typing import Any

from gym_runtime.agent import AgentContext, Outcome, Trajectory
from gym_runtime.errors import Failure
from gym_runtime.messages import FunctionCall, create_params


async def _turns(ctx: AgentContext, row: dict[str, Any] | None) -> None:
    trajectory = Trajectory(create_params((row or ctx.row)["responses_create_params"]))
    async with await ctx.open_session(row=row) as session:
        for _ in range(int(ctx.config.options.get("turns", 2))):
            resp = await trajectory.generate(ctx)
            calls = [o for o in resp.output if isinstance(o, FunctionCall)]
            for i, call in enumerate(calls):
                await trajectory.call(ctx, session, call, i, last=i == len(calls) - 1)
            trajectory.answered(ctx)


async def run(ctx: AgentContext) -> Outcome:
    await _turns(ctx, None)
    raise Failure("tool_error", "the ledger agent stops here")


async def run_group(ctx: AgentContext, size: int) -> list[Outcome]:
    for i in range(size):
        with ctx.repeat(i):
            await _turns(ctx, {**ctx.row, "_ng_rollout_index": ctx.task.rollout_index + i})
    raise Failure("tool_error", "the ledger agent stops here")
