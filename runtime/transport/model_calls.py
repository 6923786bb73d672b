"""Model calls as agents and resources make them: direct to a replica with a free slot, else queued.

A model worker serves two subjects with one set of slots (``gym_runtime.workers.model_worker``): the
direct subject (core NATS, answered only while a slot is free) and the model's work queue. Callers
live above the transport (agents, resources) and reach both through :func:`call_model`.
"""

from __future__ import annotations

from gym_runtime.messages import ModelRequest, ModelResponse
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.rpc import Timings


def direct_patience(ack_wait_s: float, timings: Timings) -> float:
    """How long a direct call waits on a silent replica before going to the queue: the model's
    ``ack_wait_s`` (the queue's own patience), at least two keepalives, at most the liveness."""
    return min(timings.liveness_s, max(ack_wait_s, 2 * timings.keepalive_s))


async def call_model(
    bus: Bus,
    model: str,
    request: ModelRequest,
    *,
    timeout: float,
    liveness_s: float | None = None,
    wait_s: float | None = None,
) -> ModelResponse:
    """One model call as agents and resources make it: direct to a replica with a free slot, else queued.

    ``timeout`` bounds the call once a replica has it; queued behind other calls it may wait up to
    ``wait_s`` (an agent passes its rollout's remaining time) for a replica to take it."""
    return await bus.direct_or_queued(  # type: ignore[no-any-return]
        bus.subjects.model_direct(model),
        bus.subjects.model_queue(model),
        request,
        timeout=timeout,
        op=f"generate {model}",
        liveness_s=liveness_s,
        wait_s=wait_s,
    )
