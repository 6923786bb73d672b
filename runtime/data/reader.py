"""Reading one batch's stored results, and knowing from the server when no more will come.

A reader has a consumer of its own on the results stream, filtered to the batch (``{ns}.result.*.{batch}``)
and read from the start in stream order, so a collector interrupted and run again ends with the same file.
It acks what it has handled (ack-all: one ack covers every message before it), so the consumer's counts
say whether anything stored is still on its way to it: nothing undelivered (``num_pending``), nothing
delivered and unhandled (``num_ack_pending``). Neither counts a message that was purged or evicted, so a
stream emptied or flooded under a reader never makes it wait for what is gone.

**Lost slots.** A task leaves the work queue when it is acked (its result is stored first) or terminated
(``+TERM`` by a buggy or hostile worker, or past max deliveries). Once the batch is wholly published, the
server counts none of its tasks on ``{ns}.task.*.{batch}`` (queued or held), and the reader holds nothing
pending, a slot still without a row will never get one. Its task is published again from the body the batch
keeps (``data.republish``), at most ``max_republish`` rounds (the manifest's, or the reader's own); a slot that
cannot be, or is still empty after the last round, gets a ``lost`` failure row saying why, and a record of it
is stored on ``{ns}.result._lost.{batch}`` under an id of its own (``lost_msg_id``). Readers never take such
records as rows, so no credential can end another reader's batch early with them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import anyio

from gym_runtime.data.batches import Manifest, TaskOwners, get_manifest
from gym_runtime.data.intake import Intake, read_result
from gym_runtime.data.republish import NOT_KEPT, republish
from gym_runtime.messages import ErrorInfo, RolloutResult
from gym_runtime.observability import logs
from gym_runtime.transport import jetstream
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.delivery import Delivery
from gym_runtime.transport.pull import PullWorker
from gym_runtime.transport.subjects import advisory

log = logs.get("gym.reader")

TICK_S = 5.0  # how often a reader acks what it handled and, with empty slots, asks whether they will ever fill
ACK_EVERY = 256  # ... and it acks every this many messages (one ack covers all before it)
RECORD_IN_FLIGHT = 256  # lost records stored at once

LOST = (
    "no result of this slot is stored and none of the batch's tasks is queued or running any more: its task "
    "was terminated (+TERM by a worker, or past max deliveries), or its stored result was removed (purged, "
    "evicted from a full stream, or lost with a damaged replica)"
)


class BatchReader:
    """Reads a batch's stored results; ``take(result, slot)`` gets each one its ``Intake`` admits (the owner of
    ``take`` applies the slot rule). With ``empty`` (the slots still without a row), lost slots are settled:
    ``take`` gets a ``lost`` failure row for each (attempt 0)."""

    def __init__(
        self,
        bus: Bus,
        intake: Intake,
        take: Callable[[RolloutResult, int], None],
        *,
        name: str,
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
        self.stream = bus.subjects.results_stream
        self.consumer = bus.subjects.reader(name, self.batch)
        self.handled = 0  # messages handled (taken, refused or unreadable)
        self.taken = 0  # ... of which the intake admitted
        self._last_seq = 0  # the stream sequence of the last one: where a reader made again reads on
        self._unacked: Delivery | None = None  # handled, not acked yet (every message before it is acked)
        self._puller: PullWorker | None = None

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
        return cls(bus, intake, take, name=name, empty=empty, owner=owners.owner, max_republish=max_republish)

    async def open(self) -> None:
        """Make the consumer (it reads from the start of the stream, whenever ``run`` starts)."""
        subject = self.bus.subjects.batch_results(self.batch)
        await jetstream.add_reader(self.bus, self.stream, self.consumer, subject, acked=True)

        async def recreate() -> None:  # deleted by someone else: read on from where we were
            await jetstream.add_reader(
                self.bus, self.stream, self.consumer, subject, start_seq=self._last_seq + 1, acked=True
            )

        self._puller = PullWorker(
            self.bus,
            stream=self.stream,
            consumer=self.consumer,
            slots=512,
            handle=self._on_msg,
            heartbeat_s=3600.0,
            inline=True,  # in stream order, one at a time: an ack of one message says every one before was handled
            recreate=recreate,
        )

    async def run(self) -> None:
        """Read until ``stop()`` or cancelled; the consumer is deleted on the way out."""
        if self._puller is None:
            await self.open()
        assert self._puller is not None
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._tick)
                await self._puller.run()
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await jetstream.delete_consumer(self.bus, self.stream, self.consumer)

    def stop(self) -> None:
        if self._puller is not None:
            self._puller.stop_pulling()

    async def _on_msg(self, msg: Delivery) -> None:
        res = await read_result(self.bus, msg)
        if res is not None:
            slot = self.intake.slot(res, msg.subject, msg.headers)
            if slot is not None:
                self.taken += 1
                self._take(res, slot)
        self.handled += 1
        self._last_seq = max(self._last_seq, msg.stream_seq)
        if self.handled % ACK_EVERY == 0:
            self._unacked = None
            await msg.ack()
        else:
            self._unacked = msg

    async def _ack_handled(self) -> None:
        msg, self._unacked = self._unacked, None
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
                await self.bus.nc.subscribe(advisory(e, tasks), cb=on_advisory)
                for e in ("MSG_TERMINATED", "MAX_DELIVERIES")
            ]
        try:
            seen = 0
            while True:
                with anyio.move_on_after(TICK_S):
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
        if await jetstream.subject_count(self.bus, tasks, self.bus.subjects.batch_tasks(self.batch)):
            return  # queued or held: a worker may still store its result
        # every result is stored before its task is acked: all that will come is in the stream now
        await self._ack_handled()
        if not await jetstream.reader_settled(self.bus, self.stream, self.consumer):
            return  # some are still on their way to this reader
        empty = self._empty()
        if not empty:
            return
        why = await self._again(manifest, empty)
        if not why:
            return  # every one is published again: their rows come, or the next round looks again
        log.warning("batch.slots_lost", batch=self.batch, lost=len(why), then="failure rows")
        repeats = self.intake.repeats
        errors: dict[str, ErrorInfo] = {}
        lost = []
        for slot, reason in why.items():
            task, rollout = divmod(slot, repeats)
            error = errors.get(reason) or errors.setdefault(
                reason, ErrorInfo(error_class="lost", message=f"{LOST}; {reason}")
            )
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
