"""Where each rollout an agent worker runs waits now (``gym-runtime why``): read when asked, never per call.

A running rollout is registered by its clock's pause (the agent worker's ``_Paused``), which every call the
rollout makes carries as its ``ON_PAUSE`` (``Pending.on_pause``): so the bus's calls in flight name their
rollout without a word added to the hot path. A rollout's stage is its oldest call's (the subject says what:
a generation, a tool, a verify, a sandbox), or its sandbox acquisition, or its own code between calls. A core
call's silence is its handler's keepalives missing: past ``silence_bound`` the handler's process (its
keepalives name it: ``node/pid``) is flagged by ``why`` as the component to look at.
"""

from __future__ import annotations

import time
from typing import Any

from gym_runtime.transport.rpc import Pending
from gym_runtime.transport.subjects import Subjects, classify

SILENT_BEATS = 1.5  # a core call with no keepalive for this many keepalive periods (sent every one, up to half late)
SILENT_KEPT_S = 300.0  # how long a process a call went silent on is still named (``Rollouts.report``)


def silence_bound(keepalive_s: float) -> float:
    """How long a core call's handler may stay silent before ``why`` flags it (one rule, used by both ends)."""
    return SILENT_BEATS * keepalive_s


class Running:
    """One rollout (or a group task's repeats) running here: its task and when it started."""

    __slots__ = ("batch", "task_index", "rollout_index", "group", "attempt", "t0")

    def __init__(self, task: Any, attempt: int) -> None:
        self.batch, self.task_index, self.rollout_index = task.batch, task.task_index, task.rollout_index
        self.group, self.attempt, self.t0 = max(1, task.group), attempt, time.monotonic()


class Rollouts:
    """An agent worker's running rollouts, keyed by their clock's pause (see the module's docstring)."""

    def __init__(self, subjects: Subjects, keepalive_s: float) -> None:
        self.subjects = subjects
        self.keepalive_s = keepalive_s
        self.live: dict[Any, Running] = {}

    def report(
        self,
        calls: list[Pending],
        went_silent: dict[str, tuple[str, float]],
        peers_lost: dict[str, tuple[float, int]] | None = None,
        component: str = "",
    ) -> dict[str, Any]:
        """What a discovery asking ``WAITS`` gets: each running rollout where it waits now (the longest waits
        first), the processes calls went silent on lately (gone from the calls: moved elsewhere or failed), and
        the peers of this worker's own pool found silent (``PullWorker.lost``: their tasks nak'd for the others)."""
        now = time.monotonic()
        for subject in [s for s, (_, at) in went_silent.items() if now - at >= SILENT_KEPT_S]:
            del went_silent[subject]  # forgotten: a process silent that long ago is someone else's by now
        silent = []
        for subject, (by, at) in went_silent.items():
            _, what, component = classify(self.subjects, subject)
            silent.append({"process": by, "what": what, "component": component, "ago_s": round(now - at, 1)})
        for process, (at, held) in (peers_lost or {}).items():
            what = f"a peer agent worker holding {held} task(s), handed to the live workers"
            silent.append({"process": process, "what": what, "component": component, "ago_s": round(now - at, 1)})
        return {"waits": self.waits(calls), "went_silent": silent}

    def waits(self, calls: list[Pending]) -> list[dict[str, Any]]:
        """Each running rollout where it waits now, the longest waits first."""
        now = time.monotonic()
        by_rollout: dict[Any, Pending] = {}
        for call in calls:
            owner = getattr(call.on_pause, "__self__", None)  # the rollout's pause (``_Paused.in_call``)
            if owner in self.live:
                held = by_rollout.get(owner)
                if held is None or call.started < held.started:
                    by_rollout[owner] = call
        out = []
        for pause, r in self.live.items():
            entry: dict[str, Any] = {
                "batch": r.batch,
                "task_index": r.task_index,
                "rollout_index": r.rollout_index,
                "attempt": r.attempt,
                "rollout_s": round(now - r.t0, 1),
            }
            if r.group > 1:
                entry["group"] = r.group
            waiting_on = by_rollout.get(pause)
            if getattr(pause, "acquiring", 0):
                entry.update(stage="sandbox_wait", what="waiting for a sandbox lease", for_s=now - pause.since)
            elif waiting_on is not None:
                entry.update(self._call(waiting_on, now))
            else:
                entry.update(stage="agent", what="in the agent's own code (no call out)", for_s=now - r.t0)
            entry["for_s"] = round(entry["for_s"], 1)
            out.append(entry)
        return sorted(out, key=lambda e: -e["for_s"])

    def _call(self, call: Pending, now: float) -> dict[str, Any]:
        stage, what, component = classify(self.subjects, call.subject)
        e: dict[str, Any] = {"stage": stage, "what": what, "for_s": now - call.started, "component": component}
        if call.queued and not call.taken:
            e.update(stage=f"queued_{stage}", what=f"queued: {what}")
            return e
        if call.by:
            e["by"] = call.by  # the process that has it (node/pid)
        e["silent_s"] = round(now - call.seen, 1)
        if not call.queued:  # a core call: its handler beats every keepalive_s
            e["silent_bound_s"] = silence_bound(self.keepalive_s)
        if call.paused_now:
            e["what"] += " (its handler waits for a sandbox lease)"
        return e
