"""Batch manifests: what a published batch holds, so any collector can wait for it.

``publish`` writes the manifest (a JetStream key-value entry keyed by batch id)
before it publishes the first task; ``collect`` reads it to know how many
task×repeat results make the batch complete, and which agent owns each task
(a reader takes a task's results from that agent's result subject only).
"""

from __future__ import annotations

import time
from array import array
from bisect import bisect_right
from collections.abc import Iterator

import anyio
import msgspec

from gym_runtime.transport import jetstream
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.headers import CONTROL
from gym_runtime.transport.interface import Connection, KeyValue
from gym_runtime.transport.subjects import kv_key, kv_stream


class Owners(msgspec.Struct, kw_only=True):
    """Which agent runs each task of a batch, as index ranges in task order: ``runs`` holds pairs (position in
    ``names``, how many consecutive tasks), so a one-agent batch is one pair, and rows that alternate between
    agents cost ~4 bytes each (1,000,000 of them: 4 MB, under the 8 MB max payload)."""

    names: list[str] = msgspec.field(default_factory=list)
    runs: list[int] = msgspec.field(default_factory=list)

    @classmethod
    def one(cls, agent: str, tasks: int) -> Owners:
        """Every one of ``tasks`` tasks is ``agent``'s."""
        return cls(names=[agent], runs=[0, tasks])

    def add(self, agent: str) -> None:
        """The next task is ``agent``'s."""
        if self.runs and self.names[self.runs[-2]] == agent:
            self.runs[-1] += 1
            return
        if agent not in self.names:
            self.names.append(agent)
        self.runs += [self.names.index(agent), 1]

    def ranges(self) -> Iterator[tuple[int, int, str]]:
        """(first task, end, agent) of each range, in task order."""
        start = 0
        for i in range(0, len(self.runs), 2):
            end = start + self.runs[i + 1]
            yield start, end, self.names[self.runs[i]]
            start = end

    def each(self) -> Iterator[str]:
        """Each task's agent, in task order."""
        for start, end, agent in self.ranges():
            for _ in range(end - start):
                yield agent

    @property
    def tasks(self) -> int:
        return sum(self.runs[1::2])

    def counts(self) -> dict[str, int]:
        """Tasks per agent (the manifest's ``agents``)."""
        out: dict[str, int] = {}
        for start, end, agent in self.ranges():
            out[agent] = out.get(agent, 0) + end - start
        return out


class Manifest(msgspec.Struct, kw_only=True):
    batch: str
    expected: int  # task × repeat results that complete the batch
    tasks: int
    repeats: int
    agents: dict[str, int]
    input: str
    # each task's agent (None in a manifest written before owners were recorded: see TaskOwners)
    owners: Owners | None = None
    created: float = msgspec.field(default_factory=time.time)
    # every task is queued (written again after the last one): from then on, a task no longer queued
    # whose result never came was removed without one (terminated), and collect writes its failure row
    published: bool = False
    # tasks, in publish order, stored with every one before them: a publish of this batch run again (after
    # a crash, or a full stream) starts after them, whatever the streams' duplicate window
    stored: int = 0
    # how many times a reader publishes again the tasks of slots whose stored results were lost
    # (``jetstream.max_republish``); each task's body is kept (``Subjects.kept``) only when > 0
    max_republish: int = 0
    # the long values rows' ``provenance`` leaves out, kept once per batch: each model entry's adapter, model
    # name and config fingerprint (``ResolvedConfig.model_table``; never its URL or key)
    models: dict[str, dict[str, str]] = {}
    # the first slot its budget held back (-1: none): it and every later slot were never published, and get
    # ``budget`` failure rows; a publish of this batch again (with a larger budget) goes on from ``stored``
    held_from: int = -1


def new_manifest(
    batch: str,
    owners: Owners,
    *,
    repeats: int,
    input_path: str,
    max_republish: int = 0,
    models: dict[str, dict[str, str]] | None = None,
) -> Manifest:
    """The manifest of a batch about to be published: ``owners`` says whose each task is."""
    tasks = owners.tasks
    return Manifest(
        batch=batch,
        expected=tasks * repeats,
        tasks=tasks,
        repeats=repeats,
        agents=owners.counts(),
        input=input_path,
        owners=owners,
        max_republish=max_republish,
        models=models or {},
    )


