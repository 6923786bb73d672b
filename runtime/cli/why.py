"""``gym-runtime why``: where every in-flight rollout waits now, the longest waits first, the late ones named."""

from __future__ import annotations

import argparse
import json

from gym_runtime.cli import _common as cli
from gym_runtime.errors import UserError
from gym_runtime.observability.tracing import Telemetry


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "why", help="where every in-flight rollout waits now (generating, in a tool, ...), late waits named"
    )
    cli.bus_options(p, "NATS URL of the running system")
    p.add_argument("--batch", metavar="ID", help="only this batch's rollouts")
    p.add_argument("--watch", action="store_true", help="refresh until interrupted (Ctrl-C ends it, exit 0)")
    p.add_argument("--interval", type=float, default=2.0, metavar="S", help="--watch refresh period (default 2)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    cli.log_level_option(p)


def main(args: argparse.Namespace) -> int:
    from gym_runtime.ops.why import gather, render
    from gym_runtime.service.loop import run_async
    from gym_runtime.transport.bus import Bus

    url = cli.reach(cli.need_url(args, None), query=True)
    if args.interval <= 0:
        raise UserError(f"--interval {args.interval:g}: must be positive (seconds between refreshes)")
    auth = cli.client_auth(args)

    async def go() -> None:
        import anyio

        bus = await Bus.connect(
            url,
            namespace=args.namespace,
            telemetry=Telemetry(service="gym-runtime.why"),
            name="gym-why",
            auth=auth,
            role="publisher",
        )
        try:
            while True:
                report = await gather(bus, batch=args.batch)
                print(json.dumps(report) if args.json else render(report), flush=True)
                if not args.watch:
                    return
                await anyio.sleep(max(0.0, args.interval - 1.0))  # gather itself listens for a second
        finally:
            await bus.close()

    try:
        run_async(go)
    except KeyboardInterrupt:
        if not args.watch:
            raise
    return 0
