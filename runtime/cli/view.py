"""``gym-runtime view OUT.jsonl [MORE.jsonl ...]``: a local, read-only web page over rollouts files.

Each file is indexed once (the index kept beside it) before the server starts, so a bad file is one line and
exit 2, never a page that fails later. Loopback by default; ``--host`` beyond it serves every request only
with the access token the printed URL carries.
"""

from __future__ import annotations

import argparse
import ipaddress

from gym_runtime.cli._common import log_level_option
from gym_runtime.errors import UserError

DEFAULT_PORT = 8765


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("view", help="a local read-only web page over rollouts files: runs, rollouts, trajectories")
    p.add_argument(
        "files", metavar="FILE", nargs="+", help="rollouts JSONL (its _failures.jsonl beside it is read too)"
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1; beyond loopback: token)"
    )
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: any free one)")
    log_level_option(p)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(args: argparse.Namespace) -> int:
    import errno
    import secrets
    import sys

    from aiohttp import web

    from gym_runtime.service.loop import run_async
    from gym_runtime.view.runs import open_runs
    from gym_runtime.view.server import View

    if not 0 <= args.port <= 65535:
        raise UserError(f"--port {args.port}: not a port (0 to 65535)")
    runs = open_runs(args.files)
    local = is_loopback(args.host)
    token = None if local else secrets.token_urlsafe(24)

    async def serve() -> None:
        import anyio

        view = View(runs, token=token)
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
        url = f"http://{shown}:{port}/" + (f"?token={token}" if token else "")
        print(f"gym-runtime view: {url}", flush=True)
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
