"""``gym-runtime gateway``: NeMo Gym's head server, agent protocol and 0.7 Environment Servers, over the bus."""

from __future__ import annotations

import argparse

from gym_runtime.cli._common import EXIT_USAGE, common_options, config_argument, err, load, metrics_options, telemetry
from gym_runtime.config import resolve_config, resolve_models
from gym_runtime.errors import ClientError, UserError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "gateway",
        help="serve NeMo Gym's HTTP protocol (/global_config_dict_yaml, /run, Environment Servers) over the bus",
    )
    config_argument(p)
    p.add_argument(
        "--nats",
        help="NATS URL of a running cluster (default: the config's `nats`; `embedded` starts "
        "a server and the config's workers here)",
    )
    p.add_argument("--auth-dir", help="NATS credentials directory (from the trust set-up)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument(
        "--port", type=int, default=11000, help="port (default: 11000, NeMo Gym's head-server port; 0: free)"
    )
    p.add_argument(
        "--environment-port",
        type=int,
        default=0,
        help="the first port of the agents' NeMo Gym 0.7 Environment Servers, one per agent in the config's "
        "order (default: free ports)",
    )
    p.add_argument(
        "--hostname",
        action="append",
        default=[],
        metavar="NAME",
        help="a name (or address) other nodes reach this gateway by: requests with that Host are served, and the "
        "first is advertised in /global_config_dict_yaml and /server_instances (repeatable; default: the --host "
        "address, or this machine's name when it is 0.0.0.0; localhost and loopback always)",
    )
    p.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="a web origin (https://dash.example) whose pages may call the gateway (repeatable; default: none, "
        "every request carrying an Origin header is refused)",
    )
    p.add_argument(
        "--token-file",
        metavar="PATH",
        help="the file holding the control token, sent as 'Authorization: Bearer TOKEN' on /pause and /resume "
        "(made, mode 0600, when missing; default: ~/.config/gym-runtime/gateway.token)",
    )
    p.add_argument(
        "--require-token",
        action="store_true",
        help="want the token on NeMo Gym's routes too (/run, /aggregate_metrics, the Environment Servers, the "
        "config listing; not the liveness /); NeMo Gym's own client sends none, so only for clients that do",
    )
    p.add_argument(
        "--workers",
        choices=["auto", "here", "none"],
        default="auto",
        help="start the config's workers in this process: auto = only with an embedded server",
    )
    metrics_options(p)
    common_options(p)


def main(args: argparse.Namespace) -> int:
    import signal
    from pathlib import Path

    import anyio

    from gym_runtime.client import Client
    from gym_runtime.gateway import GATEWAY, Access, control_token, default_token_file, start
    from gym_runtime.gateway.access import check_hostname, check_origin
    from gym_runtime.service.loop import run_async

    cfg = load(args)
    if not cfg.agents:
        raise UserError("the config names no agents: the gateway serves agents")
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port {args.port}: not a TCP port (give one in 0..65535; 0 picks a free one)")
    env_ports = {a: args.environment_port + i for i, a in enumerate(cfg.agents)} if args.environment_port else {}
    if not 0 <= args.environment_port <= 65535 - len(cfg.agents) + 1 or args.port in env_ports.values():
        raise UserError(f"--environment-port {args.environment_port}: not {len(cfg.agents)} TCP ports beside --port")
    token_file = Path(args.token_file).expanduser() if args.token_file else default_token_file()
    access = Access(
        token=control_token(token_file),
        hostnames=tuple(check_hostname(h) for h in args.hostname),
        origins=tuple(check_origin(o) for o in args.allow_origin),
        require_token=args.require_token,
    )
    url = args.nats or cfg.nats
    workers = args.workers == "here" or (args.workers == "auto" and url == "embedded")
    tel = telemetry(args, "gateway")

    async def go() -> None:
        resolved = resolve_config(cfg) if workers else resolve_models(cfg)  # a client that only submits: no agent
        async with Client(resolved, nats=url, auth_dir=args.auth_dir, workers=workers, telemetry=tel) as client:
            try:
                runner, port = await start(client, host=args.host, port=args.port, env_ports=env_ports, access=access)
            except OSError as e:  # the port is taken, or the address is not ours
                raise ClientError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
            try:
                gateway = runner.app[GATEWAY]
                advertised = f" (advertised as {gateway.host})" if gateway.host != args.host else ""
                print(f"gateway listening on http://{args.host}:{port}{advertised}", flush=True)
                servers = (f"{gateway.env_names[a]} :{p}" for a, p in gateway.env_ports.items())
                print(f"environment servers (NeMo Gym 0.7): {', '.join(servers)}", flush=True)
                routes = "every route but /" if access.require_token else "/pause and /resume"
                print(f"token: {token_file} (send 'Authorization: Bearer <its contents>' on {routes})", flush=True)
                with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for _ in signals:
                        break
            finally:
                with anyio.CancelScope(shield=True):
                    await runner.cleanup()

    try:
        run_async(go)
    except ClientError as e:
        err(str(e))
        return EXIT_USAGE
    finally:
        tel.shutdown()
    return 0
