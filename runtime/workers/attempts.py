"""An agent worker's records of its attempts (``explain``): where and when each started, why one was given back.

Sent in batches rather than one publish per attempt: a publish per attempt was +1.4% instructions per weather
rollout (``tests/bench/instructions.py``), this is a dict append per attempt.
"""

from __future__ import annotations

import asyncio
import contextlib

import anyio
import msgspec

from gym_runtime.messages import AttemptRetried, AttemptStart
from gym_runtime.transport.interface import Transport

# A worker sends its records at most this often, each batch's together in one message of at most
# RECORDS_PER_MESSAGE. An attempt whose worker dies within this time of its start leaves no record (``explain``
# still counts it, from the next attempt's delivery count).
RECORDS_EVERY_S = 0.5
RECORDS_PER_MESSAGE = 256


class AttemptRecords:
    """An agent worker's attempt records on their way to ``{NS}_ATTEMPTS`` (``Subjects.attempt``): held per batch,
    sent by ``run`` every ``RECORDS_EVERY_S`` without awaiting the server's ack (a lost message costs history, never
    a rollout), and on the way out."""

    def __init__(self, bus: Transport, agent: str) -> None:
        self.bus, self.agent = bus, agent
        self._held: dict[str, list[AttemptStart | AttemptRetried]] = {}
        self._wake = asyncio.Event()

    def add(self, batch: str, record: AttemptStart | AttemptRetried) -> None:
        held = self._held.get(batch)
        if held is None:
            held = self._held[batch] = []
        held.append(record)
        if not self._wake.is_set():
            self._wake.set()

    async def run(self) -> None:
        try:
            while True:
                await self._wake.wait()
                await asyncio.sleep(RECORDS_EVERY_S)
                self._wake.clear()
                await self.send()
        finally:
            with anyio.CancelScope(shield=True):
                await self.send()

    async def send(self) -> None:
        held, self._held = self._held, {}
        for batch, records in held.items():
            subject = self.bus.subjects.attempt(self.agent, batch)
            for i in range(0, len(records), RECORDS_PER_MESSAGE):
                with contextlib.suppress(Exception):  # a connection gone: that history is lost, nothing else
                    await self.bus.note(subject, _encode_records(records[i : i + RECORDS_PER_MESSAGE]))


_encode_records = msgspec.msgpack.Encoder().encode
