"""An agent worker's records of its attempts (``explain``): where and when each started, why one was given back.

An attempt's start record is the only trace of an attempt whose worker is killed, so it is stored (the server's
ack) before the attempt runs, hence before its first model call. Records are committed in groups: one stored
message carries every record that came while the previous one was on its way, so at 32 rollouts in flight a
record costs a share of one acked publish, and an attempt waits one round trip at the most. (A publish per
attempt was +1.4% instructions per weather rollout, ``tests/bench/instructions.py``; one every 0.5 s without an
ack, the round before, lost the records of an attempt killed within that time.)
"""

from __future__ import annotations

import asyncio
import itertools
import uuid

import anyio
import msgspec

from gym_runtime.messages import AttemptRetried, AttemptStart
from gym_runtime.observability import logs
from gym_runtime.transport.bus import Bus

RECORDS_PER_MESSAGE = 256  # a batch's records in one stored message, at most
LAST_SEND_S = 3.0  # how long a stopping worker tries to store the records it still holds

log = logs.get("gym.agent")


class AttemptRecords:
    """An agent worker's attempt records on their way to ``{NS}_ATTEMPTS`` (``Subjects.attempt``), stored by
    ``run`` in groups: ``started`` returns once its record is stored, ``add`` does not wait."""

    def __init__(self, bus: Bus, agent: str) -> None:
        self.bus, self.agent = bus, agent
        self._held: dict[str, list[AttemptStart | AttemptRetried]] = {}
        # the attempts waiting for what is held now to be stored: a future each, so one whose attempt is
        # cancelled leaves the others' alone (no shield, which cost a future and two callbacks more per record)
        self._waiting: list[asyncio.Future[None]] = []
        self._wake = asyncio.Event()
        self._ids = (f"{uuid.uuid4().hex[:12]}.{n}" for n in itertools.count())  # each message's msg id
        self._failing = False  # said once while the stream refuses, not per record

    def add(self, batch: str, record: AttemptStart | AttemptRetried) -> None:
        """Hold ``record`` for the next group."""
        held = self._held.get(batch)
        if held is None:
            held = self._held[batch] = []
        held.append(record)
        self._wake.set()

    async def started(self, batch: str, record: AttemptStart) -> None:
        """Store an attempt's start record; returns once the server holds it (or the group is given up)."""
        stored: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(stored)
        self.add(batch, record)
        await stored

    async def run(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                await self.send()
        finally:  # the records still held, sent on the way out, for a bounded time: a stopping worker whose
            # server is gone would retry each for the bus's store_retry_s (20 s) and overrun its supervisor's
            # grace (srun's 32 s, Compose's 10 s) to be killed; those records are lost either way
            with anyio.move_on_after(LAST_SEND_S, shield=True):
                await self.send()

    async def send(self) -> None:
        held, waiting, self._held, self._waiting = self._held, self._waiting, {}, []
        try:
            for batch, records in held.items():
                subject = self.bus.subjects.attempt(self.agent, batch)
                for i in range(0, len(records), RECORDS_PER_MESSAGE):
                    await self.bus.record(
                        subject, _encode_records(records[i : i + RECORDS_PER_MESSAGE]), msg_id=next(self._ids)
                    )
            self._failing = False
        except Exception as e:  # the bus gone or the stream refusing: that history is lost, never a rollout
            if not self._failing:
                log.warning("attempts.not_stored", agent=self.agent, error=repr(e))
            self._failing = True
        finally:
            for stored in waiting:
                if not stored.done():  # (cancelled with its attempt)
                    stored.set_result(None)


_encode_records = msgspec.msgpack.Encoder().encode
