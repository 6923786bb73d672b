"""What ``view`` shows of a training run: each row's step, group, handed-over reward and advantage (the keys a trainer
adapter's ``rows_path`` file adds, ``trainers.train_rows``), its groups with their spread, and the figures per step
the plots draw.

A rollouts file with no training keys is grouped by (agent, task) and stepped by policy version, so a plain
``run``'s output has group pages too. A part's training columns are read in one pass beside its index (only the few
keys below are decoded; the rest of a row is skipped) and read again when the file has grown.

A training field may hold any number a JSON writer writes (±1e308, 10**400, a 40-digit integer, NaN, the
infinities): each is kept as written for its page, and the statistics (``numbers``) take it as a float, never
overflowing, so a page shows "inf" or "not a number" where a mean cannot be had, and never fails.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from gym_runtime.data.rowkeys import TrainFields
from gym_runtime.data.sampling import TaskStats, outcome, signal
from gym_runtime.view import index as index_mod
from gym_runtime.view.numbers import mean, spread
from gym_runtime.view.runs import Part, Ref, Run, passed

UNATTRIBUTED = "unattributed"  # a failure row written before rows carried ``failure_attribution``


class _Usage(msgspec.Struct):
    output_tokens: int = 0


class _Response(msgspec.Struct):
    usage: _Usage | None = None


class _ModelOut(msgspec.Struct):
    output_tokens: int = 0


class _Cost(msgspec.Struct):
    models: dict[str, _ModelOut] = {}


class _Train(TrainFields, kw_only=True):
    """What a page of this module reads of a row: the training keys (``rowkeys.TrainFields``), their numbers of
    any size as written (10**400 is no float: msgspec keeps an integer whole), and these."""

    train_reward: int | float | None = None
    train_advantage: int | float | None = None
    failure_attribution: str | None = None
    response: _Response | None = None
    cost: _Cost | None = None


_decode = msgspec.json.Decoder(_Train).decode
_FIELDS = {f.encode_name: f for f in msgspec.structs.fields(_Train)}


def _lenient(line: bytes) -> _Train:
    """A row whose fields are of other types, or that holds ``NaN`` or ``Infinity`` (or not a row at all): what
    fits, kept."""
    out = _Train()
    try:
        value = json.loads(line)
    except (ValueError, RecursionError):  # (a line rewritten under a running view: its page says why)
        return out
    if not isinstance(value, dict):
        return out
    for key, f in _FIELDS.items():
        if key in value:
            try:
                setattr(out, f.name, msgspec.convert(value[key], f.type))
            except msgspec.ValidationError:
                pass
    return out


def _length(t: _Train) -> int:
    if t.cost is not None and t.cost.models:
        return sum(m.output_tokens for m in t.cost.models.values())
    if t.response is not None and t.response.usage is not None:
        return t.response.usage.output_tokens
    return 0


@dataclass
class TrainColumns:
    """One part's training columns, one entry per line of its index."""

    size: int
    step: list[int] = field(default_factory=list)  # -1: none
    group: list[str | None] = field(default_factory=list)
    reward: list[float | None] = field(default_factory=list)  # handed over, as written; None: none (excluded)
    advantage: list[float | None] = field(default_factory=list)  # as written; None: none
    attribution: list[str] = field(default_factory=list)  # "" none
    length: list[int] = field(default_factory=list)  # generated tokens
    training: bool = False  # any line has a train_group
    task: list[str | None] = field(default_factory=list)  # the task's sampler key (``train_task``); None: none


def read_columns(path: Path, ix: index_mod.Index) -> TrainColumns:
    """The training columns of ``path``'s lines that ``ix`` indexes (matched by byte offset)."""
    at = {o: i for i, o in enumerate(ix.offsets)}
    n = len(ix)
    try:
        size = path.stat().st_size
    except OSError:  # removed while viewed (the runs page says so): no column to read
        size = -1
    cols = TrainColumns(size, [-1] * n, [None] * n, [None] * n, [None] * n, [""] * n, [0] * n, task=[None] * n)
    for _, offset, line in index_mod.lines(path) if size >= 0 else ():
        i = at.get(offset)
        if i is None:
            continue
        try:
            t = _decode(line)
        except (msgspec.ValidationError, msgspec.DecodeError):
            t = _lenient(line)
        cols.step[i] = t.train_step if t.train_step is not None and t.train_step >= 0 else -1
        if t.train_group is not None:
            cols.group[i] = str(t.train_group)
            cols.training = True
        cols.reward[i] = t.train_reward
        cols.advantage[i] = t.train_advantage
        cols.attribution[i] = t.failure_attribution if isinstance(t.failure_attribution, str) else ""
        cols.length[i] = _length(t)
        cols.task[i] = t.train_task if isinstance(t.train_task, str) else None
    return cols


