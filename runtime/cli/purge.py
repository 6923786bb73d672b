"""``gym-runtime purge --batch ID``: drop a batch's stored results and manifest.

On a ``server --secure`` bus only the admin role may purge (``admin.creds`` in ``--auth-dir``).

Results otherwise stay until the stream's retention (``jetstream.max_age_s`` /
``max_bytes``) drops them, so a rerun ``collect`` still writes the same file.
"""

from __future__ import annotations

import argparse
from typing import Any

from gym_runtime.cli import _common as cli
from gym_runtime.data.batches import get_manifest, other_namespaces


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("purge", help="delete a batch's stored results and manifest")
    p.add_argument("--batch", required=True, action="append", help="batch id (repeatable)")
    cli.bus_options(p, "NATS URL(s), comma-separated")
    cli.log_level_option(p)


def main(args: argparse.Namespace) -> int:
    from gym_runtime.data.batches import purge_batch
    from gym_runtime.service.loop import run_async

    url = cli.reach(cli.need_url(args, None), query=True)
    auth = cli.client_auth(args)  # on a `server --secure` bus purging is the admin's (admin.creds)

    async def go() -> Any:
        done = []
        async with cli.connected(args, url, "purge", auth=auth, role="admin") as bus:
            for b in args.batch:
                known = await get_manifest(bus, b) is not None
                removed = await purge_batch(bus, b)
                # nothing here: where else it is, as `collect` and `explain` say it
                elsewhere = "" if known or removed else await other_namespaces(bus, b)
                done.append((b, known, removed, elsewhere))
        return done

    unknown = []
    for batch, known, removed, elsewhere in run_async(go):
        if known or removed:
            print(f"batch {batch}: purged {cli.plural(removed, 'result')}")
        else:
            unknown.append((batch, elsewhere))
    if unknown:  # a mistyped id, one purged before, or another namespace's: said, not "purged 0 results"
        names = ", ".join(repr(b) for b, _ in unknown)
        where = "; ".join(dict.fromkeys(e for _, e in unknown))
        cli.err(f"no batch {names} in namespace {args.namespace!r} (nothing stored under it; purged already?); {where}")
        return cli.EXIT_USAGE
    return 0
