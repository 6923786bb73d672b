"""A running ``view``: its lifecycle, from the runs opened and the access policy resolved (both before it
binds) to the pages served until cancelled, with a followed batch's rows as they come.

The command line only parses and prints: it is told the port bound (``ready``), and prints
``access.url(port)``.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import tempfile
from collections.abc import Callable
from pathlib import Path

import anyio
import msgspec
from aiohttp import web

from gym_runtime.data.batches import get_manifest, no_such_batch
from gym_runtime.errors import UserError, port_in_use
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.ops.credentials import ClientAuth
from gym_runtime.ops.why import gather
from gym_runtime.transport.bus import Bus
from gym_runtime.view.access import Access
from gym_runtime.view.live import Live
from gym_runtime.view.runs import Runs
from gym_runtime.view.server import View
from gym_runtime.view.tokens import Decode


class Follow(msgspec.Struct, frozen=True):
    """``--batch``: a batch to follow on a bus (reached before the view starts)."""

    batch: str
    url: str | list[str]
    namespace: str
    auth: ClientAuth | None = None


async def serve(
    runs: Runs,
    access: Access,
    port: int,
    *,
    ready: Callable[[int], None],
    follow: Follow | None = None,
    decode: Decode | None = None,
) -> None:
    """Serve ``runs`` under ``access`` on ``access.host``:``port`` until cancelled; ``ready(port)`` once bound."""
    async with contextlib.AsyncExitStack() as stack:
        live = await _open_live(stack, follow, len(runs.runs)) if follow is not None else None
        async with anyio.create_task_group() as tg:  # (left before the bus closes and the spool goes)
            if live is not None:
                runs.runs.append(live[0].run)
                tg.start_soon(live[0].follow, live[1])
            waits = functools.partial(gather, live[1], batch=live[0].manifest.batch, wait_s=0.5) if live else None
            await _serve_pages(View(runs, access, decode=decode, waits=waits), access, port, ready)


async def _serve_pages(view: View, access: Access, port: int, ready: Callable[[int], None]) -> None:
    runner = web.AppRunner(view.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, access.host, port)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        if e.errno == errno.EADDRINUSE:
            raise UserError(f"--port {port}: {port_in_use(access.host, port, '--port', zero=True)}") from None
        raise UserError(f"--host {access.host} --port {port}: cannot serve there ({e.strerror or e})") from None
    try:
        ready(runner.addresses[0][1])
        await anyio.sleep_forever()
    finally:
        await runner.cleanup()


async def _open_live(stack: contextlib.AsyncExitStack, follow: Follow, run_id: int) -> tuple[Live, Bus]:
    """The live run of ``--batch`` and its bus: the manifest read (none: the user's mistake), its rows to go
    into a spool file in a temporary folder (the bus and the folder go with ``stack``)."""
    bus = await Bus.connect(
        follow.url,
        namespace=follow.namespace,
        telemetry=Telemetry(),
        name="gym-view",
        auth=follow.auth,
        role="publisher",
    )
    stack.push_async_callback(bus.close)
    manifest = await get_manifest(bus, follow.batch)
    if manifest is None:
        raise UserError(f"--batch {follow.batch}: {await no_such_batch(bus, follow.batch)}")
    folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="gym-view-"))
    return Live(manifest, Path(folder) / f"{follow.batch}.jsonl", run_id), bus
