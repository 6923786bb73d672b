"""Reading one batch's stored results, and knowing from the server when no more will come.

Every agent's results are in a stream of its own (``{NS}_RESULTS_{agent}``: a pool that fills it is refused
there and never evicts another's). A reader has a consumer of its own on the stream of each agent of the
batch, filtered to the batch (``{ns}.result.{agent}.{batch}``) and read from the start in stream order.
It acks what it has handled (ack-all: one ack covers every message before it), so the consumer's counts
say whether anything stored is still on its way to it: nothing undelivered (``num_pending``), nothing
delivered and unhandled (``num_ack_pending``). Neither counts a message that was purged or evicted, so a
stream emptied or flooded under a reader never makes it wait for what is gone.

**Lost slots.** A task leaves the work queue when it is acked (its result is stored first) or terminated
(``+TERM`` by a buggy or hostile worker, or past max deliveries). Once the batch is wholly published, the
server counts none of its tasks on ``{ns}.task.*.{batch}`` (queued or held), and the reader holds nothing
pending, a slot still without a row will never get one. When its agent's results stream is full, it gets a
``storage_full`` failure row at once (its pool's results are refused until that agent's batches are purged).
Otherwise its task is published again from the body the batch
keeps (``data.republish``), at most ``max_republish`` rounds (the manifest's, or the reader's own); a slot that
cannot be, or is still empty after the last round, gets a ``lost`` failure row saying why, and a record of it
is stored on ``{ns}.result._lost.{batch}`` (a stream of its own) under an id of its own (``lost_msg_id``).
Readers never take such records as rows, so no credential can end another reader's batch early with them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from functools import partial
from typing import Any

import anyio

from gym_runtime.data.batches import Manifest, TaskOwners, get_manifest
from gym_runtime.data.intake import Intake, read_result
from gym_runtime.data.republish import NOT_KEPT, republish
from gym_runtime.messages import ErrorClass, ErrorInfo, RolloutResult
from gym_runtime.observability import logs
from gym_runtime.transport import jetstream
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.delivery import Delivery
from gym_runtime.transport.interface import StreamReader
from gym_runtime.transport.subjects import LOST as LOST_AGENT
from gym_runtime.transport.subjects import advisory

log = logs.get("gym.reader")

STORAGE_FULL = (
    "no result of this slot is stored: its agent's results stream {stream} is full and refuses its pool's results: "
    "raise jetstream.results_max_bytes (per agent), or collect and purge that agent's finished batches"
)

TICK_S = 5.0  # how often a reader acks what it handled and, with empty slots, asks whether they will ever fill
ACK_EVERY = 256  # ... and it acks every this many messages (one ack covers all before it)
RECORD_IN_FLIGHT = 256  # lost records stored at once

LOST = (
    "no result of this slot is stored and none of the batch's tasks is queued or running any more: its task "
    "was terminated (+TERM by a worker, or past max deliveries), or its stored result was removed (purged, "
    "evicted from a full stream, or lost with a damaged replica)"
)


class _Lane:
    """One results stream a reader reads (one agent's): its reader and what it handled."""

    __slots__ = ("agent", "stream", "reader", "handled", "unacked")

    def __init__(self, agent: str, stream: str) -> None:
        self.agent, self.stream = agent, stream
        self.reader: StreamReader | None = None
        self.handled = 0
        self.unacked: Delivery | None = None  # handled, not acked yet (every message before it is acked)


def budget_slots(
    batch: str,
    slots: list[int],
    repeats: int,
    owner: Callable[[int], str],
    message: str,
    input_row: dict[str, Any] | None = None,
) -> list[tuple[int, RolloutResult]]:
    """``budget`` failure results of slots whose tasks a budget held back (attempt 0; never stored)."""
    error = ErrorInfo(error_class="budget", message=message)
    out = []
    for slot in slots:
        task, rollout = divmod(slot, repeats)
        res = RolloutResult(
            batch=batch,
            task_index=task,
            rollout_index=rollout,
            agent=owner(task),
            error=error,
            input_row=input_row,
            attempts=0,
        )
        out.append((slot, res))
    return out


class BatchReader:
    """Reads a batch's stored results, from the results stream of each of its ``agents``; ``take(result, slot)``
    gets each one its ``Intake`` admits (the owner of ``take`` applies the slot rule). With ``empty`` (the slots
    still without a row), lost slots are settled: ``take`` gets a ``lost`` (or ``storage_full``) failure row for
    each (attempt 0)."""

    def __init__(
        self,
        bus: Bus,
        intake: Intake,
        take: Callable[[RolloutResult, int], None],
        *,
        name: str,
        agents: list[str],
        empty: Callable[[], list[int]] | None = None,
        owner: Callable[[int], str] = lambda _task: "",
        max_republish: int | None = None,
    ) -> None:
        self.bus = bus
        self.intake = intake
        self.batch = intake.batch
        self._take = take
        self._empty = empty
        self._owner = owner
        self._max_republish = max_republish  # None: the manifest's
        self.republished = 0  # rounds of tasks published again
        self.agents = list(dict.fromkeys(agents))
        self.name = name
        self.handled = 0  # messages handled (taken, refused or unreadable)
        self.taken = 0  # ... of which the intake admitted
        self._lanes: list[_Lane] = []
        self._lost_ready = False
        self.tick_s = TICK_S

    @classmethod
    def of(
        cls,
        bus: Bus,
        manifest: Manifest,
        take: Callable[[RolloutResult, int], None],
        empty: Callable[[], list[int]],
        *,
        name: str,
        max_republish: int | None = None,
    ) -> BatchReader:
        """The reader of a published batch: results checked against its manifest's owners, lost slots published
        again (``max_republish`` rounds, default the manifest's), then settled."""
        owners = TaskOwners(manifest)
        intake = Intake(bus, manifest.batch, repeats=manifest.repeats, tasks=manifest.tasks, allows=owners.allows)
        return cls(
            bus,
            intake,
            take,
            name=name,
            agents=sorted(manifest.agents),
            empty=empty,
            owner=owners.owner,
            max_republish=max_republish,
        )

    async def open(self) -> None:
        """Make the consumers (each reads its stream from the start, whenever ``run`` starts)."""
        names = self.bus.subjects
        for agent in self.agents:
            lane = _Lane(agent, await self.bus.ensure_results_stream(agent))
            lane.reader = await self.bus.reader(
                lane.stream,
                names.reader(self.name, self.batch),
                names.result(agent, self.batch),
                handle=partial(self._on_msg, lane),
            )
            self._lanes.append(lane)

    async def run(self) -> None:
        """Read until ``stop()`` or cancelled; the consumers are deleted on the way out."""
        if not self._lanes:
            await self.open()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._tick)
                async with anyio.create_task_group() as readers:
                    for lane in self._lanes:
                        assert lane.reader is not None
                        readers.start_soon(lane.reader.run)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                for lane in self._lanes:
                    with contextlib.suppress(Exception):
                        assert lane.reader is not None
                        await lane.reader.close()

    def stop(self) -> None:
        for lane in self._lanes:
            if lane.reader is not None:
                lane.reader.stop_pulling()

    async def _on_msg(self, lane: _Lane, msg: Delivery) -> None:
        res = await read_result(self.bus, msg)
        if res is not None:
            slot = self.intake.slot(res, msg.subject, msg.headers)
            if slot is not None:
                self.taken += 1
                self._take(res, slot)
        self.handled += 1
        lane.handled += 1
        if lane.handled % ACK_EVERY == 0:
            lane.unacked = None
            await msg.ack()
        else:
            lane.unacked = msg

    async def _ack_handled(self) -> None:
        for lane in self._lanes:
            msg, lane.unacked = lane.unacked, None
            if msg is not None:
                await msg.ack()

    async def _tick(self) -> None:
        """Every ``TICK_S``: ack what was handled; with empty slots and no result taken since the last tick,
        settle lost slots (at once, too, when JetStream announces a terminated task)."""
        tasks = self.bus.subjects.tasks_stream
        poke = anyio.Event()

        async def on_advisory(_: Any) -> None:
            poke.set()

        subs = []
        if self._empty is not None:
            subs = [
                await self.bus.subscribe(advisory(e, tasks), on_advisory) for e in ("MSG_TERMINATED", "MAX_DELIVERIES")
            ]
        try:
            seen = 0
            while True:
                with anyio.move_on_after(self.tick_s):
                    await poke.wait()
                try:
                    await self._ack_handled()
                    if self._empty is None or (not poke.is_set() and self.taken != seen):
                        seen = self.taken  # results are coming in: nothing is stuck
                        continue
                    poke = anyio.Event()
                    seen = self.taken
                    await self._settle_lost(tasks)
                except Exception as e:  # the server is busy or restarting: look again later
                    log.info("reader.lost_check_failed", batch=self.batch, error=str(e))
        finally:
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                for sub in subs:
                    await sub.unsubscribe()

    async def _settle_lost(self, tasks: str) -> None:
        assert self._empty is not None
        manifest = await get_manifest(self.bus, self.batch)
        if manifest is None or not manifest.published:  # tasks may still be on their way
            return
        if await self.bus.subject_count(tasks, self.bus.subjects.batch_tasks(self.batch)):
            return  # queued or held: a worker may still store its result
        # every result is stored before its task is acked: all that will come is in the streams now
        await self._ack_handled()
        for lane in self._lanes:
            assert lane.reader is not None
            if not await lane.reader.settled():
                return  # some are still on their way to this reader
        empty = self._empty()
        if manifest.held_from >= 0:  # held back by the batch's budget: never published, so never stored
            held = [s for s in empty if s >= manifest.held_from]
            empty = [s for s in empty if s < manifest.held_from]
            message = "not started: the batch's budget was spent; publish the batch again with a larger budget"
            for slot, res in budget_slots(self.batch, held, self.intake.repeats, self._owner, message):
                self._take(res, slot)
        if not empty:
            return
        repeats = self.intake.repeats
        full = {lane.agent: lane.stream for lane in self._lanes if await self.bus.stream_full(lane.stream)}
        why: dict[int, tuple[ErrorClass, str]] = {}  # slot -> (error class, message)
        for s in empty:  # a full stream's slots are not published again: they would be refused again
            agent = self._owner(s // repeats)
            if agent in full:
                why[s] = ("storage_full", STORAGE_FULL.format(stream=full[agent]))
        if full:
            log.warning("batch.results_stream_full", batch=self.batch, streams=sorted(full.values()), slots=len(why))
        rest = [s for s in empty if s not in why]
        for s, text in (await self._again(manifest, rest) if rest else {}).items():
            why[s] = ("lost", f"{LOST}; {text}")
        if not why:
            return  # every one is published again: their rows come, or the next round looks again
        log.warning("batch.slots_lost", batch=self.batch, lost=len(why), then="failure rows")
        errors: dict[tuple[ErrorClass, str], ErrorInfo] = {}
        lost = []
        for slot, reason in why.items():
            task, rollout = divmod(slot, repeats)
            error = errors.get(reason) or errors.setdefault(reason, ErrorInfo(error_class=reason[0], message=reason[1]))
            lost.append(
                RolloutResult(
                    batch=self.batch,
                    task_index=task,
                    rollout_index=rollout,
                    agent=self._owner(task),
                    error=error,
                    attempts=0,
                )
            )
        await self._record(lost)
        for slot, res in zip(why, lost, strict=True):
            self._take(res, slot)

    async def _again(self, manifest: Manifest, empty: list[int]) -> dict[int, str]:
        """Publish the tasks of ``empty`` slots again while rounds are left; the slots that were not, with why."""
        limit = manifest.max_republish if self._max_republish is None else self._max_republish
        if manifest.max_republish <= 0:
            return dict.fromkeys(empty, NOT_KEPT)
        if self.republished >= limit:
            done = f"published again {self.republished} times" if self.republished else "not published again"
            return dict.fromkeys(empty, f"{done} (max_republish={limit}) and no result of it is stored")
        self.republished += 1
        return await republish(self.bus, manifest, empty, self.republished, self._owner)

    async def _record(self, lost: list[RolloutResult]) -> None:
        """Store a record of each lost slot, under an id no result has (best effort: the rows are taken anyway)."""
        subject = self.bus.subjects.lost(self.batch)
        try:
            if not self._lost_ready:
                await self.bus.ensure_results_stream(LOST_AGENT)
                self._lost_ready = True
            for i in range(0, len(lost), RECORD_IN_FLIGHT):
                await asyncio.gather(
                    *(
                        self.bus.js_publish(
                            subject, r, msg_id=jetstream.lost_msg_id(r.batch, r.task_index, r.rollout_index)
                        )
                        for r in lost[i : i + RECORD_IN_FLIGHT]
                    )
                )
        except Exception as e:  # a full stream, a server going away: the reader's own rows stand
            log.warning("batch.lost_not_recorded", batch=self.batch, error=str(e))
