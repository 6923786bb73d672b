"""A batch stopped once a model it needs has no endpoint in service, read from the bus (issue 77).

Each model worker says in its status answer whether every endpoint of its adapter is out of service
(``out_of_service``, ``ModelWorker``); each agent worker which model it calls. So the watch holds wherever the
workers run: in ``run``'s own process, in its worker children, or ``start``ed apart from a ``publish`` and its
``collect``. A model is out when every replica that answers says so; its batch is cancelled (the rollouts not
run become ``cancelled`` rows, each row still once) rather than each rollout failing in turn on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio

from gym_runtime.data.batches import get_manifest
from gym_runtime.observability import logs
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.discovery import discover
from gym_runtime.workers.control import cancel_batch

log = logs.get("gym.batch")

WATCH_EVERY_S = 2.0  # between two looks at the workers' status (a discovery: nothing per call)


@dataclass(frozen=True)
class Out:
    """A model none of whose replicas has an endpoint in service: why (its worker's last call said), and the
    processes (``node/pid``) of those replicas."""

    model: str
    cause: str
    processes: tuple[str, ...]


class Nudge:
    """ "Look again now", from a callback of the caller's (a failure row came in: ``collect``, and ``run`` with its
    workers in children): the watch's next look is at once rather than ``every_s`` later. On a quiet machine a
    model with every endpoint out fails a thousand rollouts within the two seconds between looks, and the batch
    ended as a failure row each, with no line."""

    def __init__(self) -> None:
        self._event = anyio.Event()

    def poke(self) -> None:
        self._event.set()

    def on_failure(
        self, on_result: Callable[[bool, float | None], None] | None
    ) -> Callable[[bool, float | None], None]:
        """A collector's ``on_result`` (``ok``, ``reward``) that also pokes on a failure row."""

        def on(ok: bool, reward: float | None) -> None:
            if on_result is not None:
                on_result(ok, reward)
            if not ok:
                self.poke()

        return on

    async def wait(self, within_s: float) -> None:
        with anyio.move_on_after(within_s):
            await self._event.wait()
        self._event = anyio.Event()


def models_out(workers: list[dict[str, Any]], models: set[str]) -> list[Out]:
    """Which of ``models`` have replicas that answer and every one of them out of service (pure: the rule)."""
    found = []
    for model in sorted(models):
        replicas = [w for w in workers if w.get("role") == "model" and w.get("name") == model]
        if replicas and all(w.get("out_of_service") for w in replicas):
            processes = tuple(sorted(str(w.get("process") or "?") for w in replicas))
            found.append(Out(model, str(replicas[0]["out_of_service"]), processes))
    return found


async def stop_when_out(bus: Bus, batch: str, *, every_s: float = WATCH_EVERY_S, nudge: Nudge | None = None) -> Out:
    """Watch the models the batch's agents call; once one is out, cancel the batch and return which (and say it
    in one log line). Runs until then: its caller cancels it when the batch ends first."""
    agents: set[str] = set()
    while True:
        if not agents:  # read until there is one: a `collect` may start before its batch's `publish`
            manifest = await get_manifest(bus, batch)
            agents = set(manifest.agents) if manifest is not None else set()
        workers = await discover(bus, wait_s=0.5)
        models = {
            str(w["model"]) for w in workers if w.get("role") == "agent" and w.get("name") in agents and w.get("model")
        }
        out = models_out(workers, models)
        if out:
            log.warning("batch.stopped", batch=batch, model=out[0].model, cause=out[0].cause)
            await cancel_batch(bus, batch)
            return out[0]
        if nudge is None:
            await anyio.sleep(every_s)
        else:
            await nudge.wait(every_s)
