"""The task sampler's statistics in the bus's KV (``Subjects.sampler_bucket``), one key per run and task.

Durable like the rest of the bus: a trainer restarted mid-run, or a second trainer of the same run, reads what
the first learned. Keys carry the run (``SamplerConfig.run``), so two runs sharing a namespace stay apart; give
them the same run to share. Each write replaces the task's record whole (last writer wins: two trainers of one
run observing the same task at once may lose one group's counts, which only blurs an estimate).
"""

from __future__ import annotations

from collections.abc import Iterable

import anyio
import msgspec

from gym_runtime.data.sampling import TaskStats
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.interface import KeyValue

__all__ = ["SamplerStore", "sampler_kv"]

_decode = msgspec.json.Decoder(TaskStats).decode


async def sampler_kv(bus: Bus) -> KeyValue:
    """The bucket, made on first use (under ``server --secure``, by the admin's ``provision``: no other role may)."""
    return await bus.kv(bus.subjects.sampler_bucket)


class SamplerStore:
    """Reads and writes ``TaskStats`` of one run; ``open`` makes the bucket on first use."""

    def __init__(self, kv: KeyValue, bus: Bus, run: str) -> None:
        self._kv = kv
        self._bus = bus
        self.run = run

    @classmethod
    async def open(cls, bus: Bus, run: str) -> SamplerStore:
        return cls(await sampler_kv(bus), bus, run)

    def _key(self, task: str) -> str:
        return self._bus.subjects.sampler_key(self.run, task)

    async def load(self, tasks: Iterable[str]) -> dict[str, TaskStats]:
        """The stored records of ``tasks`` (a task with none is left out); read concurrently."""
        out: dict[str, TaskStats] = {}
        limit = anyio.CapacityLimiter(64)  # many tasks: a bounded number of gets in flight

        async def one(task: str) -> None:
            async with limit:
                raw = await self._kv.get(self._key(task))
            if raw is not None:
                try:
                    out[task] = _decode(raw)
                except msgspec.DecodeError:  # a record of another shape: the task starts afresh
                    pass

        async with anyio.create_task_group() as tg:
            for task in dict.fromkeys(tasks):
                tg.start_soon(one, task)
        return out

    async def save(self, task: str, stats: TaskStats) -> None:
        await self._kv.put(self._key(task), msgspec.json.encode(stats))
