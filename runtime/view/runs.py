"""The runs a ``view`` shows: each rollouts file with its sidecars, indexed, and what the pages compute from
the indexes alone (summaries, filters, sorts), never from the rows themselves.

A row is named by ``(run, part, line)``: integers into the files given on the command line, so no request
names a path.
"""

from __future__ import annotations

import json
import math
import tempfile
from bisect import bisect_left, bisect_right
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from gym_runtime.data.atif import from_atif, is_atif
from gym_runtime.data.collector import sidecar_paths
from gym_runtime.data.sidecars import attempts_path, batch_path
from gym_runtime.errors import UserError
from gym_runtime.view import index as index_mod
from gym_runtime.view.index import Index

PASS = 1.0  # a rollout passes with a reward of at least this (pass@k, the diff's flips)
BINS = 10


@dataclass
class Part:
    """One file of a run: its rows (``failures``: its ``_failures.jsonl``)."""

    path: Path
    ix: Index
    failures: bool


@dataclass
class Run:
    id: int
    label: str
    path: Path
    parts: list[Part]
    metrics: Any = None  # its ``_aggregate_metrics.json``, when there is one
    batch: Any = None  # its ``_batch.json`` (``run`` and ``collect`` write it): batch id, manifest, config
    attempts: Attempts | None = None  # its ``_attempts.jsonl``
    live: Any = None  # a batch followed on the bus (``view.live.Live``): it grows

    def ref(self, p: int, i: int) -> Ref:
        return Ref(self.id, p, i)

    def refs(self) -> list[Ref]:
        return [Ref(self.id, p, i) for p, part in enumerate(self.parts) for i in range(len(part.ix))]


class _Slot(msgspec.Struct):
    task_index: int = -1
    rollout_index: int = -1


class Attempts:
    """A run's ``_attempts.jsonl`` (``data.sidecars``): each line's slot and offset, so a trajectory's records
    are read alone."""

    def __init__(self, path: Path) -> None:
        self.path = path
        keyed = []
        decode = msgspec.json.Decoder(_Slot).decode
        for number, offset, line in index_mod.lines(path):
            try:
                s = decode(line)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                raise UserError(f"{path}:{number}: not an attempt record ({e})") from None
            keyed.append(((s.task_index, s.rollout_index), offset, len(line)))
        keyed.sort(key=lambda k: k[0])
        self.keys = [k for k, _, _ in keyed]
        self.spans = [(o, n) for _, o, n in keyed]

    def of(self, task: int, rollout: int) -> list[dict[str, Any]]:
        lo, hi = bisect_left(self.keys, (task, rollout)), bisect_right(self.keys, (task, rollout))
        out = []
        with self.path.open("rb") as f:
            for offset, size in self.spans[lo:hi]:
                f.seek(offset)
                out.append(json.loads(f.read(size)))
        return out


class Ref(msgspec.Struct, frozen=True, array_like=True):
    run: int
    part: int
    line: int


@dataclass
class Runs:
    runs: list[Run]
    scratch: Any = None  # where ATIF files given were converted to rows (a TemporaryDirectory: gone with it)

    def part(self, ref: Ref) -> Part:
        return self.runs[ref.run].parts[ref.part]

    def get(self, run: int, part: int, line: int) -> Ref | None:
        """The row those integers name, or None (a request's path parts: nothing else is ever opened)."""
        if 0 <= run < len(self.runs) and 0 <= part < len(self.runs[run].parts):
            if 0 <= line < len(self.runs[run].parts[part].ix):
                return Ref(run, part, line)
        return None

    def raw(self, ref: Ref) -> bytes:
        p = self.part(ref)
        return index_mod.read_line(p.path, p.ix, ref.line)

    def all(self) -> list[Ref]:
        return [r for run in self.runs for r in run.refs()]


def open_runs(paths: list[str]) -> Runs:
    """Each file given, with its ``_failures.jsonl`` beside it (when it is not that file itself), indexed."""
    runs: list[Run] = []
    out = Runs(runs)
    labels = [Path(p).name for p in paths]
    for n, arg in enumerate(paths):
        path = Path(arg)
        if not path.is_file():
            raise UserError(
                f"{arg}: no such file; give a rollouts JSONL (what `run` or `collect` wrote with -o) or an ATIF file"
                if not path.exists()
                else f"{arg}: not a file"
            )
        if atif_file(path):
            if out.scratch is None:
                out.scratch = tempfile.TemporaryDirectory(prefix="gym-view-atif-")
            rows = Path(out.scratch.name) / f"{n}-{path.name}.jsonl"
            rows.write_bytes(
                b"".join(json.dumps(from_atif(doc, i)).encode() + b"\n" for i, doc in enumerate(atif_docs(path)))
            )
            runs.append(Run(n, labels[n], path, [Part(rows, index_mod.load(rows), failures=False)]))
            continue
        parts = [Part(path, index_mod.load(path), failures=path.name.endswith("_failures.jsonl"))]
        failures, metrics_path = sidecar_paths(path)
        if failures != path and failures.is_file():
            parts.append(Part(failures, index_mod.load(failures), failures=True))
        label = labels[n] if labels.count(labels[n]) == 1 else str(path)
        run = Run(n, label, path, parts, _json_file(metrics_path), _json_file(batch_path(path)))
        if attempts_path(path).is_file():
            run.attempts = Attempts(attempts_path(path))
        runs.append(run)
    return out


