"""A tiny sandboxed agent (tests/e2e/test_sandbox_quota.py): one ``true`` in a sandbox of its own, reward 1
when it ran. No model call: the batch measures the fleet's admission, not a policy."""

from __future__ import annotations

import time

from gym_runtime.agent import AgentContext, Outcome
from gym_runtime.messages import Response, VerifyReply


async def run(ctx: AgentContext) -> Outcome:
    t0 = time.monotonic()
    async with ctx.sandbox() as box:
        t1 = time.monotonic()
        r = await box.exec("true", timeout_s=30)
        t2 = time.monotonic()
    t3 = time.monotonic()
    took = {"acquire_s": round(t1 - t0, 3), "exec_s": round(t2 - t1, 3), "close_s": round(t3 - t2, 3)}
    return Outcome(
        response=Response(id="boxed", created_at=time.time()), verdict=VerifyReply(reward=float(r.ok)), fields=took
    )
