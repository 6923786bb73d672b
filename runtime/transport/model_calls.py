"""Model calls as agents and resources make them: direct to a replica with a free slot, else queued.

A model worker serves three subjects with one set of slots (``gym_runtime.workers.model_worker``): its own
direct subject (``Subjects.model_replica``), the model's direct subject (a queue group; both core NATS,
answered only while a slot is free) and the model's work queue. Callers live above the transport (agents,
resources) and reach them through :func:`call_model`.

Cache-aware routing: a rollout's later turns go first to the replica that served its last turn (the caller
carries it: ``ModelResponse.worker``), which holds the rollout's prefix in its cache. That replica takes the
call only with a slot free at once; busy, gone, drained or paused it answers ``busy`` (or nobody does) and the
call goes on as any other: to whichever replica has a free slot, else the queue; the rollout's affinity moves
to the replica that answers. No shared state: the caller's own memory of its last turn is the choice.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

from gym_runtime.messages import ModelRequest, ModelResponse
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.rpc import Timings

PROGRESS_STREAM = 3  # the output stream (``Bus.send_output``) a generation's tokens so far reach its caller on
# how a call was routed (``ModelRequest.route``, counted per worker): to the replica of its rollout's last
# turn; elsewhere as that one had no free slot ("load"); elsewhere as that one was gone ("moved")
ROUTES = ("affine", "load", "moved")
CUT_MARGIN_S = 1.0  # a generation is cut this long before its rollout's deadline: its answer is back before it


def cut_at(remaining_s: float, timeout_s: float) -> float:
    """When the policy's generation in a rollout with ``remaining_s`` left (of ``timeout_s``) is stopped and
    answered with its tokens so far (``ModelRequest.cut_at``), in epoch seconds: the queue's expiry is epoch
    seconds too, read by a model worker on another node on its own clock."""
    return time.time() + max(0.0, remaining_s - min(CUT_MARGIN_S, timeout_s / 4))


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
    on_output: Callable[[int, bytes], None] | None = None,
    replica: str | None = None,
    route: str = "affine",
) -> ModelResponse:
    """One model call as agents and resources make it: direct to a replica with a free slot, else queued.

    ``timeout`` bounds the call once a replica has it; queued behind other calls it may wait up to
    ``wait_s`` (an agent passes its rollout's remaining time) for a replica to take it. ``on_output``: given
    what the worker sends before its answer (a generation's tokens so far: ``ModelRequest.progress_s``).
    ``replica``: a worker to try first (one round trip, never a wait): the one that served the rollout's last
    turn (``route`` ``affine``), or one a caller chose for load (``load``: ``transport.affinity``)."""
    if replica is not None:
        deadline = time.monotonic() + timeout
        why, answer = await bus.try_direct(
            bus.subjects.model_replica(model, replica),
            msgspec.structs.replace(request, route=route),
            timeout=timeout,
            op=f"generate {model}",
            liveness_s=liveness_s,
            on_output=on_output,
        )
        if why == "answered":
            return answer  # type: ignore[no-any-return]
        request = msgspec.structs.replace(request, route="moved" if why in ("absent", "lost") else "load")
        timeout = max(0.0, deadline - time.monotonic())
    return await bus.direct_or_queued(  # type: ignore[no-any-return]
        bus.subjects.model_direct(model),
        bus.subjects.model_queue(model),
        request,
        timeout=timeout,
        op=f"generate {model}",
        liveness_s=liveness_s,
        wait_s=wait_s,
        on_output=on_output,
    )
