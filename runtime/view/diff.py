"""Two runs compared over the rollouts they share: reward deltas, pass/fail flips, provenance changes, and
what each row would need to be brought up to date.

A row's class, from which parts of its provenance changed:
REUSE: none (the same agent, model entries, environment code, grader, images); REGRADE: only what grades it
(the environment's code, the grader, the resource entry's options): ``reverify`` can redo it without the
model; RERUN: anything the rollout itself depends on (the agent or a model entry, the images, or a part one
of the two rows does not record).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from gym_runtime.errors import UserError
from gym_runtime.view.runs import Ref, Run, Runs, passed

REUSE, REGRADE, RERUN = "REUSE", "REGRADE", "RERUN"
GRADING = ("env", "grader", "resource")  # parts a regrade redoes


def classify(a: dict[str, str], b: dict[str, str]) -> tuple[str, list[str]]:
    """The class of a row whose provenance parts went from ``a`` to ``b``, and the parts that changed."""
    changed = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    if not changed:
        return (REUSE if a else RERUN), changed  # a row with no provenance at all cannot be reused
    if all(k in GRADING for k in changed):
        return REGRADE, changed
    return RERUN, changed


@dataclass
class Pair:
    key: tuple[Any, ...]
    a: Ref
    b: Ref
    reward_a: float
    reward_b: float
    failure_a: str
    failure_b: str
    klass: str
    changed: list[str]

    @property
    def delta(self) -> float | None:
        d = self.reward_b - self.reward_a
        return None if math.isnan(d) else d

    @property
    def flip(self) -> str:
        pa, pb = passed(self.reward_a) and not self.failure_a, passed(self.reward_b) and not self.failure_b
        return "pass→fail" if pa and not pb else "fail→pass" if pb and not pa else ""


@dataclass
class Diff:
    a: Run
    b: Run
    pairs: list[Pair]
    only_a: int
    only_b: int
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def flips(self) -> dict[str, int]:
        out = {"pass→fail": 0, "fail→pass": 0}
        for p in self.pairs:
            if p.flip:
                out[p.flip] += 1
        return out

    def mean(self, side: str) -> float | None:
        values = [getattr(p, f"reward_{side}") for p in self.pairs]
        values = [v for v in values if not math.isnan(v)]
        return sum(values) / len(values) if values else None

    def as_json(self) -> dict[str, Any]:
        return {
            "a": str(self.a.path),
            "b": str(self.b.path),
            "common": len(self.pairs),
            "only_a": self.only_a,
            "only_b": self.only_b,
            "mean_reward": {"a": self.mean("a"), "b": self.mean("b")},
            "flips": self.flips,
            "classes": self.counts,
            "rows": [
                {
                    "task": p.key[-2],
                    "rollout": p.key[-1],
                    **({"agent": p.key[0]} if len(p.key) == 3 else {}),
                    "reward_a": None if math.isnan(p.reward_a) else p.reward_a,
                    "reward_b": None if math.isnan(p.reward_b) else p.reward_b,
                    "delta": p.delta,
                    "failure_a": p.failure_a or None,
                    "failure_b": p.failure_b or None,
                    "flip": p.flip or None,
                    "class": p.klass,
                    "changed": p.changed,
                }
                for p in self.pairs
            ],
        }


def _keyed(run: Run, by_agent: bool, provenance: Any) -> dict[tuple[Any, ...], tuple[Ref, float, str, dict[str, str]]]:
    out: dict[tuple[Any, ...], tuple[Ref, float, str, dict[str, str]]] = {}
    for p, part in enumerate(run.parts):
        ix = part.ix
        for i in range(len(ix)):
            key: tuple[Any, ...] = (ix.task[i], ix.rollout[i])
            if by_agent:
                key = (ix.name(ix.agent[i]), *key)
            failure = ix.name(ix.error_class[i]) or ("failure" if part.failures else "")
            prev = out.get(key)
            if prev is not None and not prev[2]:
                continue  # a row is kept over a failure row of the same slot
            out[key] = (Ref(run.id, p, i), ix.reward[i], failure, provenance(Ref(run.id, p, i)))
    return out


def diff(a: Run, b: Run, provenance: Any) -> Diff:
    """``a`` and ``b`` over their common (task, rollout) slots (with the agent, where both ran the same
    agents); ``provenance(ref)``: the provenance parts of a row. No slot in common is the user's mistake."""
    agents_a = {a.parts[0].ix.name(x) for part in a.parts for x in set(part.ix.agent)}
    agents_b = {b.parts[0].ix.name(x) for part in b.parts for x in set(part.ix.agent)}
    by_agent = agents_a == agents_b
    ka, kb = _keyed(a, by_agent, provenance), _keyed(b, by_agent, provenance)
    common = sorted(ka.keys() & kb.keys(), key=lambda k: tuple(str(x) if isinstance(x, str) else x for x in k))
    if not common:
        raise UserError(f"{a.path} and {b.path} have no task in common (nothing to compare)")
    pairs = []
    counts = {REUSE: 0, REGRADE: 0, RERUN: 0}
    for key in common:
        (ra, wa, fa, pa), (rb, wb, fb, pb) = ka[key], kb[key]
        klass, changed = classify(pa, pb)
        counts[klass] += 1
        pairs.append(Pair(key, ra, rb, wa, wb, fa, fb, klass, changed))
    return Diff(a, b, pairs, len(ka.keys() - kb.keys()), len(kb.keys() - ka.keys()), counts)


def compare(runs: Runs, a: int, b: int) -> Diff:
    """Runs ``a`` and ``b`` of ``runs`` compared (provenance from their indexes)."""
    return diff(runs.runs[a], runs.runs[b], lambda ref: runs.part(ref).ix.parts(ref.line))
