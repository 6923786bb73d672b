"""A test-only agent that, before its first model call, asks the server whether its attempt's start record is
stored (``row["nats_url"]``: the server): the only trace of an attempt whose worker is killed must be on disk
by then. An attempt that finds none fails (``internal``: no retry); else it runs the simple agent."""

from __future__ import annotations

import nats

from agents import simple
from gym_runtime.agent import AgentContext, Outcome
from gym_runtime.transport.subjects import Subjects


async def run(ctx: AgentContext) -> Outcome:
    nc = await nats.connect(ctx.row["nats_url"])
    try:
        stored = (await nc.jetstream().stream_info(Subjects("gym").attempts_stream)).state.messages
    finally:
        await nc.close()
    if not stored:
        raise RuntimeError("the attempt's start record was not stored before its first model call")
    return await simple.run(ctx)
