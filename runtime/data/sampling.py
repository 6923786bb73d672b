"""Which task to run next: the decisions of the runtime's task sampler (issue 79), pure, with no bus.

A GRPO group whose rollouts all pass or all fail has no spread, so no advantage: it teaches nothing and costs its
whole generation. Each task keeps a Beta posterior of its pass rate (a scored row's reward clipped to [0, 1] is its
share of a pass; a policy failure is a fail; an environment or infrastructure failure is no outcome at all, only
counted, so a broken environment never makes a task look hard). A task's expected signal is its posterior mean
of p(1-p) (learnability: 1/4 at p = 1/2, 0 for a task always or never solved); divided by its cost (rollouts,
generated tokens, sandbox seconds or the row's estimated cost) and raised to ``sharpness`` (how strongly the best
tasks are preferred) it weighs the task. Old outcomes fade: each counts half after ``half_life`` later outcomes
of its task, so a task the policy has learned stops looking learnable, one that starts being solved is seen to,
and no record grows so certain that new outcomes cannot move it. A floor keeps every task a minimum chance, and a
task not picked for ``revisit_after`` picks is picked again outright, so a task that becomes learnable is found
again. ``score: uniform`` (the default) is uniform sampling without replacement.

What cannot teach is skipped (``skip_below``, off by default): a task whose expected signal is below it (its pass
rate, by the faded evidence and its uncertainty, near 0 or 1) gets no weight beyond the floor and is not revisited,
so only the floor's exploration spends on it (and finds it again should it become learnable: its record moves only
when it is run). When no task of the set can teach the set is *exhausted*: the picks are the floor's (uniform) and
the caller is told (``Pick.exhausted``), so a trainer can stop rather than train on groups with no advantage.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import msgspec

from gym_runtime.data.attribution import attribute

__all__ = [
    "CostMeasure",
    "Pick",
    "SamplerConfig",
    "TaskStats",
    "cannot_teach",
    "choose",
    "observe",
    "outcome",
    "row_cost",
    "signal",
    "task_key",
    "weights",
    "zero_spread_chance",
]

CostMeasure = Literal["rollouts", "tokens", "sandbox_s", "cost"]


class SamplerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The sampler's few knobs (docs/trainer.md "Choosing tasks")."""

    score: Literal["uniform", "learnability"] = "uniform"  # uniform: every task alike (the default)
    floor: float = 0.1  # the share of picks spread uniformly over every task (exploration), 0..1
    revisit_after: int = 0  # a task not picked for this many picks is picked again (0: 4 x the number of tasks)
    cost: CostMeasure = "rollouts"  # what a rollout costs: 1, its generated tokens, sandbox seconds, or its cost
    sharpness: float = 4.0  # the weight is (signal per cost) to this power: 1 proportional, more: the best first
    prior: tuple[float, float] = (1.0, 1.0)  # Beta(passes, fails) before any outcome
    half_life: float = 16.0  # an outcome counts half after this many later outcomes of its task (0: never fades)
    run: str = "default"  # whose statistics: two runs in one namespace keep their own (the same run: shared)
    skip_below: float = (
        0.0  # a task whose expected signal is below this cannot teach: skipped but for the floor (0: off)
    )

    def __post_init__(self) -> None:
        if not 0.0 <= self.floor <= 1.0:
            raise ValueError(f"sampler floor {self.floor}: give a share between 0 and 1 (0.1 keeps 10% uniform)")
        if not 0.0 < self.sharpness <= 32.0:
            raise ValueError(f"sampler sharpness {self.sharpness}: give a power above 0 and at most 32 (4 by default)")
        if not (self.half_life == 0 or 1.0 <= self.half_life < math.inf):
            raise ValueError(
                f"sampler half_life {self.half_life}: give 0 (keep every outcome) or at least 1 outcome (16 by default)"
            )
        if self.revisit_after < 0:
            raise ValueError(f"sampler revisit_after {self.revisit_after}: give 0 (the default) or a positive count")
        if len(self.prior) != 2 or min(self.prior) <= 0:
            raise ValueError(f"sampler prior {self.prior}: give two positive numbers (1, 1 is uniform)")
        if not 0.0 <= self.skip_below < 0.25:
            raise ValueError(
                f"sampler skip_below {self.skip_below}: give an expected signal from 0 (off) to below 0.25 (the most "
                "p(1-p) can be; 0.05 skips a task solved, or failed, about 19 times in 20)"
            )
        if self.skip_below > 0 and self.floor <= 0:
            raise ValueError(
                f"sampler skip_below {self.skip_below} with floor 0: a skipped task would never be tried again; give "
                "a floor above 0 (0.1 keeps 10% uniform)"
            )
        if not self.run or not all(c.isalnum() or c in "-_" for c in self.run):
            raise ValueError(f"sampler run {self.run!r}: give letters, digits, '-' and '_' only")


