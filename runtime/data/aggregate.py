"""Aggregate metrics over rollout output rows, laid out like NeMo Gym's ``<out>_aggregate_metrics.json``.

One streaming pass: :meth:`MetricsAccumulator.add` takes each output row as it is written and keeps only
what the metrics need -- per agent, one ``array('d')`` of floats per numeric field (8 bytes a value; NaN
marks "absent in this row"), the task and rollout index of each row, and, when the verifier names an
answer field, that field's value (for ``majority@k``). Whole rows are never kept. :meth:`result` does
the arithmetic at the end (medians, the combinatorial pass@k estimator, majority votes) and can be
called any number of times.

Layout (NeMo Gym's, from ``RolloutCollectionHelper._call_aggregate_metrics``): a JSON **list** with one
entry per agent, sorted by agent name (numbers: the 2 tasks x 4 rollouts of ``tests/test_aggregate.py``)::

    [
      {
        "agent_ref": {"name": "math_agent"},
        "num_rollouts": 8,                    # extra to NeMo Gym: rows seen for this agent
        "num_tasks": 2,                       # extra to NeMo Gym: distinct _ng_task_index values
        "agent_metrics": {
          "mean/reward": 0.5, "max/reward": 1.0, "min/reward": 0.0, "median/reward": 0.5,
          "std/reward": 0.53, "ci_low_95/reward": 0.05, "ci_high_95/reward": 0.95,
          "mean/input_tokens": 25.0, ...      # the same seven stats for every numeric field
          "pass@1/reward": 50.0, ..., "pass@4/reward": 100.0,
          "pass@1[avg-of-1]/reward": 50.0, ..., "pass@1[avg-of-4]/reward": 50.0,
          "pass@1[avg-of-4]/reward/std_dev_across_runs": 40.82,
          "pass@1[avg-of-4]/reward/std_err_across_runs": 20.41,
          "majority@4/reward": 50.0,          # only with answer_field
          "pass@4/no_answer": 50.0, ...       # only with answer_field
          "per_sample_aggregate": {"reward": [50.0, 0.0, 100.0, 50.0], "no_answer": [...]}
        },
        "key_metrics": {"mean/reward": ..., "pass@1[avg-of-4]/reward": ..., "pass@4/reward": ...},
        "group_level_metrics": [              # one entry per task, sorted by task index
          {"_ng_task_index": 0, "num_rollouts": 4, "mean/reward": 0.75, "std/reward": 0.5, ...},
          ...
        ]
      }
    ]

Conventions (learnt from NeMo Gym's ``nemo_gym/reward_profile.py``; the arithmetic is re-implemented
here, nothing is imported from it):

* **Numeric fields** are the row's top-level ``int``/``float``/``bool`` values (booleans as 0/1) plus the
  top-level numeric values of ``response.usage`` under their own names (``input_tokens``,
  ``output_tokens``, ``total_tokens``; a usage value wins over a same-named top-level one, as NeMo Gym's
  ``result | usage`` does). Nested dicts (``input_tokens_details``) are not descended into. Fields whose
  name starts with ``_ng_`` (``_ng_task_index``, ``_ng_rollout_index``, ...) are skipped. ``None``, NaN
  and infinities count as "absent" (NeMo Gym's pandas drops NaN; infinities would not be valid JSON).
* **Stats** ``mean/ max/ min/ median/ std/ ci_low_95/ ci_high_95/<field>``: ``std`` is the sample
  standard deviation (ddof=1, pandas' default) and ``0.0`` for a single value; the 95 % Student-t
  confidence interval (``mean +- t(0.975, n-1) * std / sqrt(n)``) is omitted when ``n < 2`` or the values
  are all equal (NeMo Gym's scipy call yields NaN there and NaN entries are dropped). Per-agent stats go
  to ``agent_metrics``, per-task stats to ``group_level_metrics``. Stats are raw values, not percents.
* **Score fields** get the accuracy metrics: ``reward`` always, every other numeric field whose values
  are all 0/1 (booleans included), except the usage token counts and the answer field; with
  ``answer_field`` set, a synthetic ``no_answer`` score (1 where the answer is ``None``/absent) too.
  NeMo Gym's servers pick their scores with a ``score_fn`` (often ``{"accuracy": r["reward"]}``, so their
  ``pass@k/accuracy`` is our ``pass@k/reward``); here the scores are named after their fields.
* **Accuracy metrics**, in percent (x100), for every k = 1..n, n = the most rollouts any task has; the
  rollouts of a task are taken in ``_ng_rollout_index`` order (arrival order where it is missing):

  - ``pass@{k}/<score>``: per task with at least k values, if the task's values are all 0/1 the unbiased
    estimator ``1 - C(n-c, k) / C(n, k)`` (n values, c ones; 1 when n-c < k), else the max of its first
    k values; averaged over tasks.
  - ``pass@1[avg-of-{k}]/<score>``: per task the mean over the present values among its first k
    rollouts; averaged over tasks. ``.../std_dev_across_runs`` and ``.../std_err_across_runs`` (k >= 2):
    sample std (and std / sqrt(k)) of the first k entries of ``per_sample_aggregate``.
  - ``per_sample_aggregate[<score>][i]``: the percent mean over tasks of the task's i-th rollout.
  - ``majority@{k}/<score>`` (only with ``answer_field``): per task, among its first k rollouts with an
    answer and that score, the most frequent (answer, score) pair; ties average their scores; a task
    with no answered rollout counts 0. Averaged over tasks.

* ``key_metrics``: every ``mean/*`` entry (NeMo Gym's default) plus the highest-k entries of
  ``pass@1[avg-of-k]/*``, ``pass@k/*`` and ``majority@k/*`` (no ``no_answer`` for the last two).
* A row without ``agent_ref.name`` is counted in :attr:`MetricsAccumulator.rows_skipped` and otherwise
  ignored (NeMo Gym drops it too); a row without ``_ng_task_index`` counts as task 0 (NeMo Gym's default).
* NeMo Gym also writes per-task ``sample``/``rollout_infos`` (whole rows) and ``repeat_level_metrics``;
  those are not produced here.
"""

