"""Drift: rows whose ``provenance`` names another environment or grader than the one that checks them now.

``reverify`` (and ``parity``, where both sides carry provenance) re-grades recorded rows with the code installed
today; a changed reward may then be the code's doing, not the row's. Each row's ``provenance.env`` (the
environment's code identity) and ``provenance.grader`` (the judges its code called, with their fingerprints)
are compared with what the verifying worker reports, and each difference is counted once per (what, was, now).
"""

from __future__ import annotations

import functools
import importlib.resources
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec

from gym_runtime.plugins import bundled_environments, tree_hash


class Drift:
    """Counts of rows by what differs between their provenance and the installed environment."""

    def __init__(self) -> None:
        self.changed: dict[tuple[str, str, str], int] = {}

    def check(self, provenance: Any, env: str | None, grader: str | None) -> None:
        """Compare one row's ``provenance`` (a dict, or anything else: a row without one is not compared)."""
        if not isinstance(provenance, dict):
            return
        for what, was, now in (
            ("environment code", provenance.get("env"), env),
            ("grader", provenance.get("grader"), grader),
        ):
            if isinstance(was, str) and was and (was != now) and (now is not None or what == "grader"):
                key = (what, was, now or "none")
                self.changed[key] = self.changed.get(key, 0) + 1

    def lines(self, where: str, fix: str = "") -> list[str]:
        """One warning line per difference, naming what changed (``where``: the environment's entry; ``fix``: what
        the command's user may do about other environment code, said after it)."""
        return [
            f"warning: drift: the {what} of {where} differs from the one these rows were made with "
            f"({was} -> {now}, {n} row{'s' if n != 1 else ''}): rewards may differ for that reason"
            + (fix if what == "environment code" else "")
            for (what, was, now), n in sorted(self.changed.items())
        ]


@functools.cache
def _bundled_codes() -> dict[str, str]:
    """Each bundled environment's code identity (``provenance.env`` of the rows it verifies) -> its name."""
    root = importlib.resources.files("gym_runtime.resources")
    return {tree_hash(Path(str(root / name))): name for name in bundled_environments()}


def made_by(path: str | Path, *, sample: int = 1000) -> tuple[str, str] | None:
    """The bundled environment that made most of the first ``sample`` rows of a rollouts JSONL (by their
    ``provenance.env``), as (its name, the identity), or None (no provenance, or code of no bundled one)."""
    envs: Counter[str] = Counter()
    with Path(path).open("rb") as f:
        for n, line in enumerate(f):
            if n >= sample:
                break
            try:
                row = msgspec.json.decode(line)
            except msgspec.DecodeError:
                continue
            env = (row.get("provenance") or {}).get("env") if isinstance(row, dict) else None
            if isinstance(env, str):
                envs[env] += 1
    if not envs:
        return None
    identity = envs.most_common(1)[0][0]
    name = _bundled_codes().get(identity)
    return (name, identity) if name else None


__all__ = ["Drift", "made_by"]
