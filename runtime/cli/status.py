"""``gym-runtime status``: workers per role, queue depths, recent rollouts/s; or one batch's progress."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from gym_runtime.cli import _common as cli


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="workers per role and replica, queue depths, recent rollouts/s")
    cli.bus_options(p, "NATS URL of the running system")
    p.add_argument("--batch", metavar="ID", help="one batch: done, failed, pending, rate and ETA")
    p.add_argument(
        "--watch",
        action="store_true",
        help="refresh until interrupted (Ctrl-C ends it, exit 0; a live table on a terminal)",
    )
    p.add_argument("--interval", type=float, default=2.0, metavar="S", help="--watch refresh period (default 2)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    cli.log_level_option(p)


def main(args: argparse.Namespace) -> int:
    async def body(bus: Any) -> None:
        await (_batch(bus, args) if args.batch else _overview(bus, args))

    return cli.watched_query(args, "status", body)


async def _overview(bus: Any, args: argparse.Namespace) -> None:
    from gym_runtime.ops.status import gather, render

    with _Screen(args) as screen:
        while True:
            report = await gather(bus)
            screen.show(json.dumps(report, indent=2) if args.json else render(report))
            if not args.watch:
                return
            await _sleep(args.interval - 1.0)  # gather itself watches for a second


async def _batch(bus: Any, args: argparse.Namespace) -> None:
    import anyio

    from gym_runtime.ops.status import BatchWatch, render_batch

    async with anyio.create_task_group() as tg:
        watch = await BatchWatch.open(bus, args.batch, tg)
        await anyio.sleep(1.0)  # read what is stored; a second of arrivals gives a first rate
        with _Screen(args) as screen:
            while True:
                snap = watch.snapshot()
                screen.show(json.dumps(snap) if args.json else render_batch(snap))
                if not args.watch:  # --watch: until interrupted, past the batch's end too (as its help says)
                    break
                await _sleep(args.interval)
        tg.cancel_scope.cancel()


async def _sleep(seconds: float) -> None:
    import anyio

    await anyio.sleep(max(0.0, seconds))


class _Screen:
    """On a terminal with --watch: one live region redrawn in place; otherwise plain prints."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.live: Any = None
        if args.watch and not args.json and sys.stdout.isatty():
            from rich.live import Live

            self.live = Live(auto_refresh=False)

    def __enter__(self) -> _Screen:
        if self.live is not None:
            self.live.__enter__()
        return self

    def show(self, text: str) -> None:
        if self.live is not None:
            from rich.text import Text

            self.live.update(Text(text), refresh=True)
        else:
            print(text, flush=True)

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.__exit__(*exc)