from __future__ import annotations

import functools
import json
import math
import os
from array import array
from collections import Counter
from collections.abc import Iterator
from typing import Any

import msgspec

from gym_runtime.messages import Cost, RolloutResult

__all__ = ["MetricsAccumulator", "summary_lines"]

_STAT_NAMES = ("mean", "max", "min", "median", "std", "ci_low_95", "ci_high_95")
_USAGE_TOKEN_FIELDS = frozenset({"input_tokens", "output_tokens", "total_tokens"})
_NO_ANSWER = "no_answer"
_VARIANCE_SUFFIXES = ("std_dev_across_runs", "std_err_across_runs", "avg_sample_std_dev")
_NAN = float("nan")
_to_json = json.JSONEncoder().encode  # ``json.dumps`` with its defaults, less its call's own steps (once per task)
# ``add_line``: a JSON line's top-level values left undecoded until ``add`` would read them
_raw_row = msgspec.json.Decoder(dict[str, msgspec.Raw])
_NUMBER_STARTS = frozenset(b"-0123456789tf")  # a JSON number's or boolean's first byte (a bool counts: 0/1)
_ALWAYS_READ = frozenset({"agent_ref", "cost", "_ng_task_index", "_ng_rollout_index"})


class _Usage(msgspec.Struct):
    """The one part of a row's ``response`` the metrics read (the rest is skipped, not built)."""

    usage: Any = None


_usage_dec = msgspec.json.Decoder(_Usage)
_any_dec = msgspec.json.Decoder()


def _as_number(value: Any) -> float | None:
    """The float a row value counts as, or None when it is not a (finite) number."""
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if isinstance(value, (int, float)):
        f = float(value)
        return f if math.isfinite(f) else None
    return None


def _answer_key(value: Any) -> Any:
    """A hashable stand-in for an answer value (None stays None: no answer)."""
    if value is None:
        return None
    try:
        hash(value)
        return value
    except TypeError:
        return json.dumps(value, sort_keys=True, default=str)


def _task_sort_key(task: Any) -> tuple[int, float, str]:
    if isinstance(task, (int, float)) and not isinstance(task, bool):
        return (0, task, "")
    return (1, 0, str(task))


# ---------------------------------------------------------------------------------------------------------
# Student-t quantile (no scipy): regularised incomplete beta by continued fraction, then bisection.
# ---------------------------------------------------------------------------------------------------------


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    tiny = 1e-300
    c = 1.0
    d = 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        even = m * (b - m) * x / ((a - 1.0 + m2) * (a + m2))
        d = 1.0 + even * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + even / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        odd = -(a + m) * (a + b + m) * x / ((a + m2) * (a + 1.0 + m2))
        d = 1.0 + odd * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + odd / c
        c = c if abs(c) > tiny else tiny
        step = d * c
        h *= step
        if abs(step - 1.0) < 1e-15:
            break
    return h


