"""Branch a rollout at turn k (``Client.branch``): a task that names another rollout and a turn of it
(``RolloutTask.branch``) goes on from that rollout's checkpoint at the turn, as a resumed attempt would, but in a
session of its own: restored from the snapshot kept there, never the parent's (which may still run, or be closed).

A rollout is kept for branching only when its caller asked (``RolloutTask.keep_checkpoints_s``): its checkpoint is
then written every turn, a part a turn, each part kept that long from its write (the bucket's per-message TTL,
capped by ``jetstream.checkpoint_ttl_s``), and not deleted with its row. The branch point is read under the
branch's own agent pool's keys (``Subjects.checkpoint_key``), the one prefix its credential may read: a rollout is
branched by its own pool only, and an id naming another pool's rollout finds nothing (issue 73's rule: an id is a
name, never a key). A branch point that cannot be taken up is one ``invalid_task`` failure naming why.

A session's sandboxes are kept per turn too: a copy of each, made as the turn's snapshot is taken
(``sandboxes.kept``); a branch forks its own from that copy, so it sees the files as they were at its turn, not
the parent's later writes, and never a sibling's; the agent's own (``ctx.sandbox`` in the agent) likewise, kept with
the turn's checkpoint (``Checkpoint.kept``).
"""

from __future__ import annotations

from gym_runtime.errors import Failure
from gym_runtime.messages import BranchPoint, Checkpoint, RolloutTask
from gym_runtime.rollout.checkpoint import Checkpointer
from gym_runtime.transport.bus import Bus


def parse_point(parent: str, turn: int) -> BranchPoint:
    """``parent`` (``"batch:task_index:rollout_index"``, a row's ``branch_of``) and ``turn`` as a branch point; a
    ``ValueError`` naming the value and its spelling (the client's and ``publish``'s one check)."""
    batch, _, rest = parent.rpartition(":")
    batch, _, task = batch.rpartition(":")
    if not (batch and task.isdigit() and rest.isdigit()):
        raise ValueError(f"parent {parent!r} is not a rollout key: write it 'batch:task_index:rollout_index'")
    if isinstance(turn, bool) or not isinstance(turn, int) or turn < 1:
        raise ValueError(f"turn must be a model turn >= 1, got {turn!r}")
    return BranchPoint(batch=batch, task_index=int(task), rollout_index=int(rest), turn=turn)


def kept_s(value: float | None, cap_s: float) -> float:
    """``keep_checkpoints_s`` checked (0.0: not kept): > 0, and within the bucket's own age limit ``cap_s``
    (``jetstream.checkpoint_ttl_s``, 0: none); a ``ValueError`` naming both."""
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0 or (cap_s and value > cap_s):
        raise ValueError(
            f"keep_checkpoints_s must be > 0 and at most jetstream.checkpoint_ttl_s={cap_s:g} (the bucket's own age "
            f"limit), got {value!r}"
        )
    return float(value)


async def branch_point(bus: Bus, task: RolloutTask) -> Checkpoint:
    """The checkpoint ``task`` branches from (``task.branch``: its parent and turn), read under ``task``'s own
    agent's keys; a ``Failure("invalid_task")`` saying why there is none to take up."""
    point = task.branch
    assert point is not None
    key = bus.subjects.checkpoint_key(task.agent, point.batch, point.task_index, point.rollout_index)
    cp = await Checkpointer(bus, key, "off").at_turn(point.turn)
    where = f"rollout {point.parent()} at turn {point.turn}"
    if cp is None:
        raise Failure(
            "invalid_task",
            f"branch: no checkpoint of {where} is kept for agent {task.agent}: submit the rollout with "
            "keep_checkpoints_s (its parts live that long from each write), branch a turn that made tool calls, "
            "and branch it from its own agent pool",
        )
    if cp.sandboxes and cp.kept is None:
        raise Failure(
            "invalid_task",
            f"branch: {where}: no copy of the agent's own sandboxes (ctx.sandbox) was kept at that turn (its pool had "
            "no room for one: the copies kept count against its max_live and capacity)",
        )
    if unkept := [h.resource for h in cp.sessions if h.held is not None and h.kept is None]:
        raise Failure(
            "invalid_task",
            f"branch: {where}: no copy of the sandboxes of the session of {', '.join(unkept)} was kept at that turn "
            "(its pool had no room for one: the copies kept count against its max_live and capacity)",
        )
    if bare := [h.resource for h in cp.sessions if h.snapshot is None]:
        raise Failure(
            "invalid_task",
            f"branch: {where}: the session of {', '.join(bare)} kept no snapshot (its environment defines no "
            "snapshot/restore): it cannot be branched",
        )
    return cp
