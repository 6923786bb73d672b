"""``gym-runtime collect``: wait for a batch's results and write JSONL + sidecars."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from gym_runtime.cli import _common as cli
from gym_runtime.observability import progress


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("collect", help="wait for a batch's results and write JSONL + sidecars")
    p.add_argument("--batch", required=True, help="the batch id `publish` printed")
    cli.bus_options(p, "NATS URL the batch was published to")
    p.add_argument("-o", "--output", required=True, help="output rollouts JSONL")
    p.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="S",
        help="seconds to wait for a batch that is not published yet (default 0: an unknown id is an error at "
        "once; publish returns only once its batch is stored)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar or lines (same as --quiet)")
    p.add_argument(
        "--purge",
        action="store_true",
        help="once the file is written, delete the batch's stored results, kept tasks and manifest",
    )
    p.add_argument(
        "--max-republish",
        type=cli.non_negative_int,
        metavar="N",
        help="publish the tasks of slots whose stored results were lost again at most N times before they become "
        "`lost` failure rows (default: the batch's jetstream.max_republish, recorded when it was published)",
    )
    progress.add_arguments(p)
    cli.log_level_option(p)


NO_WORKER_CHECK_S = 5.0


async def watch_agents(bus: Any, batch: str) -> None:
    """Say once (stderr) when an agent of the batch has no worker at all: the wait is not a hang."""
    import anyio

    from gym_runtime.data.batches import get_manifest
    from gym_runtime.transport.discovery import serving

    manifest = await get_manifest(bus, batch, wait_s=3600.0)
    if manifest is None:
        return
    told: set[str] = set()
    while True:
        await anyio.sleep(NO_WORKER_CHECK_S)
        unheard = set(manifest.agents) - told
        for agent in sorted(unheard - await serving(bus, "agent", unheard, wait_s=0.5)):
            told.add(agent)
            print(
                f"gym-runtime: warning: no worker serves agent {agent!r}; batch {batch} waits until one "
                f"starts (gym-runtime start CONFIG --only agents.{agent})",
                file=sys.stderr,
                flush=True,
            )


def main(args: argparse.Namespace) -> int:
    from gym_runtime.observability.tracing import Telemetry
    from gym_runtime.service.batches import collect_batch
    from gym_runtime.service.loop import run_async
    from gym_runtime.service.outage import Nudge, Out, stop_when_out

    url = cli.need_url(args, None)
    auth = cli.client_auth(args)
    if args.purge and auth is not None:  # on a `server --secure` bus purging is the admin's: say so before collecting
        auth.creds("admin")
    cli.check_output(args.output)
    cli.reach(url)
    telemetry = Telemetry()
    stopped: list[Out] = []
    with progress.Tracker(f"collect {args.batch}", progress.options_from(args)) as tracker:
        cli.when_interrupted(
            lambda: (
                (f"{tracker.done} of {tracker.total} rows were read" if tracker.done else "no row was read yet")
                + f"; {args.output} is written whole when every row is in, so it was not written; the batch's results "
                "stay on the bus: run the same collect again to write it"
            )
        )

        async def go() -> Any:
            async with cli.connected(args, url, "collect", auth=auth, telemetry=telemetry) as bus:
                import asyncio

                watcher = asyncio.ensure_future(watch_agents(bus, args.batch))  # errors here stay plain
                # a notice, not the collect: its own error is dropped whenever it ends (a cancel can be lost to
                # an answer in the same step), and the collect's outcome says what went wrong
                watcher.add_done_callback(lambda t: t.cancelled() or t.exception())
                failed = Nudge()  # a failure row: look at the models at once
                stopper = asyncio.ensure_future(stop_when_out(bus, args.batch, nudge=failed))  # a model all out
                stopper.add_done_callback(lambda t: t.cancelled() or t.exception())
                try:
                    stats = await collect_batch(
                        bus,
                        args.batch,
                        args.output,
                        wait_s=args.wait,
                        on_progress=tracker,
                        on_result=failed.on_failure(tracker.result),
                        max_republish=args.max_republish,
                        on_note=lambda line: print(f"gym-runtime: note: {line}", file=sys.stderr, flush=True),
                    )
                finally:
                    watcher.cancel()
                    stopper.cancel()
                if stopper.done() and not stopper.cancelled() and stopper.exception() is None:
                    stopped.append(stopper.result())
                if args.purge:  # only now: the file and sidecars are on disk
                    from gym_runtime.data.batches import purge_batch

                    if auth is None:
                        await purge_batch(bus, args.batch)
                    else:  # the publisher role may not purge a stream: the admin's credentials do
                        async with cli.connected(
                            args, url, "purge", auth=auth, role="admin", telemetry=telemetry
                        ) as admin:
                            await purge_batch(admin, args.batch)
                return stats

        stats = run_async(go)
    cli.print_stats(args.batch, stats, args.output)
    if stopped:  # one line, not a failure row each; the workers are `start`'s, not this command's to stop
        o = stopped[0]
        cli.err(
            f"model {o.model!r}: {o.cause}; the batch was stopped, its rollouts not run are cancelled rows "
            f"({args.output}). Its model workers keep running (process {', '.join(o.processes)}), taking each "
            "endpoint back in once it answers: stop them with Ctrl-C (or SIGTERM) to the `gym-runtime start` that "
            "runs them"
        )
        return cli.EXIT_FAILURES
    return cli.failures_exit(stats, args.output)
