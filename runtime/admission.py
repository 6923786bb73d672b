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

import math
import re
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import msgspec

from gym_runtime.messages import RolloutResult

__all__ = ["GROUP_STALENESS", "Admission", "Budget", "Gate", "StalenessWindow", "Work", "parse_budget"]

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


_TOKENS = re.compile(r"^\s*([0-9][0-9_]*)\s*tokens?\s*$")


def parse_budget(value: object) -> Budget:
    """A budget as a user writes it: a number is money (``2.50``: in ``pricing.currency``), a whole number
    followed by ``tokens`` is tokens (``200000tokens``, ``"200000 tokens"``). ``ValueError`` says what is wrong."""
    if isinstance(value, Budget):
        return value
    text = str(value)
    m = _TOKENS.match(text)
    if m:
        amount, tokens = float(m.group(1).replace("_", "")), True
    else:
        try:
            amount, tokens = float(text), False
        except ValueError:
            amount, tokens = math.nan, False
        if isinstance(value, bool) or math.isnan(amount):
            raise ValueError(f"a budget is an amount of money (2.50) or of tokens (200000tokens), got {text!r}")
    if not math.isfinite(amount) or amount <= 0:
        raise ValueError(f"a budget must be more than 0, got {text!r}")
    return Budget(amount, tokens=tokens)


def used(res: RolloutResult, *, tokens: bool) -> float | None:
    """What a stored result counts against a budget: its row's ``cost`` (or a failure's), in tokens (input
    and output of every model entry: policy, judges, user simulators) or its estimated money. None: a count
    that cannot be taken (negative, non-finite, not a number), which ``Budget`` counts as its largest rollout's
    cost: no count lowers a budget."""
    cost = _cost_of(res)
    if cost is None:
        return 0.0
    if not tokens:
        est = cost.get("estimated_cost")
        if est is None:
            return 0.0
        ok = isinstance(est, (int, float)) and not isinstance(est, bool) and math.isfinite(est) and est >= 0
        return float(est) if ok else None
    total = 0
    for m in (cost.get("models") or {}).values():
        if not isinstance(m, dict):
            return None
        for k in ("input_tokens", "output_tokens"):
            n = m.get(k, 0)
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                return None
            total += n
    return float(total)


def unmeasured(res: RolloutResult) -> str | None:
    """The model entry of a result's cost whose calls reported no usage and returned no token ids (their
    tokens unknown: a token budget cannot count them), or None."""
    cost = _cost_of(res)
    for entry, m in ((cost or {}).get("models") or {}).items():
        if isinstance(m, dict) and m.get("unmeasured"):
            return str(entry)
    return None


def _cost_of(res: RolloutResult) -> dict[str, Any] | None:
    cost: Any = res.row.get("cost") if res.row is not None else res.cost
    if cost is None:
        return None
    out = cost if isinstance(cost, dict) else msgspec.to_builtins(cost)
    return out if isinstance(out, dict) else {}


class Budget:
    """A batch's budget as a gate: ``charge`` counts rollouts started (in flight), ``finished`` what one cost.

    What is in flight is not known until it finishes, so each rollout in flight is counted at an estimate: the
    mean cost of the rollouts finished so far (the batch's own running mean: the best estimate there is without
    a model of each task), never below the largest single rollout's cost seen; until the first finishes there
    is none, and one rollout runs at a time. A rollout may start while ``spent + (in_flight + 1) * estimate <=
    limit``; once spent, there is no room. A count that cannot be taken (``used``: None) counts as the largest
    seen, and a token budget stops at a rollout whose model calls reported no tokens (``refused`` says why).
    """

    def __init__(self, limit: float, *, tokens: bool) -> None:
        self.limit = limit
        self.tokens = tokens
        self.spent = 0.0  # the finished rollouts' cost, as their results were stored
        self.largest = 0.0  # the largest single rollout's cost seen
        self.finished = 0
        self.in_flight = 0
        self.refused: str | None = None  # why nothing more starts though the budget is not spent

    def room(self, work: Work) -> int:
        if self.spent >= self.limit or self.refused is not None:
            return 0
        if not self.finished:
            return 0 if self.in_flight else 1
        estimate = max(self.spent / self.finished, self.largest)
        if estimate <= 0:
            return 1 << 62
        return max(0, math.floor((self.limit - self.spent) / estimate + 1e-9) - self.in_flight)

    def charge(self, work: Work) -> None:
        self.in_flight += work.units

    def done(self, res: RolloutResult, *, in_flight: bool = True) -> None:
        """One rollout's result was stored (counted once per slot by its reader); ``in_flight``: it was
        charged as started here (not a result an earlier run of the batch stored)."""
        cost = used(res, tokens=self.tokens)
        cost = self.largest if cost is None else cost
        self.spent += cost
        self.largest = max(self.largest, cost)
        self.finished += 1
        entry = unmeasured(res) if self.tokens else None
        if entry is not None and self.refused is None:
            self.refused = (
                f"model entry {entry!r} reported no token usage and returned no token ids, so a token budget "
                "cannot count its calls: give a money budget (with a pricing section) or an adapter that reports usage"
            )
        if in_flight:
            self.in_flight -= min(1, self.in_flight)
