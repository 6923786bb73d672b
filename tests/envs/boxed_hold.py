"""A test-only sandboxed agent that holds its sandbox for the row's ``hold_s`` (tests/e2e/test_lease_wait.py):
one ``sleep`` in a sandbox of its own, reward 1 when it ran. No model call."""

from __future__ import annotations

import time

from gym_runtime.agent import AgentContext, Outcome
from gym_runtime.messages import Response, VerifyReply


async def run(ctx: AgentContext) -> Outcome:
    async with ctx.sandbox() as box:
        r = await box.exec(f"sleep {float(ctx.row.get('hold_s', 0))}", timeout_s=60)
    return Outcome(response=Response(id="held", created_at=time.time()), verdict=VerifyReply(reward=float(r.ok)))