@dataclass
class Member:
    ref: Ref
    task: int | None
    rollout: int | None
    step: int | None
    reward: float  # NaN: none
    handed: float | None  # the reward handed to the trainer, as written (None: excluded, or none)
    advantage: float | None  # as written (None: none)
    length: int
    failure: str  # the class, "" a row
    attribution: str
    scored: bool  # in the group's statistics


@dataclass
class Group:
    n: int  # its number in the run (the group page's address)
    label: str
    step: int | None
    task: int | None
    members: list[Member] = field(default_factory=list)

    @property
    def scored(self) -> list[float]:
        return [m.handed if m.handed is not None else m.reward for m in self.members if m.scored]

    @property
    def mean(self) -> float | None:
        return mean(self.scored)

    @property
    def spread(self) -> float | None:
        """The population standard deviation of the scored rewards (None: fewer than two)."""
        s = self.scored
        return spread(s) if len(s) >= 2 else None

    @property
    def zero_spread(self) -> bool:
        return self.spread == 0.0


@dataclass
class Step:
    step: int
    rewards: list[float] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    lengths: list[int] = field(default_factory=list)
    tasks: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))

    @property
    def mean(self) -> float | None:
        return mean(self.rewards)

    @property
    def std(self) -> float:
        return spread(self.rewards) if len(self.rewards) >= 2 else 0.0

    @property
    def pass_rate(self) -> float | None:
        return sum(passed(r) for r in self.rewards) / len(self.rewards) if self.rewards else None


@dataclass
class TaskLine:
    """One task of a training run (its sampler key): the groups it was picked for, its outcomes step by step, and
    the sampler's estimate of its signal from them (``data.sampling``'s rule, the one the sampler keeps in the KV)."""

    key: str
    first: Ref  # its first rollout (what the task is)
    groups: set[int] = field(default_factory=set)
    steps: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))  # step -> scored rewards
    stats: TaskStats = field(default_factory=TaskStats)

    def see(self, m: Member, group: int) -> None:
        self.groups.add(group)
        row = {"error_class": m.failure, "failure_attribution": m.attribution} if m.failure else {"reward": m.reward}
        got = outcome(row)
        self.stats.rollouts += 1
        if got is None:
            self.stats.env_failures += 1
        else:
            self.stats.outcomes += 1
            self.stats.passes += got
        if m.step is not None and not m.failure and not math.isnan(m.reward):
            self.steps[m.step].append(m.reward)

    @property
    def signal(self) -> float:
        return signal(self.stats)

    def history(self) -> list[tuple[int, float]]:
        """(step, pass rate) for each step it has scored rows at."""
        return [(s, sum(passed(r) for r in rs) / len(rs)) for s, rs in sorted(self.steps.items()) if rs]


@dataclass
class Training:
    """One run's groups and steps (``training``: its rows carry a trainer's keys)."""

    run: Run
    training: bool
    groups: list[Group]
    of: dict[Ref, int]  # a row's group
    steps: list[Step]
    order: list[Ref]  # every row in file order (keyboard navigation)
    members: dict[Ref, Member] = field(default_factory=dict)
    position: dict[Ref, int] = field(default_factory=dict)
    tasks: dict[str, TaskLine] = field(default_factory=dict)  # by sampler key (rows that carry ``train_task``)

    @property
    def zero_spread(self) -> list[Group]:
        return [g for g in self.groups if g.zero_spread]


