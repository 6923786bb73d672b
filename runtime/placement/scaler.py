"""Each elastic role's replicas kept at what its backlog asks for (``ray.roles.ROLE.NAME.min``/``max``).

Every ``ray.scale_interval_s`` a role reads its demand (``backlog.read``) and does what ``backlog.decide`` says
(the whole rule, a pure function): ``ceil(asked / slots)`` replicas within [min, max]. More are added at once
(each placed and ready before it counts); fewer only after the surplus lasted ``ray.idle_s``, and then the newest
are drained first (SIGTERM: an agent finishes or hands back what it holds) before Ray ends them. The demand
counts in-flight rollouts, so a pool never scales below what they hold; a resource or sandbox pool, whose
sessions are pinned to the replica that opened them, only scales down when none of its agents has a task left.
The whole cluster's wish is told to Ray's autoscaler (``request_resources``: one bundle per wanted actor), so it
adds nodes before the actors wait on them.

``min: 0`` and the agents' ``absent_grace_s`` (60 s): a role is asked for as soon as its agents' tasks are stored
(``backlog``), so it is scaled up within the grace; absence is not made aware of the scaler. Keep
``ray.placement_timeout_s`` (30 s) plus a worker's start under ``absent_grace_s``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio
from ray.autoscaler.sdk import request_resources

from gym_runtime.config import Config
from gym_runtime.observability import logs
from gym_runtime.placement import backlog
from gym_runtime.placement.pools import PlacementError, RolePools, ask
from gym_runtime.transport.bus import Bus

__all__ = ["Scaler"]

log = logs.get("gym.scaler")


class Scaler:
    """One loop per elastic role over ``pools``; ``on_change(role, name, replicas)`` after each change."""

    def __init__(
        self, cfg: Config, pools: RolePools, *, on_change: Callable[[str, str, int], None] | None = None
    ) -> None:
        self.cfg, self.pools = cfg, pools
        self.on_change = on_change
        self.wanted: dict[tuple[str, str], int] = {}
        self._told: list[dict[str, float]] | None = None

    def bounds(self, role: str, name: str) -> tuple[int, int]:
        r = self.pools.role(role, name)
        fixed = int(getattr(self.cfg, role)[name].replicas)
        low = r.min if r.min is not None else min(fixed, r.max or fixed)
        return low, r.max if r.max is not None else max(low, fixed)

    async def run(self, bus: Bus, roles: list[tuple[str, str]]) -> None:
        """Scale the elastic ones of ``roles`` until cancelled, reading their backlog on ``bus``."""
        self.bus = bus
        elastic = [(r, n) for r, n in roles if self.pools.role(r, n).elastic]
        for r, n in roles:
            self.wanted[r, n] = self.pools.count(r, n)
        async with anyio.create_task_group() as tg:
            for role, name in elastic:
                tg.start_soon(self._role, role, name)

    async def _role(self, role: str, name: str) -> None:
        low, high = self.bounds(role, name)
        surplus_since: float | None = None
        said: str | None = None
        while True:
            demand = (await backlog.read(self.bus, self.cfg, [(role, name)]))[role, name]
            have = self.pools.count(role, name)
            step = backlog.decide(
                role,
                demand,
                have,
                low,
                high,
                surplus_since=surplus_since,
                now=time.monotonic(),
                idle_s=self.cfg.ray.idle_s,
            )
            surplus_since = step.surplus_since
            self.wanted[role, name] = step.ask
            self._tell_ray()
            at = {"role": f"{role}.{name}", "have": have, "want": step.want, "asked": demand.asked}
            if step.add:
                log.info("scale.up", **at)
                try:
                    await anyio.to_thread.run_sync(self.pools.add, role, name, step.add)
                    said = None
                except PlacementError as e:
                    if str(e) != said:  # said once, not every interval
                        log.warning("scale.not_placed", role=f"{role}.{name}", reason=str(e))
                        said = str(e)
                self._changed(role, name)
            elif step.remove:
                log.info("scale.down", **at)
                await anyio.to_thread.run_sync(self.pools.remove, role, name, step.remove)
                self._changed(role, name)
            await anyio.sleep(self.cfg.ray.scale_interval_s)

    def _changed(self, role: str, name: str) -> None:
        if self.on_change is not None:
            self.on_change(role, name, self.pools.count(role, name))

    def _tell_ray(self) -> None:
        """Ask Ray's autoscaler for one bundle per actor wanted now (it adds nodes for them; a cluster without
        an autoscaler keeps the request and ignores it)."""
        bundles = [ask(self.pools.role(r, n)) for (r, n), k in sorted(self.wanted.items()) for _ in range(k)]
        if bundles != self._told:
            request_resources(bundles=bundles or [])
            self._told = bundles
