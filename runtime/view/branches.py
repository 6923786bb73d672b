"""A rollout's branches as its trajectory page shows them (issue 78): the rollout it was branched from and at which
turn, and the branches of it among the runs viewed, a level a turn, each with its reward (a tree, one level a page:
each branch's own page shows its branches).

A branch's row names its parent (``branch_of``: ``batch:task:rollout``, ``branch_turn``); a run names its batch in
its ``_batch.json`` (``collect`` and ``run`` write it), so a rollout's key is known only in a run that has one. The
branches are found by reading the runs' rows once (only lines that name a ``branch_of`` are decoded), again after a
run is re-indexed. Plain data for the template; nothing here is HTML.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from gym_runtime.view.runs import Ref, Runs

_MARK = b'"branch_of"'


@dataclass
class Branch:
    """One branch of a rollout: its page, the turn it branched at, its reward or failure."""

    ref: Ref
    label: str  # its own key (``batch:task:rollout``)
    turn: int
    reward: float | None
    failure: str = ""


@dataclass
class Tree:
    """What the page shows: the rollout's key, its parent (its page where viewed) and its branches by turn."""

    key: str | None
    parent: str | None = None
    parent_ref: Ref | None = None
    turn: int | None = None
    by_turn: list[tuple[int, list[Branch]]] = field(default_factory=list)


class Branches:
    """The branches among ``runs``, read when first asked and again when a run was re-indexed."""

    def __init__(self, runs: Runs) -> None:
        self.runs = runs
        self._seen: tuple[tuple[int, int], ...] | None = None
        self._children: dict[str, list[Branch]] = {}

    def batch(self, run: int) -> str | None:
        meta = self.runs.runs[run].batch
        batch = meta.get("batch") if isinstance(meta, dict) else None
        return batch if isinstance(batch, str) and batch else None

    def tree(self, ref: Ref, row: dict[str, Any], task: int | None, rollout: int | None) -> Tree:
        batch = self.batch(ref.run)
        key = f"{batch}:{task}:{rollout}" if batch is not None and task is not None and rollout is not None else None
        tree = Tree(key)
        parent, turn = row.get("branch_of"), row.get("branch_turn")
        if isinstance(parent, str) and isinstance(turn, int) and not isinstance(turn, bool):
            tree.parent, tree.turn, tree.parent_ref = parent, turn, self.find(parent)
        if key is not None:
            turns: dict[int, list[Branch]] = {}
            for b in self._index().get(key, []):
                turns.setdefault(b.turn, []).append(b)
            tree.by_turn = sorted(turns.items())
        return tree

    def find(self, key: str) -> Ref | None:
        """The row of rollout ``key`` among the runs whose batch it names (None: not viewed)."""
        batch, _, rest = key.rpartition(":")
        batch, _, task = batch.rpartition(":")
        if not (task.isdigit() and rest.isdigit()):
            return None
        for run in self.runs.runs:
            if self.batch(run.id) != batch:
                continue
            for p, part in enumerate(run.parts):
                ix = part.ix
                for i in range(len(ix)):
                    if ix.task[i] == int(task) and ix.rollout[i] == int(rest):
                        return Ref(run.id, p, i)
        return None

    def _index(self) -> dict[str, list[Branch]]:
        seen = tuple((run.id, run.generation) for run in self.runs.runs)
        if seen != self._seen:
            self._children = self._read()
            self._seen = seen
        return self._children

    def _read(self) -> dict[str, list[Branch]]:
        children: dict[str, list[Branch]] = {}
        for ref in self.runs.all():
            try:
                raw = self.runs.raw(ref)
                if _MARK not in raw:
                    continue
                row = json.loads(raw)
            except (OSError, ValueError, RecursionError):
                continue
            if not isinstance(row, dict):
                continue
            parent, turn = row.get("branch_of"), row.get("branch_turn")
            if not isinstance(parent, str) or not isinstance(turn, int) or isinstance(turn, bool):
                continue
            reward = row.get("reward")
            reward = float(reward) if isinstance(reward, int | float) and not isinstance(reward, bool) else None
            failure = str(row.get("error_class") or "")
            ix = self.runs.part(ref).ix
            label = f"{self.batch(ref.run) or '?'}:{ix.task[ref.line]}:{ix.rollout[ref.line]}"
            children.setdefault(parent, []).append(Branch(ref, label, turn, None if failure else reward, failure))
        return children
