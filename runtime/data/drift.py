"""Drift: rows whose ``provenance`` names another environment or grader than the one that checks them now.

``reverify`` (and ``parity``, where both sides carry provenance) re-grades recorded rows with the code installed
today; a changed reward may then be the code's doing, not the row's. Each row's ``provenance.env`` (the
environment's code identity) and ``provenance.grader`` (the judges its code called, with their fingerprints)
are compared with what the verifying worker reports, and each difference is counted once per (what, was, now).
"""

from __future__ import annotations

from typing import Any


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

    def lines(self, where: str) -> list[str]:
        """One warning line per difference, naming what changed (``where``: the environment's entry)."""
        return [
            f"warning: drift: the {what} of {where} differs from the one these rows were made with "
            f"({was} -> {now}, {n} row{'s' if n != 1 else ''}): rewards may differ for that reason"
            for (what, was, now), n in sorted(self.changed.items())
        ]


__all__ = ["Drift"]
