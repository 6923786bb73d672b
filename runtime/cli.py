"""``gym-runtime``: run a batch, serve workers, or run the NATS server.

Exit codes: 0 success; 1 the batch finished with failure rows; 2 bad usage,
config or input (nothing was run); 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

from runtime import logs
from runtime.bus import ServerUnreachable
from runtime.config import Config, ConfigError, load_config
from runtime.server import DEFAULT_MAX_PAYLOAD, EmbeddedServer, ServerError, parse_size
from runtime.tasks import InputError
from runtime.tracing import Telemetry

EXIT_FAILURES = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def _err(msg: str) -> None:
    print(f"gym-runtime: error: {msg}", file=sys.stderr)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override a config value, e.g. --set models.policy.adapter=openai (repeatable)")
    p.add_argument("--log-level", default=os.environ.get("GYM_LOG_LEVEL", "warning"),
                   help="structlog level (default: warning; env GYM_LOG_LEVEL)")
    p.add_argument("--trace-file", help="write spans as JSON lines to this file")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gym-runtime", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="collect verified rollouts for an input file, end to end")
    run.add_argument("config", help="config YAML")
    run.add_argument("-i", "--input", required=True, help="input tasks JSONL (NeMo Gym format)")
    run.add_argument("-o", "--output", required=True, help="output rollouts JSONL")
    run.add_argument("--agent", help="agent for rows without agent_ref (or to override it)")
    run.add_argument("--repeats", type=int, default=1, help="rollouts per task (default 1)")
    run.add_argument("--limit", type=int, help="use only the first N rows")
    run.add_argument("--concurrency", type=int, help="rollouts in flight per agent worker")
    run.add_argument("--nats", help="use this NATS server instead of starting an embedded one")
    run.add_argument("--batch", help="batch id (default: random)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    _common(run)

    start = sub.add_parser("start", help="run long-lived workers for the roles a config names")
    start.add_argument("config")
    start.add_argument("--nats", help="NATS URL (default: the config's `nats`)")
    start.add_argument("--only", action="append", metavar="ROLE.NAME",
                       help="start only these, e.g. models.policy (repeatable)")
    start.add_argument("--replicas", type=int, help="processes per selected worker (default: the config's replicas)")
    start.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)  # one pool child
    _common(start)

    pub = sub.add_parser("publish", help="validate and publish a batch of tasks; prints the batch id")
    pub.add_argument("config")
    pub.add_argument("-i", "--input", required=True, help="input tasks JSONL (NeMo Gym format)")
    pub.add_argument("--nats", help="NATS URL (default: the config's `nats`)")
    pub.add_argument("--batch", help="batch id (default: random); re-publishing the same id is deduplicated")
    pub.add_argument("--agent", help="agent for rows without agent_ref (or to override it)")
    pub.add_argument("--repeats", type=int, default=1)
    pub.add_argument("--limit", type=int)
    _common(pub)

    col = sub.add_parser("collect", help="wait for a batch's results and write JSONL + sidecars")
    col.add_argument("--batch", required=True)
    col.add_argument("--nats", required=True)
    col.add_argument("-o", "--output", required=True)
    col.add_argument("--namespace", default="gym")
    col.add_argument("--wait", type=float, default=60.0, help="seconds to wait for the batch to be published")
    col.add_argument("--no-progress", action="store_true")
    col.add_argument("--log-level", default=os.environ.get("GYM_LOG_LEVEL", "warning"))

    rv = sub.add_parser("reverify", help="recompute the rewards of recorded rollouts (any NeMo Gym rollouts file)")
    rv.add_argument("config")
    rv.add_argument("-i", "--input", required=True, help="rollouts JSONL (rows with `response`)")
    rv.add_argument("-o", "--output", required=True, help="re-verified rollouts JSONL")
    rv.add_argument("--agent", help="whose resource verifies (default: the config's only one)")
    rv.add_argument("--tasks", help="task rows to join by input messages (older rollout files lack task fields)")
    rv.add_argument("--replicas", type=int, help="resource workers to start here (default: the config's)")
    rv.add_argument("--concurrency", type=int, default=64, help="rows in flight")
    rv.add_argument("--nats", help="use this NATS server instead of an embedded one")
    _common(rv)

    st = sub.add_parser("status", help="workers per role and replica, queue depths, recent rollouts/s")
    st.add_argument("--nats", required=True)
    st.add_argument("--namespace", default="gym")
    st.add_argument("--json", action="store_true", help="print JSON instead of a table")
    st.add_argument("--log-level", default=os.environ.get("GYM_LOG_LEVEL", "warning"))

    server = sub.add_parser("server", help="run the NATS server (JetStream on) in the foreground")
    server.add_argument("--port", type=int, default=4222)
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--store-dir", help="JetStream store dir (default: a temp dir)")
    server.add_argument("--max-payload", default=str(DEFAULT_MAX_PAYLOAD), help="e.g. 8MB")
    return parser


def _load(args: argparse.Namespace) -> Config:
    cfg = load_config(args.config, args.overrides)
    if getattr(args, "concurrency", None):
        for a in cfg.agents.values():
            a.concurrency = args.concurrency
    return cfg


def _print_stats(batch: str, s: Any, out: str, *, elapsed_s: float | None = None) -> None:
    from runtime.metrics import summary_lines

    took = f" in {elapsed_s:.2f}s" if elapsed_s is not None else ""
    print(f"batch {batch}: {s.rows} rows, {s.failures} failed{took} -> {out}")
    if s.mean_reward is not None:
        print(f"mean reward: {s.mean_reward:.4f}")
    for line in summary_lines(s.metrics):
        print(line)


def _failures_exit(stats: Any, out: str) -> int:
    if stats.failures:
        from runtime.collector import sidecar_paths

        _err(f"{stats.failures} rollouts failed; see {sidecar_paths(out)[0]}")
        return EXIT_FAILURES
    return 0


@contextlib.contextmanager
def _server_url(args: argparse.Namespace, cfg: Config) -> Iterator[str | list[str]]:
    """``--nats URL`` or the config's; ``embedded`` starts a server for the command and stops it after."""
    url: str | list[str] = args.nats or cfg.nats
    if url != "embedded":
        yield url
        return
    with EmbeddedServer() as server:
        yield server.url


