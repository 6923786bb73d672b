"""One admission point: work starts only when every gate has room for it.

Why one point: a rollout that may not be used (too stale for the trainer, over a quota, over a budget) is
cheapest when it is never started, so each of those limits is a ``Gate`` asked before the work starts, all
of them at one place, rather than checks that turn finished work into failure rows. The trainer's
staleness window (``StalenessWindow``, AReaL's rule) is the gate built here; the sandbox fleet's quotas
(a gate keyed by ``Work.owner`` as a pool) and the ledger's budgets (issue 39: a gate that charges
``Work.units`` to ``Work.owner`` as an agent and has no room once spent) are meant to be gates of the same
``Admission``, not limits of their own. Pure bookkeeping, no I/O: its owner publishes what is admitted
and calls ``changed()`` when something that frees room happens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import anyio

__all__ = ["GROUP_STALENESS", "Admission", "Gate", "StalenessWindow", "Work"]

GROUP_STALENESS = ("member", "group")  # what is redone when a group's members would straddle a version


@dataclass
class Work:
    """What asks to start: ``units`` rollouts (a group admitted whole: its size), submitted under policy
    ``version`` with ``max_staleness`` (None: no staleness bound), paid by ``owner`` (an agent, a pool)."""

    units: int
    version: int | None = None
    max_staleness: int | None = None
    owner: str = ""


class Gate(Protocol):
    """One limit on what starts: ``room`` is how many units of ``work``'s kind may start now; ``charge``
    counts ``work`` as started. Giving room back is each gate's own call (consumed, ended, refunded)."""

    def room(self, work: Work) -> int: ...

    def charge(self, work: Work) -> None: ...


class Admission:
    """The gates asked, in order, before anything starts; ``admit`` starts ``work`` in all or in none."""

    def __init__(self, *gates: Gate) -> None:
        self.gates = list(gates)
        self.admitted = 0  # units started through this point
        self._changed = anyio.Event()

    def admit(self, work: Work) -> bool:
        if any(g.room(work) < work.units for g in self.gates):
            return False
        for g in self.gates:
            g.charge(work)
        self.admitted += work.units
        return True

    def changed(self) -> None:
        """Room may have been freed: wake whoever waits in ``wait``."""
        self._changed.set()
        self._changed = anyio.Event()

    async def wait(self) -> None:
        await self._changed.wait()


class StalenessWindow:
    """AReaL's bound on rollouts started, from what the trainer reports: ``consumed(n)`` and its versions.

    With ``B`` rollouts consumed per policy version, a rollout started now is used
    ``(outstanding + consumed_since_update) // B`` versions after the current one (``outstanding``: started,
    not consumed yet). It may start only if that is within ``max_staleness`` of the version its task was
    *submitted* under (queue time counts), i.e. while::

        outstanding + consumed_since_update < (v_submit + S - v_now + 1) * B

    For a task submitted at the current version this is AReaL's ``started <= (v_now - v_0 + S + 1) * B``
    (``started`` counted from ``v_0``, when the trainer consumes B per version), written with what the
    trainer consumed instead of what the version implies, so a trainer that filters or drops rows keeps the
    bound. A task whose ``v_submit + S < v_now`` can no longer start in bound: ``expired``; its owner
    submits it again under the current version (redone, not run stale and discarded).
    """

    def __init__(self, batch_size: int, version: int) -> None:
        assert batch_size >= 1, batch_size  # the client checks what a trainer gives
        self.batch_size = batch_size
        self.version = version
        self.outstanding = 0  # started, not consumed (nor given back)
        self.since_update = 0  # consumed since the version last changed
        self.started = 0
        self.consumed_total = 0

    def expired(self, work: Work) -> bool:
        return (
            work.version is not None
            and work.max_staleness is not None
            and (work.version + work.max_staleness < self.version)
        )

    def room(self, work: Work) -> int:
        if work.version is None or work.max_staleness is None:
            return 1 << 62
        ahead = work.version + work.max_staleness - self.version + 1
        return max(0, ahead * self.batch_size - self.outstanding - self.since_update)

    def charge(self, work: Work) -> None:
        self.outstanding += work.units
        self.started += work.units

    def consumed(self, n: int) -> None:
        """The trainer used (or dropped) ``n`` delivered rows."""
        self.outstanding -= min(n, self.outstanding)
        self.since_update += n
        self.consumed_total += n

    def released(self, n: int) -> None:
        """``n`` started rollouts will never be delivered (their batch was cancelled): room again."""
        self.outstanding -= min(n, self.outstanding)

    def updated(self, version: int) -> None:
        """The trainer made ``version`` current."""
        if version != self.version:
            self.version = version
            self.since_update = 0