class TaskStats(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One task's record (the KV value): outcomes, failures kept out of them, groups and their spread, cost."""

    passes: float = 0.0  # sum of clipped rewards of scored rows (and 0 per policy failure), faded by half_life
    outcomes: float = 0.0  # scored rows and policy failures, faded alike (the Beta posterior's evidence)
    env_failures: int = 0  # environment and infrastructure failures: not outcomes
    groups: int = 0
    zero_spread: int = 0  # groups whose outcomes all had the same reward
    cost: float = 0.0  # summed over every rollout run (failed ones too: they cost)
    rollouts: int = 0
    last_pick: int = -1  # the sampler's pick count when it was last picked (-1: never)


class Pick(msgspec.Struct, kw_only=True):
    """One choice: the tasks, and what the choice skipped and why (for the logged metrics)."""

    tasks: list[int]
    revisited: int = 0  # picked because not seen for revisit_after picks
    signal: float = 0.0  # mean expected signal of the picked tasks
    skipped_low_signal: int = 0  # tasks whose weight was below a uniform share that were not picked
    skipped_cannot_teach: int = 0  # tasks whose expected signal was below skip_below that were not picked
    exhausted: bool = False  # no task could teach: the picks were the floor's exploration alone


def task_key(row: Mapping[str, Any]) -> str:
    """A task's stable name: a hash of its row (the same row in another process, or after a restart, is the same
    task; a KV key's characters)."""
    body = msgspec.json.encode({k: v for k, v in row.items() if not k.startswith("_ng_")}, order="sorted")
    return hashlib.sha256(body).hexdigest()[:20]


def outcome(row: Mapping[str, Any]) -> float | None:
    """A row's share of a pass: a scored row's reward clipped to [0, 1], 0 for a policy failure, None for an
    environment or infrastructure failure (no outcome: the task is not harder for it)."""
    if "error_class" in row:
        given = row.get("failure_attribution")
        who = given if given in ("policy", "environment", "infrastructure") else attribute(str(row["error_class"]))
        return 0.0 if who == "policy" else None
    reward = row.get("reward", 0.0)
    r = float(reward) if isinstance(reward, int | float) and not isinstance(reward, bool) else 0.0
    return min(1.0, max(0.0, r)) if math.isfinite(r) else 0.0


def row_cost(row: Mapping[str, Any], measure: CostMeasure) -> float:
    """What one rollout cost by ``measure`` (a row that does not say: 1 rollout, 0 of the rest)."""
    if measure == "rollouts":
        return 1.0
    cost = row.get("cost")
    cost = cost if isinstance(cost, dict) else {}
    if measure == "tokens":
        return float(sum(int(m.get("output_tokens", 0)) for m in (cost.get("models") or {}).values()))
    if measure == "sandbox_s":
        return float(cost.get("sandbox_ms", 0)) / 1000.0
    return float(cost.get("estimated_cost") or 0.0)


def observe(
    stats: TaskStats, rows: Sequence[Mapping[str, Any]], measure: CostMeasure = "rollouts", half_life: float = 0.0
) -> TaskStats:
    """``stats`` with one group's rows counted (a new record: the stored one is replaced whole); with
    ``half_life`` the earlier outcomes first fade by half per ``half_life`` new ones (the counts of groups, spread
    and cost do not: they are what happened)."""
    out = msgspec.structs.replace(stats)
    got = []
    for row in rows:
        o = outcome(row)
        out.rollouts += 1
        out.cost += row_cost(row, measure)
        if o is None:
            out.env_failures += 1
        else:
            got.append(o)
    if got:
        if half_life > 0:
            fade = 0.5 ** (len(got) / half_life)
            out.passes *= fade
            out.outcomes *= fade
        out.passes += sum(got)
        out.outcomes += len(got)
        out.groups += 1
        out.zero_spread += int(len(got) > 1 and max(got) == min(got))
    return out


def signal(stats: TaskStats, prior: tuple[float, float] = (1.0, 1.0)) -> float:
    """The posterior mean of p(1-p) under Beta(a, b): ab / ((a+b)(a+b+1)); 1/6 for a task never seen."""
    a = prior[0] + stats.passes
    b = prior[1] + stats.outcomes - stats.passes
    return a * b / ((a + b) * (a + b + 1))


def zero_spread_chance(stats: TaskStats, n: int, prior: tuple[float, float] = (1.0, 1.0)) -> float:
    """The chance, under the posterior, that a group of ``n`` of this task is all passes or all fails:
    E[p^n] + E[(1-p)^n] under Beta(a, b) (a product: E[p^n] = prod (a+k)/(a+b+k), k < n)."""
    a = prior[0] + stats.passes
    b = prior[1] + stats.outcomes - stats.passes
    all_pass = all_fail = 1.0
    for k in range(n):
        all_pass *= (a + k) / (a + b + k)
        all_fail *= (b + k) / (a + b + k)
    return all_pass + all_fail


def cannot_teach(stats: Sequence[TaskStats], config: SamplerConfig) -> list[bool]:
    """Per task: its expected signal is below ``skip_below`` (all False when skipping is off, or uniform)."""
    if config.score == "uniform" or config.skip_below <= 0:
        return [False] * len(stats)
    return [signal(s, config.prior) < config.skip_below for s in stats]


def weights(stats: Sequence[TaskStats], config: SamplerConfig) -> list[float]:
    """Each task's chance of being picked next: signal per unit of mean cost to the power ``sharpness``,
    normalised, mixed with the floor; a task that cannot teach has the floor's share alone (every task's, uniform,
    when none can)."""
    n = len(stats)
    if n == 0:
        return []
    if config.score == "uniform":
        return [1.0 / n] * n
    costs = [s.cost / s.rollouts for s in stats if s.rollouts and s.cost > 0]
    typical = sum(costs) / len(costs) if costs else 1.0  # a task not yet measured costs the mean
    skipped = cannot_teach(stats, config)
    raw = []
    for s, skip in zip(stats, skipped, strict=True):
        per = s.cost / s.rollouts if s.rollouts and s.cost > 0 else typical
        raw.append(0.0 if skip else signal(s, config.prior) / max(per, 1e-9))
    top = max(raw)
    raw = [(r / top) ** config.sharpness if top > 0 else 0.0 for r in raw]  # scaled first: no underflow
    total = sum(raw)
    if total <= 0:
        return [1.0 / n] * n
    return [(1 - config.floor) * w / total + config.floor / n for w in raw]


def choose(stats: Sequence[TaskStats], k: int, config: SamplerConfig, rng: random.Random, clock: int) -> Pick:
    """``k`` distinct tasks (fewer when there are fewer): first those not picked for ``revisit_after`` picks
    (the longest unseen first), then by ``weights`` without replacement. ``clock``: picks made so far."""
    n = len(stats)
    k = min(k, n)
    w = weights(stats, config)
    skip = cannot_teach(stats, config)
    after = config.revisit_after or 4 * n
    due = sorted(  # never picked: -1; one that cannot teach is left to the floor
        (s.last_pick, i) for i, s in enumerate(stats) if clock - s.last_pick >= after and not skip[i]
    )
    picked = [i for _, i in due[:k]] if config.score != "uniform" else []
    revisited = len(picked)
    taken = set(picked)
    left = [i for i in range(n) if i not in taken]
    while len(picked) < k:
        i = rng.choices(left, weights=[w[j] for j in left])[0]
        picked.append(i)
        left.remove(i)
    share = sum(signal(stats[i], config.prior) for i in picked) / max(1, len(picked))
    low = sum(1 for i in left if w[i] < 1.0 / n and not skip[i]) if config.score != "uniform" else 0
    return Pick(
        tasks=picked,
        revisited=revisited,
        signal=share,
        skipped_low_signal=low,
        skipped_cannot_teach=sum(1 for i in left if skip[i]),
        exhausted=all(skip) and config.skip_below > 0 and config.score != "uniform",
    )
