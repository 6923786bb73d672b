"""``gym-runtime purge --batch ID``: drop a batch's stored results and manifest.

On a ``server --secure`` bus only the admin role may purge (``admin.creds`` in ``--auth-dir``).

Results otherwise stay until the stream's retention (``jetstream.max_age_s`` /
``max_bytes``) drops them, so a rerun ``collect`` still writes the same file.
"""

from __future__ import annotations

import argparse
from typing import Any

from gym_runtime.cli._common import auth_option, client_auth, log_level_option, need_url
from gym_runtime.observability.tracing import Telemetry


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("purge", help="delete a batch's stored results and manifest")
    p.add_argument("--batch", required=True, action="append", help="batch id (repeatable)")
    p.add_argument("--nats", required=True, help="NATS URL(s), comma-separated")
    p.add_argument("--namespace", default="gym", help="the config's namespace (default: gym)")
    log_level_option(p)
    auth_option(p)


def main(args: argparse.Namespace) -> int:
    from gym_runtime.data.batches import purge_batch
    from gym_runtime.transport.bus import Bus
    from gym_runtime.workers.runner import run_async

    url = need_url(args, None)
    auth = client_auth(args)  # on a `server --secure` bus purging is the admin's (admin.creds)

    async def go() -> Any:
        bus = await Bus.connect(
            url, namespace=args.namespace, telemetry=Telemetry(), name="gym-purge", auth=auth, role="admin"
        )
        try:
            return [(b, await purge_batch(bus, b)) for b in args.batch]
        finally:
            await bus.close()

    for batch, removed in run_async(go):
        print(f"batch {batch}: purged {removed} results")
    return 0