def _regularized_beta(a: float, b: float, x: float) -> float:
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    front = math.exp(log_front)
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_continued_fraction(a, b, x) / a
    return 1.0 - front * _beta_continued_fraction(b, a, 1.0 - x) / b


@functools.lru_cache(maxsize=1024)
def _t_quantile_975(dof: int) -> float:
    """t such that P(|T| > t) = 0.05 for Student's t with ``dof`` degrees of freedom."""

    def two_sided_tail(t: float) -> float:
        return _regularized_beta(dof / 2.0, 0.5, dof / (dof + t * t))

    lo, hi = 0.0, 2.0
    while two_sided_tail(hi) > 0.05:
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if two_sided_tail(mid) > 0.05:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-13 * hi:
            break
    return (lo + hi) / 2.0


def _describe(values: list[float]) -> dict[str, float]:
    """mean/max/min/median/std/ci of the (already NaN-free) values; empty dict for no values."""
    n = len(values)
    if n == 0:
        return {}
    if n == 1:  # (a task of one rollout: each of its stats is its value)
        v = values[0]
        return {"mean": math.fsum(values), "max": v, "min": v, "median": v, "std": 0.0}  # (fsum: -0.0's mean is 0.0)
    ordered = sorted(values)
    mean = math.fsum(ordered) / n
    mid = n // 2
    median = ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2.0
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in ordered) / (n - 1)) if n > 1 else 0.0
    out = {"mean": mean, "max": ordered[-1], "min": ordered[0], "median": median, "std": std}
    if n > 1 and std > 0.0:
        half_width = _t_quantile_975(n - 1) * std / math.sqrt(n)
        out["ci_low_95"] = mean - half_width
        out["ci_high_95"] = mean + half_width
    return out


def _stat_keys(field: str) -> tuple[str, ...]:
    """``field``'s stat names, in ``_STAT_NAMES`` order (``mean/reward``, ...)."""
    return tuple(f"{stat}/{field}" for stat in _STAT_NAMES)


def _put_stats(target: dict[str, Any], field: str, values: list[float], keys: tuple[str, ...] | None = None) -> None:
    """``values``' stats into ``target`` under ``keys`` (``_stat_keys(field)``: a caller that puts one field's
    stats for every task names them once)."""
    keys = keys or _stat_keys(field)
    if len(values) == 1:  # a task of one rollout, as ``_describe`` has it, without its dict
        v = values[0]
        target[keys[0]] = math.fsum(values)
        target[keys[1]] = target[keys[2]] = target[keys[3]] = v
        target[keys[4]] = 0.0
        return
    stats = _describe(values)
    for stat, key in zip(_STAT_NAMES, keys):
        if stat in stats:
            target[key] = stats[stat]


def _pct_mean(values: list[float]) -> float:
    return 100.0 * math.fsum(values) / len(values)


# ---------------------------------------------------------------------------------------------------------
# Accumulation
# ---------------------------------------------------------------------------------------------------------


def result_cost(res: RolloutResult) -> Cost | None:
    """A stored result's cost: its row's ``cost`` key, or a failure's own (None: it has none)."""
    if res.row is None:
        return res.cost
    raw = res.row.get("cost")
    try:
        return msgspec.convert(raw, Cost) if isinstance(raw, dict) else None
    except msgspec.ValidationError:
        return None


