"""A test-only agent whose process dies on rows marked ``"poison": true`` (``os._exit``, no cleanup).

Every other row runs the simple agent. The fault tests use it for a task that kills every worker that
takes it: it must still end as one failure row (``worker_lost``), and the rest of the batch completes.
"""

from __future__ import annotations

import os

from agents import simple
from gym_runtime.agent import AgentContext, Outcome


async def run(ctx: AgentContext) -> Outcome:
    if ctx.row.get("poison"):
        os._exit(3)  # like a segfault or the OOM killer: the worker vanishes holding the task
    return await simple.run(ctx)
