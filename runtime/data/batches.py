"""Batch manifests: what a published batch holds, so any collector can wait for it.

``publish`` writes the manifest (a JetStream key-value entry keyed by batch id)
before it publishes the first task; ``collect`` reads it to know how many
task×repeat results make the batch complete.
"""

from __future__ import annotations

import time

import anyio
import msgspec

from gym_runtime.transport import jetstream
from gym_runtime.transport.bus import Bus


class Manifest(msgspec.Struct, kw_only=True):
    batch: str
    expected: int  # task × repeat results that complete the batch
    tasks: int
    repeats: int
    agents: dict[str, int]
    input: str
    created: float = msgspec.field(default_factory=time.time)
    # every task is queued (written again after the last one): from then on, a task no longer queued
    # whose result never came was removed without one (terminated), and collect writes its failure row
    published: bool = False
    # tasks, in publish order, stored with every one before them: a publish of this batch run again (after
    # a crash, or a full stream) starts after them, whatever the streams' duplicate window
    stored: int = 0


async def _kv(bus: Bus) -> jetstream.KV:
    return await jetstream.kv_bucket(bus, bus.subjects.batches_bucket)


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


async def purge_batch(bus: Bus, batch: str) -> int:
    """Remove a batch's results and manifest; returns how many results were removed.

    Never automatic: only ``gym-runtime purge`` or ``collect --purge`` (after the
    file is written) call it, so a rerun ``collect`` of a kept batch always works.
    """
    names = bus.subjects
    removed = await jetstream.purge_subject(bus, names.results_stream, names.batch_results(batch))
    await jetstream.delete_key(bus, names.batches_bucket, names.manifest_key(batch))
    return removed
