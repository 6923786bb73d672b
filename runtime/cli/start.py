"""``gym-runtime start``: long-lived workers for the roles a config names (a process pool)."""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any

from gym_runtime.cli import _common as cli
from gym_runtime.cli._gc import freeze_startup
from gym_runtime.config import resolve_config
from gym_runtime.errors import UserError
from gym_runtime.harbor.hosting import ensure_config_images
from gym_runtime.nemo_gym.hosting.asgi import ForwardedSignals, beside_main
from gym_runtime.nemo_gym.hosting.env import HOSTED_ENV, HostedEnv, in_hosted_env
from gym_runtime.nemo_gym.hosting.env import ensure as hosted_env
from gym_runtime.service.ready import say_ready


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("start", help="run long-lived workers for the roles a config names")
    cli.config_argument(p)
    p.add_argument("--nats", help="NATS URL (default: the config's `nats`)")
    p.add_argument(
        "--only", action="append", metavar="ROLE.NAME", help="start only these, e.g. models.policy (repeatable)"
    )
    p.add_argument(
        "--replicas", type=cli.positive_int, help="processes per selected worker (default: the config's replicas)"
    )
    p.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="run each replica as a Ray actor on this Ray cluster (auto: the one this node is in; the ray extra)",
    )
    p.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)  # one pool child
    # a worker child of `run`, which says a dead model endpoint itself in one line: its workers log it at info
    p.add_argument("--verdicts-said-by-caller", action="store_true", help=argparse.SUPPRESS)
    cli.metrics_options(p)
    cli.auth_option(p)
    cli.common_options(p)


def role_of(pairs: list[tuple[str, str]]) -> str:
    """The OTel service role: ``agent``, ``model``, ``resource`` or ``sandbox`` for one kind, else ``workers``."""
    from gym_runtime.service.runner import BUS_ROLE  # as main's: loaded with the workers, not for `--help`

    roles = {r for r, _ in pairs}
    return BUS_ROLE[next(iter(roles))] if len(roles) == 1 else "workers"


def _hosted_env(cfg: Any, role: str, name: str) -> HostedEnv | None:
    """The built environment of a hosted NeMo Gym resource or agent (built now if missing) whose worker runs on
    it; None: the worker runs on this Python (native, or a hosted server in a guest)."""
    if role == "resources" and cfg.resources[name].hosted:
        env = hosted_env(cfg.resources[name].nemo_gym)  # built now, before any worker starts
        # isolation: process (the default): the worker runs here, the server's code in a guest on env's Python
        return env if cfg.resources[name].isolation == "none" else None
    if role == "agents" and cfg.agents[name].hosted:
        return hosted_env(cfg.agents[name].nemo_gym, kind="responses_api_agents")
    return None


