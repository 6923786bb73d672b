"""Two runs compared over the rollouts they share: reward deltas, pass/fail flips, provenance changes, what
each row would need to be brought up to date, and the difference in mean reward and pass@k with a 95% interval.

The pairing rule: two rows pair when they have the same task index and rollout index (and agent, when both
runs ran the same set of agents) and, where both rows record their task's input (``responses_create_params``'s
``input`` and ``instructions``, or a failure row's task row), the same input: the same task. Rows at the same
index with different inputs are other tasks, left out and counted; two runs with no pair are the user's
mistake. Runs whose agents or environments differ are compared, with a warning that says so.

The interval: each task's mean over its paired rollouts on each side, then the paired t interval over tasks
(mean difference ± t(0.975, n-1) · sd / √n): exact for the mean of per-task differences under the usual normal
approximation, deterministic (no resampling), and the formula NeMo Gym's ``compare`` users can redo by hand.

A row's class, from which parts of its provenance changed:
REUSE: none (the same agent, model entries, environment code, grader, images); REGRADE: only what grades it
(the environment's code, the grader, the resource entry's options): ``reverify`` can redo it without the
model; RERUN: anything the rollout itself depends on (the agent or a model entry, the images, or a part one
of the two rows does not record).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from gym_runtime.data.atif import is_atif_file
from gym_runtime.errors import UserError
from gym_runtime.view.index import read_line
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
    def passed_a(self) -> bool:
        return passed(self.reward_a) and not self.failure_a

    @property
    def passed_b(self) -> bool:
        return passed(self.reward_b) and not self.failure_b

    @property
    def flip(self) -> str:
        pa, pb = self.passed_a, self.passed_b
        return "pass→fail" if pa and not pb else "fail→pass" if pb and not pa else ""


def _pass_at(n: int, c: int, k: int) -> float:
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _order(key: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(str(x) if isinstance(x, str) else x for x in key)


def task_name(key: tuple[Any, ...]) -> str:
    """A task of ``Diff.tasks`` as the pages and the terminal name it: ``7``, or ``agent/7``."""
    return "/".join(str(x) for x in key)


# t(0.975, df) for df 1..30; beyond, the Cornish-Fisher expansion around z (within 1e-3 of the table's end)
_T975 = (
    *(12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131),
    *(2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042),
)
_Z975 = 1.959964


def t975(df: int) -> float:
    if df <= len(_T975):
        return _T975[df - 1]
    z = _Z975
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


@dataclass
class Estimate:
    """A figure of both runs over the tasks they share: its value on each side, the difference (B - A) and its
    95% interval (None with fewer than two tasks); ``tasks``: how many tasks it is over."""

    name: str
    a: float
    b: float
    delta: float
    lo: float | None
    hi: float | None
    tasks: int

    def as_json(self) -> dict[str, Any]:
        return {k: _finite(v) for k, v in vars(self).items()}


def paired(name: str, per_task: list[tuple[float, float]], bound: float | None = None) -> Estimate | None:
    """The paired t interval of the mean difference over tasks, each ``(a, b)``; ``bound``: the most a
    difference can be (a rate's: 1), where the interval is cut."""
    n = len(per_task)
    if not n:
        return None
    a = sum(x for x, _ in per_task) / n
    b = sum(y for _, y in per_task) / n
    d = [y - x for x, y in per_task]
    mean = sum(d) / n
    if n < 2:
        return Estimate(name, a, b, mean, None, None, n)
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1)) if math.isfinite(mean) else math.nan
    half = t975(n - 1) * sd / math.sqrt(n)
    lo, hi = mean - half, mean + half
    if bound is not None:
        lo, hi = max(lo, -bound), min(hi, bound)
    return Estimate(name, a, b, mean, lo, hi, n)


def _finite(v: Any) -> Any:
    """A value as JSON can hold it: NaN as null, an infinity as the string "inf" or "-inf"."""
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else str(v)
    return v


