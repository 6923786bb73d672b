"""``gym-runtime why``: where every in-flight rollout waits now, the longest waits first, the late ones named.

It reads what the workers already answer: a discovery that asks for waits (``discovery.WAITS``) gets each
agent worker's rollouts where they are (``workers.waits``), and every worker's process (``node/pid``), which
is what a silent call's keepalives named; the work queues' consumers say what waits for an agent worker and
what is held by one that did not answer. A wait past its bound is flagged with the component to look at: a
core call whose handler sent no keepalive for ``silence_bound`` (its process named, and whether it answered),
a queued call for a model no replica serves, rollouts held by agent workers that no longer answer, a model's
HTTP endpoint out of service (its adapter took it out: hung, or failing every call).
"""

from __future__ import annotations

from typing import Any

from gym_runtime.transport import jetstream
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.discovery import WAITS, discover


async def gather(bus: Bus, *, batch: str | None = None, wait_s: float = 1.0) -> dict[str, Any]:
    """The namespace's (or one batch's) rollouts in flight, each where it waits, oldest first."""
    names = bus.subjects
    workers = await discover(bus, wait_s=wait_s, ask=WAITS)
    consumers = await jetstream.consumers(bus, names.tasks_stream) + await jetstream.consumers(bus, names.model_stream)
    return judge(workers, consumers, batch=batch, ns=bus.ns)


def judge(
    workers: list[dict[str, Any]], consumers: list[dict[str, Any]], *, batch: str | None, ns: str
) -> dict[str, Any]:
    """The report from the workers' answers and the queues (pure: the rule for what is late, in one place)."""
    by_process = {w["process"]: w for w in workers if w.get("process")}
    serving = {(w.get("role"), w.get("name")) for w in workers}
    rollouts: list[dict[str, Any]] = []
    in_flight: dict[str, int] = {}
    # processes a call went silent on that do not answer now: frozen or gone, by component
    gone: dict[str, dict[str, Any]] = {}
    for w in workers:
        for s in w.get("went_silent") or []:
            if s["process"] not in by_process and s["process"] not in gone:
                gone[s["process"]] = s
    for w in workers:
        if w.get("role") != "agent":
            continue
        in_flight[w["name"]] = in_flight.get(w["name"], 0) + int(w.get("in_flight") or 0)
        for e in w.get("waits") or []:
            if batch is not None and e.get("batch") != batch:
                continue
            e = {**e, "agent": w["name"], "agent_worker": w.get("worker"), "agent_process": w.get("process")}
            _place(e, by_process, serving, gone)
            rollouts.append(e)
    rollouts.sort(key=lambda e: -float(e.get("for_s") or 0.0))
    queues, held_elsewhere = [], []
    for c in consumers:
        kind, _, name = c["consumer"].partition("_")
        role = "agent" if kind == "agent" else kind
        if c["pending"]:
            none = "" if (role, name) in serving else f": no {role} worker of {name} answers"
            queues.append(f"{c['pending']} waiting in {c['consumer']}'s queue{none}")
        if role == "agent":  # delivered to a worker and not acked, beyond what the answering workers hold
            missing = int(c["ack_pending"]) - in_flight.get(name, 0)
            if missing > 0 and batch is None:
                peers = [p for p, g in gone.items() if g["component"] == f"agents.{name}"]
                named = f" (found silent by its peers: process {', '.join(peers)})" if peers else ""
                held_elsewhere.append(
                    f"{missing} task(s) of agent {name} held by workers that did not answer{named} (frozen or gone; "
                    f"their peers hand them out again within seconds, else the queue after its ack_wait_s), or "
                    f"being stored"
                )
    late = [e for e in rollouts if e.get("late")]
    out = {  # a model's HTTP endpoints out of service, as its workers' adapters say (hung, or failing every call)
        f"models.{w['name']} endpoint {url}": cause
        for w in workers
        if w.get("role") == "model"
        for url, cause in (w.get("endpoints_out") or {}).items()
    }
    silent = [
        f"{s['component']} process {p}: a call ({s['what']}) went silent on it {s['ago_s']:g}s ago and it does not "
        "answer status (frozen, or gone)"
        for p, s in gone.items()
    ]
    return {
        "namespace": ns,
        "batch": batch,
        "in_flight": len(rollouts),
        "late": len(late),
        "look_at": sorted(
            {e["look_at"] for e in late} | {f"{s['component']} process {p}" for p, s in gone.items()} | set(out)
        ),
        "silent": silent,
        "out_of_service": [f"{where}: {cause}" for where, cause in sorted(out.items())],
        "rollouts": rollouts,
        "queues": queues,
        "unanswered": held_elsewhere,
    }


def _place(
    e: dict[str, Any],
    by_process: dict[str, dict[str, Any]],
    serving: set[tuple[Any, Any]],
    gone: dict[str, dict[str, Any]],
) -> None:
    """Name who has the rollout's call, mark a weight update's pause, and flag a wait past its bound."""
    by = e.get("by")
    holder = by_process.get(by) if by else None
    component = e.get("component") or "?"
    if holder is not None:
        e["on"] = f"{holder.get('role')} {holder.get('name')} worker {holder.get('worker')} ({by})"
        if holder.get("paused") and e.get("stage") == "generating":
            e.update(stage="paused", what=f"paused for a weight update ({e['what']})")
    stage = str(e.get("stage") or "")
    if stage.startswith("queued_") and component.startswith("models."):
        model = component.split(".", 1)[1]
        if ("model", model) not in serving:
            went = [p for p, s in gone.items() if s["component"] == component]
            named = f" (its calls went silent on process {', '.join(went)})" if went else ""
            e["late"] = f"queued for model {model}, which no replica that answers serves{named}"
            e["look_at"] = f"{component} process {went[0]}" if went else component
        return
    bound, silent = e.get("silent_bound_s"), e.get("silent_s")
    if bound is None or silent is None or silent <= bound:
        return
    if by:
        where = f"{component} process {by}"
        answered = "" if holder is not None else " (it did not answer status either: frozen, or gone)"
        e["late"] = f"no keepalive for {silent:g}s (bound {bound:g}s): look at {where}{answered}"
        e["look_at"] = where
    else:
        e["late"] = f"no sign of life for {silent:g}s (bound {bound:g}s) from whichever {component} worker took it"
        e["look_at"] = component


def render(report: dict[str, Any]) -> str:
    scope = f"batch {report['batch']}" if report["batch"] else f"namespace {report['namespace']}"
    lines = [f"{scope}: {report['in_flight']} rollout(s) in flight, {report['late']} past their bound"]
    if report["look_at"]:
        lines.append("LOOK AT: " + "; ".join(report["look_at"]))
    for e in report["rollouts"]:
        flag = "LATE " if e.get("late") else "     "
        who = f"{e['batch']} task {e['task_index']} #{e['rollout_index']} (attempt {e['attempt']})"
        where = e["what"] + (f" on {e['on']}" if e.get("on") else (f" by {e['by']}" if e.get("by") else ""))
        silent = f", silent {e['silent_s']:g}s" if e.get("silent_s") else ""
        lines.append(f"  {flag}{e['for_s']:>7.1f}s  {who}: {where}{silent}")
        if e.get("late"):
            lines.append(f"         {e['late']}")
    for line in report["silent"]:
        lines.append(f"  silent: {line}")
    for line in report.get("out_of_service") or []:
        lines.append(f"  out of service: {line}")
    for q in report["queues"]:
        lines.append(f"  queued: {q}")
    for u in report["unanswered"]:
        lines.append(f"  unanswered: {u}")
    return "\n".join(lines)
