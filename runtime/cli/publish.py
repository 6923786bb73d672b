"""``gym-runtime publish``: validate and publish a batch of tasks."""

from __future__ import annotations

import argparse
import functools
import sys
import uuid
from typing import TYPE_CHECKING, Any

from gym_runtime.cli import _common as cli
from gym_runtime.errors import UserError
from gym_runtime.observability import progress

if TYPE_CHECKING:
    from gym_runtime.messages import BranchPoint


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("publish", help="validate and publish a batch of tasks; prints the batch id")
    cli.config_argument(p)
    cli.input_argument(p, "input tasks JSONL (NeMo Gym format)", required=True)
    p.add_argument("--nats", help="NATS URL (default: the config's `nats`)")
    p.add_argument("--batch", help="batch id (default: random); re-publishing the same id is deduplicated")
    cli.rows_options(p)
    cli.budget_option(p)  # with one, publish stays until every task is started or held back (it counts the results)
    p.add_argument(
        "--keep-checkpoints",
        type=float,
        metavar="SECONDS",
        help="keep each rollout's checkpoint, a part per turn, this long from each write (not deleted with its row): "
        "a later `publish --branch` may branch it at any turn that made tool calls",
    )
    p.add_argument(
        "--branch",
        metavar="BATCH:TASK:ROLLOUT",
        help="branch this rollout (kept with --keep-checkpoints, run by the same agent) at --turn into --repeats "
        "continuations; the input holds its one row (its input row, or its output row)",
    )
    p.add_argument("--turn", type=int, help="with --branch: the model turn to branch at (>= 1)")
    progress.add_arguments(p)
    cli.any_tools_option(p)
    cli.auth_option(p)
    cli.common_options(p)


def _branching(args: argparse.Namespace, cap_s: float, rows: int) -> tuple[float, BranchPoint | None]:
    """``--keep-checkpoints`` and ``--branch``/``--turn`` checked (``rollout.branch``'s checks): a mistake is one
    ``UserError`` naming the flag and its value."""
    from gym_runtime.rollout.branch import kept_s, parse_point

    try:
        keep_s = kept_s(args.keep_checkpoints, cap_s)
    except ValueError as e:
        raise UserError(f"--keep-checkpoints: {e}") from None
    if args.branch is None:
        if args.turn is not None:
            raise UserError("--turn needs --branch BATCH:TASK:ROLLOUT (the rollout to branch)")
        return keep_s, None
    if args.turn is None:
        raise UserError(f"--branch {args.branch} needs --turn K (the model turn to branch it at)")
    try:
        point = parse_point(args.branch, args.turn)
    except ValueError as e:
        raise UserError(f"--branch: {e}") from None
    if rows != 1:
        raise UserError(f"--branch: the input holds {rows} rows: give it the branched rollout's one row (--limit 1)")
    return keep_s, point


def main(args: argparse.Namespace) -> int:
    import anyio

    from gym_runtime.config import resolve_models
    from gym_runtime.data.validation import plan_publish
    from gym_runtime.service.batches import publish_batch
    from gym_runtime.service.loop import run_async
    from gym_runtime.transport.bus import Bus

    cfg = cli.load(args)
    resolved = resolve_models(cfg)  # the tasks' fingerprints need the adapters' options (no agent, no environment)
    url = cli.need_url(args, cfg)
    if not cfg.agents:
        raise UserError("the config names no agents")
    # the rows routed and checked against their environments (what `validate` checks), before connecting
    plan = plan_publish(cfg, args.input, agent=args.agent, limit=args.limit, any_tools=args.any_tools)
    keep_s, branch = _branching(args, cfg.jetstream.checkpoint_ttl_s, plan.count)
    budget = cli.budgeted(args.budget, cfg, repeats=args.repeats)
    if budget is not None and args.batch is None:  # its reader of the results needs the id up front
        args.batch = uuid.uuid4().hex[:12]
    cli.reach(url)  # the rows and flags are checked first: a mistake there is said without waiting for a server
    auth = cli.client_auth(args)
    tel = cli.telemetry(args, "publish")

    with progress.Tracker("publish", progress.options_from(args), total=plan.count * args.repeats) as tracker:

        async def go() -> Any:
            bus = await Bus.connect(
                url,
                namespace=cfg.namespace,
                telemetry=tel,
                name="gym-publish",
                auth=auth,
                role="publisher",
                jetstream=cfg.jetstream,
            )
            try:
                publish = functools.partial(
                    publish_batch,
                    bus,
                    resolved,
                    args.input,
                    agent=args.agent,
                    repeats=args.repeats,
                    limit=args.limit,
                    batch=args.batch,
                    plan=plan,
                    on_sent=tracker.advance,
                    keep_checkpoints_s=keep_s,
                    branch=branch,
                )
                if budget is None:
                    return await publish()
                async with anyio.create_task_group() as tg:
                    tg.start_soon(budget.watch, bus, args.batch)
                    manifest = await publish(gate=budget)
                    tg.cancel_scope.cancel()
                return manifest
            finally:
                await bus.close()

        try:
            manifest = run_async(go)
        finally:
            tel.shutdown()
    if manifest.held_from >= 0:
        print(manifest.batch)
        cli.err(
            f"budget reached: {budget.spent_line()}; {manifest.expected - manifest.held_from} of {manifest.expected} "
            f"rollouts not started (class budget: `collect` writes their failure rows); publish again with --batch "
            f"{manifest.batch} and a larger --budget to finish the batch"
        )
        return cli.EXIT_FAILURES
    print(
        f"published {manifest.expected} tasks ({manifest.tasks} rows x {manifest.repeats}) as batch:", file=sys.stderr
    )
    print(manifest.batch)
    return 0
