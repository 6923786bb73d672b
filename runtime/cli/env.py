"""``gym-runtime env build CONFIG``: build (or find) the environments of a config's hosted NeMo Gym servers
(resources servers and agent servers), and verifiers 0.4's own (``--verifiers``, or a config whose agents run
``agents.verifiers_v1``).

``start`` and ``run`` build what is missing themselves; this is the explicit step (a
CI job, a node image) that takes the minutes up front. ``--server NAME`` builds one
catalogue server's environment without a config.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from gym_runtime.cli import _common as cli
from gym_runtime.errors import UserError
from gym_runtime.nemo_gym.hosting.env import (
    VERIFIERS_VERSION,
    ServerKind,
    build_verifiers,
    check_server,
    check_verifiers,
    disk_mb,
    ensure,
)
from gym_runtime.plugins import load_plugin


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
    b.add_argument(
        "--verifiers",
        nargs="?",
        const=VERIFIERS_VERSION,
        metavar="VERSION",
        help=f"verifiers' own environment (Taskset x Harness tasksets; default version {VERIFIERS_VERSION})",
    )
    b.add_argument(
        "--python",
        help="the Python to build on (NeMo Gym: >= 3.13, default $GYM_NEMO_PYTHON; verifiers: >= 3.12, default"
        " $GYM_VERIFIERS_PYTHON; else searched)",
    )
    b.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE", help="override a config value"
    )
    cli.log_level_option(b)


def main(args: argparse.Namespace) -> int:
    servers: list[tuple[str, ServerKind]] = [(s, "resources_servers") for s in args.server]
    servers += [(a, "responses_api_agents") for a in args.agent]
    releases: list[str] = [args.verifiers] if args.verifiers else []  # verifiers' own environments to build
    if args.config:
        cfg = cli.load(args)
        servers += [(r.nemo_gym, "resources_servers") for r in cfg.resources.values() if r.hosted]
        servers += [(a.nemo_gym, "responses_api_agents") for a in cfg.agents.values() if a.hosted]
        # agents whose package needs verifiers' own environment (agents.verifiers_v1 says which release)
        modules = [load_plugin("agent", a.agent, "agents.*.agent") for a in cfg.agents.values() if not a.hosted]
        releases += [v for m in modules if (v := getattr(m, "verifiers_version", None))]
    if not releases and not servers:
        raise UserError(
            "env build: no hosted servers (give a config with resources.NAME.nemo_gym or agents.NAME.nemo_gym, "
            "or --server / --agent / --verifiers)"
        )
    # every name, path and version checked before anything is built (a build takes minutes)
    for server, kind in dict.fromkeys(servers):
        check_server(server, kind)
    plans = [check_verifiers(release, python=args.python) for release in dict.fromkeys(releases)]
    for plan in plans:
        vf = build_verifiers(plan)
        how = f"built in {vf.built_s:.0f}s" if vf.built_s else "cached"
        print(f"verifiers=={vf.version}: {vf.python} ({how}; {disk_mb(Path(vf.prefix)):.0f} MB)")
    for server, kind in dict.fromkeys(servers):
        env = ensure(server, python=args.python, kind=kind)
        how = f"built in {env.built_s:.0f}s" if env.built_s else "cached"
        extras = f" + {', '.join(env.extras)}" if env.extras else ""
        print(f"{server}: {env.python} ({how}; server layer {disk_mb(Path(env.prefix)):.1f} MB{extras})")
    return 0
