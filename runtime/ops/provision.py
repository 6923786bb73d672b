"""Provisioning a secured server: as admin, create what every other role may only use.

Under ``server --secure`` no role but admin may create streams, consumers' streams, KV buckets or
the blob store, so the server's launcher runs :func:`provision` once per namespace after it starts.
"""

from __future__ import annotations

import threading
from pathlib import Path

import anyio

from gym_runtime.data import batches
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.ops.credentials import ClientAuth
from gym_runtime.transport import jetstream
from gym_runtime.transport.bus import Bus
from gym_runtime.workers import control
from gym_runtime.workers.runner import run_async


async def provision(url: str | list[str], auth: ClientAuth, namespaces: list[str], *, timeout: float = 30.0) -> None:
    """As admin, create each namespace's streams, batch and control KV buckets and blob store (idempotent).

    Retries for ``timeout`` seconds: a cluster's JetStream needs a meta leader first.
    """

    bus = await Bus.connect(
        url, namespace=namespaces[0], telemetry=Telemetry(), name="gym-provision", auth=auth, role="admin"
    )
    try:
        deadline = anyio.current_time() + timeout
        while True:
            try:
                for ns in namespaces:
                    b = Bus(bus.nc, namespace=ns, telemetry=bus.telemetry)
                    await jetstream.ensure_streams(b)
                    await batches._kv(b)  # the manifest bucket, created on first use
                    await control.control_kv(b)  # the trainer's policy versions, pauses, cancelled batches
                    await jetstream.ensure_blob_stream(b)  # bodies over the max payload
                return
            except Exception:
                if anyio.current_time() >= deadline:
                    raise
                await anyio.sleep(1.0)
    finally:
        await bus.close()


def provision_blocking(url: str, auth_dir: str | Path, namespaces: list[str], *, timeout: float = 30.0) -> None:
    """``provision`` from synchronous code, in a thread of its own (the caller may be inside an event loop)."""
    errors: list[BaseException] = []
    auth = ClientAuth(Path(auth_dir))

    def go() -> None:
        try:
            run_async(lambda: provision(url, auth, namespaces, timeout=timeout))
        except BaseException as e:  # re-raised in the caller's thread
            errors.append(e)

    t = threading.Thread(target=go, name="gym-provision")
    t.start()
    t.join()
    if errors:
        raise errors[0]
