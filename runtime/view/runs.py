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
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from gym_runtime.data.atif import from_atif, is_atif_file, read_atif
from gym_runtime.data.collector import sidecar_paths
from gym_runtime.data.sidecars import attempts_path, batch_path
from gym_runtime.errors import UserError
from gym_runtime.view import index as index_mod
from gym_runtime.view import tokens
from gym_runtime.view.index import Index

PASS = 1.0  # a rollout passes with a reward of at least this (pass@k, the diff's flips)
BINS = 10


@dataclass
class Part:
    """One file of a run: its rows (``failures``: its ``_failures.jsonl``); ``shown``: its name on the pages
    (an ATIF file's, not the rows it was converted to); ``notice``: what happened to it while viewed."""

    path: Path
    ix: Index
    failures: bool
    shown: str = ""
    notice: str = ""
    follows: bool = True  # re-indexed when the file changes (not a converted ATIF file's rows, nor a live spool)

    def __post_init__(self) -> None:
        self.shown = self.shown or str(self.path)

    def refresh(self) -> bool:
        """Re-index the file if it changed since it was indexed; whether it did."""
        try:
            st = self.path.stat()
        except OSError as e:
            if self.notice.startswith("removed"):
                return False
            self.ix, self.notice = (
                index_mod.Builder(0, 0).ix,
                f"removed while viewed: {self.shown}: no such file ({e.strerror})",
            )
            return True
        if (st.st_size, st.st_mtime_ns) == (self.ix.size, self.ix.mtime_ns):
            return False
        ix = index_mod.update(self.path, self.ix)
        if ix is self.ix:  # (only a line still being written: no whole line yet)
            return False
        self.ix = ix
        bad = self.ix.unreadable
        self.notice = "changed while viewed: re-indexed" + (
            f"; {len(bad)} line(s) cannot be read, the first: {bad[min(bad)]}" if bad else ""
        )
        return True


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
    generation: int = 0  # bumped each time a part is re-indexed (what the pages computed from it is stale)

    resources: dict[str, str] = field(default_factory=dict)  # agent -> its resource entry (the batch's config)

    def env_label(self, ix: Index, i: int) -> str:
        """Line ``i``'s environment by name: the resource entry its agent used, from the batch sidecar's config
        (our rows name their environment's code by a digest only), else as the row names it."""
        return self.resources.get(ix.name(ix.agent[i])) or ix.name(ix.env[i])

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

    def refresh(self) -> None:
        """Re-index each file that changed since it was indexed (rewritten, truncated, grown, removed): the
        pages then read it as it is now, and say what happened."""
        for run in self.runs:
            changed = [part.refresh() for part in run.parts if part.follows]
            if any(changed):
                run.generation += 1


def _not_a_file(path: Path) -> str:
    """Why a folder (or another non-file) is not what the command reads, and the files in it that are."""
    if not path.is_dir():
        return "not a file; give a rollouts JSONL (what `run` or `collect` wrote with -o) or an ATIF file"
    sidecars = ("_failures.jsonl", "_attempts.jsonl", "_aggregate_metrics.json", "_batch.json")
    found = sorted(str(f) for f in path.iterdir() if f.suffix in (".jsonl", ".json") and not f.name.endswith(sidecars))
    inside = f", e.g. {' '.join(found[:3])}" if found else f" (none in {path})"
    return (
        "a folder, not a file: give the rollouts JSONL files (what `run` or `collect` wrote with -o) or ATIF "
        f"files in it{inside}"
    )


