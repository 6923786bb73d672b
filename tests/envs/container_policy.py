"""A scripted policy for NeMo Gym's container servers hosted on the fleet (tests/e2e/test_hosted_sandbox_servers.py):
a test double for an LLM-driven sandboxed agent.

It opens the rollout's session on the hosted server (whose ``seed_session`` creates the task's sandbox through
``sandbox_provider: gym_runtime``), runs its commands in that sandbox with the runtime's ``sandbox.exec``
operation (as NeMo Gym's sandboxed agents reach the server's sandbox by its handle), then asks the server to
verify. Its commands come from the agent entry's ``options.commands``, keyed by the row's ``instance_id`` or
``task_name``: a row with none gets no command (the policy that does not solve). A row named in ``options.flaky``
(key: a marker file's path) fails its first attempt after running its commands (a retryable error, the marker
written), as a rollout whose agent failed midway: its next attempt runs with a fresh session.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from gym_runtime.agent import AgentContext, Outcome
from gym_runtime.errors import Failure
from gym_runtime.messages import Response


async def run(ctx: AgentContext) -> Outcome:
    key = str(ctx.row.get("instance_id") or ctx.row.get("task_name") or "")
    commands: list[str] = ctx.config.options.get("commands", {}).get(key, [])
    ran: list[dict[str, Any]] = []
    async with await ctx.open_session() as session:
        for command in ["pwd", "ls", *commands]:  # the first operation seeds the session: its sandbox is made then
            reply = await session.operate("sandbox.exec", json.dumps({"command": command, "timeout_s": 120}))
            ran.append(json.loads(reply.output))
        marker = ctx.config.options.get("flaky", {}).get(key)
        if marker and not Path(marker).exists():
            Path(marker).write_text(json.dumps(ran))
            raise Failure("tool_error", "scripted: this attempt fails after its commands ran", retryable=True)
        response = Response(id=f"policy-{key}", created_at=time.time())
        verdict = await session.verify(ctx.row, response)
    return Outcome(response=response, verdict=verdict, fields={"policy_exec": ran})
