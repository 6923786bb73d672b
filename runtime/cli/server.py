"""``gym-runtime server``: the NATS server (JetStream on) in the foreground.

``--cluster NAME --routes ...`` joins a NATS cluster (JetStream replicated by
the server's own Raft, nothing home-made); the monitoring endpoint
(``/healthz``, ``/jsz``) is on by default, on loopback unless ``--http-host``
says otherwise. A port already in use is a usage error (exit 2), so a
scheduler never mistakes a server that did not start for one that did.
"""

from __future__ import annotations

import argparse
import sys

from gym_runtime.cli._common import err
from gym_runtime.errors import UserError
from gym_runtime.ops.nats_server import DEFAULT_MAX_PAYLOAD, EmbeddedServer, port_taken
from gym_runtime.transport.jetstream import parse_size

DEFAULT_HTTP_PORT = 8222
HTTP_PORT_OFFSET = DEFAULT_HTTP_PORT - 4222  # NATS's own pairing: client 4222, monitoring 8222


def split_list(text: str | None) -> list[str]:
    return [x.strip() for x in (text or "").split(",") if x.strip()]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("server", help="run the NATS server (JetStream on) in the foreground")
    p.add_argument("--port", type=int, default=4222, help="client port (default 4222)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--store-dir", help="JetStream store dir (default: a temp dir)")
    p.add_argument(
        "--max-payload", default=str(DEFAULT_MAX_PAYLOAD), help="largest message the server accepts, e.g. 8MB"
    )
    p.add_argument(
        "--secure",
        metavar="DIR",
        help="TLS + nkey authentication + per-role permissions; DIR empty: write a CA, a server "
        "certificate and publisher/agent/model/resource/admin.creds there; filled: reuse it",
    )
    p.add_argument(
        "--namespace",
        action="append",
        dest="namespaces",
        metavar="NS",
        help="with --secure: namespace whose subjects the roles may use (repeatable; default gym)",
    )
    p.add_argument(
        "--tls-name",
        action="append",
        default=[],
        metavar="NAME",
        help="with --secure: extra DNS name or IP for a new server certificate (the name clients dial)",
    )
    p.add_argument(
        "--pool",
        action="append",
        default=[],
        metavar="SECTION.NAME",
        help="with --secure: also write SECTION.NAME's own credential (agents.NAME, resources.NAME, models.NAME "
        "-> agent.NAME.creds ...), allowed only that entry's queue, results, calls and replies (repeatable)",
    )
    p.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="CONFIG",
        help="with --secure: the run's config YAML(s), merged in order; each resources.NAME.calls there lets that "
        "environment's pool (and the role-wide resource credential) call the environments it lists (repeatable)",
    )
    p.add_argument("--name", help="server name (unique in a cluster; default: CLUSTER-PORT)")
    p.add_argument("--cluster", metavar="NAME", help="join the NATS cluster NAME (JetStream replicated)")
    p.add_argument("--cluster-port", type=int, default=6222, help="port for routes from other nodes (default 6222)")
    p.add_argument("--cluster-host", help="address routes listen on (default: --host)")
    p.add_argument("--routes", metavar="URL,...", help="other nodes' route URLs, e.g. nats://n2:6222,nats://n3:6222")
    p.add_argument(
        "--http-port",
        type=int,
        default=None,
        help=f"monitoring port (/healthz, /jsz; -1 turns it off). Default: the client port + {HTTP_PORT_OFFSET} "
        f"(4222 -> {DEFAULT_HTTP_PORT}, where KEDA and the deploy files read /jsz), or a free port if that one is "
        "taken (a second server on the machine); the URL is printed on stderr",
    )
    p.add_argument("--http-host", default="127.0.0.1", help="monitoring address (default 127.0.0.1)")


def monitoring_port(args: argparse.Namespace) -> int | None:
    """``--http-port`` as given (a taken port is then an error), else the client port + 4000, or a free port
    (0) when that one is taken: monitoring nobody asked for must not stop a second server on the machine."""
    if args.http_port is not None:
        return None if args.http_port < 0 else args.http_port
    derived = args.port + HTTP_PORT_OFFSET if args.port else 0
    if not 0 < derived <= 65535 or port_taken(args.http_host, derived):
        return 0
    return derived


def build(args: argparse.Namespace) -> EmbeddedServer:
    if args.config and not args.secure:
        raise UserError("--config is read for the permissions of --secure DIR; without --secure it has no effect")
    calls: dict[str, list[str]] = {}
    if args.config:
        from gym_runtime.config import load_config, resource_calls

        calls = resource_calls(load_config(args.config))
    routes = split_list(args.routes)
    if routes and not args.cluster:
        raise UserError("--routes needs --cluster NAME")
    if args.cluster and not routes:
        raise UserError("--cluster needs --routes URL,... (every node's route URL; a node may list itself)")
    for r in routes:
        if "://" not in r:
            raise UserError(f"--routes {r!r}: expected a URL like nats://host:6222")
    return EmbeddedServer(
        port=args.port,
        host=args.host,
        store_dir=args.store_dir,
        max_payload=parse_size(args.max_payload),
        server_name=args.name,
        cluster=args.cluster,
        cluster_port=args.cluster_port if args.cluster else 0,
        cluster_host=args.cluster_host,
        routes=routes,
        http_port=monitoring_port(args),
        http_host=args.http_host,
        secure_dir=args.secure,
        namespaces=args.namespaces or ["gym"],
        calls=calls,
    )


def main(args: argparse.Namespace) -> int:
    import signal
    import threading

    if args.secure:
        from gym_runtime.ops.security import ensure_auth_dir, parse_pool, unnamed

        ensure_auth_dir(args.secure, host=args.host, names=args.tls_name, pools=[parse_pool(p) for p in args.pool])
        missing = unnamed(args.secure, args.tls_name)
        if missing:
            raise UserError(
                f"--tls-name {', '.join(missing)}: {args.secure}/server.pem (kept from before) does not "
                f"name it; delete server.pem and server-key.pem there to make a new one"
            )
    srv = build(args)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    srv.start()
    print(srv.url, flush=True)
    if srv.monitor_url:
        print(f"monitoring: {srv.monitor_url} (/healthz, /jsz)", file=sys.stderr, flush=True)
    if not args.secure and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"gym-runtime: warning: no authentication on {args.host}: anyone who can reach it reads and writes "
            f"every subject; use --secure DIR",
            file=sys.stderr,
            flush=True,
        )
    if args.secure:
        print(
            f"secured: TLS + nkey users from {args.secure}; give each node --auth-dir with ca.pem and the "
            f".creds of the roles it runs",
            file=sys.stderr,
            flush=True,
        )
    try:
        while not stop.is_set() and srv.running:
            stop.wait(0.5)
        if not stop.is_set():
            err(f"nats-server exited unexpectedly (code {srv._proc.returncode if srv._proc else '?'})")
            return 1
    except KeyboardInterrupt:
        pass
    finally:
        srv.stop()
    return 0