@dataclass
class Diff:
    a: Run
    b: Run
    pairs: list[Pair]
    only_a: int
    only_b: int
    counts: dict[str, int] = field(default_factory=dict)
    other_tasks: int = 0  # rows at the same index whose task input differs (not paired)
    warnings: list[str] = field(default_factory=list)

    def tasks(self) -> dict[tuple[Any, ...], list[Pair]]:
        """The paired rollouts of each task (agent and task index, where the pairing has the agent)."""
        out: dict[tuple[Any, ...], list[Pair]] = {}
        for p in self.pairs:
            out.setdefault(p.key[:-1], []).append(p)
        return out

    def estimates(self) -> list[Estimate]:
        """Mean reward, pass@1 and pass@k (k: the most paired rollouts of a task), B - A with 95% intervals."""
        tasks = self.tasks().values()
        rewards = []
        for ps in tasks:
            ra = [p.reward_a for p in ps if not math.isnan(p.reward_a)]
            rb = [p.reward_b for p in ps if not math.isnan(p.reward_b)]
            if ra and rb:
                rewards.append((sum(ra) / len(ra), sum(rb) / len(rb)))
        out = [e for e in [paired("mean reward", rewards)] if e is not None]
        counts = [(len(ps), sum(p.passed_a for p in ps), sum(p.passed_b for p in ps)) for ps in tasks]
        for k in sorted({1, max((n for n, _, _ in counts), default=1)}):
            at_k = [(_pass_at(n, ca, k), _pass_at(n, cb, k)) for n, ca, cb in counts if n >= k]
            e = paired(f"pass@{k}", at_k, bound=1.0)
            if e is not None:
                out.append(e)
        return out

    def flipped_tasks(self) -> dict[str, list[tuple[Any, ...]]]:
        """The tasks solved (a paired rollout passing) in one run and not the other, each way."""
        out: dict[str, list[tuple[Any, ...]]] = {"pass→fail": [], "fail→pass": []}
        for key, ps in sorted(self.tasks().items(), key=lambda kv: _order(kv[0])):
            sa, sb = any(p.passed_a for p in ps), any(p.passed_b for p in ps)
            if sa != sb:
                out["pass→fail" if sa else "fail→pass"].append(key)
        return out

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
        flipped = self.flipped_tasks()
        return {
            "a": str(self.a.path),
            "b": str(self.b.path),
            "pairing": "task index and rollout index (and agent, where both ran the same agents), same task input",
            "warnings": self.warnings,
            "common": len(self.pairs),
            "only_a": self.only_a,
            "only_b": self.only_b,
            "other_tasks": self.other_tasks,
            "mean_reward": {"a": _finite(self.mean("a")), "b": _finite(self.mean("b"))},
            "estimates": {e.name: e.as_json() for e in self.estimates()},
            "interval": "95%, paired t over tasks (each task's mean over its paired rollouts)",
            "flips": self.flips,
            "flipped_tasks": {k: [list(t) for t in v] for k, v in flipped.items()},
            "classes": self.counts,
            "rows": [
                {
                    "task": p.key[-2],
                    "rollout": p.key[-1],
                    **({"agent": p.key[0]} if len(p.key) == 3 else {}),
                    "reward_a": _finite(p.reward_a),
                    "reward_b": _finite(p.reward_b),
                    "delta": _finite(p.delta),
                    "failure_a": p.failure_a or None,
                    "failure_b": p.failure_b or None,
                    "flip": p.flip or None,
                    "class": p.klass,
                    "changed": p.changed,
                }
                for p in self.pairs
            ],
        }


Slot = tuple[Ref, float, str, dict[str, str], int]  # a row, its reward, failure, provenance parts, input checksum


def _keyed(run: Run, by_agent: bool, provenance: Any) -> dict[tuple[Any, ...], Slot]:
    out: dict[tuple[Any, ...], Slot] = {}
    for p, part in enumerate(run.parts):
        ix = part.ix
        prompts = ix.prompt if len(ix.prompt) == len(ix) else [-1] * len(ix)
        for i in range(len(ix)):
            key: tuple[Any, ...] = (ix.task[i], ix.rollout[i])
            if by_agent:
                key = (ix.name(ix.agent[i]), *key)
            failure = ix.name(ix.error_class[i]) or ("failure" if part.failures else "")
            prev = out.get(key)
            if prev is not None and not prev[2]:
                continue  # a row is kept over a failure row of the same slot
            ref = Ref(run.id, p, i)
            out[key] = (ref, ix.reward[i], failure, provenance(ref), prompts[i])
    return out


