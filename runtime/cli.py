"""``gym-runtime``: run a batch, serve workers, or run the NATS server.

Exit codes: 0 success; 1 the batch finished with failure rows; 2 bad usage,
config or input (nothing was run); 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from runtime import logs
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
    start.add_argument("--replicas", type=int, help="replicas of each selected worker")
    _common(start)

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


def _print_summary(result: Any, out: str) -> None:
    from runtime.metrics import summary_lines

    s = result.stats
    print(f"batch {result.batch}: {s.rows} rows, {s.failures} failed, in {result.elapsed_s:.2f}s -> {out}")
    if s.mean_reward is not None:
        print(f"mean reward: {s.mean_reward:.4f}")
    for line in summary_lines(s.metrics):
        print(line)


def cmd_run(args: argparse.Namespace) -> int:
    from runtime.runner import run_async, run_batch

    cfg = _load(args)
    telemetry = Telemetry.from_options(trace_file=args.trace_file, service="gym-runtime run")
    server: EmbeddedServer | None = None
    url: str | list[str] = args.nats or cfg.nats
    if url == "embedded":
        server = EmbeddedServer()
        url = server.start()
    try:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        show = not args.no_progress and sys.stderr.isatty()
        progress = Progress(TextColumn("rollouts"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            transient=True, disable=not show)
        with progress:
            bar = progress.add_task("rollouts", total=None)

            def on_progress(done: int, total: int) -> None:
                progress.update(bar, completed=done, total=total)

            result = run_async(lambda: run_batch(
                cfg, url, input_path=args.input, out=args.output, telemetry=telemetry, agent=args.agent,
                repeats=args.repeats, limit=args.limit, batch=args.batch, on_progress=on_progress,
            ))
    finally:
        telemetry.shutdown()
        if server:
            server.stop()
    _print_summary(result, args.output)
    if result.stats.failures:
        from runtime.collector import sidecar_paths

        _err(f"{result.stats.failures} rollouts failed; see {sidecar_paths(args.output)[0]}")
        return EXIT_FAILURES
    return 0


def cmd_start(args: argparse.Namespace) -> int:
    from runtime.runner import run_async, serve

    cfg = _load(args)
    url = args.nats or cfg.nats
    if url == "embedded":
        _err("start needs --nats URL (or a config whose `nats` is a URL); run `gym-runtime server` first")
        return EXIT_USAGE
    telemetry = Telemetry.from_options(trace_file=args.trace_file, service="gym-runtime workers")
    try:
        run_async(lambda: serve(cfg, url, only=args.only, telemetry=telemetry, replicas=args.replicas,
                                ready=lambda: print("workers ready", flush=True)))
    finally:
        telemetry.shutdown()
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.configure(args.log_level if hasattr(args, "log_level") else "warning")
    handlers = {"run": cmd_run, "start": cmd_start, "server": cmd_server}
    try:
        return handlers[args.command](args)
    except (ConfigError, InputError, ServerError, ValueError) as e:
        _err(str(e))
        return EXIT_USAGE
    except KeyboardInterrupt:
        _err("interrupted")
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())