def cmd_run(args: argparse.Namespace) -> int:
    from runtime.runner import run_async, run_batch

    cfg = _load(args)
    telemetry = Telemetry.from_options(trace_file=args.trace_file, service="gym-runtime run")
    try:
        with _server_url(args, cfg) as url, _progress(args.no_progress) as progress:
            bar = progress.add_task("rollouts", total=None)

            def on_progress(done: int, total: int) -> None:
                progress.update(bar, completed=done, total=total)

            result = run_async(lambda: run_batch(
                cfg, url, input_path=args.input, out=args.output, telemetry=telemetry, agent=args.agent,
                repeats=args.repeats, limit=args.limit, batch=args.batch, on_progress=on_progress,
            ))
    finally:
        telemetry.shutdown()
    _print_stats(result.batch, result.stats, args.output, elapsed_s=result.elapsed_s)
    return _failures_exit(result.stats, args.output)


def _url(args: argparse.Namespace, cfg: Config | None) -> str | list[str]:
    url = args.nats or (cfg.nats if cfg else None)
    if not url or url == "embedded":
        raise ValueError(f"{args.command} needs --nats URL (start one with `gym-runtime server`)")
    return url


def cmd_start(args: argparse.Namespace) -> int:
    from runtime.runner import run_async, selected, serve

    cfg = _load(args)
    url = _url(args, cfg)
    pairs = selected(cfg, args.only)
    replicas = {(r, n): args.replicas or getattr(cfg, r)[n].replicas for r, n in pairs}
    if args.in_process or sum(replicas.values()) == 1:
        telemetry = Telemetry.from_options(trace_file=args.trace_file, service="gym-runtime workers")
        try:
            run_async(lambda: serve(cfg, url, only=args.only, telemetry=telemetry, replicas=args.replicas,
                                    ready=lambda: print("workers ready", flush=True)))
        finally:
            telemetry.shutdown()
        return 0
    from runtime.supervisor import Child, child_argv, run_pool

    passthrough = [x for o in args.overrides for x in ("--set", o)] + ["--log-level", args.log_level]
    if args.trace_file:
        passthrough += ["--trace-file", args.trace_file]
    children = [
        Child(f"{r}.{n}", child_argv(args.config, url if isinstance(url, str) else ",".join(url), f"{r}.{n}", passthrough))
        for (r, n), k in replicas.items() for _ in range(k)
    ]
    return run_pool(children)


