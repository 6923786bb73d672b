"""Resume at the last turn, turn by turn: when a turn is checkpointed, the ids its tool calls run under, and how a
redelivered attempt takes up its checkpoint (its sandboxes, its session, its trajectory and ledger).

A turn with tool calls is checkpointed after its generation, before its calls run (``generated``); each call runs
under an id that is the same on every attempt of the turn, once that checkpoint is stored (``call_id``: a resume
replays the calls the model made, never samples new ones, and the session answers a repeated id once); the turn
is checkpointed again once its calls are answered (``answered``: the next attempt starts at the next turn). The
simple agent's loop shows the pattern (docs/operations.md#resume-at-the-last-turn).
"""

from __future__ import annotations

import hashlib

import msgspec

from gym_runtime.errors import Failure
from gym_runtime.messages import Checkpoint, FunctionCall, Response, Usage
from gym_runtime.rollout.ledger import TrajectoryState
from gym_runtime.rollout.session import SessionLink
from gym_runtime.rollout.state import Rollout


def generated(rollout: Rollout, traj: TrajectoryState, resp: Response) -> None:
    """A turn was generated: one with tool calls is checkpointed (when one is due) before they run."""
    calls = any(isinstance(o, FunctionCall) for o in resp.output)
    traj.checkpointed = traj.unsettled = calls and rollout.checkpoint(traj, "generated")


def answered(rollout: Rollout, traj: TrajectoryState) -> None:
    """The turn's calls are answered: checkpoint it (the next attempt starts at the next turn), where its
    generation was (so the snapshot kept with it is this turn's)."""
    if traj.checkpointed:
        rollout.checkpoint(traj, "answered")


async def call_id(rollout: Rollout, traj: TrajectoryState, index: int, call: FunctionCall) -> str:
    """The ``index``-th call of this turn's id, the same on every attempt of the turn, once the turn's checkpoint is
    stored ("" in a turn before the first checkpoint: nothing replays it)."""
    if not traj.checkpointed:
        return ""
    if traj.unsettled and rollout.checkpoints is not None:
        traj.unsettled = False
        await rollout.checkpoints.settled()  # a resume replays these calls, never samples new ones
    return tool_call_id(traj.steps, index, call)


def tool_call_id(turn: int, index: int, call: FunctionCall) -> str:
    """A tool call's id, the same on every attempt of its turn: the turn, its place in it, and a digest of the call
    (a turn sampled again from an older checkpoint, with other calls, is never answered with this one's reply)."""
    digest = hashlib.blake2b(f"{call.name}\0{call.arguments}".encode(), digest_size=6).hexdigest()
    return f"{turn}.{index}.{digest}"


async def take_up(rollout: Rollout, traj: TrajectoryState, link: SessionLink) -> Response | None:
    """Take up a redelivered attempt's checkpoint (``rollout.resumed``), if any: the agent's own sandboxes
    reattached (each handed to the create that asks for it again), its session reattached or restored (else the
    rollout starts over, in fresh sandboxes) and its trajectory, turn and ledger; a branch's (``rollout.branching``)
    is another rollout's checkpoint, its session restored in a fresh one (``_branch``). Returns the last generation when
    its tool calls are still to run (each answered once: ``call_id``), else None."""
    cp = rollout.resumed
    if cp is None:
        return None
    if rollout.branching:
        assert rollout.task.branch is not None
        await _branch(link, cp, rollout.task.branch.parent())
        how = "branched"
    else:
        took = await _resume(rollout, link, cp)
        if took is None:
            return None
        how = took
    rollout.resume_from(cp, how)
    if cp.offered_tools and traj.offered is not None:  # the generation's tools were the trajectory's own
        cp.response.tools = traj.offered
    traj.outputs = list(cp.response.output)
    traj.usage = cp.response.usage or Usage()
    traj.steps = cp.turn
    traj.last = msgspec.structs.replace(cp.response, status=cp.last_status)
    if cp.phase != "generated":
        return None
    traj.last_from, traj.checkpointed = cp.last_from, True  # its calls replayed under their ids
    return msgspec.structs.replace(traj.last, output=traj.outputs[cp.last_from :])


async def _branch(link: SessionLink, cp: Checkpoint, parent: str) -> None:
    """A branch's session: a fresh one of its own, restored from the snapshot at its branch point
    (``branch.branch_point`` made sure there is one), holding forks of the sandboxes kept there; one that cannot be
    restored fails the branch."""
    handle = next((h for h in cp.sessions if h.resource == link.resource), None)
    if handle is None:
        return
    reply = await link.restore(handle, branch_of=parent)
    if not reply.ok:
        raise Failure("invalid_task", f"branch: {link.resource} could not restore its snapshot: {reply.reason}")


async def _resume(rollout: Rollout, link: SessionLink, cp: Checkpoint) -> str | None:
    """How a redelivered attempt took up its own checkpoint (None: it restarted)."""
    handle = next((h for h in cp.sessions if h.resource == link.resource), None)
    if handle is not None and handle.held is not None and cp.phase == "generated":
        # its calls may have run in the session's containers after the snapshot: a restore takes up only
        # containers as the snapshot left them (an answered turn's), else it starts from fresh ones
        handle = msgspec.structs.replace(handle, held=None)
    if cp.sandboxes:
        rollout.sandboxes.take_up(cp.sandboxes, cp.sandbox_lease)
    boxes = await rollout.sandboxes.reattach()  # all of them, or none (one is gone: the rollout starts over)
    if not boxes:
        how = "restarted"
    elif handle is not None:
        how = await link.resume(handle)
    else:  # no session was open yet (its first call is its seed): only the agent's own sandboxes hold state
        how = "reattached" if cp.sandboxes and not cp.sessions else "restarted"
    if how == "restarted":
        if handle is not None and not boxes:  # its session holds state of a trajectory that starts over
            await link.abandon(handle)
        await rollout.sandboxes.drop_reattached()
        rollout.restarted()
        return None
    return how