def atif_file(path: Path) -> bool:
    """Whether ``path`` holds ATIF trajectories (a document, a list of them, or one a line), from its start."""
    with path.open("rb") as f:
        head = f.read(4096).lstrip()
    return head[:1] in (b"{", b"[") and b'"schema_version"' in head and b'"ATIF-' in head


def atif_docs(path: Path) -> list[Any]:
    """The ATIF documents of ``path``: one JSON value (a document or a list), else one a line."""
    try:
        whole = json.loads(path.read_bytes())
        docs = whole if isinstance(whole, list) else [whole]
    except ValueError:
        docs = []
        for number, _, line in index_mod.lines(path):
            try:
                docs.append(json.loads(line))
            except ValueError as e:
                raise UserError(f"{path}:{number}: not JSON ({e})") from None
    for i, doc in enumerate(docs):
        if not is_atif(doc):
            raise UserError(f"{path}: trajectory {i + 1} is not an ATIF document (no schema_version ATIF-...)")
    return docs


def _json_file(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return msgspec.json.decode(path.read_bytes())
    except msgspec.DecodeError as e:
        raise UserError(f"{path}: not JSON ({e})") from None


# ------------------------------------------------------------------ what the runs page shows


def passed(reward: float) -> bool:
    return not math.isnan(reward) and reward >= PASS


def pass_at_k(groups: list[tuple[int, int]], k: int) -> float | None:
    """The unbiased pass@k over tasks, each ``(rollouts, passes)`` (those with fewer than k rollouts left out)."""
    scores = [1.0 - (math.comb(n - c, k) / math.comb(n, k)) for n, c in groups if n >= k]
    return sum(scores) / len(scores) if scores else None


@dataclass
class Histogram:
    label: str
    lo: float
    hi: float
    counts: list[int]

    def bars(self, width: int = 300, height: int = 80) -> list[dict[str, Any]]:
        """SVG rectangles (numbers only: the template writes them as attributes)."""
        top = max(self.counts) or 1
        w = width / len(self.counts)
        step = (self.hi - self.lo) / len(self.counts)
        out = []
        for b, c in enumerate(self.counts):
            h = round(height * c / top, 1)
            lo = self.lo + b * step
            out.append({"x": round(b * w, 1), "y": height - h, "w": round(w - 2, 1), "h": h, "count": c, "lo": lo})
        return out


@dataclass
class Summary:
    run: Run
    rows: int = 0
    failures: int = 0
    mean_reward: float | None = None
    pass_at: dict[int, float] = field(default_factory=dict)
    failure_classes: list[tuple[str, int]] = field(default_factory=list)
    tokens: int = 0
    busy_ms: int = 0
    costs: dict[str, float] = field(default_factory=dict)  # currency -> estimated total
    histograms: list[Histogram] = field(default_factory=list)
    slowest: list[tuple[Ref, int]] = field(default_factory=list)
    agents: list[str] = field(default_factory=list)


def summarize(run: Run, slowest: int = 10) -> Summary:
    s = Summary(run)
    rewards: dict[tuple[str, str], list[float]] = defaultdict(list)
    groups: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0, 0])
    classes: Counter[str] = Counter()
    total = 0.0
    counted = 0
    busy: list[tuple[int, Ref]] = []
    agents: set[str] = set()
    for p, part in enumerate(run.parts):
        ix = part.ix
        for i in range(len(ix)):
            agent = ix.name(ix.agent[i])
            agents.add(agent)
            fc = ix.error_class[i]
            r = ix.reward[i]
            if fc >= 0 or part.failures:
                s.failures += 1
                classes[ix.name(fc) or "?"] += 1
            else:
                s.rows += 1
                if not math.isnan(r):
                    total += r
                    counted += 1
                    rewards[(agent, ix.name(ix.env[i]))].append(r)
            g = groups[(agent, ix.task[i])]
            g[0] += 1
            g[1] += passed(r) and fc < 0
            s.tokens += ix.tokens[i]
            s.busy_ms += ix.busy_ms[i]
            if not math.isnan(ix.cost[i]):
                cur = ix.name(ix.currency[i]) or "?"
                s.costs[cur] = s.costs.get(cur, 0.0) + ix.cost[i]
            busy.append((ix.busy_ms[i], Ref(run.id, p, i)))
    s.mean_reward = total / counted if counted else None
    pairs = [(n, c) for n, c in groups.values()]
    for k in sorted({1, max((n for n, _ in pairs), default=1)}):
        v = pass_at_k(pairs, k)
        if v is not None:
            s.pass_at[k] = v
    s.failure_classes = classes.most_common()
    s.agents = sorted(agents)
    for (agent, env), values in sorted(rewards.items()):
        lo, hi = min(0.0, *values), max(1.0, *values)
        counts = [0] * BINS
        for v in values:
            counts[min(BINS - 1, int((v - lo) / (hi - lo) * BINS))] += 1
        s.histograms.append(Histogram(f"{agent or '?'} / {env or '?'}", lo, hi, counts))
    busy.sort(key=lambda t: -t[0])
    s.slowest = [(ref, ms) for ms, ref in busy[:slowest] if ms > 0]
    return s


