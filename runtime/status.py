"""``gym-runtime status``: who is serving, how deep the queues are, how fast results land."""

from __future__ import annotations

import time
from typing import Any

import anyio
from nats.js.errors import NotFoundError

from runtime.bus import Bus
from runtime.discovery import discover
from runtime.pull import stream_names


async def _consumers(bus: Bus, stream: str) -> list[dict[str, Any]]:
    try:
        infos = await bus.js.consumers_info(stream)
    except NotFoundError:
        return []
    return [
        {
            "stream": stream,
            "consumer": c.name,
            "pending": c.num_pending,
            "ack_pending": c.num_ack_pending,
            "redelivered": c.num_redelivered,
            "waiting_pulls": c.num_waiting,
        }
        for c in infos
    ]


async def _result_count(bus: Bus) -> int:
    try:
        info = await bus.js.stream_info(stream_names(bus.ns)["result"])
    except NotFoundError:
        return 0
    return int(info.state.messages)


async def gather(bus: Bus, *, window_s: float = 1.0) -> dict[str, Any]:
    t0, before = time.monotonic(), await _result_count(bus)
    workers = await discover(bus)
    names = stream_names(bus.ns)
    consumers = await _consumers(bus, names["task"]) + await _consumers(bus, names["model"])
    await anyio.sleep(max(0.0, window_s - (time.monotonic() - t0)))
    after = await _result_count(bus)
    return {
        "namespace": bus.ns,
        "workers": workers,
        "consumers": consumers,
        "results_stored": after,
        "rollouts_per_s": round((after - before) / max(1e-9, time.monotonic() - t0), 1),
    }


def render(report: dict[str, Any]) -> str:
    lines = [f"namespace {report['namespace']}: {report['results_stored']} results stored, "
             f"{report['rollouts_per_s']} rollouts/s (last second)", "", "workers:"]
    if not report["workers"]:
        lines.append("  (none)")
    by_role: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for w in report["workers"]:
        by_role.setdefault((w.get("role", "?"), w.get("name", "?")), []).append(w)
    for (role, name), ws in sorted(by_role.items()):
        lines.append(f"  {role} {name}: {len(ws)} replica(s)")
        for w in ws:
            extra = ", ".join(f"{k}={v}" for k, v in w.items() if k not in ("role", "name", "namespace", "worker"))
            lines.append(f"    {w.get('worker')}: {extra}")
    lines += ["", "queues:"]
    if not report["consumers"]:
        lines.append("  (none)")
    for c in report["consumers"]:
        lines.append(f"  {c['consumer']}: pending={c['pending']} ack_pending={c['ack_pending']} "
                     f"redelivered={c['redelivered']} waiting_pulls={c['waiting_pulls']}")
    return "\n".join(lines)
