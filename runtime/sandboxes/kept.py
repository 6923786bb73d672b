"""A rollout's sandboxes at a branch point (issue 78, item 3): copied as a turn ends, and forked by its branches.

A rollout kept for branching (``RolloutTask.keep_checkpoints_s``) keeps a copy of its sandboxes as each turn ends:
its session's, asked with the turn's snapshot (``ToolCall.keep_s``), and the agent's own (``ctx.sandbox``), kept
with the turn's checkpoint (``Checkpoint.kept``). Each is forked once into a *parked* copy (``park``:
unused, unrenewed, never ended as idle; removed by its worker at its lease's end, the keep's time capped by the
pool's ``max_lease_s``, or when its batch is purged), under a lease of its own bound to the same rollout and caller
as the session's. The turn's later writes never touch it: it is the sandbox as it was at that turn, whatever the
parent does next. A branch at that turn forks its own sandboxes from the copy (``Sandboxes.fork_kept``), never the
parent's live ones: each of its M continuations gets files of its own. The copies count against the pool's quota
while kept (a container each, each turn): a copy that finds no room is not kept, and a branch at that turn is
refused by name.
"""

from __future__ import annotations

import time

import anyio

from gym_runtime.errors import Failure
from gym_runtime.messages import HeldSandboxes
from gym_runtime.observability import logs
from gym_runtime.sandboxes.client import Sandboxes

log = logs.get("gym.sandbox")
TRIES = 2  # a copy whose fork failed (not for want of room) is asked once more


async def keep(lease: Sandboxes, keep_s: float) -> HeldSandboxes | None:
    """A parked copy of each sandbox ``lease`` holds, kept ``keep_s`` (their worker's ``max_lease_s`` at most), under
    one new lease bound as ``lease`` is; None where one could not be made (no room, or its fork failed twice: the
    others made are closed)."""
    copies = Sandboxes(lease._bus, lease.pool, bound=lease.bound, deadline=time.time() + keep_s, where=lease.where)
    batch = lease.rollout.rsplit(":", 2)[0] if lease.rollout.count(":") >= 2 else ""
    try:
        for box in lease.held():
            for tries in range(1, TRIES + 1):
                try:
                    await box.fork(1, into=[copies], park=True, batch=batch)
                    break
                except Failure as e:  # an engine's hiccup (a copy read under load) is asked again; no room is not
                    if e.info.error_class == "sandbox_unavailable" or tries == TRIES:
                        raise
    except Failure as e:
        log.warning("sandbox.not_kept", pool=lease.pool, error=e.info.message)
        with anyio.CancelScope(shield=True):
            await copies.close_all()
        return None
    kept = HeldSandboxes(lease=copies.lease, sandboxes=copies.handles())
    copies.let_go()  # parked: their worker ends them at their deadline
    return kept