class TaskOwners:
    """Each task's agent, resolved once from a manifest (a bisect over its ranges): the agent whose result
    subject alone may carry the task's results. A manifest written before owners were recorded names its
    agents only: one agent owns every task; with several, any of them may answer any task."""

    def __init__(self, manifest: Manifest) -> None:
        self.tasks = manifest.tasks
        owners = manifest.owners
        if owners is None and len(manifest.agents) == 1:
            owners = Owners.one(next(iter(manifest.agents)), manifest.tasks)
        self._any = None if owners is not None else frozenset(manifest.agents)
        self._starts = array("q")
        self._names: list[str] = []
        for start, _, agent in owners.ranges() if owners is not None else ():
            self._starts.append(start)
            self._names.append(agent)

    def owner(self, task: int) -> str:
        """The task's agent ('' when the manifest does not say, or the batch has no such task)."""
        if self._any is not None or not 0 <= task < self.tasks:
            return ""
        return self._names[bisect_right(self._starts, task) - 1]

    def allows(self, task: int, agent: str) -> bool:
        """Whether ``agent`` may store results of ``task`` (a task of the batch, owned by that agent)."""
        if not 0 <= task < self.tasks:
            return False
        if self._any is not None:
            return agent in self._any
        return self._names[bisect_right(self._starts, task) - 1] == agent


async def _kv(bus: Bus) -> KeyValue:
    return await bus.kv(bus.subjects.batches_bucket)


async def put_manifest(bus: Bus, manifest: Manifest) -> None:
    kv = await _kv(bus)
    await kv.put(bus.subjects.manifest_key(manifest.batch), msgspec.json.encode(manifest))


async def get_manifest(bus: Bus, batch: str, *, wait_s: float = 0.0) -> Manifest | None:
    """The batch's manifest; waits up to ``wait_s`` for a publish that has not happened yet."""
    kv = await _kv(bus)
    deadline = time.monotonic() + wait_s
    while True:
        value = await kv.get(bus.subjects.manifest_key(batch))
        if value is not None:
            return msgspec.json.decode(value, type=Manifest)
        if time.monotonic() >= deadline:
            return None
        await anyio.sleep(0.2)


async def other_namespaces(bus: Connection, batch: str | None = None) -> str:
    """Where else to look, for a command that found nothing in its namespace: the other namespaces of this server
    that hold ``batch`` (without one: any stream), as the ``--namespace`` to give; else how to name one."""
    others: list[str] = []
    if not bus.secured:  # a secured server's roles are kept to their namespaces' streams: the flag, unnamed
        others = [ns for ns in await jetstream.namespaces(bus) if ns != bus.subjects.ns]
        if batch is not None:
            others = [ns for ns in others if await jetstream.holds_batch(bus, ns, batch)]
    if not others:
        return "--namespace NAME reads another namespace"
    held = "holds it" if batch is not None else "is on this server"
    return "; ".join(f"namespace {ns!r} {held}: add --namespace {ns}" for ns in others)


async def no_such_batch(bus: Connection, batch: str, *, shown: int = 10) -> str:
    """The line for a ``batch`` this namespace has no manifest of: the batches it has (by name, ``shown`` of
    them), and where else ``batch`` is (``other_namespaces``). A secured bus's roles may not list a bucket:
    there, only where to look."""
    names = [] if bus.secured else await jetstream.kv_keys(bus, bus.subjects.batches_bucket)
    ns = bus.subjects.ns
    held = (
        f"its batches: {', '.join(names[:shown])}{f' … ({len(names)})' if len(names) > shown else ''}"
        if names
        else f"namespace {ns!r} holds no batch"
    )
    where = await other_namespaces(bus, batch)
    return f"no batch {batch!r} in namespace {ns!r} (published here? purged?); {held}; {where}"


async def purge_batch(bus: Connection, batch: str) -> int:
    """Remove a batch's results, kept tasks, attempt records, rollouts' checkpoints (and the sandboxes kept with them)
    and manifest; returns how many results were removed.

    Never automatic: only ``gym-runtime purge`` or ``collect --purge`` (after the
    file is written) call it, so a rerun ``collect`` of a kept batch always works.
    """
    names = bus.subjects
    removed = 0
    for stream in await jetstream.results_streams(bus):  # each agent's, and the lost records'
        removed += await jetstream.purge_subject(bus, stream, names.batch_results(batch))
    await jetstream.purge_subject(bus, names.kept_stream, names.kept(batch, "*"), count=False)
    await jetstream.purge_subject(bus, names.attempts_stream, names.attempt("*", batch), count=False)
    checkpoints = names.checkpoints_bucket  # its rollouts' checkpoints (resume): none outlives its batch
    every = kv_key(checkpoints, names.batch_checkpoints(batch))
    await jetstream.purge_subject(bus, kv_stream(checkpoints), every, count=False)
    await jetstream.delete_key(bus, names.batches_bucket, names.manifest_key(batch))
    # the sandboxes kept for branching its rollouts (parked copies, ``sandboxes.kept``) go too
    await bus.nc.publish(names.purged(batch), b"", headers=CONTROL)
    await bus.nc.flush()
    return removed