# ------------------------------------------------------------------ the rollouts table


class Query(msgspec.Struct, kw_only=True):
    """The rollouts table's filters, sort and page, as the form sends them (all optional)."""

    run: int | None = None
    agent: str | None = None
    env: str | None = None
    failure: str | None = None  # a class; "none": rows only; "any": failures only
    rmin: float | None = None
    rmax: float | None = None
    pv: int | None = None  # a policy version within the row's [min, max]
    q: str | None = None
    sort: str = "order"
    desc: bool = False
    page: int = 1


SORTS = {
    "order": None,
    "reward": "reward",
    "task": "task",
    "busy": "busy_ms",
    "tokens": "tokens",
    "cost": "cost",
}
PAGE = 50


def select(runs: Runs, q: Query) -> list[Ref]:
    """The rows that pass ``q``'s filters, sorted (full-text search reads only the rows the others left)."""
    out: list[Ref] = []
    for run in runs.runs:
        if q.run is not None and run.id != q.run:
            continue
        for p, part in enumerate(run.parts):
            ix = part.ix
            want_agent = _name_id(ix, q.agent)
            want_env = _name_id(ix, q.env)
            want_fc = _name_id(ix, q.failure) if q.failure not in (None, "none", "any") else None
            if -2 in (want_agent, want_env, want_fc):
                continue  # a name this file does not have
            keep = []
            for i in range(len(ix)):
                if want_agent is not None and ix.agent[i] != want_agent:
                    continue
                if want_env is not None and ix.env[i] != want_env:
                    continue
                failed = part.failures or ix.error_class[i] >= 0
                if (q.failure == "none" and failed) or (q.failure == "any" and not failed):
                    continue
                if want_fc is not None and ix.error_class[i] != want_fc:
                    continue
                r = ix.reward[i]
                if q.rmin is not None and not (r >= q.rmin):
                    continue
                if q.rmax is not None and not (r <= q.rmax):
                    continue
                if q.pv is not None and not (ix.pv_min[i] <= q.pv <= ix.pv_max[i]):
                    continue
                keep.append(i)
            if q.q:
                keep = index_mod.search(part.path, ix, q.q, keep)
            out += [Ref(run.id, p, i) for i in keep]
    col = SORTS.get(q.sort)
    if col is not None:

        def key(ref: Ref) -> float:
            v = getattr(runs.part(ref).ix, col)[ref.line]
            return -math.inf if isinstance(v, float) and math.isnan(v) else v

        out.sort(key=key, reverse=q.desc)
    elif q.desc:
        out.reverse()
    return out


def _name_id(ix: Index, name: str | None) -> int | None:
    """None: no filter; -2: this file has no such name."""
    if not name:
        return None
    try:
        return ix.names.index(name)
    except ValueError:
        return -2


def choices(runs: Runs) -> dict[str, list[str]]:
    """The values the table's filters offer: agents, environments, failure classes."""
    out: dict[str, set[str]] = {"agent": set(), "env": set(), "failure": set()}
    for run in runs.runs:
        for part in run.parts:
            ix = part.ix
            for col, key in (("agent", "agent"), ("env", "env"), ("error_class", "failure")):
                out[key].update(ix.names[i] for i in set(getattr(ix, col)) if i >= 0)
    return {k: sorted(v) for k, v in out.items()}