def _names(run: Run, column: str) -> set[str]:
    """Every name of one column over a run's parts, each looked up in its own part's table."""
    return {part.ix.name(x) for part in run.parts for x in set(getattr(part.ix, column)) if x >= 0}


def _envs(run: Run) -> set[str]:
    return {run.env_label(part.ix, i) for part in run.parts for i in range(len(part.ix))} - {""}


def _how_to_pair(a: Run, b: Run) -> str:
    """What to give ``diff`` instead of two runs with no pair: runs of one input file (and, for an ATIF file of
    another tool, what its trajectories pair by)."""
    how = (
        "diff pairs rows by task and rollout index with the same input: give the outputs of two runs of the same "
        "input file (run or collect over the same -i)"
    )
    if any(is_atif_file(r.path) for r in (a, b)):
        how += (
            "; an ATIF file's trajectories keep the task index `gym-runtime export` wrote, and another tool's pair "
            "by their order in the file (the n-th is task n): export both from runs of the same tasks, in one order"
        )
    return how


def diff(a: Run, b: Run, provenance: Any) -> Diff:
    """``a`` and ``b`` paired by the module's rule; ``provenance(ref)``: the provenance parts of a row. No pair
    is the user's mistake."""
    agents_a, agents_b = _names(a, "agent"), _names(b, "agent")
    by_agent = agents_a == agents_b
    ka, kb = _keyed(a, by_agent, provenance), _keyed(b, by_agent, provenance)
    same_slot = sorted(ka.keys() & kb.keys(), key=_order)
    common: list[tuple[Any, ...]] = []
    other: list[tuple[Any, ...]] = []
    for key in same_slot:
        ca, cb = ka[key][4], kb[key][4]
        same = ca < 0 or cb < 0 or ca == cb or _task_input(a, ka[key]) == _task_input(b, kb[key])
        (common if same else other).append(key)
    if not common:
        why = "no task in common"
        if other:
            t = other[0][-2]
            why = f"no task in common: task {t}'s input differs ({len(other)} rows at the same index hold other tasks)"
        raise UserError(f"{a.path} and {b.path} have {why}; {_how_to_pair(a, b)}")
    pairs = []
    counts = {REUSE: 0, REGRADE: 0, RERUN: 0}
    for key in common:
        (ra, wa, fa, pa, _), (rb, wb, fb, pb, _) = ka[key], kb[key]
        klass, changed = classify(pa, pb)
        counts[klass] += 1
        pairs.append(Pair(key, ra, rb, wa, wb, fa, fb, klass, changed))
    warnings = []
    if not by_agent:
        warnings.append(f"the agents differ (A: {', '.join(sorted(agents_a))}; B: {', '.join(sorted(agents_b))})")
    envs_a, envs_b = _envs(a), _envs(b)
    if envs_a and envs_b and envs_a != envs_b:
        warnings.append(f"the environments differ (A: {', '.join(sorted(envs_a))}; B: {', '.join(sorted(envs_b))})")
    if other:
        warnings.append(f"{len(other)} rows at the same task index hold another task's input: left out")
    only_a, only_b = len(ka.keys() - kb.keys()), len(kb.keys() - ka.keys())
    return Diff(a, b, pairs, only_a, only_b, counts, len(other), warnings)


def _task_input(run: Run, slot: Slot) -> Any:
    """A row's task input, read whole (its checksum differed from its pair's: maybe another writer's spacing
    or escapes, maybe another task)."""
    ref = slot[0]
    part = run.parts[ref.part]
    try:
        row = json.loads(read_line(part.path, part.ix, ref.line))
    except (OSError, ValueError, RecursionError):
        return None
    params = row.get("responses_create_params") if isinstance(row, dict) else None
    if not isinstance(params, dict) and isinstance(row, dict) and isinstance(row.get("input"), dict):
        params = row["input"].get("responses_create_params")
    return (params.get("input"), params.get("instructions")) if isinstance(params, dict) else None


def compare(runs: Runs, a: int, b: int) -> Diff:
    """Runs ``a`` and ``b`` of ``runs`` compared (provenance from their indexes)."""
    return diff(runs.runs[a], runs.runs[b], lambda ref: runs.part(ref).ix.parts(ref.line))
