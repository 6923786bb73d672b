"""``gym-runtime view OUT.jsonl [MORE.jsonl ...]``: a local, read-only web page over rollouts files.

Each file is indexed once (the index kept beside it) before the server starts, so a bad file is one line and
exit 2, never a page that fails later. Loopback by default; ``--host`` beyond it serves every request only
with the access token the printed URL carries.
"""

from __future__ import annotations

import argparse
import ipaddress
from typing import Any

from gym_runtime.cli import _common as cli
from gym_runtime.errors import UserError

DEFAULT_PORT = 8765


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("view", help="a local read-only web page over rollouts files: runs, rollouts, trajectories")
    p.add_argument(
        "files", metavar="FILE", nargs="*", help="rollouts JSONL (its _failures.jsonl beside it is read too)"
    )
    p.add_argument("--batch", help="also follow this batch on the bus as its results are stored (with --nats)")
    cli.nats_option(p, "the bus of --batch")
    cli.namespace_option(p)
    p.add_argument(
        "--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1; beyond loopback: token)"
    )
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: any free one)")
    p.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="decode the token view with this local tokenizer.json (or a model folder holding one; needs the "
        "'tokenizers' extra)",
    )
    p.add_argument(
        "--export",
        metavar="DIR",
        help="write the pages as files that open with no server (a bundle to share) into DIR, then exit",
    )
    p.add_argument(
        "--filter",
        metavar="QUERY",
        default="",
        help="with --export: the rollouts table's filters, as its URL's query string (e.g. 'failure=any&run=0')",
    )
    cli.log_level_option(p)
    cli.auth_option(p)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(args: argparse.Namespace) -> int:
    import contextlib
    import errno
    import secrets
    import sys

    from aiohttp import web

    from gym_runtime.cli._common import client_auth, need_url, reach
    from gym_runtime.service.loop import run_async
    from gym_runtime.view.runs import open_runs
    from gym_runtime.view.server import View

    if not 0 <= args.port <= 65535:
        raise UserError(f"--port {args.port}: not a port (0 to 65535)")
    if not args.files and not args.batch:
        raise UserError("view needs a rollouts FILE, or --batch B --nats URL")
    if args.export is not None:
        return export(args)
    if args.filter:
        raise UserError("--filter goes with --export (the served table takes its filters from its form)")
    url = reach(need_url(args, None), query=True) if args.batch else None  # a dead bus: one line, before all else
    auth = client_auth(args)
    decode = tokenizer(args)
    runs = open_runs(args.files)
    local = is_loopback(args.host)
    token = None if local else secrets.token_urlsafe(24)

    async def serve() -> None:
        import anyio

        async with contextlib.AsyncExitStack() as stack:
            live = await open_live(stack, url, auth, args, len(runs.runs)) if url is not None else None
            async with anyio.create_task_group() as tg:  # (left before the bus closes and the spool goes)
                if live is not None:
                    runs.runs.append(live[0].run)
                    tg.start_soon(live[0].follow, live[1])
                await serve_pages(runs)

    async def serve_pages(runs: Any) -> None:
        import anyio

        view = View(runs, token=token, decode=decode)
        runner = web.AppRunner(view.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port)
        try:
            await site.start()
        except OSError as e:
            await runner.cleanup()
            if e.errno == errno.EADDRINUSE:
                raise UserError(f"--port {args.port}: already in use on {args.host} (choose another, or 0)") from None
            raise UserError(f"--host {args.host} --port {args.port}: cannot serve there ({e.strerror or e})") from None
        port = runner.addresses[0][1]
        shown = f"[{args.host}]" if ":" in args.host else args.host
        if local:  # a DNS-rebinding page reaches loopback under another name: only these are answered
            view.hosts = {f"{h}:{port}" for h in (shown, "127.0.0.1", "localhost", "[::1]")}
        page = f"http://{shown}:{port}/" + (f"?token={token}" if token else "")
        print(f"gym-runtime view: {page}", flush=True)
        if token:
            print(
                "gym-runtime view: served beyond loopback; the URL's token is what lets a browser in", file=sys.stderr
            )
        try:
            await anyio.sleep_forever()
        finally:
            await runner.cleanup()

    run_async(serve)
    return 0


async def open_live(stack: Any, url: Any, auth: Any, args: argparse.Namespace, run_id: int) -> tuple[Any, Any]:
    """The live run of ``--batch`` and its bus: the manifest read (none: the user's mistake), its rows to go
    into a spool file in a temporary folder (the bus and the folder go with ``stack``)."""
    import tempfile
    from pathlib import Path

    from gym_runtime.data.batches import get_manifest
    from gym_runtime.observability.tracing import Telemetry
    from gym_runtime.transport.bus import Bus
    from gym_runtime.view.live import Live

    bus = await Bus.connect(
        url, namespace=args.namespace, telemetry=Telemetry(), name="gym-view", auth=auth, role="publisher"
    )
    stack.push_async_callback(bus.close)
    manifest = await get_manifest(bus, args.batch)
    if manifest is None:
        raise UserError(f"--batch {args.batch}: no such batch in namespace {args.namespace!r} (published here?)")
    folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="gym-view-"))
    return Live(manifest, Path(folder) / f"{args.batch}.jsonl", run_id), bus


def tokenizer(args: argparse.Namespace) -> Any:
    """``--tokenizer``'s decoder (None: token ids shown); a missing file or extra is one line, before anything else."""
    from gym_runtime.view.tokens import load_tokenizer

    return load_tokenizer(args.tokenizer) if args.tokenizer else None


def export(args: argparse.Namespace) -> int:
    """``--export DIR``: the pages written as files (``view.export``), then a line saying what and where."""
    import asyncio
    from pathlib import Path

    from gym_runtime.view.export import Bundle, query
    from gym_runtime.view.runs import open_runs
    from gym_runtime.view.server import View

    if args.batch:
        raise UserError("--export writes files given, not a live --batch (collect it first, then export the file)")
    out = Path(args.export)
    if out.exists() and not out.is_dir():
        raise UserError(f"--export {args.export}: not a folder")
    q = query(args.filter)
    decode = tokenizer(args)
    runs = open_runs(args.files)
    out.mkdir(parents=True, exist_ok=True)
    written = asyncio.run(Bundle(View(runs, decode=decode), out, q).write())
    size = sum(written.values())
    print(f"gym-runtime view: wrote {len(written)} files, {size / 1e6:.1f} MB: open {out / 'index.html'}", flush=True)
    return 0
