"""The open sessions of one resource worker, bounded per caller.

Past ``max_sessions`` the least recently used session is closed (so replayed seed requests cannot pile
up sessions for ``session_ttl_s``), but only among the sessions of the caller that opened one more: one
pool's flood of seeds closes its own sessions, never another pool's live ones. A caller is the pool its
seed request's subject names (``Subjects.seed``: ``{ns}.res.{R}.seed.{role}.{pool}``, which a secured server
allows each pool only its own; the reply subject is the publisher's choice, so it is never the caller). Only
the pools a config can have count as callers (``agent.NAME`` for its agents, ``resource.NAME`` for its
environments calling one another, ``_`` for a role-wide credential); every other name (a role-wide
credential's made-up pools, an unsecured bus's clients) shares one table, so made-up names cannot multiply
the sessions a worker holds. Each session keeps the caller that seeded it (``caller``): its worker answers its
operations only for that caller.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

T = TypeVar("T")

OTHERS = ""  # the table of every reply that names no pool of the config


def config_callers(agent_names: Iterable[str], resource_names: Iterable[str]) -> frozenset[str]:
    """The callers that get a table of their own: the pools that open sessions (agents, and environments
    calling others), and the role-wide credentials of both roles."""
    return frozenset(
        [*(f"agent.{a}" for a in agent_names), *(f"resource.{r}" for r in resource_names), "agent._", "resource._"]
    )


class Sessions(Generic[T]):
    """Session id -> session, each caller's table in least-recently-used order (dicts keep insertion order)."""

    __slots__ = ("limit", "_callers", "_tables", "_owner")

    def __init__(self, limit: int, callers: frozenset[str] = frozenset()) -> None:
        self.limit = max(1, limit)
        self._callers = callers
        self._tables: dict[str, dict[str, tuple[T, float]]] = {}
        self._owner: dict[str, str] = {}  # session id -> the caller that seeded it (its table: ``_table``)

    def __len__(self) -> int:
        return len(self._owner)

    def __contains__(self, sid: object) -> bool:
        return sid in self._owner

    def _table(self, caller: str) -> str:
        return caller if caller in self._callers else OTHERS

    def open(self, sid: str, session: T, caller: str) -> list[T]:
        """Hold a new session for ``caller``; returns the sessions it pushed out (to be closed)."""
        table = self._tables.setdefault(self._table(caller), {})
        evicted = []
        while len(table) >= self.limit:
            old = next(iter(table))
            evicted.append(table.pop(old)[0])
            del self._owner[old]
        table[sid] = (session, time.monotonic())
        self._owner[sid] = caller
        return evicted

    def caller(self, sid: str) -> str | None:
        """The caller that seeded the session (None: it is not held here)."""
        return self._owner.get(sid)

    def use(self, sid: str) -> T | None:
        """The session, now its caller's most recently used; None when it is not held here."""
        caller = self._owner.get(sid)
        if caller is None:
            return None
        table = self._tables[self._table(caller)]
        session, _ = table.pop(sid)
        table[sid] = (session, time.monotonic())
        return session

    def pop(self, sid: str) -> T | None:
        caller = self._owner.pop(sid, None)
        if caller is None:
            return None
        key = self._table(caller)
        table = self._tables[key]
        session = table.pop(sid)[0]
        if not table:
            del self._tables[key]
        return session

    def idle_since(self, cutoff: float) -> list[T]:
        """Remove and return every session last used before ``cutoff`` (``time.monotonic()``)."""
        out = []
        for table in self._tables.values():
            for sid, (_, seen) in list(table.items()):
                if seen >= cutoff:
                    break  # least recently used first: the rest are newer
                out.append(self._take(table, sid))
        self._tables = {k: t for k, t in self._tables.items() if t}
        return out

    def _take(self, table: dict[str, tuple[T, float]], sid: str) -> T:
        del self._owner[sid]
        return table.pop(sid)[0]

    def pop_where(self, lost: Callable[[T], bool]) -> list[T]:
        """Remove and return every session ``lost`` says is gone (those of a stopped guest process)."""
        out = []
        for table in self._tables.values():
            for sid, (session, _) in list(table.items()):
                if lost(session):
                    out.append(self._take(table, sid))
        self._tables = {k: t for k, t in self._tables.items() if t}
        return out

    def pop_all(self) -> list[T]:
        out = [session for table in self._tables.values() for session, _ in table.values()]
        self._tables.clear()
        self._owner.clear()
        return out