class CostTotals:
    """Cost totals: rows', and failed rollouts' apart (an agent's ``cost`` in the metrics entry, a batch's in
    ``status --batch``)."""

    __slots__ = ("rows", "failed", "failed_rollouts", "counted")

    def __init__(self) -> None:
        self.rows, self.failed = Cost(), Cost()
        self.failed_rollouts = 0
        self.counted = 0  # rollouts whose cost was added

    def add(self, cost: Cost, failed: bool) -> None:
        total = self.failed if failed else self.rows
        total.merge(cost)
        if cost.estimated_cost is not None:
            total.estimated_cost = round((total.estimated_cost or 0.0) + cost.estimated_cost, 9)
            total.currency = total.currency or cost.currency
        self.failed_rollouts += failed
        self.counted += 1

    def entry(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rollouts": msgspec.to_builtins(self.rows)}
        if self.failed_rollouts:
            out["failed"] = msgspec.to_builtins(self.failed)
            out["failed_rollouts"] = self.failed_rollouts
        return out


class _AgentColumns:
    """Column store for one agent: per row a task id, a rollout index, one float per numeric field."""

    __slots__ = ("n", "task_ids", "rollout_idx", "columns", "answers", "task_keys", "task_ids_by_key", "arrivals")

    def __init__(self, with_answers: bool) -> None:
        self.n = 0
        self.task_ids = array("q")
        self.rollout_idx = array("q")
        self.columns: dict[str, array[float]] = {}
        self.answers: list[Any] | None = [] if with_answers else None
        self.task_keys: list[Any] = []  # task id -> the row's _ng_task_index value
        self.task_ids_by_key: dict[Any, int] = {}
        self.arrivals: list[int] = []  # task id -> rows seen (stands in for a missing rollout index)

    def add(self, task_key: Any, rollout_index: Any, numbers: dict[str, float], answer: Any) -> None:
        task_id = self.task_ids_by_key.get(task_key)
        if task_id is None:
            task_id = len(self.task_keys)
            self.task_ids_by_key[task_key] = task_id
            self.task_keys.append(task_key)
            self.arrivals.append(0)
        arrival = self.arrivals[task_id]
        self.arrivals[task_id] = arrival + 1
        if isinstance(rollout_index, bool) or not isinstance(rollout_index, int):
            rollout_index = arrival
        self.task_ids.append(task_id)
        self.rollout_idx.append(rollout_index)
        for name, column in self.columns.items():
            column.append(numbers.get(name, _NAN))
        for name, value in numbers.items():
            if name not in self.columns:
                column = array("d", [_NAN]) * self.n
                column.append(value)
                self.columns[name] = column
        if self.answers is not None:
            self.answers.append(answer)
        self.n += 1


class MetricsAccumulator:
    """Streams rollout output rows into NeMo Gym style aggregate metrics (see the module docstring)."""

    def __init__(self, *, answer_field: str | None = None) -> None:
        self.answer_field = answer_field
        self.rows_skipped = 0
        self._agents: dict[str, _AgentColumns] = {}
        self._costs: dict[str, CostTotals] = {}  # per agent, when its rows carry a ``cost`` (gym-runtime's key)

    def add_cost(self, row: dict[str, Any], *, failed: bool = False) -> None:
        """Count a row's ``cost`` (an output row's, or a failure row's: those are totalled apart)."""
        raw = row.get("cost")
        agent_ref = row.get("agent_ref")
        name = agent_ref.get("name") if isinstance(agent_ref, dict) else None
        if not isinstance(raw, dict) or not name:
            return
        try:
            cost = msgspec.convert(raw, Cost)
        except msgspec.ValidationError:
            return
        totals = self._costs.get(name)
        if totals is None:
            totals = self._costs[name] = CostTotals()
        totals.add(cost, failed)

    def add_line(self, line: bytes) -> None:
        """``add`` of a row given as its JSON line, building only the values ``add`` reads: its numbers,
        ``agent_ref``, ``cost``, the indices, the answer field and ``response.usage``. The rest (the prompt, the
        response's output: most of a row's bytes) is skipped, not built; the metrics are the same."""
        try:
            raw = _raw_row.decode(line)
        except msgspec.ValidationError:  # not an object: as ``add`` takes the whole row
            self.add(msgspec.json.decode(line))
            return
        answer_field, decode = self.answer_field, _any_dec.decode
        row: dict[str, Any] = {}
        for key, value in raw.items():
            if key in _ALWAYS_READ or key == answer_field:
                row[key] = decode(value)
            elif key == "response":
                try:
                    row[key] = {"usage": _usage_dec.decode(value).usage}
                except msgspec.ValidationError:  # not an object: taken whole, as ``add`` reads it
                    row[key] = decode(value)
            elif memoryview(value)[0] in _NUMBER_STARTS:
                row[key] = decode(value)
        self.add(row)

    def add(self, row: dict[str, Any]) -> None:
        agent_ref = row.get("agent_ref")
        agent_name = agent_ref.get("name") if isinstance(agent_ref, dict) else None
        if not agent_name:
            self.rows_skipped += 1
            return
        numbers: dict[str, float] = {}
        for key, value in row.items():
            if not isinstance(value, (int, float)) or key.startswith("_ng_"):  # (bool is an int)
                continue
            number = _as_number(value)
            if number is not None:
                numbers[key] = number
        response = row.get("response")
        usage = response.get("usage") if isinstance(response, dict) else None
        if isinstance(usage, dict):
            for key, value in usage.items():
                number = _as_number(value)
                if number is not None:
                    numbers[key] = number
                elif value is None:
                    numbers.pop(key, None)
        if "cost" in row:
            self.add_cost(row)
        answer = _answer_key(row.get(self.answer_field)) if self.answer_field else None
        agent = self._agents.get(agent_name)
        if agent is None:
            agent = self._agents[agent_name] = _AgentColumns(self.answer_field is not None)
        agent.add(row.get("_ng_task_index", 0), row.get("_ng_rollout_index"), numbers, answer)

    def result(self, *, per_task: bool = True) -> list[dict[str, Any]]:
        """The content of ``<out>_aggregate_metrics.json``: one entry per agent, sorted by name."""
        out = []
        for name in sorted(self._agents):
            entry = self._agent_entry(name, self._agents[name])
            entry["group_level_metrics"] = list(entry["group_level_metrics"]) if per_task else []
            out.append(entry)
        return out

    def write_json(self, path: str | os.PathLike[str]) -> list[dict[str, Any]]:
        """Write the metrics file, per-task entries streamed one at a time (memory stays flat
        however many tasks); returns the metrics without the per-task entries."""
        summary = []
        with open(path, "w", encoding="utf-8") as f:
            f.write("[")
            for n, name in enumerate(sorted(self._agents)):
                entry = self._agent_entry(name, self._agents[name])
                groups = entry.pop("group_level_metrics")
                summary.append({**entry, "group_level_metrics": []})
                head = json.dumps(entry, indent=2)[:-2]  # reopen the object to append the list
                f.write(("," if n else "") + "\n" + head + ',\n  "group_level_metrics": [')
                for i, g in enumerate(groups):
                    f.write(("," if i else "") + "\n    " + _to_json(g))
                f.write("\n  ]\n}")
            f.write("\n]\n")
        return summary

    # -----------------------------------------------------------------------------------------------------

    def _agent_entry(self, name: str, agent: _AgentColumns) -> dict[str, Any]:
        # Rows grouped by task (tasks in index order), each task's rollouts in rollout-index order.
        order = sorted(range(agent.n), key=lambda i: (agent.task_ids[i], agent.rollout_idx[i], i))
        groups: dict[int, list[int]] = {}
        for i in order:
            groups.setdefault(agent.task_ids[i], []).append(i)
        task_rows = [groups[t] for t in sorted(groups, key=lambda t: _task_sort_key(agent.task_keys[t]))]
        task_labels = [agent.task_keys[agent.task_ids[rows[0]]] for rows in task_rows]

        agent_metrics: dict[str, Any] = {}
        score_columns: dict[str, list[list[float]]] = {}  # score -> per task, per rollout (NaN = absent)
        fields_present: list[str] = []
        for field in sorted(agent.columns):
            column = agent.columns[field]
            present = [v for v in column if not math.isnan(v)]
            if not present:
                continue
            fields_present.append(field)
            _put_stats(agent_metrics, field, present)
            is_score = field == "reward" or (
                field not in _USAGE_TOKEN_FIELDS
                and field != self.answer_field
                and field != _NO_ANSWER
                and all(v in (0.0, 1.0) for v in present)
            )
            if is_score:
                score_columns[field] = [[column[i] for i in rows] for rows in task_rows]

        task_answers: list[list[Any]] | None = None
        if agent.answers is not None:
            task_answers = [[agent.answers[i] for i in rows] for rows in task_rows]
            score_columns[_NO_ANSWER] = [[1.0 if a is None else 0.0 for a in answers] for answers in task_answers]

        max_k = max((len(rows) for rows in task_rows), default=0)
        accuracy: dict[str, Any] = {}
        per_sample: dict[str, list[float]] = {}
        for score in sorted(score_columns):
            _score_metrics(accuracy, score, score_columns[score], task_answers, max_k)
            per_sample_score = _per_sample_aggregate(score_columns[score], max_k)
            if per_sample_score:
                per_sample[score] = per_sample_score
                _variance_across_runs(accuracy, score, per_sample_score, max_k)
        # Key order as NeMo Gym: k outermost, then score name, then the metric kind.
        agent_metrics.update(sorted(accuracy.items(), key=lambda item: _accuracy_sort_key(item[0])))
        if score_columns:
            agent_metrics["per_sample_aggregate"] = per_sample

        entry = {
            "agent_ref": {"name": name},
            "num_rollouts": agent.n,
            "num_tasks": len(task_rows),
            "agent_metrics": agent_metrics,
            "key_metrics": _key_metrics(agent_metrics),
            "group_level_metrics": _task_entries(agent, task_labels, task_rows, fields_present),
        }
        costs = self._costs.get(name)
        if costs is not None:  # gym-runtime's addition, as the rows' ``cost``: totals, failed rollouts apart
            entry["cost"] = costs.entry()
        return entry


def _task_entries(
    agent: _AgentColumns, labels: list[Any], task_rows: list[list[int]], fields: list[str]
) -> Iterator[dict[str, Any]]:
    """Per-task stats, one task at a time (a batch of 100k tasks never sits in memory as dicts)."""
    columns = [(field, agent.columns[field], _stat_keys(field)) for field in fields]
    isnan = math.isnan
    for label, rows in zip(labels, task_rows):
        entry: dict[str, Any] = {"_ng_task_index": label, "num_rollouts": len(rows)}
        for field, column, keys in columns:
            _put_stats(entry, field, [column[i] for i in rows if not isnan(column[i])], keys)
        yield entry


def _score_metrics(
    out: dict[str, Any],
    score: str,
    tasks: list[list[float]],
    task_answers: list[list[Any]] | None,
    max_k: int,
) -> None:
    """pass@k, pass@1[avg-of-k] and majority@k of one score, for k = 1..max_k (percent).

    Linear in rows plus max_k: a task's metrics past its own rollout count are constant, so they are
    added once, from k = len(rollouts) + 1 on, through ``tail_*`` (a task of 16,000 rollouts among many
    small ones costs 16,000 steps, not 16,000 per task)."""
    pass_sums = [0.0] * (max_k + 2)
    pass_counts = [0] * (max_k + 2)
    avg_sums = [0.0] * (max_k + 2)
    avg_counts = [0] * (max_k + 2)
    maj_sums = [0.0] * (max_k + 2)
    tail_avg = [0.0] * (max_k + 2)
    tail_avg_counts = [0] * (max_k + 2)
    tail_maj = [0.0] * (max_k + 2)
    for t, rollouts in enumerate(tasks):
        values = [v for v in rollouts if not math.isnan(v)]
        for k, estimate in enumerate(_pass_at_k(values), start=1):
            pass_sums[k] += estimate
            pass_counts[k] += 1
        # pass@1[avg-of-k]: the present values among the task's first k rollouts.
        total, present = 0.0, 0
        for k, value in enumerate(rollouts, start=1):
            if not math.isnan(value):
                total += value
                present += 1
            if present:
                avg_sums[k] += total / present
                avg_counts[k] += 1
        if present:
            tail_avg[len(rollouts) + 1] += total / present
            tail_avg_counts[len(rollouts) + 1] += 1
        if task_answers is not None:
            votes: Counter[Any] = Counter()
            for k, (answer, value) in enumerate(zip(task_answers[t], rollouts), start=1):
                if answer is not None and not math.isnan(value):
                    votes[(answer, value)] += 1
                if votes:
                    maj_sums[k] += _majority(votes)
            if votes:
                tail_maj[len(rollouts) + 1] += _majority(votes)
    carry_avg, carry_avg_count, carry_maj = 0.0, 0, 0.0
    for k in range(1, max_k + 1):
        carry_avg += tail_avg[k]
        carry_avg_count += tail_avg_counts[k]
        carry_maj += tail_maj[k]
        if pass_counts[k]:
            out[f"pass@{k}/{score}"] = 100.0 * pass_sums[k] / pass_counts[k]
        if avg_counts[k] + carry_avg_count:
            avg = (avg_sums[k] + carry_avg) / (avg_counts[k] + carry_avg_count)
            out[f"pass@1[avg-of-{k}]/{score}"] = 100.0 * avg
        if task_answers is not None and tasks:
            out[f"majority@{k}/{score}"] = 100.0 * (maj_sums[k] + carry_maj) / len(tasks)


def _pass_at_k(values: list[float]) -> Iterator[float]:
    """A task's pass@k for k = 1..len(values): the unbiased estimator 1 - C(wrong, k) / C(n, k) for 0/1
    scores, else the best of the first k.

    The ratio of binomials is the running product of (wrong - i) / (n - i), summed as logarithms
    (``log1p``/``expm1`` keep 1 - ratio exact to ~k ulps where it is small): O(1) a step, where
    ``math.comb`` on integers of thousands of digits made 16,000 rollouts cost seconds."""
    n = len(values)
    if all(v in (0.0, 1.0) for v in values):
        right = n - sum(1 for v in values if v == 0.0)
        log_ratio = 0.0
        for k in range(1, n + 1):
            if right >= n - k + 1:  # fewer wrong than k: every k-subset holds a right one
                yield 1.0
                continue
            log_ratio += math.log1p(-right / (n - k + 1))
            yield -math.expm1(log_ratio)
        return
    best = -math.inf
    for value in values:
        best = max(best, value)
        yield best


def _majority(votes: Counter[Any]) -> float:
    top = max(votes.values())
    tied = [value for (_, value), count in votes.items() if count == top]
    return math.fsum(tied) / len(tied)


def _per_sample_aggregate(tasks: list[list[float]], max_k: int) -> list[float]:
    """[i] = percent mean over tasks of each task's i-th rollout (where it has the score)."""
    runs: list[list[float]] = [[] for _ in range(max_k)]
    for rollouts in tasks:
        for i, value in enumerate(rollouts):
            if not math.isnan(value):
                runs[i].append(value)
    return [_pct_mean(run) for run in runs if run]


def _variance_across_runs(out: dict[str, Any], score: str, runs: list[float], max_k: int) -> None:
    """Std dev and std error of the per-run means over the first k runs, k = 2..max_k (past the last
    run: all runs). Welford's running mean and sum of squares: one step a run, where summing the
    first k afresh for every k took 16,000 runs into hundreds of millions of steps."""
    mean, squares = 0.0, 0.0
    std = math.nan
    for k in range(1, max_k + 1):
        if k <= len(runs):
            delta = runs[k - 1] - mean
            mean += delta / k
            squares += delta * (runs[k - 1] - mean)
            if k >= 2:
                std = math.sqrt(max(squares, 0.0) / (k - 1))
        if k < 2 or math.isnan(std):
            continue
        size = min(k, len(runs))
        out[f"pass@1[avg-of-{k}]/{score}/std_dev_across_runs"] = std
        out[f"pass@1[avg-of-{k}]/{score}/std_err_across_runs"] = std / math.sqrt(size)


def _split_accuracy_key(key: str) -> tuple[str, int, str] | None:
    """'pass@4/reward' -> ('pass', 4, 'reward'); 'pass@1[avg-of-4]/r/std...' -> ('avg', 4, 'r/std...')."""
    head, _, rest = key.partition("/")
    if head.startswith("pass@1[avg-of-") and head.endswith("]"):
        kind, k = "avg", head[len("pass@1[avg-of-") : -1]
    elif head.startswith("pass@"):
        kind, k = "pass", head[len("pass@") :]
    elif head.startswith("majority@"):
        kind, k = "majority", head[len("majority@") :]
    else:
        return None
    return (kind, int(k), rest) if k.isdigit() else None


def _accuracy_sort_key(key: str) -> tuple[Any, ...]:
    kind, k, rest = _split_accuracy_key(key) or ("", 0, key)
    score = rest.split("/", 1)[0]
    return (k, score, {"pass": 0, "avg": 1, "majority": 2}.get(kind, 3), rest)


def _key_metrics(agent_metrics: dict[str, Any]) -> dict[str, Any]:
    key = {k: v for k, v in agent_metrics.items() if k.startswith("mean/")}
    best: dict[str, list[tuple[int, str]]] = {"avg": [], "pass": [], "majority": []}
    for metric in agent_metrics:
        split = _split_accuracy_key(metric)
        if split is None:
            continue
        kind, k, rest = split
        if "/" in rest or rest.endswith(_VARIANCE_SUFFIXES):
            continue
        if kind != "avg" and rest == _NO_ANSWER:
            continue
        best[kind].append((k, metric))
    for kind in ("avg", "pass", "majority"):
        if best[kind]:
            top = max(k for k, _ in best[kind])
            key.update({metric: agent_metrics[metric] for k, metric in best[kind] if k == top})
    return key


# ---------------------------------------------------------------------------------------------------------
# Human summary
# ---------------------------------------------------------------------------------------------------------


def _fmt(value: Any, percent: bool = False) -> str:
    if not isinstance(value, (int, float)):
        return "n/a"
    return f"{value:.2f}%" if percent else f"{value:.4g}"


def _accuracy(metrics: dict[str, Any], rate: bool, key: str) -> str:
    v = metrics.get(key)
    return _fmt(v, True) if rate or not isinstance(v, (int, float)) else _fmt(v / 100)


def summary_lines(result: list[dict[str, Any]] | dict[str, Any]) -> list[str]:
    """A few human lines per agent: rollouts, tasks, mean reward, pass@k, majority@k, token usage.

    Takes :meth:`MetricsAccumulator.result` (a list of agent entries); a single entry is accepted too.
    """
    entries = [result] if isinstance(result, dict) else list(result or [])
    if not entries:
        return ["no rollouts: no metrics"]
    lines: list[str] = []
    for entry in entries:
        name = (entry.get("agent_ref") or {}).get("name", "?")
        metrics = entry.get("agent_metrics") or {}
        head = f"{name}: {entry.get('num_rollouts', '?')} rollouts over {entry.get('num_tasks', '?')} tasks"
        if "mean/reward" in metrics:
            head += f", mean reward {_fmt(metrics['mean/reward'])} (std {_fmt(metrics.get('std/reward'))})"
        lines.append(head)
        ks = sorted({split[1] for m in metrics if (split := _split_accuracy_key(m)) and split[2] == "reward"})
        if ks:
            top = ks[-1]
            # NeMo Gym's accuracy metrics are percentages (x100) whatever the rewards: a rate only when every
            # reward is in [0, 1]; otherwise show the means they are (1.8, not "180.00%")
            rate = 0 <= metrics.get("min/reward", 0) and metrics.get("max/reward", 1) <= 1
            acc = functools.partial(_accuracy, metrics, rate)

            parts = [f"pass@1 {acc('pass@1/reward')}"]
            if top > 1:
                parts.append(f"pass@{top} {acc(f'pass@{top}/reward')}")
                parts.append(f"pass@1[avg-of-{top}] {acc(f'pass@1[avg-of-{top}]/reward')}")
            if f"majority@{top}/reward" in metrics:
                parts.append(f"majority@{top} {acc(f'majority@{top}/reward')}")
            if f"pass@1[avg-of-{top}]/no_answer" in metrics:
                parts.append(f"no answer {_fmt(metrics[f'pass@1[avg-of-{top}]/no_answer'], True)}")
            note = "" if rate else " (means of the rewards, not rates: rewards are not all in [0, 1])"
            lines.append("  reward: " + " | ".join(parts) + note)
        tokens = [
            f"{field.split('_')[0]} {_fmt(metrics[f'mean/{field}'])}"
            for field in ("input_tokens", "output_tokens", "total_tokens")
            if f"mean/{field}" in metrics
        ]
        if tokens:
            lines.append("  mean tokens per rollout: " + ", ".join(tokens))
        cost = entry.get("cost")
        if isinstance(cost, dict):
            lines.append("  cost: " + cost_text(cost.get("rollouts") or {}))
            if cost.get("failed_rollouts"):
                lines.append(
                    f"  cost of {cost['failed_rollouts']} failed rollouts: " + cost_text(cost.get("failed") or {})
                )
    return lines


def cost_text(cost: dict[str, Any]) -> str:
    """``cost`` totals in one line: calls and tokens per model entry, tool and sandbox time (wall, CPU), bytes
    stored, the estimate."""
    parts = [
        f"{name} {m.get('calls', 0)} calls, {m.get('input_tokens', 0)} in / {m.get('output_tokens', 0)} out tokens"
        for name, m in sorted((cost.get("models") or {}).items())
    ]
    for key, what in (("tool_ms", "tools"), ("sandbox_ms", "sandboxes"), ("sandbox_cpu_ms", "sandbox CPU")):
        if cost.get(key):
            parts.append(f"{what} {cost[key] / 1000:.2f} s")
    if cost.get("stored_bytes"):
        parts.append(f"results stored {cost['stored_bytes']} B")
    if cost.get("estimated_cost") is not None:
        parts.append(f"estimated {cost['estimated_cost']:.6g} {cost.get('currency') or ''}".rstrip())
    return "; ".join(parts) or "nothing counted"
