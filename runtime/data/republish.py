"""Publishing again the tasks whose stored results the broker lost, so that a batch ends with every row.

An acknowledged task leaves the work queue, so its result in the results stream is its only copy: a result
that is purged, evicted from a full stream, or lost with a damaged replica (docs/operations.md, "What survives
what") would leave its slot empty for good. So ``publish`` keeps each task's body while its batch lives (the
first repeat's task, which is the whole task of a group; for a body over the max payload, its blob's key), in
the stream of kept tasks (``Subjects.kept``, one message per task) until the batch is purged. A
reader that finds slots without a row once the server holds nothing more for it (``BatchReader``) publishes
their tasks again, at most ``max_republish`` times (the batch's manifest), each round under task ids of its
own (``task_msg_id``'s ``again``). The rows they bring follow the rule for later attempts: the slot held no
row, so the first one stored takes it (a group task runs all its repeats again: the rows of slots that hold
one already are duplicates). A slot that cannot be published again, or is still empty after the last round,
becomes a ``lost`` failure row that says why.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec

from gym_runtime.data.batches import Manifest
from gym_runtime.errors import Failure
from gym_runtime.messages import RolloutTask
from gym_runtime.observability import logs
from gym_runtime.transport import jetstream
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.discovery import serving

log = logs.get("gym.republish")

IN_FLIGHT = 256  # tasks read and published again at once

NOT_KEPT = (
    "its task's body is not kept (the batch was published with jetstream.max_republish 0 or by an older "
    "version, or the body left the full or expired stream of kept tasks), so it cannot be published again"
)


async def kept_task(bus: Bus, batch: str, task: int) -> RolloutTask | None:
    """The body ``publish`` kept for ``task`` of ``batch``; None when none is kept."""
    names = bus.subjects
    msg = await bus.last_stored(names.kept_stream, names.kept(batch, task))  # a last-by-subject direct get
    if msg is None:
        return None
    body = await bus.decode(msg)
    if not isinstance(body, RolloutTask) or body.batch != batch or body.task_index != task:
        raise Failure("integrity", "the kept body is not this task's")
    return body


async def republish(
    bus: Bus, manifest: Manifest, slots: list[int], again: int, owner: Callable[[int], str]
) -> dict[int, str]:
    """Publish again, as round ``again``, the tasks of ``slots``; returns each slot it could not, with why.

    A task goes again only to an agent that a live worker serves now: with none, the reader would wait for one
    (as ``collect`` waits for a batch's first run), so its slots are lost at once instead, and a later
    ``collect``, with workers up, publishes them again."""
    repeats = max(1, manifest.repeats)
    rollouts: dict[int, list[int]] = {}
    for slot in slots:
        task, rollout = divmod(slot, repeats)
        rollouts.setdefault(task, []).append(rollout)
    live = await serving(bus, "agent", {owner(task) for task in rollouts})
    why: dict[int, str] = {}

    async def one(task: int) -> None:
        agent = owner(task)
        if agent not in live:
            reason = f"no worker serves agent {agent!r} to run it again (collect it again once one runs)"
        else:
            try:
                reason = await _publish_again(bus, manifest.batch, task, agent, rollouts[task], again)
            except Exception as e:  # a body that cannot be read, a full task stream: said in its slots' rows
                reason = f"it could not be published again: {e}"
        if reason:
            why.update({task * repeats + r: reason for r in rollouts[task]})

    tasks = list(rollouts)
    for i in range(0, len(tasks), IN_FLIGHT):
        await asyncio.gather(*(one(task) for task in tasks[i : i + IN_FLIGHT]))
    log.warning(
        "batch.republished", batch=manifest.batch, round=again, tasks=len(tasks), not_published=len(why) or None
    )
    return why


async def _publish_again(bus: Bus, batch: str, task: int, agent: str, rollouts: list[int], again: int) -> str:
    """Publish ``task``'s empty ``rollouts`` again from its kept body; '' when done, else why not."""
    body = await kept_task(bus, batch, task)
    if body is None:
        return NOT_KEPT
    subject = bus.subjects.task(agent, batch)
    if body.group:  # the repeats of a group run together
        await bus.js_publish(subject, body, msg_id=jetstream.task_msg_id(batch, task, 0, body.group, again))
        return ""
    for r in rollouts:
        each = msgspec.structs.replace(body, rollout_index=r)
        await bus.js_publish(subject, each, msg_id=jetstream.task_msg_id(batch, task, r, 0, again))
    return ""
