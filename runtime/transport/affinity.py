"""Which replica a rollout's next model turn goes to first: the one that served its last turn, bounded by load.

One ``Affinity`` per agent process (its worker's), for all the rollouts it runs: each rollout's replica per
model (``ModelResponse.worker`` of its last turn) and how many of the process's running rollouts each replica
holds. A rollout keeps its replica while that replica holds at most ``load`` times the mean (the running
rollouts, those whose first turn is still out included, over the replicas that hold any: consistent hashing
with bounded loads, over the process's own rollouts); past the bound its next turn goes to the replica that
holds the fewest. A first turn goes to any replica with a free slot (the
model's queue group): a replica added mid-batch takes new rollouts at once. Nothing is shared between
processes: each balances its own rollouts, so their sum is balanced too. ``model_calls.call_model`` does the
rest (only with a free slot at once, else elsewhere).
"""

from __future__ import annotations

import math


class Affinity:
    def __init__(self, load: dict[str, float]) -> None:
        self.load = {m: c for m, c in load.items() if c > 0}  # per model; a model without one: no affinity
        self._home: dict[tuple[str, str], str] = {}  # (model, rollout) -> the replica of its last turn
        self._held: dict[str, dict[str, int]] = {}  # model -> replica -> running rollouts whose last turn it had
        self._first: dict[str, set[str]] = {}  # model -> rollouts whose first turn is out (not yet anywhere)

    @classmethod
    def of(cls, load: dict[str, float]) -> Affinity | None:
        """One for the models with a bound (``load`` > 0), or None where none has one: no call is routed."""
        return cls(load) if any(c > 0 for c in load.values()) else None

    def choose(self, model: str, rollout: str) -> tuple[str | None, str]:
        """The replica to try first and why (``affine``: the rollout's own; ``load``: it holds more than its
        share, this one the fewest), or ``(None, "")``: a first turn, or a model without affinity."""
        if model not in self.load:
            return None, ""
        home = self._home.get((model, rollout))
        if home is None:
            self._first.setdefault(model, set()).add(rollout)  # counted in the mean until it lands
            return None, ""
        held = self._held[model]
        mean = (sum(held.values()) + len(self._first.get(model, ()))) / len(held)
        bound = max(math.ceil(mean), math.floor(self.load[model] * mean))  # never under the mean: always room
        if held[home] <= bound:
            return home, "affine"
        least = min(held, key=held.__getitem__)
        self.served(model, rollout, least)  # counted there now: its replica's other rollouts, choosing while
        return least, "load"  # this turn is out, see the load it leaves (``served`` corrects where it lands)

    def served(self, model: str, rollout: str, replica: str | None) -> None:
        """The rollout's turn on ``model`` was answered by ``replica``: its affinity is there from now on."""
        if replica is None or model not in self.load:
            return
        self._first.get(model, set()).discard(rollout)
        key = (model, rollout)
        before = self._home.get(key)
        if before == replica:
            return
        held = self._held.setdefault(model, {})
        if before is not None:
            self._drop(held, before)
        self._home[key] = replica
        held[replica] = held.get(replica, 0) + 1

    def ended(self, rollout: str) -> None:
        """The rollout ended here (its attempt): it holds no replica any more."""
        for first in self._first.values():
            first.discard(rollout)
        for model, held in self._held.items():
            before = self._home.pop((model, rollout), None)
            if before is not None:
                self._drop(held, before)

    @staticmethod
    def _drop(held: dict[str, int], replica: str) -> None:
        held[replica] -= 1
        if not held[replica]:  # holds none of ours: the mean is over the replicas that hold some
            del held[replica]
