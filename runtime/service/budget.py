"""A batch's budget between its publish and its collector: tasks start through ``admission`` only while the
budget has room (``gym_runtime.admission.Budget``), each stored result is counted as it is read, and the tasks
held back get ``budget`` failure rows from the collector (never stored: a run of the batch again may run them).
"""

from __future__ import annotations

from gym_runtime.admission import Admission, Budget, Work
from gym_runtime.data.batches import get_manifest
from gym_runtime.data.collector import Collector
from gym_runtime.data.reader import BatchReader
from gym_runtime.messages import RolloutResult, RolloutTask
from gym_runtime.transport.bus import Bus


class BudgetedPublish:
    """``admit`` and ``held`` for ``publish_batch``; ``stored`` for the collector's ``on_stored``.

    A task an earlier run of the batch published counts as in flight until its result is read (unless it was
    read already), so a resumed batch's budget counts what the first run spent."""

    def __init__(self, budget: Budget, repeats: int, currency: str | None = None) -> None:
        self.budget = budget
        self.admission = Admission(budget)
        self.repeats = max(1, repeats)
        self.currency = currency
        self.held_back = 0  # rollouts never started
        self._seen: set[int] = set()  # slots whose result was read
        self._charged: set[int] = set()  # slots counted in flight

    def _slots(self, task: RolloutTask) -> list[int]:
        base = task.task_index * self.repeats
        return [base + r for r in range(task.group)] if task.group else [base + task.rollout_index]

    def stored(self, res: RolloutResult) -> None:
        slot = res.task_index * self.repeats + res.rollout_index
        if slot in self._seen:  # a later attempt's copy: counted once
            return
        self._seen.add(slot)
        self.budget.done(res, in_flight=slot in self._charged)
        self.admission.changed()

    async def admit(self, task: RolloutTask, stored_before: bool) -> bool:
        slots = self._slots(task)
        if stored_before:  # published by an earlier run: in flight until its result is read
            unseen = [s for s in slots if s not in self._seen]
            self.budget.charge(Work(len(unseen), owner=task.agent))
            self._charged.update(unseen)
            return True
        work = Work(len(slots), owner=task.agent)
        while not self.admission.admit(work):
            if not self.budget.in_flight:  # nothing left to finish can make room: the budget is spent
                return False
            await self.admission.wait()
        self._charged.update(slots)
        return True

    async def watch(self, bus: Bus, batch: str) -> None:
        """Count the batch's stored results as they come (``publish``: no collector runs here)."""
        manifest = await get_manifest(bus, batch, wait_s=60.0)
        if manifest is None:
            return
        self.repeats = max(1, manifest.repeats)
        reader = BatchReader.of(bus, manifest, lambda res, _slot: self.stored(res), list, name="budget")
        await reader.open()
        await reader.run()

    def spent_line(self) -> str:
        b = self.budget
        line = f"{self.amount(b.spent)} of the budget's {self.amount(b.limit)} spent"
        if b.finished and b.spent / b.finished > b.limit:  # the first rollout runs alone, whatever it costs
            line += (
                f" (a rollout costs {self.amount(b.spent / b.finished)}, more than the whole budget: it runs one "
                "rollout at most; give a larger --budget)"
            )
        return f"{line}, and {b.refused}" if b.refused else line

    def amount(self, n: float) -> str:
        return f"{n:,.0f} tokens" if self.budget.tokens else f"{n:.4f} {self.currency or ''}".rstrip()

    def held(self, task: RolloutTask) -> None:
        """Counted (``publish``: a reader of the batch writes their rows, from ``held_from``; ``run``: its
        collector, with ``not_started`` as the reason)."""
        self.held_back += len(self._slots(task))

    def not_started(self) -> str:
        """Why a held-back task's failure row says it never ran."""
        return (
            f"not started: the batch's budget was spent ({self.spent_line()}); run the batch again with a larger "
            "budget to run it"
        )


class HeldInCollector:
    """``run``'s gate (``inputs.Gate``): the budget's admission, each task it holds back given its ``budget``
    failure row by the run's collector."""

    def __init__(self, budget: BudgetedPublish, collector: Collector) -> None:
        self.budget, self.collector = budget, collector

    async def admit(self, task: RolloutTask, stored: bool) -> bool:
        return await self.budget.admit(task, stored)

    def held(self, task: RolloutTask) -> None:
        self.budget.held(task)
        self.collector.hold_back(task, self.budget.not_started())
