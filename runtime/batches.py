"""Batch manifests: what a published batch holds, so any collector can wait for it.

``publish`` writes the manifest (a JetStream key-value entry keyed by batch id)
before it publishes the first task; ``collect`` reads it to know how many
task×repeat results make the batch complete.
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import msgspec
from nats.js.api import KeyValueConfig
from nats.js.errors import BucketNotFoundError, KeyNotFoundError

from runtime.bus import Bus


class Manifest(msgspec.Struct, kw_only=True):
    batch: str
    expected: int  # task × repeat results that complete the batch
    tasks: int
    repeats: int
    agents: dict[str, int]
    input: str
    created: float = msgspec.field(default_factory=time.time)


def _bucket(bus: Bus) -> str:
    return f"{bus.ns.upper().replace('-', '_')}_BATCHES"


async def _kv(bus: Bus) -> Any:
    try:
        return await bus.js.key_value(_bucket(bus))
    except BucketNotFoundError:
        return await bus.js.create_key_value(KeyValueConfig(bucket=_bucket(bus), history=1))


async def put_manifest(bus: Bus, manifest: Manifest) -> None:
    kv = await _kv(bus)
    await kv.put(manifest.batch, msgspec.json.encode(manifest))


async def get_manifest(bus: Bus, batch: str, *, wait_s: float = 0.0) -> Manifest | None:
    """The batch's manifest; waits up to ``wait_s`` for a publish that has not happened yet."""
    kv = await _kv(bus)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            entry = await kv.get(batch)
            return msgspec.json.decode(entry.value, type=Manifest)
        except KeyNotFoundError:
            if time.monotonic() >= deadline:
                return None
            await anyio.sleep(0.2)