def open_runs(paths: list[str], *, shared: bool = False) -> Runs:
    """Each file given, with its ``_failures.jsonl`` beside it (when it is not that file itself), indexed.

    ``shared``: the pages go into a bundle to share (``--export``), so they name each file by its base name (two
    of one name by their place on the command line) and hold no path of this machine."""
    runs: list[Run] = []
    out = Runs(runs)
    labels = [Path(p).name for p in paths]
    for n, arg in enumerate(paths):
        path = Path(arg)
        if not path.is_file():
            raise UserError(
                f"{arg}: no such file; give a rollouts JSONL (what `run` or `collect` wrote with -o) or an ATIF file"
                if not path.exists()
                else f"{arg}: {_not_a_file(path)}"
            )
        not_rollouts(path)
        label = labels[n] if labels.count(labels[n]) == 1 else f"{labels[n]} (file {n + 1})" if shared else str(path)
        if is_atif_file(path):
            if out.scratch is None:
                out.scratch = tempfile.TemporaryDirectory(prefix="gym-view-atif-")
            rows = Path(out.scratch.name) / f"{n}.jsonl"
            docs = read_atif(path)
            rows.write_bytes(b"".join(json.dumps(from_atif(doc, i)).encode() + b"\n" for i, doc in enumerate(docs)))
            shown = path.name if shared else str(path)
            part = Part(rows, index_mod.load(rows), failures=False, shown=shown, follows=False)
            runs.append(Run(n, label, path, [part]))
            continue
        parts = [Part(path, index_mod.load(path), failures=path.name.endswith("_failures.jsonl"))]
        failures, metrics_path = sidecar_paths(path)
        if failures != path and failures.is_file():
            parts.append(Part(failures, index_mod.load(failures), failures=True))
        if shared:
            for part in parts:
                part.shown = part.path.name
        batch = _json_file(batch_path(path))
        if shared:
            _names_only(batch)
        run = Run(n, label, path, parts, _json_file(metrics_path), batch)
        run.resources = _resources(run.batch)
        if attempts_path(path).is_file():
            run.attempts = Attempts(attempts_path(path))
        runs.append(run)
    return out


def _names_only(batch: Any) -> None:
    """A batch sidecar's input file by its base name (what the runs page shows of it), for a bundle."""
    manifest = batch.get("manifest") if isinstance(batch, dict) else None
    if isinstance(manifest, dict) and isinstance(manifest.get("input"), str):
        manifest["input"] = Path(manifest["input"]).name


SIDECARS = {  # a file name's ending -> what it is, and the rollouts file beside it
    "_attempts.jsonl": "the attempts sidecar",
    "_batch.json": "the batch sidecar",
    "_aggregate_metrics.json": "the metrics sidecar",
}


def not_rollouts(path: Path) -> None:
    """Refuse, naming what to open instead, a file that is not rollouts: a sidecar ``run`` keeps beside its
    output, an index, or a tasks file (rows with no ``response``, ``reward`` or ``error_class``)."""
    for end, what in SIDECARS.items():
        if path.name.endswith(end) and len(path.name) > len(end):
            out = path.with_name(path.name[: -len(end)] + ".jsonl")
            raise UserError(f"{path}: {what} of {out.name}, not rollouts: open {out} (view reads its sidecars)")
    if path.name.endswith(index_mod.SUFFIX):
        raise UserError(f"{path}: view's index of a file, not rollouts: open {path.name[: -len(index_mod.SUFFIX)]}")
    first = next(index_mod.lines(path), None)
    if first is None or not first[2].lstrip().startswith(b"{"):
        return  # (empty: no rows; not JSON: the index says where)
    try:
        keys = msgspec.json.decode(first[2], type=dict[str, msgspec.Raw])
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return
    if "kind" in keys and "task_index" in keys and "response" not in keys:
        raise UserError(f"{path}:{first[0]}: an attempt record, not rollouts: open the rollouts file it sits beside")
    if not keys.keys() & {"response", "reward", "error_class"} and "responses_create_params" in keys:
        raise UserError(
            f"{path}:{first[0]}: a task row (no response, no reward), not rollouts: run the tasks first "
            f"(gym-runtime run CONFIG -i {path} -o OUT.jsonl), then view OUT.jsonl"
        )


def _resources(batch: Any) -> dict[str, str]:
    config = batch.get("config") if isinstance(batch, dict) else None
    agents = config.get("agents") if isinstance(config, dict) else None
    if not isinstance(agents, dict):
        return {}
    return {k: v["resource"] for k, v in agents.items() if isinstance(v, dict) and isinstance(v.get("resource"), str)}


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
    not_finite: dict[str, int] = field(default_factory=dict)  # "inf", "-inf", "nan": how many (not in a bin)

    def bars(self, width: int = 300, height: int = 80) -> list[dict[str, Any]]:
        """SVG rectangles (numbers only: the template writes them as attributes)."""
        top = max(self.counts) or 1
        w = width / len(self.counts)
        step = self.hi / len(self.counts) - self.lo / len(self.counts)
        out = []
        for b, c in enumerate(self.counts):
            h = round(height * c / top, 1)
            lo = self.lo + b * step
            out.append({"x": round(b * w, 1), "y": height - h, "w": round(w - 2, 1), "h": h, "count": c, "lo": lo})
        return out


