"""``gym-runtime gateway``: NeMo Gym's head-server and agent HTTP protocol on one port, over the bus."""

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
        "--workers",
        choices=["auto", "here", "none"],
        default="auto",
        help="start the config's workers in this process: auto = only with an embedded server",
    )
    metrics_options(p)
    common_options(p)


def main(args: argparse.Namespace) -> int:
    import signal

    import anyio

    from gym_runtime.client import Client
    from gym_runtime.gateway import GATEWAY, start
    from gym_runtime.service.loop import run_async

    cfg = load(args)
    if not cfg.agents:
        raise UserError("the config names no agents: the gateway serves agents")
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port {args.port}: not a TCP port (give one in 0..65535; 0 picks a free one)")
    env_ports = {a: args.environment_port + i for i, a in enumerate(cfg.agents)} if args.environment_port else {}
    if not 0 <= args.environment_port <= 65535 - len(cfg.agents) + 1 or args.port in env_ports.values():
        raise UserError(f"--environment-port {args.environment_port}: not {len(cfg.agents)} TCP ports beside --port")
    url = args.nats or cfg.nats
    workers = args.workers == "here" or (args.workers == "auto" and url == "embedded")
    tel = telemetry(args, "gateway")

    async def go() -> None:
        resolved = resolve_config(cfg) if workers else resolve_models(cfg)  # a client that only submits: no agent
        async with Client(resolved, nats=url, auth_dir=args.auth_dir, workers=workers, telemetry=tel) as client:
            try:
                runner, port = await start(client, host=args.host, port=args.port, env_ports=env_ports)
            except OSError as e:  # the port is taken, or the address is not ours
                raise ClientError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
            try:
                print(f"gateway listening on http://{args.host}:{port}", flush=True)
                gateway = runner.app[GATEWAY]
                servers = (f"{gateway.env_names[a]} :{p}" for a, p in gateway.env_ports.items())
                print(f"environment servers (NeMo Gym 0.7): {', '.join(servers)}", flush=True)
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
