"""``gym-runtime health``: liveness/readiness checks for probes and schedulers.

Exit 0 when healthy, 1 when not (one line on stderr says why), 2 on bad usage.
Checks, all optional but the first: the NATS server answers and JetStream is
on (``--nats``); the server's monitoring endpoint says healthy (``--monitor``,
``/healthz``); at least ``--min-workers`` workers of a role are registered
(``--role agents.NAME``, or ``--role agents``: of any agent), which is what a readiness probe of a pool asks.
"""

from __future__ import annotations

import argparse
import os
import urllib.request
from typing import Any

from gym_runtime.cli import _common as cli
from gym_runtime.errors import UserError

EXIT_UNHEALTHY = 1
ROLE_NAMES = {"agents": "agent", "models": "model", "resources": "resource"}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("health", help="liveness/readiness check: exit 0 healthy, 1 not")
    cli.bus_options(p, "NATS URL(s), comma-separated")
    p.add_argument("--monitor", metavar="URL", help="also check the server's /healthz, e.g. http://127.0.0.1:8222")
    p.add_argument(
        "--role",
        metavar="ROLE.NAME",
        help="ready only when workers of this role (ROLE alone: of any entry) are registered",
    )
    p.add_argument("--min-workers", type=int, default=1, help="with --role: workers needed to be ready (default 1)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds for each check (default 5)")
    p.add_argument(
        "--log-level",
        default=os.environ.get("GYM_LOG_LEVEL", "error"),
        help="log level of the JSON logs on stderr (default: error; env GYM_LOG_LEVEL)",
    )


def _role(spec: str | None) -> tuple[str, str | None] | None:
    """``ROLE.NAME``, or ``ROLE`` alone (any entry of it: a pod that starts what its mounted config declares)."""
    if spec is None:
        return None
    role, _, name = spec.partition(".")
    if role not in ROLE_NAMES:
        raise UserError(
            f"--role {spec!r}: expected ROLE or ROLE.NAME with ROLE one of {', '.join(ROLE_NAMES)} (e.g. --role agents)"
        )
    return ROLE_NAMES[role], name or None


def main(args: argparse.Namespace) -> int:
    from gym_runtime.service.loop import run_async
    from gym_runtime.transport.connect import JetStreamNotReady, NotProvisioned, ServerUnreachable
    from gym_runtime.transport.discovery import discover
    from gym_runtime.transport.subjects import js_info

    url = cli.need_url(args, None)
    role = _role(args.role)
    if args.monitor:
        try:
            with urllib.request.urlopen(args.monitor.rstrip("/") + "/healthz", timeout=args.timeout) as r:
                if r.status != 200:
                    cli.err(f"unhealthy: {args.monitor}/healthz answered {r.status}")
                    return EXIT_UNHEALTHY
        except OSError as e:
            cli.err(f"unhealthy: {args.monitor}/healthz: {e}")
            return EXIT_UNHEALTHY

    async def go() -> str | None:
        async with cli.connected(args, url, "health", auth=cli.client_auth(args), initial_timeout=args.timeout) as bus:
            try:
                await bus.raw_request(js_info(), b"", timeout=args.timeout)
            except Exception as e:
                return f"JetStream does not answer: {type(e).__name__}"
            if role is not None:
                workers: list[dict[str, Any]] = await discover(bus, wait_s=min(1.0, args.timeout))
                n = sum(1 for w in workers if w.get("role") == role[0] and role[1] in (None, w.get("name")))
                if n < args.min_workers:
                    return f"{args.role}: {n} worker(s) registered, need {args.min_workers}"
            return None

    try:
        problem = run_async(go)
    except (ServerUnreachable, NotProvisioned, JetStreamNotReady) as e:  # not up, or not ready yet: unhealthy
        problem = str(e)
    if problem:
        cli.err(f"unhealthy: {problem}")
        return EXIT_UNHEALTHY
    print("ok")
    return 0