def histogram(label: str, values: list[float]) -> Histogram:
    """``values`` in ``BINS`` bins over [min(0, lowest), max(1, highest)] (the finite ones: the others counted
    apart); halves compared, so a range from -1e308 to 1e308 does not overflow."""
    finite = [v for v in values if math.isfinite(v)]
    odd = Counter(str(v) for v in values if not math.isfinite(v))
    lo, hi = min([0.0, *finite]), max([1.0, *finite])
    span = hi / 2 - lo / 2
    counts = [0] * BINS
    for v in finite:
        counts[min(BINS - 1, int((v / 2 - lo / 2) / span * BINS))] += 1
    return Histogram(label, lo, hi, counts, dict(odd))


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
    pass_over: str = "task"  # what pass@k pools: an agent's "task", or a training run's "group"


def summarize(run: Run, slowest: int = 10, groups_of: Mapping[Ref, int] | None = None) -> Summary:
    """``groups_of``: a training run's groups (``training.Training.of``): pass@k pools each group's rollouts (one
    dataset row at one step), not every row sharing a task index, which each trainer call numbers from 0."""
    s = Summary(run, pass_over="task" if groups_of is None else "group")
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
                    rewards[(agent, run.env_label(ix, i))].append(r)
            g = groups[(agent, ix.task[i]) if groups_of is None else ("", groups_of[Ref(run.id, p, i)])]
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
        s.histograms.append(histogram(f"{agent or '?'} / {env or '?'}", values))
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
            want_fc = _name_id(ix, q.failure) if q.failure not in (None, "none", "any") else None
            if -2 in (want_agent, want_fc):
                continue  # a name this file does not have
            keep = []
            for i in range(len(ix)):
                if want_agent is not None and ix.agent[i] != want_agent:
                    continue
                if q.env and run.env_label(ix, i) != q.env:  # (by name: the resource entry, where known)
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
            for col, key in (("agent", "agent"), ("error_class", "failure")):
                out[key].update(ix.names[i] for i in set(getattr(ix, col)) if i >= 0)
            for agent, env in set(zip(ix.agent, ix.env)):
                label = run.resources.get(ix.name(agent)) or ix.name(env)
                if label:
                    out["env"].add(label)
    return {k: sorted(v) for k, v in out.items()}


# ------------------------------------------------------------------ ``--tokenizer`` against the rows


def tokenizer_misfit(tok: Any, runs: Runs) -> str | None:
    """Why ``tok`` (``tokens.Loaded``) is not the tokenizer of ``runs``' rows, or None: the first generations that
    wrote text (``tokens.TURNS_CHECKED``), decoded and compared with the text the rows hold."""
    turns: list[tuple[str, str, list[Any]]] = []
    models: list[str] = []
    for run in runs.runs:
        config = run.batch.get("config") if isinstance(run.batch, dict) else None
        entries = config.get("models") if isinstance(config, dict) else None
        for name, e in (entries or {}).items() if isinstance(entries, dict) else ():
            if isinstance(e, dict) and isinstance(e.get("model"), str):
                models.append(f"{name}: {e['model']}")
        for p, part in enumerate(run.parts):
            for i in range(len(part.ix)):
                if len(turns) >= tokens.TURNS_CHECKED:
                    break
                try:
                    row = json.loads(runs.raw(Ref(run.id, p, i)))
                except (ValueError, OSError, RecursionError):
                    continue
                if isinstance(row, dict):
                    turns += [(f"{part.shown}, row {i + 1}", text, ids) for text, ids in tokens.turns_said(row)]
    wrong = tokens.misfit(tok, turns[: tokens.TURNS_CHECKED])
    if wrong is None:
        return None
    where, text, decoded = wrong
    model = f" (the run's model entry {', '.join(models)})" if models else ""
    return (
        f"decodes these rows' tokens into other words ({where}: the row says {text[:60]!r}, this tokenizer reads "
        f"{decoded[:60]!r}): give the tokenizer of the model that wrote them{model}, or leave --tokenizer out"
    )
