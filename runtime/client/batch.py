"""One submitted batch as a trainer sees it (``BatchHandle``): its rows in completion order, its groups, its
counts, its cancel. Rows are read by the batch's own reader (``data.reader``), as ``collect`` reads them; what
the batch tells its client's admission (a result came, rows were consumed) goes to ``admission.Admitter``.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio

from gym_runtime.admission import Admission, Budget
from gym_runtime.data.batches import Manifest
from gym_runtime.data.collector import failure_row
from gym_runtime.data.intake import replaces
from gym_runtime.data.reader import BatchReader
from gym_runtime.errors import ClientError
from gym_runtime.messages import RolloutResult
from gym_runtime.transport.bus import Bus
from gym_runtime.workers import control

__all__ = ["BatchHandle", "result_row"]


def result_row(res: RolloutResult) -> tuple[dict[str, Any], bool]:
    if res.error is None and res.row is not None:
        return res.row, True
    return failure_row(res), False


class BatchHandle:
    """One submitted batch: async-iterate rows in completion order, ``groups()``, ``gather()``, ``cancel()``.

    Iteration ends when every task×repeat has a row (or failure row: ``lost`` for a slot whose task left the
    queue without a result), or at once after ``cancel()``. Only the owning agent's results count (the
    manifest's owners, as ``collect`` checks them). Each slot is yielded once; in the rare case that a later
    attempt's row replaces a failure row already yielded (a worker lost after storing it), ``gather()``
    returns the replacement, as ``collect`` writes it.
    """

    def __init__(
        self,
        bus: Bus,
        manifest: Manifest,
        *,
        woken: Callable[[], None],
        consumed: Callable[[int, int], Awaitable[None]],
        admit: Callable[[], Awaitable[None]],
    ) -> None:
        """``woken``, ``consumed`` and ``admit`` are its client's admission's (``admission.Admitter``): a budget's
        result came, the trainer consumed rows (and how many were released), held tasks may start."""
        self._bus = bus
        self._woken, self._consumed, self._admit = woken, consumed, admit
        self.batch = manifest.batch
        self.tasks = manifest.tasks
        self.repeats = manifest.repeats
        self.expected = manifest.expected
        self.cancelled = False
        self._rows: dict[int, tuple[dict[str, Any], bool, int]] = {}  # slot -> (row, ok, attempt)
        self._send, self._recv = anyio.create_memory_object_stream[dict[str, Any]](math.inf)
        self._reader = BatchReader.of(bus, manifest, self._take, self._empty, name="client")
        self._finished = anyio.Event()
        self._manifest = manifest
        self.admitted = False  # started by admission (``submit(batch_size=...)``)
        self.delivered = 0  # rows handed to the trainer
        self.consumed_rows = 0  # of those, reported with ``consumed``
        self.started = 0  # rollouts admitted (published)
        self.held = 0  # rollouts waiting for admission
        self.redone = 0  # rollouts submitted again under a newer version before they started (never run stale)
        self.budget: Budget | None = None  # ``submit(budget=...)``: what this batch may spend
        self.admission: Admission | None = None  # the gates its held tasks pass (the window, its budget)
        self.budget_stopped = 0  # rollouts its budget held back: ``budget`` failure rows, never started
        self.held_from = -1  # the first of them

    @property
    def done(self) -> bool:
        return self._finished.is_set()

    @property
    def refused(self) -> int:
        """Stored results of this batch that were not its owners' (or named no slot of it): dropped."""
        return self._reader.intake.refused

    def _empty(self) -> list[int]:
        return [] if self.cancelled else [s for s in range(self.expected) if s not in self._rows]

    def _take(self, res: RolloutResult, slot: int) -> None:
        if self.cancelled:
            return  # late: iteration has ended
        held = self._rows.get(slot)
        if held is not None:
            if replaces(held[1], held[2], res):
                self._rows[slot] = (*result_row(res), res.attempts)
            return
        row, ok = result_row(res)
        self._rows[slot] = (row, ok, res.attempts)
        if self.budget is not None and res.attempts:  # a stored result (a budget's own rows have no attempt)
            self.budget.done(res)
            self._woken()
        self._send.send_nowait(row)
        if len(self._rows) >= self.expected:
            self._finish()

    def _finish(self) -> None:
        if not self._finished.is_set():
            self._finished.set()
            self._send.close()
            self._reader.stop()

    def __aiter__(self) -> BatchHandle:
        return self

    async def __anext__(self) -> dict[str, Any]:
        try:
            row = await self._recv.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None
        self.delivered += 1
        return row

    async def consumed(self, n: int) -> None:
        """The trainer used (or dropped) ``n`` more rows of this batch, failure rows included.

        With ``submit(batch_size=...)`` this is what lets more rollouts start (``gym_runtime.admission``);
        without, it is only counted."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ClientError(f"consumed(n) takes a count of rows >= 0, got {n!r}")
        if self.consumed_rows + n > self.delivered:
            raise ClientError(
                f"consumed({n}) on batch {self.batch}: only {self.delivered} rows were delivered and "
                f"{self.consumed_rows} reported consumed already"
            )
        self.consumed_rows += n
        if self.admitted and not self.cancelled:
            await self._consumed(n, 0)

    async def groups(self) -> AsyncIterator[list[dict[str, Any]]]:
        """Each task's rows (all its repeats, in rollout order) as soon as the last one is in."""
        pending: dict[int, list[dict[str, Any]]] = {}
        async for row in self:
            group = pending.setdefault(int(row["_ng_task_index"]), [])
            group.append(row)
            if len(group) == self.repeats:
                del pending[int(row["_ng_task_index"])]
                yield sorted(group, key=lambda r: r["_ng_rollout_index"])

    async def gather(self) -> list[dict[str, Any]]:
        """Wait for the whole batch; every row received, in ``aabbcc`` order (as ``collect`` writes)."""
        async for _ in self:
            pass
        return [self._rows[s][0] for s in sorted(self._rows)]

    async def cancel(self) -> None:
        """Tasks of this batch not yet started are never run; iteration ends now."""
        self.cancelled = True
        await control.cancel_batch(self._bus, self.batch)
        self._finish()
        if self.admitted:  # its rollouts not consumed yet will not be: room for other batches
            await self._consumed(0, self.started - self.consumed_rows)
        elif self.held:  # held by its budget alone: published marked cancelled, as the window's are
            await self._admit()
