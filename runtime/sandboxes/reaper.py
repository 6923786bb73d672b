"""Nothing leaks: containers of dead workers and ended leases are removed, on start-up and on a timer.

Every sandbox worker of a pool beacons its id on the pool's liveness subject (``Subjects.live("sandbox",
pool)``) and hears its peers'. A container's labels name the worker that created it and when its lease
ends. A sweep removes only what is provably dead, since another cluster (another bus, the same namespace
and pool names) may share the engine and its workers are never heard here:

- a container whose processes ended (an engine that kept it), seen ended at two sweeps in a row: one
  being restarted (``Backend.restart``, before a verify) is not running for a moment, and must stay;
- one whose lease has ended (its owner, if alive, removes it then itself);
- one whose owner this reaper heard on its own bus and has not heard for ``DEAD_AFTER_S`` (SIGKILLed, its
  node lost). An owner never heard here may be another cluster's live worker: its containers are left to end
  by themselves (docker's keeper, within the pool's ``orphan_after_s`` of the owner's
  death), or else (podman's, an older version's) to their lease's end (a warm one's label: ``warm_max_s``).

A worker that starts listens for ``DEAD_AFTER_S`` before its first sweep. Sandboxes a live holder stopped
using (an agent killed mid-rollout) end with the pool's ``idle_ttl_s`` (the owner closes them).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import anyio

from gym_runtime.observability import logs
from gym_runtime.sandboxes.backend import Backend, Owned
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.headers import CONTROL, sent_as_control

BEACON_S = 1.0
DEAD_AFTER_S = 4.0  # a worker unheard this long is dead (four beacons missed)

log = logs.get("gym.sandbox")


class Peers:
    """The workers of one pool this one has heard, when (``time.monotonic``), and how many live sandboxes
    each said it holds (``load``: the pool-wide quota's view of the others).

    Only beacons sent as the pool's workers send them count (``sent_as_control``: a server's answer borrowed
    into the subject is none). A peer's ``live`` is bounded by its capacity (what it declares, at most the pool's
    own ``capacity``); the quota counts at most ``replicas`` workers, this one included (0: no cap), the first
    heard; a worker unheard for ``DEAD_AFTER_S`` is forgotten."""

    def __init__(self, me: str, *, capacity: int = 0, replicas: int = 0) -> None:
        self.me = me
        self.capacity = capacity  # the pool's capacity per worker (0: unbounded), declared in each beacon
        self.replicas = replicas
        self.seen: dict[str, float] = {me: math.inf}
        self.load: dict[str, int] = {}
        self.own: Callable[[], int] = lambda: 0  # this worker's live sandboxes, said in each beacon

    def heard(self, worker: str, live: int = 0, capacity: int | None = None) -> None:
        if not worker or worker == self.me:
            return
        self.forget()
        bound = self.capacity if capacity is None else min(capacity, self.capacity or capacity)
        self.seen[worker] = time.monotonic()
        self.load[worker] = min(max(0, live), bound) if bound > 0 else max(0, live)

    def forget(self) -> None:
        """Drop the workers unheard for ``DEAD_AFTER_S`` (a ghost's id is not kept for ever)."""
        for w in [w for w in self.seen if not self.alive(w)]:
            del self.seen[w]
            self.load.pop(w, None)

    def alive(self, worker: str) -> bool:
        return time.monotonic() - self.seen.get(worker, -math.inf) < DEAD_AFTER_S

    def counted(self) -> list[str]:
        """The live workers the quota counts: this one and, up to ``replicas`` in all, the first heard."""
        others = [w for w in self.seen if w != self.me and self.alive(w)]
        return [self.me, *(others[: self.replicas - 1] if self.replicas else others)]

    def alive_ids(self) -> list[str]:
        """The pool's live workers the quota counts, this one included, in a fixed order (every worker
        computes the same)."""
        return sorted(self.counted())

    def others_live(self) -> int:
        return sum(self.load.get(w, 0) for w in self.counted() if w != self.me)

    def share(self, total: int) -> int:
        """This worker's part of a pool-wide ``total``: split evenly over the live workers, the remainder to
        the first ones (the parts add up to ``total``)."""
        alive = self.alive_ids()
        n, i = len(alive), alive.index(self.me)
        return total // n + (1 if i < total % n else 0)


async def beacons(bus: Bus, subject: str, peers: Peers) -> None:
    """Say this worker is alive every ``BEACON_S`` (its id, live sandboxes and capacity), and hear the pool's
    other workers (until cancelled)."""

    async def on_beacon(msg: Any) -> None:
        if not sent_as_control(msg.headers):  # a direct get's answer borrowed into the subject ("ghost 100000")
            bus.warn_limited("beacon.refused", "not sent as a beacon", subject=msg.subject)
            return
        worker, live, capacity = (msg.data.decode(errors="replace").split(" ") + ["", ""])[:3]
        peers.heard(worker, int(live) if live.isdigit() else 0, int(capacity) if capacity.isdigit() else None)

    sub = await bus.subscribe(subject, on_beacon)
    try:
        while True:
            try:
                said = f"{peers.me} {peers.own()} {peers.capacity}".encode()
                await bus.publish_raw(subject, said, headers=dict(CONTROL))
            except Exception:  # disconnected meanwhile: the next beacon says it again
                pass
            await anyio.sleep(BEACON_S)
    finally:
        with anyio.CancelScope(shield=True):
            try:
                await sub.unsubscribe()
            except Exception:
                pass


class Reaper:
    """One pool's sweeps over one backend."""

    def __init__(self, backend: Backend, peers: Peers, *, now: Callable[[], float] = time.time) -> None:
        self.backend = backend
        self.peers = peers
        self.now = now
        self.reaped = 0  # containers removed (status, metrics)
        self.sweeps = 0  # sweeps done (status)
        self.heard: set[str] = set()  # the workers this reaper has seen alive on its own bus (at a sweep)
        self.ended: set[str] = set()  # containers seen ended at the last sweep (removed if still ended at this one)

    def doomed(self, c: Owned) -> str:
        """Why container ``c`` must go ('' : it stays)."""
        if not c.running:
            return "ended" if c.id in self.ended else ""
        if c.expires and c.expires < self.now():
            return "lease ended"
        if not self.peers.alive(c.owner) and c.owner in self.heard:
            return "owner dead"
        return ""  # an owner never heard here may be another cluster's live worker: it ends by itself, or at its end

    async def sweep(self) -> list[str]:
        """Remove every doomed container of the pool; their ids."""
        gone = []
        owned = await self.backend.list_owned()
        self.heard.update(self.peers.alive_ids())
        for c in owned:
            why = self.doomed(c)
            if why:
                await self.backend.close(c.id)
                gone.append(c.id)
                log.info("sandbox.reaped", sandbox=c.id[:12], owner=c.owner, lease=c.lease, why=why)
        self.ended = {c.id for c in owned if not c.running and c.id not in gone}
        self.reaped += len(gone)
        self.sweeps += 1
        return gone
