"""``gym-runtime server``: the NATS server (JetStream on) in the foreground.

``--cluster NAME --routes ...`` joins a NATS cluster (JetStream replicated by
the server's own Raft, nothing home-made); with ``--secure`` the server provisions
the streams and buckets itself, with ``--replicas``, the ``--config``'s ``jetstream:``
block, or on a cluster min(3, nodes) replicas (``provision_settings``); the monitoring endpoint
(``/healthz``, ``/jsz``) is on by default, on loopback unless ``--http-host``
says otherwise. A port already in use is a usage error (exit 2), so a
scheduler never mistakes a server that did not start for one that did.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import threading
import time
from urllib.parse import urlparse

import msgspec

from gym_runtime.cli._common import err, port_number
from gym_runtime.config import Config, JetStreamConfig, load_config, load_raw, merge_raw
from gym_runtime.errors import UserError
from gym_runtime.ops.nats_server import DEFAULT_MAX_PAYLOAD, EmbeddedServer, port_taken
from gym_runtime.ops.permissions import Reach
from gym_runtime.ops.security import ensure_auth_dir, parse_pool, unnamed
from gym_runtime.transport.limits import parse_size

DEFAULT_HTTP_PORT = 8222
HTTP_PORT_OFFSET = DEFAULT_HTTP_PORT - 4222  # NATS's own pairing: client 4222, monitoring 8222


def split_list(text: str | None) -> list[str]:
    return [x.strip() for x in (text or "").split(",") if x.strip()]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("server", help="run the NATS server (JetStream on) in the foreground")
    p.add_argument("--port", type=port_number, default=4222, help="client port (default 4222)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--store-dir", help="JetStream store dir (default: a temp dir)")
    p.add_argument(
        "--sync",
        choices=("always", "interval"),
        help="always (the default, or the --config's jetstream.sync): every write on disk before the server "
        "acknowledges it, so an OS crash or power cut loses nothing acknowledged; interval: nats-server's "
        "2-minute sync, faster, and such a crash loses up to the last 2 minutes (docs/operations.md)",
    )
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
        help="with --secure: the run's config YAML(s), merged in order; each agent's pool may call only its own "
        "resource there (needed for --pool agents.NAME), each resources.NAME.calls lets that environment's pool "
        "(and the role-wide resource credential) call the environments it lists, and its jetstream: block sets "
        "the replicas and size limits of what the server provisions (repeatable)",
    )
    p.add_argument(
        "--replicas",
        type=int,
        metavar="N",
        help="with --secure: replicas of every stream, KV bucket and the blob store the server provisions "
        "(default: the --config's jetstream.replicas if it sets one, else min(3, nodes) with --cluster, 1 without)",
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


def _is_local(host: str) -> bool:
    """``host`` names an address of this machine (we may bind it)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    for family, kind, _, _, addr in infos:
        with socket.socket(family, kind) as s:
            try:
                s.bind((addr[0], 0))
            except OSError:
                continue
            return True
    return False


def cluster_size(routes: list[str], cluster_port: int) -> int:
    """The nodes ``--routes`` names, this one counted once whether it lists itself or not."""
    listed = {(u.hostname or "", u.port or 6222) for u in map(urlparse, routes)}
    itself = any(port == cluster_port and _is_local(host) for host, port in listed)
    return len(listed) + (0 if itself else 1)


def provision_settings(args: argparse.Namespace, cfg: Config | None, nodes: int) -> JetStreamConfig:
    """What a secured server provisions with: the config's ``jetstream:`` block (or the defaults), its replicas
    from ``--replicas``, else the config if it sets them, else min(3, nodes): on a cluster, losing a node
    loses nothing unless somebody said otherwise."""
    settings = cfg.jetstream if cfg is not None else JetStreamConfig()
    if args.replicas is not None:
        replicas, said = args.replicas, f"--replicas {args.replicas}"
        if not 1 <= replicas <= 5:
            raise UserError(f"{said}: must be between 1 and 5")
    elif args.config and "replicas" in (merge_raw([load_raw(p) for p in args.config]).get("jetstream") or {}):
        replicas, said = settings.replicas, f"jetstream.replicas: {settings.replicas} in {', '.join(args.config)}"
    else:
        replicas, said = min(3, nodes), ""
    if replicas > nodes:
        where = f"a cluster of {nodes} nodes (--routes)" if args.cluster else "a single server (no --cluster)"
        raise UserError(f"{said}: {where} cannot hold {replicas} replicas; pass --replicas {nodes} or add nodes")
    return msgspec.structs.replace(settings, replicas=replicas)


def build(args: argparse.Namespace) -> EmbeddedServer:
    for flag, given in (("--config", args.config), ("--replicas", args.replicas is not None)):
        if given and not args.secure:
            raise UserError(
                f"{flag} is read for what --secure DIR provisions; without --secure it has no effect (clients "
                "create the streams with their own config's jetstream: block)"
            )
    cfg = load_config(args.config) if args.config else None
    routes = split_list(args.routes)
    if routes and not args.cluster:
        raise UserError("--routes needs --cluster NAME")
    if args.cluster and not routes:
        raise UserError("--cluster needs --routes URL,... (every node's route URL; a node may list itself)")
    for r in routes:
        if "://" not in r:
            raise UserError(f"--routes {r!r}: expected a URL like nats://host:6222")
    nodes = cluster_size(routes, args.cluster_port) if args.cluster else 1
    return EmbeddedServer(
        port=args.port,
        host=args.host,
        store_dir=args.store_dir,
        sync=args.sync or (cfg.jetstream.sync if cfg is not None else "always"),
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
        reach=Reach.of(cfg),
        jetstream=provision_settings(args, cfg, nodes) if args.secure else None,
        port_flags={"client": "--port", "cluster": "--cluster-port", "monitoring": "--http-port"},
    )


PROVISION_QUIET_S = 15.0  # a cluster node still provisioning after this says what it waits for


class _Progress:
    """A secured cluster node's provisioning on stderr: what it waits for (once, if it takes a while), then done."""

    def __init__(self, srv: EmbeddedServer) -> None:
        self.srv, self.since, self.said_wait = srv, time.monotonic(), False
        self.pending = bool(srv.secure_dir and srv.cluster)

    def check(self) -> None:
        if not self.pending:
            return
        if self.srv.provisioned:
            self.pending = False
            replicas = self.srv.jetstream.replicas if self.srv.jetstream else 1
            what = f"{replicas} replica{'s' if replicas > 1 else ''}"
            said = f"provisioned namespace {', '.join(self.srv.namespaces)}: streams, buckets and blob store at {what}"
        elif not self.said_wait and time.monotonic() - self.since > PROVISION_QUIET_S:
            self.said_wait = True
            why = self.srv.provisioning_waits_for or "JetStream does not answer yet: are a quorum of nodes up?"
            said = f"provisioning is not done yet, still trying: {why}"
        else:
            return
        print(said, file=sys.stderr, flush=True)


def main(args: argparse.Namespace) -> int:
    if args.secure:
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
    progress = _Progress(srv)
    try:
        while not stop.is_set() and srv.running:
            stop.wait(0.5)
            progress.check()
        if not stop.is_set():
            err(f"nats-server exited unexpectedly (code {srv._proc.returncode if srv._proc else '?'})")
            return 1
    except KeyboardInterrupt:
        pass
    finally:
        srv.stop()
    return 0
