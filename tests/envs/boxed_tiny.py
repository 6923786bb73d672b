"""A tiny sandboxed agent (tests/e2e/test_sandbox_quota.py): one ``true`` in a sandbox of its own, reward 1
when it ran. No model call: the batch measures the fleet's admission, not a policy."""

from __future__ import annotations

import time

from gym_runtime.agent import AgentContext, Outcome
from gym_runtime.messages import Response, VerifyReply


async def run(ctx: AgentContext) -> Outcome:
    async with ctx.sandbox() as box:
        r = await box.exec("true", timeout_s=30)
    return Outcome(response=Response(id="boxed", created_at=time.time()), verdict=VerifyReply(reward=float(r.ok)))
