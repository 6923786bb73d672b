"""``gym-runtime status``: who is serving, how deep the queues are, how fast results land.

``BatchWatch`` follows one batch: it reads the batch's results from the start
with a no-ack consumer of its own (kept open across refreshes, so ``--watch``
only reads what is new) and counts done and failed task×repeat slots, taking a
result only as ``collect`` would (``data.intake``: its owner's, by the rule for
attempts) and a reader's record of a lost slot as a failure.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from typing import Any

import anyio
import msgspec
from anyio.abc import TaskGroup

from gym_runtime.data.aggregate import CostTotals, cost_text, result_cost
from gym_runtime.data.batches import Manifest, TaskOwners, get_manifest, other_namespaces
from gym_runtime.data.intake import Intake, is_ok, read_result, replaces
from gym_runtime.errors import UserError
from gym_runtime.messages import RolloutResult
from gym_runtime.transport import jetstream
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.discovery import discover, namespaces_with_workers
from gym_runtime.transport.jetstream import message_count
from gym_runtime.transport.pull import PullWorker
from gym_runtime.transport.subjects import LOST


async def gather(bus: Bus, *, window_s: float = 1.0) -> dict[str, Any]:
    names = bus.subjects
    results = await jetstream.results_streams(bus)  # each agent's (and the lost records')

    async def stored() -> int:
        return sum([await message_count(bus, r) for r in results])

    t0, before = time.monotonic(), await stored()
    workers = await discover(bus)
    consumers = await jetstream.consumers(bus, names.tasks_stream) + await jetstream.consumers(bus, names.model_stream)
    # workers of other namespaces on this server (a secured bus keeps a connection to its own): named with the flag
    # whatever this namespace holds, so results or queues of its own do not hide them
    busy = [] if bus.secured else await namespaces_with_workers(bus, await jetstream.namespaces(bus))
    await anyio.sleep(max(0.0, window_s - (time.monotonic() - t0)))
    after = await stored()
    elsewhere: dict[str, Any] = {}
    if busy:
        elsewhere["elsewhere"] = "; ".join(f"namespace {ns!r} has workers here: add --namespace {ns}" for ns in busy)
    elif not workers and not consumers:  # nothing here: where else to look
        elsewhere["elsewhere"] = await other_namespaces(bus)
    return {
        "namespace": bus.ns,
        "workers": workers,
        "consumers": consumers,
        "results_stored": after,
        "rollouts_per_s": round((after - before) / max(1e-9, time.monotonic() - t0), 1),
        **elsewhere,
    }


class BatchWatch:
    """Done / failed / pending, rate and ETA of one batch."""

    def __init__(self, bus: Bus, manifest: Manifest, *, rate_window_s: float = 30.0) -> None:
        self.bus = bus
        self.manifest = manifest
        self.repeats = max(1, manifest.repeats)
        self.intake = Intake(
            bus, manifest.batch, repeats=self.repeats, tasks=manifest.tasks, allows=TaskOwners(manifest).allows
        )
        self._seen: dict[int, tuple[bool, int]] = {}  # slot -> (a result, attempt)
        self.failed = 0
        self.costs = CostTotals()  # what the results read so far used (rows' cost; failed attempts' apart)
        self._samples: deque[tuple[float, int]] = deque()
        self._window = rate_window_s
        self._t0 = time.monotonic()

    @classmethod
    async def open(cls, bus: Bus, batch: str, tg: TaskGroup) -> BatchWatch:
        manifest = await get_manifest(bus, batch)
        if manifest is None:
            raise UserError(
                f"no batch {batch!r} in namespace {bus.ns!r} (was it published here?); "
                + await other_namespaces(bus, batch)
            )
        watch = cls(bus, manifest)
        names = bus.subjects

        async def take(msg: Any) -> None:
            res = await read_result(bus, msg)
            if res is None:
                return
            slot = watch.intake.slot(res, msg.subject, msg.headers)
            if slot is None:
                slot = watch.intake.lost_record(res, msg.subject, msg.headers)
                res = msgspec.structs.replace(res, row=None, attempts=0) if slot is not None else res
            if slot is not None:
                watch.take(res, slot)

        # each agent's results stream, and the lost records' (only a reader that settled lost slots wrote any)
        lanes = []
        for agent in [*sorted(manifest.agents), LOST]:
            stream = await jetstream.find_results_stream(bus, agent)
            if stream is None:
                continue  # nothing of it was ever stored
            consumer = names.reader("status", batch)
            await jetstream.add_reader(bus, stream, consumer, names.result(agent, batch))
            lanes.append((stream, consumer))

        async def run() -> None:
            try:
                async with anyio.create_task_group() as readers:
                    for stream, consumer in lanes:
                        puller = PullWorker(
                            bus, stream=stream, consumer=consumer, slots=512, handle=take, heartbeat_s=3600.0
                        )
                        readers.start_soon(puller.run)
            finally:
                with anyio.CancelScope(shield=True):
                    for stream, consumer in lanes:
                        with contextlib.suppress(Exception):
                            await jetstream.delete_consumer(bus, stream, consumer)

        tg.start_soon(run)
        return watch

    def take(self, res: RolloutResult, slot: int) -> None:
        held = self._seen.get(slot)
        if held is not None and not replaces(*held, res):
            return
        ok = is_ok(res)
        self._seen[slot] = (ok, res.attempts)
        self.failed += (not ok) - (held is not None and not held[0])
        cost = result_cost(res)
        if cost is not None:
            self.costs.add(cost, not ok)

    def snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        done = len(self._seen)
        self._samples.append((now, done))
        while len(self._samples) > 2 and now - self._samples[0][0] > self._window:
            self._samples.popleft()
        t_first, d_first = self._samples[0]
        rate = (done - d_first) / (now - t_first) if now - t_first > 0.5 else None
        expected = self.manifest.expected
        pending = max(0, expected - done)
        eta = pending / rate if rate else (0.0 if not pending else None)
        return {
            "batch": self.manifest.batch,
            "expected": expected,
            "done": done,
            "failed": self.failed,
            "pending": pending,
            "rollouts_per_s": None if rate is None else round(rate, 2),
            "eta_s": None if eta is None else round(eta, 1),
            "agents": self.manifest.agents,
            "age_s": round(time.time() - self.manifest.created, 1),
            "cost": self.costs.entry() if self.costs.counted else None,
        }


def render_batch(s: dict[str, Any]) -> str:
    rate = "-" if s["rollouts_per_s"] is None else f"{s['rollouts_per_s']}/s"
    eta = "-" if s["eta_s"] is None else _duration(s["eta_s"])
    pct = 100 * s["done"] / s["expected"] if s["expected"] else 100.0
    line = (
        f"batch {s['batch']}: {s['done']}/{s['expected']} done ({pct:.0f}%), {s['failed']} failed, "
        f"{s['pending']} pending, rate {rate}, ETA {eta}"
    )
    cost = s.get("cost")
    if cost:
        line += "\n  cost: " + cost_text(cost["rollouts"])
        if cost.get("failed_rollouts"):
            line += f"\n  cost of {cost['failed_rollouts']} failed rollouts: " + cost_text(cost["failed"])
    return line


def _duration(seconds: float) -> str:
    s = round(seconds)
    return f"{s}s" if s < 60 else (f"{s // 60}m{s % 60:02d}s" if s < 3600 else f"{s // 3600}h{s % 3600 // 60:02d}m")


def routed_text(ws: list[dict[str, Any]]) -> str:
    """A model's replicas' calls by route (``ModelWorker.routed``): the share of those served that went to the
    replica of their rollout's last turn, or elsewhere as it was full or gone; empty before any."""
    served = sum(w.get("served") or 0 for w in ws)
    routed = {r: sum((w.get("routed") or {}).get(r, 0) for w in ws) for r in ("affine", "load", "moved")}
    if not served:
        return ""
    text = "; routed " + ", ".join(f"{r} {100 * n / served:.0f}%" for r, n in routed.items()) + f" of {served} calls"
    hits = sum((w.get("prefix_cache") or {}).get("hits", 0) for w in ws)
    queries = sum((w.get("prefix_cache") or {}).get("queries", 0) for w in ws)
    if queries:  # the engine's own counters, where it reports them (``vllm_engine``)
        text += f"; prefix cache hits {100 * hits / queries:.0f}% of {queries} prompt tokens"
    return text


