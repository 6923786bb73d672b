"""``gym-runtime reverify``: recompute the rewards of recorded rollouts."""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import Any

from gym_runtime.cli import _common as cli
from gym_runtime.config import load_config, resolve_config
from gym_runtime.errors import UserError
from gym_runtime.observability import progress
from gym_runtime.plugins import config_path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("reverify", help="recompute the rewards of recorded rollouts (any NeMo Gym rollouts file)")
    cli.config_argument(p)
    cli.input_argument(p, "rollouts JSONL (rows with `response`)", required=True)
    p.add_argument("-o", "--output", required=True, help="re-verified rollouts JSONL")
    p.add_argument("--agent", help="whose resource verifies (default: the config's only one)")
    p.add_argument("--tasks", help="task rows to join by input messages (older rollout files lack task fields)")
    p.add_argument("--replicas", type=cli.positive_int, help="resource workers to start here (default: the config's)")
    p.add_argument("--concurrency", type=cli.positive_int, default=64, help="rows in flight (default 64)")
    p.add_argument("--nats", help="use this NATS server instead of an embedded one")
    progress.add_arguments(p)
    cli.auth_option(p)
    cli.common_options(p)


def main(args: argparse.Namespace) -> int:
    from gym_runtime.cli.run import hosted_processes
    from gym_runtime.data.reverify import validate_rollouts
    from gym_runtime.nemo_gym.hosting.env import ensure as hosted_env
    from gym_runtime.service.loop import run_async
    from gym_runtime.service.runner import resource_for, reverify_batch

    cfg = load_config([config_path(c) for c in args.config], args.overrides)
    resolved = resolve_config(cfg)
    cli.check_output(args.output, source=args.input)
    rows = validate_rollouts(args.input)
    resource = resource_for(resolved, args.agent)
    entry = cfg.resources[resource]
    other_env(args, resource, entry)
    # a hosted NeMo Gym server verifies in its built environment (built now if missing): in its worker's guest
    # (isolation: process, the default; the worker here), or in a worker child on that environment (none)
    env = hosted_env(entry.nemo_gym) if entry.hosted else None
    hosted = {f"resources.{resource}": env} if env is not None and entry.isolation == "none" else {}
    tel = cli.telemetry(args, "reverify")
    try:
        with (
            cli.server_url(args, cfg) as url,
            hosted_processes(args, cfg, url, cli.client_auth(args), hosted) if hosted else contextlib.nullcontext(),
            progress.Tracker("reverify", progress.options_from(args), total=rows) as tracker,
        ):
            cli.when_interrupted(
                lambda: (
                    f"{args.output} holds the rows re-verified so far, in input order ({tracker.done} of {rows} "
                    "done; it is not complete): run reverify again for the whole file"
                )
            )
            auth = cli.client_auth(args)
            report = run_async(
                lambda: reverify_batch(
                    resolved,
                    url,
                    **cli.batch_files(args, tel),
                    replicas=args.replicas,
                    in_flight=args.concurrency,
                    tasks_path=args.tasks,
                    on_row=tracker.advance,
                    auth=auth,
                    local_workers=not hosted,
                )
            )
    finally:
        tel.shutdown()
    for line in report.lines():
        print(cli.printable(line))  # (what rows record, e.g. a grader's name: escaped)
    if report.failed:
        from gym_runtime.data.collector import sidecar_paths

        cli.err(f"{cli.plural(report.failed, 'row')} could not be re-verified; see {sidecar_paths(args.output)[0]}")
        return cli.EXIT_FAILURES
    return 0


def other_env(args: argparse.Namespace, resource: str, entry: Any) -> None:
    """Rows another bundled environment made (their ``provenance.env`` is its code), re-graded by a bundled one,
    are refused before any work: every reward would be this environment's verdict on another one's task."""
    from gym_runtime.data.atif import is_atif_file
    from gym_runtime.data.drift import made_by
    from gym_runtime.plugins import bundled_environments

    ours = entry.server.removeprefix("gym_runtime.").removeprefix("resources.")
    if entry.hosted or ours not in bundled_environments() or is_atif_file(Path(args.input)):
        return  # (a user's own environment may be a copy of a bundled one: its rows' drift is only warned of)
    found = made_by(args.input)
    if found is None or found[0] == ours:
        return
    name, identity = found
    raise UserError(
        f"{args.input}: these rows' provenance.env ({identity}) names the bundled environment {name!r}, not "
        f"resources.{resource} ({entry.server}): reverify them with that environment's config, e.g. "
        f"gym-runtime reverify {name} -i {args.input} -o {args.output}"
    )
