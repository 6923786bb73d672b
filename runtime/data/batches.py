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


def _bucket(bus: Bus) -> str:
    return f"{bus.ns.upper().replace('-', '_')}_BATCHES"


async def _kv(bus: Bus) -> jetstream.KV:
    return await jetstream.kv_bucket(bus, _bucket(bus))


async def put_manifest(bus: Bus, manifest: Manifest) -> None:
    kv = await _kv(bus)
    await kv.put(manifest.batch, msgspec.json.encode(manifest))


async def get_manifest(bus: Bus, batch: str, *, wait_s: float = 0.0) -> Manifest | None:
    """The batch's manifest; waits up to ``wait_s`` for a publish that has not happened yet."""
    kv = await _kv(bus)
    deadline = time.monotonic() + wait_s
    while True:
        value = await kv.get(batch)
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
    removed = await jetstream.purge_subject(
        bus, jetstream.stream_names(bus.ns)["result"], jetstream.batch_results(bus.ns, batch)
    )
    await jetstream.delete_key(bus, _bucket(bus), batch)
    return removed