def render(report: dict[str, Any]) -> str:
    lines = [
        f"namespace {report['namespace']}: {report['results_stored']} results stored, "
        f"{report['rollouts_per_s']} rollouts/s (last second)",
        "",
        "workers:",
    ]
    if not report["workers"]:
        elsewhere = f": {report['elsewhere']}" if "elsewhere" in report else ""
        lines.append(f"  (none{elsewhere})")
    elif "elsewhere" in report:
        lines.append(f"  (also on this server: {report['elsewhere']})")
    by_role: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for w in report["workers"]:
        by_role.setdefault((w.get("role", "?"), w.get("name", "?")), []).append(w)
    for (role, name), ws in sorted(by_role.items()):
        pool = ""
        if role == "sandbox":  # the pool as a whole: what its quota counts, and how much the warm pool served
            live, warm = sum(w.get("live") or 0 for w in ws), sum(w.get("warm") or 0 for w in ws)
            quota = max((w.get("max_live") or 0 for w in ws), default=0)
            hits, made = sum(w.get("warm_hits") or 0 for w in ws), sum(w.get("created") or 0 for w in ws)
            of = f" of max_live {quota}" if quota else ""
            pool = f"; {live} live{of}, {warm} warm, {hits} warm hits, {made} created"
        if role == "model":  # cache-aware routing: how the calls the replicas served were routed
            pool = routed_text(ws)
        lines.append(f"  {role} {name}: {len(ws)} replica(s){pool}")
        for w in ws:
            extra = ", ".join(
                f"{k}={'-' if v is None else v}"
                for k, v in w.items()
                if k
                not in (
                    "role",
                    "name",
                    "namespace",
                    "worker",
                    "fields",
                    "routed",
                    "prefix_cache",
                )  # fields: publish's check
            )
            lines.append(f"    {w.get('worker')}: {extra}")
    lines += ["", "queues:"]
    if not report["consumers"]:
        lines.append("  (none)")
    serving = {f"{w.get('role')}_{w.get('name')}" for w in report["workers"]}
    for c in report["consumers"]:
        idle = "" if c["consumer"] in serving else "  NO WORKERS"
        lines.append(
            f"  {c['consumer']}: pending={c['pending']} ack_pending={c['ack_pending']} "
            f"redelivered={c['redelivered']} waiting_pulls={c['waiting_pulls']}{idle}"
        )
    return "\n".join(lines)