class TrainingViews:
    """Each run's ``Training``, computed when first asked for and again when one of its files has grown."""

    def __init__(self) -> None:
        self._cols: dict[tuple[int, int], TrainColumns] = {}
        self._runs: dict[int, tuple[tuple[int, ...], Training]] = {}

    def columns(self, run: Run, p: int) -> TrainColumns:
        part = run.parts[p]
        cols = self._cols.get((run.id, p))
        if cols is None or len(cols.step) != len(part.ix) or cols.size != _size(part):
            cols = self._cols[(run.id, p)] = read_columns(part.path, part.ix)
        return cols

    def of(self, run: Run) -> Training:
        stamp = tuple(len(p.ix) for p in run.parts) + tuple(_size(p) for p in run.parts)
        kept = self._runs.get(run.id)
        if kept is not None and kept[0] == stamp:
            return kept[1]
        t = build(run, [self.columns(run, p) for p in range(len(run.parts))])
        self._runs[run.id] = (stamp, t)
        return t


def _size(part: Part) -> int:
    try:
        return part.path.stat().st_size
    except OSError:
        return -1


def build(run: Run, cols: list[TrainColumns]) -> Training:
    training = any(c.training for c in cols)
    groups: list[Group] = []
    keyed: dict[tuple[Any, ...], int] = {}
    of: dict[Ref, int] = {}
    steps: dict[int, Step] = {}
    order: list[Ref] = []
    tasks: dict[str, TaskLine] = {}
    for p, (part, c) in enumerate(zip(run.parts, cols, strict=True)):
        ix = part.ix
        for i in range(len(ix)):
            ref = Ref(run.id, p, i)
            order.append(ref)
            task = ix.task[i] if ix.task[i] >= 0 else None
            failure = ix.name(ix.error_class[i]) or ("failure" if part.failures else "")
            step = c.step[i] if c.step[i] >= 0 else (ix.pv_max[i] if ix.pv_max[i] >= 0 else None)
            if training:
                key: tuple[Any, ...] = ("g", c.group[i]) if c.group[i] is not None else ("t", ix.agent[i], task, step)
                scored = c.reward[i] is not None
            else:
                key = ("t", ix.name(ix.agent[i]), task)
                scored = not failure and not math.isnan(ix.reward[i])
            n = keyed.get(key)
            if n is None:
                n = keyed[key] = len(groups)
                label = f"group {c.group[i]}" if key[0] == "g" else f"task {'–' if task is None else task}"
                groups.append(Group(n, label, step, task))
            attribution = c.attribution[i] or (UNATTRIBUTED if failure else "")
            m = Member(
                ref,
                task,
                ix.rollout[i] if ix.rollout[i] >= 0 else None,
                step,
                ix.reward[i],
                c.reward[i],
                c.advantage[i],
                c.length[i],
                failure,
                attribution,
                scored,
            )
            groups[n].members.append(m)
            of[ref] = n
            key_of_task = c.task[i]
            if key_of_task is not None:
                line = tasks.get(key_of_task)
                if line is None:
                    line = tasks[key_of_task] = TaskLine(key_of_task, ref)
                line.see(m, n)
            if step is None:
                continue
            s = steps.get(step)
            if s is None:
                s = steps[step] = Step(step)
            if failure:
                s.failures[attribution] += 1
            elif not math.isnan(ix.reward[i]):
                s.rewards.append(ix.reward[i])
                if task is not None:
                    s.tasks[task].append(ix.reward[i])
            s.lengths.append(c.length[i])
    members = {m.ref: m for g in groups for m in g.members}
    position = {ref: k for k, ref in enumerate(order)}
    return Training(run, training, groups, of, [steps[k] for k in sorted(steps)], order, members, position, tasks)


def neighbours(t: Training, ref: Ref) -> dict[str, Ref | None]:
    """The rows keyboard navigation goes to from ``ref``: the next and previous rollout, failure, group and step in
    the run's order (the row's own file first, then the next)."""
    order = t.order
    k = t.position.get(ref)
    if k is None:
        return {}
    members = t.members
    me = members[ref]
    here = t.of[ref]

    def find(step: int, pred: Any) -> Ref | None:
        j = k + step
        while 0 <= j < len(order):
            if pred(members[order[j]], order[j]):
                return order[j]
            j += step
        return None

    out: dict[str, Ref | None] = {}
    for name, step in (("next", 1), ("prev", -1)):
        out[f"{name}_rollout"] = find(step, lambda m, r: True)
        out[f"{name}_failure"] = find(step, lambda m, r: bool(m.failure))
        out[f"{name}_group"] = find(step, lambda m, r: t.of[r] != here)
        out[f"{name}_step"] = (
            find(step, lambda m, r: m.step is not None and m.step != me.step) if me.step is not None else None
        )
    return out
