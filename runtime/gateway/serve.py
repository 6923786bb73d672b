"""Start the gateway: the head app on its port and each agent's Environment Server app on its own, over one
shared state; stop them together."""

from __future__ import annotations

import errno
from collections.abc import Mapping

from aiohttp import web

from gym_runtime.client import Client
from gym_runtime.errors import UserError, port_in_use
from gym_runtime.gateway.access import Access
from gym_runtime.gateway.environment import EnvironmentServer
from gym_runtime.gateway.head import HeadServer
from gym_runtime.gateway.state import Gateway
from gym_runtime.ops.nats_server import free_port


class Served:
    """The gateway's running servers; ``app`` is the head's (``served.app[GATEWAY]``: the shared state)."""

    def __init__(self, runners: list[web.AppRunner]) -> None:
        self.runners = runners

    @property
    def app(self) -> web.Application:
        return self.runners[0].app

    async def cleanup(self) -> None:
        """Stop every server (the Environment Servers first, then the head)."""
        for runner in reversed(self.runners):
            await runner.cleanup()


async def start(
    client: Client,
    *,
    host: str,
    port: int,
    env_ports: Mapping[str, int] | None = None,
    access: Access | None = None,
) -> tuple[Served, int]:
    """Listen on ``host``: the head on ``port`` (0: a free one) and each agent's Environment Server on its port
    (``env_ports``; else a free one). Returns the servers (``await served.cleanup()`` to stop) and the head port.
    Without ``access``, a random control token (``served.app[GATEWAY].access.token``), loopback names only."""
    port = port or free_port()
    ports = {a: (env_ports or {}).get(a) or free_port() for a in client.config.agents}
    gateway = Gateway(client, host=host, port=port, env_ports=ports, access=access)
    apps = [(HeadServer(gateway).app(), port)]
    apps += [(EnvironmentServer(gateway, agent).app(), p) for agent, p in ports.items()]
    served = Served([])
    try:
        for app, p in apps:
            runner = web.AppRunner(app, access_log=None, handle_signals=False)
            await runner.setup()
            served.runners.append(runner)
            try:
                await web.TCPSite(runner, host, p, backlog=4096).start()
            except OSError as e:  # a second gateway, or another server, on the port: one line naming a free one
                if e.errno != errno.EADDRINUSE:
                    raise
                flag = "--port" if p == port else "--environment-port"
                raise UserError(f"{flag} {p}: {port_in_use(host, p, flag, zero=True)}") from None
    except BaseException:
        await served.cleanup()
        raise
    return served, port
