"""Worker discovery and live stats on the namespace's own subject (``Subjects.status``).

Every worker subscribes to ``{ns}.status``; a request there (``gym-runtime status``, the client's checks)
is answered by each live worker with what it serves (namespace, role, config name, worker id, process,
fingerprint) and its live counters (asked ``WAITS``: where each piece of its work waits, for ``why``), in
one round, into its own reply lane (``subjects.answer``): a
secured bus lets a worker publish into no other, so no answer can be borrowed to publish elsewhere
(NATS micro services answer into whatever reply subject a request names, which needs the server's
``allow_responses``). No registry, nothing to keep in sync.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from gym_runtime.transport.bus import Bus
from gym_runtime.transport.delivery import Delivery
from gym_runtime.transport.interface import Subscription
from gym_runtime.transport.rpc import process_tag
from gym_runtime.transport.subjects import Subjects, answer, lane

WAITS = b"waits"  # a discovery that asks each worker where its work waits too (``register``'s ``waits``)


class Registration:
    """A worker's announcement; ``stop()`` withdraws it (the worker no longer answers discovery)."""

    def __init__(self, sub: Subscription) -> None:
        self._sub = sub

    async def stop(self) -> None:
        await self._sub.unsubscribe()


async def register(
    bus: Bus,
    role: str,
    name: str,
    worker_id: str,
    stats: Callable[[], dict[str, Any]],
    *,
    fingerprint: str | None = None,
    fields: dict[str, str] | None = None,
    waits: Callable[[], dict[str, Any]] | None = None,
) -> Registration:
    """Announce a worker until ``stop()``.

    ``fingerprint`` (of the config entry served) lets publishers see workers of another config, and
    ``fields`` (each config key's digest) which keys differ. ``waits``: where the work it holds waits now,
    added to the answer of a discovery that asks for them (``WAITS``: ``gym-runtime why``) and no other.
    """
    meta: dict[str, Any] = {
        "namespace": bus.ns,
        "role": role,
        "name": name,
        "worker": worker_id,
        "process": process_tag(),  # as its keepalives name it: a caller's silent call is matched to it
    }
    if fingerprint:
        meta["fingerprint"] = fingerprint
    if fields:
        meta["fields"] = fields
    started = time.time()
    mine = lane(role, name)

    async def on_request(msg: Delivery) -> None:
        if not msg.reply:
            return
        body = {**meta, **stats(), "uptime_s": round(time.time() - started, 1)}
        if waits is not None and msg.data == WAITS:
            body.update(waits())
        await bus.publish_raw(answer(msg.reply, mine), json.dumps(body).encode())

    sub = await bus.subscribe(bus.subjects.status, on_request)
    await bus.flush()  # announced once this returns: a discovery right after finds the worker
    return Registration(sub)


async def discover(
    bus: Bus,
    *,
    wait_s: float = 0.5,
    until: Callable[[list[dict[str, Any]]], bool] | None = None,
    ask: bytes = b"",
) -> list[dict[str, Any]]:
    """Every live worker of this namespace with its counters: the answers gathered for ``wait_s``, or until
    ``until(answers so far)`` holds (a caller that knows whom it expects waits for them, not for a window a
    loaded machine can overrun). An answer that claims a role and name other than the lane it came in is
    dropped: on a secured bus only that entry's pool may answer there, so no pool can pass itself off as
    another's workers (a model replica a pause would wait for, say).

    A caller with ``until`` asks again while it waits (after 1, 2, 4… seconds): a request and its answers
    travel at most once on the bus, and one answer lost (a worker's connection busy or reconnecting as the
    request passed) must not read as a missing worker. Each worker counts once, with its latest answer."""
    found: dict[str, dict[str, Any]] = {}

    def each(subject: str, data: bytes) -> bool:
        w = _worker(bus, subject, data)
        if w is None:  # dropped: the answers so far are as they were
            return False
        found[f"{w['role']}.{w['name']}.{w.get('worker', '')}"] = w
        return until is not None and until(list(found.values()))

    deadline = time.monotonic() + wait_s
    ask_again_s = 1.0
    while True:
        left = deadline - time.monotonic()
        window = left if until is None else min(left, ask_again_s)
        await bus.scatter(bus.subjects.status, wait_s=max(window, 0.0), until=each, ask=ask)
        if until is None or until(list(found.values())) or window >= left:
            break
        ask_again_s *= 2
    return sorted(found.values(), key=lambda w: (w.get("role", ""), w.get("name", ""), w.get("worker", "")))


async def namespaces_with_workers(bus: Bus, namespaces: list[str], *, wait_s: float = 0.5) -> list[str]:
    """Which of ``namespaces`` (other than this connection's) have a live worker: the first answer to each one's
    discovery is enough (``status`` names them, so a user who looks in the wrong namespace learns the flag)."""
    found: list[str] = []
    for ns in namespaces:
        if ns != bus.ns and await bus.scatter(Subjects(ns).status, wait_s=wait_s, until=lambda *_: True):
            found.append(ns)
    return found


async def serving(bus: Bus, role: str, names: set[str], *, wait_s: float = 2.0) -> set[str]:
    """Which of ``names`` (config entries of ``role``) a live worker of this namespace serves: the answers to
    a discovery, gathered until each name has one, or for ``wait_s``."""

    def found(workers: list[dict[str, Any]]) -> set[str]:
        return {w["name"] for w in workers if w["role"] == role and w["name"] in names}

    if not names:
        return set()
    return found(await discover(bus, wait_s=wait_s, until=lambda workers: found(workers) >= names))


def _worker(bus: Bus, subject: str, data: bytes) -> dict[str, Any] | None:
    """A worker's answer to a discovery, if it came in the lane of the role and name it claims."""
    try:
        info = json.loads(data)
        claimed = answer("", lane(str(info["role"]), str(info["name"])))
    except (ValueError, TypeError, KeyError):
        return None
    return info if info.get("namespace") == bus.ns and subject.endswith(claimed) else None
