"""A session's sandboxes at a branch point (issue 78, item 3): copied as a turn ends, and forked by its branches.

A rollout kept for branching (``RolloutTask.keep_checkpoints_s``) asks, with its turn's snapshot, for a copy of its
session's sandboxes as they are then (``ToolCall.keep_s``): each is forked once into a *parked* copy (``park``:
unused, unrenewed, never ended as idle; removed by its worker at its lease's end, the keep's time capped by the
pool's ``max_lease_s``, or when its batch is purged), under a lease of its own bound to the same rollout and caller
as the session's. The snapshot's later turns never touch it: it is the sandbox as it was at that turn, whatever the
parent does next. A branch at that turn forks its own sandboxes from the copy (``fork_kept``), never the parent's
live ones: each of its M continuations gets files of its own. The copies count against the pool's quota while kept
(a container each, each turn): a copy that finds no room is not kept, and a branch at that turn is refused by name.
"""

from __future__ import annotations

import time

import anyio

from gym_runtime.errors import Failure
from gym_runtime.messages import HeldSandboxes
from gym_runtime.observability import logs
from gym_runtime.sandboxes.client import Sandbox, Sandboxes

log = logs.get("gym.sandbox")


async def keep(lease: Sandboxes, keep_s: float) -> HeldSandboxes | None:
    """A parked copy of each sandbox ``lease`` holds, kept ``keep_s`` (their worker's ``max_lease_s`` at most), under
    one new lease bound as ``lease`` is; None where one could not be made (no room: the others made are closed)."""
    copies = Sandboxes(lease._bus, lease.pool, bound=lease.bound, deadline=time.time() + keep_s, where=lease.where)
    batch = lease.rollout.rsplit(":", 2)[0] if lease.rollout.count(":") >= 2 else ""
    try:
        for box in lease.held():
            await box.fork(1, into=[copies], park=True, batch=batch)
    except Failure as e:
        log.warning("sandbox.not_kept", pool=lease.pool, error=e.info.message)
        with anyio.CancelScope(shield=True):
            await copies.close_all()
        return None
    kept = HeldSandboxes(lease=copies.lease, sandboxes=copies.handles())
    copies.let_go()  # parked: their worker ends them at their deadline
    return kept


async def fork_kept(kept: HeldSandboxes, lease: Sandboxes) -> None:
    """A branch's session: a fork of each copy ``kept`` at its branch point into its own ``lease``, each handed to
    the first create that asks for its spec (as a restore's reattached ones are). A pool with no room for them is
    ``sandbox_unavailable`` at once (never waited on); a copy gone (its keep ended) is ``invalid_task``."""
    parked = Sandboxes(lease._bus, lease.pool, lease=kept.lease, where=lease.where)
    forked: list[Sandbox] = []
    for h in kept.sandboxes:
        if h.pool != lease.pool:
            continue  # not this environment's pool: nothing here can hold it
        try:
            forked += await Sandbox(parked, h.sandbox, h.address, h.spec).fork(1, into=[lease])
        except Failure as e:
            if e.info.error_class == "sandbox_unavailable":
                raise
            raise Failure(
                "invalid_task",
                f"branch: the copy of sandbox {h.sandbox[:12]} kept at the branch point cannot be forked "
                f"({e.info.message}): it is kept keep_checkpoints_s from its turn, at most its pool's max_lease_s",
            ) from None
    lease.adopt(forked)
