"""What ``Client.submit`` holds back and starts as room comes: admission by staleness (``batch_size`` with
``max_staleness``: AReaL's rule, one window over every open batch) and by budget (what a batch may spend).

``Admitter`` keeps the held tasks in submit order, and publishes those their batch's gates have room for (the
pure bookkeeping of the gates is ``gym_runtime.admission``'s); a batch whose budget is spent gets ``budget``
failure rows for the rest, never started.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Coroutine
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio
import msgspec

from gym_runtime.admission import GROUP_STALENESS, Admission, Budget, StalenessWindow, Work, parse_budget
from gym_runtime.client.batch import BatchHandle
from gym_runtime.config import ResolvedConfig
from gym_runtime.data.batches import put_manifest
from gym_runtime.data.collector import budget_results
from gym_runtime.data.inputs import publish_task
from gym_runtime.errors import ClientError
from gym_runtime.messages import RolloutTask
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.jetstream import ensure_kept_stream, ensure_streams

__all__ = ["Admitter", "Held"]


@dataclass
class Held:
    """Tasks of a batch not started yet: admitted together (one repeat, a group task, or a whole group)."""

    handle: BatchHandle
    work: Work
    tasks: list[RolloutTask]
    redone: bool = False  # stamped with a later version than it was submitted under


class Admitter:
    """A client's admission: its staleness window, the batches' budgets and the tasks they hold back.

    ``bus``: the client's bus (once connected); ``spawn``: start a coroutine in the client's task group;
    ``acked``: the client's publishes of something, a lost acknowledgement one ``PublishTimeout``.
    """

    def __init__(
        self,
        config: ResolvedConfig,
        *,
        bus: Callable[[], Bus],
        spawn: Callable[[Callable[[], Coroutine[Any, Any, None]]], None],
        acked: Callable[[str, str], AbstractContextManager[None]],
    ) -> None:
        self.config = config
        self._bus, self._spawn, self._acked = bus, spawn, acked
        self._window: StalenessWindow | None = None
        self._admission: Admission | None = None
        self._held: deque[Held] = deque()
        self._admit_lock = anyio.Lock()

    async def updated(self, version: int) -> None:
        """The policy version went up: a held task may no longer start in time (it is redone under this one)."""
        if self._window is not None:
            self._window.updated(version)
            await self.admit()

    def budget(self, budget: float | str | None) -> Budget | None:
        """``submit(budget=...)`` as a gate; each mistake one ``ClientError``."""
        if budget is None:
            return None
        try:
            gate = parse_budget(budget)
        except ValueError as e:
            raise ClientError(str(e)) from None
        if not gate.tokens and self.config.pricing is None:
            raise ClientError(
                f"budget={budget!r} is an amount of money, but the config has no `pricing` section to estimate "
                "costs with: add one, or give the budget in tokens (budget='200000tokens')"
            )
        return gate

    def woken(self) -> None:
        """A budgeted batch's result came: held tasks may start now (or be held back for good)."""
        self._spawn(self.admit)

    def check(
        self, routes: list[str], repeats: int, max_staleness: int | None, batch_size: int, group_staleness: str
    ) -> None:
        """``submit``'s admission arguments, each mistake one ``ClientError``."""
        if max_staleness is None:
            raise ClientError("batch_size bounds rollouts by staleness: give max_staleness too")
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ClientError(
                f"batch_size (the rollouts the trainer consumes per policy version) must be >= 1, got {batch_size!r}"
            )
        if group_staleness not in GROUP_STALENESS:
            raise ClientError(f"group_staleness must be one of {', '.join(GROUP_STALENESS)}, got {group_staleness!r}")
        window = self._window
        if window is not None and window.batch_size != batch_size and (window.outstanding or self._held):
            raise ClientError(
                f"batch_size={batch_size}, but open batches were submitted with batch_size={window.batch_size}: "
                "one trainer consumes one batch size"
            )
        whole = group_staleness == "group" or any(self.config.agents[a].group_repeats for a in set(routes))
        if whole and batch_size % repeats:
            raise ClientError(
                f"a task's {repeats} repeats start together: batch_size={batch_size} must be a multiple of them "
                "(the trainer consumes whole groups), or use group_staleness='member'"
            )

    async def hold(
        self,
        handle: BatchHandle,
        tasks: list[RolloutTask],
        batch_size: int | None,
        *,
        by_group: bool,
        policy_version: int | None,
    ) -> None:
        """Queue a batch's tasks for admission (one unit each, or each task's repeats as one), then admit."""
        if batch_size is not None and (self._window is None or self._window.batch_size != batch_size):
            assert policy_version is not None  # max_staleness needs one (``Client._version_for``)
            self._window = StalenessWindow(batch_size, policy_version)
            self._admission = Admission(self._window)
        gates = ([self._window] if batch_size is not None and self._window is not None else []) + (
            [handle.budget] if handle.budget is not None else []
        )
        handle.admission = Admission(*gates)
        bus = self._bus()
        await ensure_streams(bus)
        if self.config.jetstream.max_republish > 0:
            await ensure_kept_stream(bus)
        handle.admitted = batch_size is not None  # in the staleness window (what ``consumed`` reports to)
        for t in tasks:
            units = max(t.group, 1)
            last = self._held[-1] if self._held else None
            if by_group and last is not None and last.handle is handle and last.tasks[0].task_index == t.task_index:
                last.tasks.append(t)
                last.work.units += units
            else:
                self._held.append(Held(handle, Work(units, t.policy_version, t.max_staleness, t.agent), [t]))
            handle.held += units
        await self.admit()

    async def consumed(self, n: int, released: int = 0) -> None:
        """A batch's rows consumed (``n``), or its rollouts not consumed that never will be (``released``)."""
        if self._window is not None:
            self._window.consumed(n)
            self._window.released(released)
            await self.admit()

    async def admit(self) -> None:
        """Publish the held tasks their batch's gates have room for (the staleness window, its budget), in submit
        order; a task that can no longer start within its staleness bound is stamped with the current version
        first (redone, never run stale); a batch whose budget is spent gets ``budget`` rows for the rest."""
        window = self._window
        async with self._admit_lock:
            bus = self._bus()
            out: list[RolloutTask] = []
            touched: dict[str, BatchHandle] = {}
            if any(h.handle.cancelled for h in self._held):
                # a cancelled batch's held tasks are published all the same, outside the window: a worker
                # turns each into its ``cancelled`` row without running it, so the batch still ends with one
                # row per slot (a collector would wait on them forever)
                for held in [h for h in self._held if h.handle.cancelled]:
                    held.handle.held -= held.work.units
                    touched[held.handle.batch] = held.handle
                    out.extend(msgspec.structs.replace(t, cancelled=True) for t in held.tasks)
                self._held = deque(h for h in self._held if not h.handle.cancelled)
            while self._held:
                held = self._held[0]
                handle = held.handle
                windowed = window is not None and window in (handle.admission.gates if handle.admission else ())
                if windowed and window is not None and window.expired(held.work):
                    held.work.version = window.version
                    held.tasks = [msgspec.structs.replace(t, policy_version=window.version) for t in held.tasks]
                    held.redone = True
                assert handle.admission is not None
                if not handle.admission.admit(held.work):
                    budget = handle.budget
                    spent = budget is not None and not budget.in_flight and budget.room(held.work) < held.work.units
                    if not spent:
                        break  # no room yet (window, or a budget's results in flight): what follows waits, in order
                    self._held.popleft()  # spent: this task and the batch's others never start
                    self._budget_stop(held)
                    touched[handle.batch] = handle
                    continue
                self._held.popleft()
                held.handle.held -= held.work.units
                held.handle.started += held.work.units
                held.handle.redone += held.work.units if held.redone else 0
                touched[held.handle.batch] = held.handle
                out.extend(held.tasks)
            keep = self.config.jetstream.max_republish > 0
            with self._acked("admission", "held tasks"):
                async with anyio.create_task_group() as tg:
                    for task in out:
                        tg.start_soon(partial(publish_task, bus, task, keep=keep))
                for handle in touched.values():
                    if handle.held == 0:  # all that will be is published: lost slots may be settled
                        held_from = handle.held_from if handle.budget_stopped else -1
                        manifest = msgspec.structs.replace(handle._manifest, published=True, held_from=held_from)
                        await put_manifest(bus, manifest)
        if self._admission is not None:
            self._admission.changed()

    def _budget_stop(self, held: Held) -> None:
        """``held``'s batch spent its budget: its tasks get ``budget`` failure rows, never started."""
        handle, budget = held.handle, held.handle.budget
        assert budget is not None
        spent = f"{budget.spent:,.0f} tokens" if budget.tokens else f"{budget.spent:.4f}"
        message = f"not started: the batch's budget was spent ({spent} of {budget.limit:g})"
        if budget.refused:
            message = f"not started: {budget.refused} ({spent} of {budget.limit:g} spent)"
        handle.held -= held.work.units
        for task in held.tasks:
            for slot, res in budget_results(task, handle.repeats, message):
                handle.budget_stopped += 1
                handle.held_from = min(handle.held_from, slot) if handle.held_from >= 0 else slot
                handle._take(res, slot)
