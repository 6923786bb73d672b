"""``gym-runtime env build CONFIG``: build (or find) the environments of a config's hosted NeMo Gym servers
(resources servers and agent servers).

``start`` and ``run`` build what is missing themselves; this is the explicit step (a
CI job, a node image) that takes the minutes up front. ``--server NAME`` builds one
catalogue server's environment without a config.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from gym_runtime.cli._common import load, log_level_option
from gym_runtime.errors import UserError
from gym_runtime.hosting.env import ServerKind, disk_mb, ensure


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("env", help="build the environments of hosted NeMo Gym resources servers")
    verbs = p.add_subparsers(dest="verb", required=True, metavar="VERB", help="build: build the environments")
    b = verbs.add_parser("build", help="build (or find, cached by content hash) the environments a config needs")
    b.add_argument(
        "config",
        nargs="*",
        metavar="CONFIG",
        help="config YAML(s) naming resources.NAME.nemo_gym or agents.NAME.nemo_gym",
    )
    b.add_argument("--server", action="append", default=[], metavar="NAME", help="a NeMo Gym server (repeatable)")
    b.add_argument("--agent", action="append", default=[], metavar="NAME", help="a NeMo Gym agent server (repeatable)")
    b.add_argument("--python", help="the Python >= 3.13 to build on (default: $GYM_NEMO_PYTHON, else searched)")
    b.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE", help="override a config value"
    )
    log_level_option(b)


def main(args: argparse.Namespace) -> int:
    servers: list[tuple[str, ServerKind]] = [(s, "resources_servers") for s in args.server]
    servers += [(a, "responses_api_agents") for a in args.agent]
    if args.config:
        cfg = load(args)
        servers += [(r.nemo_gym, "resources_servers") for r in cfg.resources.values() if r.hosted]
        servers += [(a.nemo_gym, "responses_api_agents") for a in cfg.agents.values() if a.hosted]
    if not servers:
        raise UserError(
            "env build: no hosted servers (give a config with resources.NAME.nemo_gym or agents.NAME.nemo_gym, "
            "or --server / --agent)"
        )
    for server, kind in dict.fromkeys(servers):
        env = ensure(server, python=args.python, kind=kind)
        how = f"built in {env.built_s:.0f}s" if env.built_s else "cached"
        extras = f" + {', '.join(env.extras)}" if env.extras else ""
        print(f"{server}: {env.python} ({how}; server layer {disk_mb(Path(env.prefix)):.1f} MB{extras})")
    return 0