def _progress(disabled: bool) -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    show = not disabled and sys.stderr.isatty()
    return Progress(TextColumn("rollouts"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    transient=True, disable=not show)


def cmd_publish(args: argparse.Namespace) -> int:
    from runtime.bus import Bus
    from runtime.runner import publish_batch, run_async

    cfg = _load(args)
    url = _url(args, cfg)
    telemetry = Telemetry.from_options(trace_file=args.trace_file, service="gym-runtime publish")

    async def main() -> Any:
        bus = await Bus.connect(url, namespace=cfg.namespace, telemetry=telemetry, name="gym-publish")
        try:
            return await publish_batch(bus, cfg, args.input, agent=args.agent, repeats=args.repeats,
                                       limit=args.limit, batch=args.batch)
        finally:
            await bus.close()

    try:
        manifest = run_async(main)
    finally:
        telemetry.shutdown()
    print(f"published {manifest.expected} tasks ({manifest.tasks} rows x {manifest.repeats}) as batch:", file=sys.stderr)
    print(manifest.batch)
    return 0


def cmd_collect(args: argparse.Namespace) -> int:
    from runtime.bus import Bus
    from runtime.runner import collect_batch, run_async

    url = _url(args, None)
    telemetry = Telemetry()
    with _progress(args.no_progress) as progress:
        bar = progress.add_task("rollouts", total=None)

        async def main() -> Any:
            bus = await Bus.connect(url, namespace=args.namespace, telemetry=telemetry, name="gym-collect")
            try:
                return await collect_batch(bus, args.batch, args.output, wait_s=args.wait,
                                           on_progress=lambda d, t: progress.update(bar, completed=d, total=t))
            finally:
                await bus.close()

        stats = run_async(main)
    _print_stats(args.batch, stats, args.output)
    return _failures_exit(stats, args.output)


def cmd_status(args: argparse.Namespace) -> int:
    from runtime.bus import Bus
    from runtime.runner import run_async
    from runtime.status import gather, render

    url = _url(args, None)

    async def main() -> Any:
        bus = await Bus.connect(url, namespace=args.namespace, telemetry=Telemetry(), name="gym-status")
        try:
            return await gather(bus)
        finally:
            await bus.close()

    report = run_async(main)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


def cmd_server(args: argparse.Namespace) -> int:
    import signal
    import threading

    srv = EmbeddedServer(port=args.port, host=args.host, store_dir=args.store_dir,
                         max_payload=parse_size(args.max_payload))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    srv.start()
    print(srv.url, flush=True)
    try:
        while not stop.is_set() and srv._proc is not None and srv._proc.poll() is None:
            stop.wait(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        srv.stop()
    return 0


def cmd_reverify(args: argparse.Namespace) -> int:
    from runtime.runner import reverify_batch, run_async

    cfg = load_config(args.config, args.overrides)
    telemetry = Telemetry.from_options(trace_file=args.trace_file, service="gym-runtime reverify")
    try:
        with _server_url(args, cfg) as url:
            report = run_async(lambda: reverify_batch(
                cfg, url, input_path=args.input, out=args.output, telemetry=telemetry, agent=args.agent,
                replicas=args.replicas, in_flight=args.concurrency, tasks_path=args.tasks,
            ))
    finally:
        telemetry.shutdown()
    for line in report.lines():
        print(line)
    if report.failed:
        from runtime.collector import sidecar_paths

        _err(f"{report.failed} rows could not be re-verified; see {sidecar_paths(args.output)[0]}")
        return EXIT_FAILURES
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.configure(args.log_level if hasattr(args, "log_level") else "warning")
    handlers = {"run": cmd_run, "start": cmd_start, "server": cmd_server, "publish": cmd_publish,
                "collect": cmd_collect, "status": cmd_status, "reverify": cmd_reverify}
    try:
        return handlers[args.command](args)
    except (ConfigError, InputError, ServerError, ValueError, ServerUnreachable) as e:
        _err(str(e))
        return EXIT_USAGE
    except KeyboardInterrupt:
        _err("interrupted")
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())