def on_ray(args: argparse.Namespace) -> int:
    """``start --ray``: the roles' replicas as Ray actors (gym_runtime.placement), served until SIGTERM/SIGINT."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise UserError(f"--ray {args.ray} needs Ray: pip install 'gym-runtime[ray]' (the ray extra)")
    from gym_runtime.placement.on_ray import OnRay, serve_on_ray
    from gym_runtime.placement.pools import PlacementError
    from gym_runtime.placement.ray_reach import reach

    cfg = cli.load(args)
    resolve_config(cfg)  # the plugins' option checks: a bad option is one line now, not in every actor
    passthrough = ["--log-level", args.log_level] + (["--trace-file", args.trace_file] if args.trace_file else [])
    if args.metrics_port is not None:  # each actor's worker on P, P+1, ... (on its own node), at this address
        passthrough += ["--metrics-host", args.metrics_host]
    where = {"address": args.ray, "nats": args.nats, "only": args.only, "metrics_port": args.metrics_port}
    # --auth-dir or $GYM_AUTH_DIR, on this node: each actor is handed its entry's credential, the scaler publisher's
    auth = cli.client_auth(args)
    placed = OnRay(args.config, overrides=args.overrides, passthrough=passthrough, cfg=cfg, auth=auth, **where)
    reach(args.ray)  # the Ray head first: a wrong address or a wanted token is one line before the bus is waited for

    if cfg.ray.nats == "config" or args.nats:  # the workers' bus, waited for once (one line if unreachable)
        from gym_runtime.service.loop import run_async
        from gym_runtime.service.runner import wait_for_server

        url = cli.need_url(args, cfg)  # `embedded` is refused: every node must reach the bus
        if (stopped_by := run_async(lambda: wait_for_server(url))) is not None:
            return cli.EXIT_INTERRUPTED if stopped_by == signal.SIGINT else 0

    def ready(actors: int) -> None:
        say_ready(sys.stdout, f" on Ray ({actors} actors)")

    try:
        return serve_on_ray(placed, ready=ready)
    except PlacementError as e:
        cli.err(str(e))
        return e.code


def main(args: argparse.Namespace) -> int:
    if args.ray:
        return on_ray(args)
    from gym_runtime.service.loop import run_async
    from gym_runtime.service.runner import check_resources, selected, serve, wait_for_server

    cfg = cli.load(args)
    resolved = resolve_config(cfg)  # the plugins' option checks: a bad option is one line now
    url = cli.need_url(args, cfg)
    auth = cli.client_auth(args)
    pairs = selected(cfg, args.only)
    check_resources(resolved, pairs)  # a mistyped module: one line now, whatever the server
    # the pools served here build the Harbor task images their engines lack, before any worker starts
    pools = {n for r, n in pairs if r == "sandboxes"}
    if pools:
        run_async(lambda: ensure_config_images(cfg, pools, note=cli.say))
    freeze_startup()  # the environments are imported now; nothing of a rollout exists yet
    replicas = {(r, n): args.replicas or getattr(cfg, r)[n].replicas for r, n in pairs}
    if auth is not None:  # a missing role file is a usage error here, not a crash loop in the children
        from gym_runtime.service.runner import BUS_ROLE

        for r, n in pairs:
            if auth.pool_creds(BUS_ROLE[r], n) is None:  # an entry's pool credential, else the role's
                auth.creds(BUS_ROLE[r])
    # hosted NeMo Gym servers run in their built environments: built (or found) now, before any worker starts
    here = in_hosted_env()
    hosted = {} if here else {f"{r}.{n}": env for r, n in pairs if (env := _hosted_env(cfg, r, n)) is not None}
    # one worker too is a child of the pool, so a worker that dies is restarted (--in-process: the pool's child)
    if args.in_process and not hosted:
        ready_out = sys.stdout
        if here:  # hosted server code prints freely: only our ready line goes to the supervisor's pipe
            sys.stdout = sys.stderr
        telemetry = cli.telemetry(args, role_of(pairs))

        def workers(signals: ForwardedSignals | None = None) -> int | None:
            return run_async(
                lambda: serve(
                    resolved,
                    url,
                    only=args.only,
                    telemetry=telemetry,
                    replicas=args.replicas,
                    ready=lambda: say_ready(ready_out),
                    auth=auth,
                    note=None if args.log_level == "error" else cli.say,  # a slow start named (not under --quiet)
                    verdict_said_by_caller=args.verdicts_said_by_caller,
                    **({"signal_receiver": signals.receiver} if signals else {}),
                )
            )

        try:
            # a hosted server's app keeps the main thread, as under uvicorn (signal.alarm timeouts need it)
            stopped_by = beside_main(workers) if here else workers()
        finally:
            telemetry.shutdown()
        return cli.EXIT_INTERRUPTED if stopped_by == signal.SIGINT else 0  # SIGTERM: the scheduler's normal stop
    from gym_runtime.service.supervisor import Child, child_argv, run_pool

    # the pool waits for its server once (one nats.unreachable line, with the reason), not once per child
    stopped_by = run_async(lambda: wait_for_server(url))
    if stopped_by is not None:
        return cli.EXIT_INTERRUPTED if stopped_by == signal.SIGINT else 0

    passthrough = [x for o in args.overrides for x in ("--set", o)] + ["--log-level", args.log_level]
    if args.trace_file:
        passthrough += ["--trace-file", args.trace_file]
    if auth is not None:  # a path, never a secret; the children find the role seeds there
        passthrough += ["--auth-dir", str(auth.auth_dir)]
    # children read a URL from the config themselves (it may carry credentials: never put it in argv)
    child_url = args.nats
    specs = [f"{r}.{n}" for (r, n), k in replicas.items() for _ in range(k)]
    children = []
    for i, spec in enumerate(specs):
        metrics = (
            []
            if args.metrics_port is None
            else ["--metrics-port", str(args.metrics_port + i), "--metrics-host", args.metrics_host]
        )
        env = hosted.get(spec)
        argv = child_argv(args.config, child_url, spec, passthrough + metrics, env.python if env else None)
        children.append(Child(spec, argv, env={HOSTED_ENV: env.prefix} if env else None))
    return run_pool(children)
