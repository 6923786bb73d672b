"""Each role's backlog: the work that asks for its replicas, per replica's slots (what the scaler scales on).

One definition for every role, read from the JetStream counts KEDA's ``nats-jetstream`` scaler reads too (the
work queues are work-queue streams: a task stays stored from publish until its result is stored, so a count of
an agent's stored tasks is its queued plus its in-flight rollouts, the consumer's ``num_pending`` +
``num_ack_pending``):

- an agent: its stored tasks, per ``concurrency`` slots a replica;
- a model: the stored tasks of the agents that call it (each rollout asks at most one call at a time) plus the
  calls queued for it by anyone else (a judge, a trainer), per ``concurrency``;
- a resource: sessions asked for, the stored tasks of the agents that open sessions on it (a queued rollout will
  ask one, a running one holds one), per ``concurrency``;
- a sandbox pool: leases asked for, the stored tasks of the agents whose rollouts use it (``sandbox:`` on the
  agent or on its resource), per ``capacity``.

So every role a batch needs is asked for as soon as the batch's tasks are stored, before a rollout calls it (a
role scaled from 0 is placed while the agents' ``absent_grace_s`` runs), and a role never counts fewer than its
in-flight rollouts hold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gym_runtime.config import Config
from gym_runtime.transport.bus import Bus

__all__ = ["Decision", "Demand", "agents_using", "decide", "read", "wanted"]

PINNED = ("resources", "sandboxes")  # roles whose sessions stay on the replica that opened them


@dataclass(frozen=True)
class Demand:
    """A role's work asked for (``asked``) and the slots one replica has for it."""

    asked: int
    slots: int

    def replicas(self) -> int:
        """Replicas whose slots hold the work asked for (0 when none is)."""
        return math.ceil(self.asked / max(1, self.slots))


def wanted(demand: Demand, low: int, high: int) -> int:
    """The replicas a role should have: its demand's, within [low, high]."""
    return max(low, min(high, demand.replicas()))


@dataclass(frozen=True)
class Decision:
    """What a role's scaler does at one interval: ``ask`` replicas told to Ray's autoscaler, ``add`` or
    ``remove`` (the newest drained first) now, and ``surplus_since`` carried to the next interval."""

    want: int
    ask: int
    add: int = 0
    remove: int = 0
    surplus_since: float | None = None


def decide(
    role: str, demand: Demand, have: int, low: int, high: int, *, surplus_since: float | None, now: float, idle_s: float
) -> Decision:
    """The scaler's whole rule for a role that has ``have`` replicas, read at ``now`` (monotonic seconds):
    more are added at once; fewer only once the surplus lasted ``idle_s`` (``surplus_since``: when it began, from
    the last decision); a resource or sandbox pool with work asked (its sessions pinned to their replicas) never
    scales down and keeps asking Ray for what it has."""
    want = wanted(demand, low, high)
    pinned = role in PINNED and demand.asked > 0
    ask = max(want, have) if pinned else want
    if want > have:
        return Decision(want, ask, add=want - have)
    if want < have and not pinned:
        since = now if surplus_since is None else surplus_since
        if now - since >= idle_s:
            return Decision(want, ask, remove=have - want)
        return Decision(want, ask, surplus_since=since)
    return Decision(want, ask)


def agents_using(cfg: Config, role: str, name: str) -> list[str]:
    """The agents whose rollouts ask ``role.name`` for work (an agent asks itself)."""
    if role == "agents":
        return [name]
    if role == "models":
        return [a for a, e in cfg.agents.items() if e.model == name]
    if role == "resources":
        return [a for a, e in cfg.agents.items() if e.resource == name]
    if role == "sandboxes":
        return [
            a
            for a, e in cfg.agents.items()
            if e.sandbox == name or (e.resource in cfg.resources and cfg.resources[e.resource].sandbox == name)
        ]
    raise ValueError(f"no role {role!r}")


def slots(cfg: Config, role: str, name: str) -> int:
    """One replica's slots for its work: ``concurrency`` (a sandbox pool's: ``capacity``)."""
    if role == "sandboxes":
        return cfg.sandboxes[name].capacity
    return int(getattr(cfg, role)[name].concurrency)


async def read(bus: Bus, cfg: Config, roles: list[tuple[str, str]]) -> dict[tuple[str, str], Demand]:
    """Each of ``roles``' demand now (one count per agent's queue, one per model's)."""
    names = bus.subjects
    stored: dict[str, int] = {}
    for agent in {a for r, n in roles for a in agents_using(cfg, r, n)}:
        stored[agent] = await bus.subject_count(names.tasks_stream, names.agent_tasks(agent))
    out = {}
    for role, name in roles:
        asked = sum(stored[a] for a in agents_using(cfg, role, name))
        if role == "models":
            asked += await bus.subject_count(names.model_stream, names.model_queue(name))
        out[role, name] = Demand(asked, slots(cfg, role, name))
    return out
