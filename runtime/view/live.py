"""``view --batch B --nats URL``: a batch followed on the bus as its results are stored.

Each slot's first result is appended to a spool file (in a temporary folder) and to the run's index as it
comes, so the pages read it as they read a file. Reading is all this does: its consumers read the batch's
results streams from the start and leave the stored results as they are; lost slots are neither published
again nor settled (``collect`` does that).
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import IO

import msgspec

from gym_runtime.data.batches import Manifest, TaskOwners
from gym_runtime.data.collector import failure_row
from gym_runtime.data.intake import Intake, is_ok
from gym_runtime.data.reader import BatchReader
from gym_runtime.messages import RolloutResult
from gym_runtime.transport.bus import Bus
from gym_runtime.view.index import Builder
from gym_runtime.view.runs import Part, Run

_enc = msgspec.json.Encoder()


class Live:
    """A run that grows: ``taken`` of the manifest's ``expected`` slots have their row."""

    def __init__(self, manifest: Manifest, spool: Path, run_id: int) -> None:
        self.manifest = manifest
        self.expected = manifest.expected
        self.taken = 0
        self._seen: set[int] = set()
        self._builder = Builder(0, 0)
        self._spool: IO[bytes] = spool.open("ab")
        batch = {"batch": manifest.batch, "manifest": msgspec.to_builtins(manifest), "config": None}
        part = Part(
            spool,
            self._builder.ix,
            failures=False,
            shown=f"batch {manifest.batch} (followed on the bus)",
            follows=False,
        )
        self.run = Run(run_id, f"batch {manifest.batch}", spool, [part], batch=batch, live=self)

    @property
    def done(self) -> bool:
        return self.taken >= self.expected

    def take(self, res: RolloutResult, slot: int) -> None:
        """A stored result: its slot's row, when it is the slot's first (a redelivery's second is left out)."""
        if slot in self._seen:
            return
        self._seen.add(slot)
        line = _enc.encode(res.row if is_ok(res) else failure_row(res))
        offset = self._spool.tell()
        self._spool.write(line + b"\n")
        self._spool.flush()  # the pages read the line from the file
        self._builder.add(offset, line, f"batch {self.manifest.batch} slot {slot}")
        self.taken += 1

    async def follow(self, bus: Bus) -> None:
        """Read the batch's results until cancelled (the consumers go with it)."""
        owners = TaskOwners(self.manifest)
        m = self.manifest
        intake = Intake(bus, m.batch, repeats=m.repeats, tasks=m.tasks, allows=owners.allows)
        reader = BatchReader(bus, intake, self.take, name=f"view{uuid.uuid4().hex[:8]}", agents=sorted(m.agents))
        try:
            await reader.run()
        finally:
            self._spool.close()
