"""What every worker (agent, model, resource) offers the runner: run, drain, stats."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import anyio
import anyio.abc

from gym_runtime.transport.bus import Bus
from gym_runtime.transport.discovery import register
from gym_runtime.transport.interface import Puller

__all__ = ["PulledWorker", "Worker", "drain_puller", "serve_pulled"]


class Worker(Protocol):
    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; ``task_status.started()`` once subscribed and pulling."""
        ...

    async def drain(self) -> None:
        """Take no new work, and return when the work in flight is done (the runner bounds the wait)."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counters for discovery and ``gym-runtime status`` (JSON-able)."""
        ...


async def drain_puller(puller: Puller | None) -> None:
    """Drain a work-queue worker: pull nothing more, wait for the running handlers."""
    if puller is None:
        return
    puller.stop_pulling()
    while puller.busy:
        await anyio.sleep(0.05)


class PulledWorker(Protocol):
    """A work-queue worker as ``serve_pulled`` reads it (agents and models)."""

    bus: Bus
    name: str
    worker_id: str
    fingerprint: str
    fields: Mapping[str, str]

    def stats(self) -> dict[str, Any]: ...


async def serve_pulled(
    worker: PulledWorker,
    puller: Puller,
    *,
    role: str,
    task_status: anyio.abc.TaskStatus[None],
    log: Any,
    **ready: Any,
) -> None:
    """A work-queue worker's life: announce it (discovery) and its gauges (metrics), report it
    started, pull until cancelled, then withdraw both. ``ready`` adds fields to the ready log line."""
    bus, name, worker_id = worker.bus, worker.name, worker.worker_id
    svc = await register(
        bus,
        role,
        name,
        worker_id,
        worker.stats,
        fingerprint=worker.fingerprint,
        fields=dict(worker.fields),
        waits=getattr(worker, "waits", None),  # an agent's rollouts, each where it waits (``why``)
    )
    bus.telemetry.meters.track(role, name, worker)
    log.info(f"{role}.ready", **{role: name}, worker=worker_id, **ready)
    task_status.started()
    try:
        await puller.run()
    finally:
        bus.telemetry.meters.untrack(worker)
        log.info(f"{role}.stopped", **{role: name}, worker=worker_id, **worker.stats())
        with anyio.CancelScope(shield=True):
            await svc.stop()
