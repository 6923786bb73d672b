"""Worker discovery and live stats through NATS micro services (``$SRV.*``).

Every worker registers a micro service ``gym_<role>`` whose metadata names its
namespace, role, config name and worker id, with one endpoint
``{ns}.status.{worker_id}`` answering its live counters. ``gym-runtime status``
scatters ``$SRV.INFO`` to find them, then asks each for its counters — no
registry, nothing to keep in sync.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from nats.micro.service import EndpointConfig, ServiceConfig

from gym_runtime.transport.bus import Bus


async def register(
    bus: Bus,
    role: str,
    name: str,
    worker_id: str,
    stats: Callable[[], dict[str, Any]],
    *,
    fingerprint: str | None = None,
) -> Any:
    """Announce a worker; returns the micro service (stop it on shutdown).

    ``fingerprint`` (of the config entry served) lets publishers see workers of another config.
    """
    meta = {"namespace": bus.ns, "role": role, "name": name, "worker": worker_id}
    if fingerprint:
        meta["fingerprint"] = fingerprint
    started = time.time()

    async def handler(req: Any) -> None:
        await req.respond(json.dumps({**stats(), "uptime_s": round(time.time() - started, 1)}).encode())

    svc = await bus.add_service(
        ServiceConfig(
            name=f"gym_{role}",
            version="0.1.0",
            description=f"gym-runtime {role} worker",
            metadata=meta,
        ),
    )
    await svc.add_endpoint(EndpointConfig(name="status", handler=handler, subject=bus.subject("status", worker_id)))
    return svc


async def discover(bus: Bus, *, wait_s: float = 0.5) -> list[dict[str, Any]]:
    """Every live worker of this namespace with its counters."""
    infos: list[dict[str, Any]] = []
    for data in await bus.scatter("$SRV.INFO", wait_s=wait_s):
        try:
            info = json.loads(data)
        except ValueError:
            continue
        meta = info.get("metadata") or {}
        if meta.get("namespace") == bus.ns:
            infos.append(meta)
    out = []
    for meta in infos:
        try:
            live = json.loads(await bus.raw_request(bus.subject("status", meta["worker"]), b"", timeout=1.0))
        except Exception:
            live = {"error": "no answer"}
        out.append({**meta, **live})
    out.sort(key=lambda w: (w.get("role", ""), w.get("name", ""), w.get("worker", "")))
    return out
