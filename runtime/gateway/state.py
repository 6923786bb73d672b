"""What the gateway's apps share: the client, every server's name and port, the limits and the access guard.

Built once when the gateway starts: the global config and the server list it advertises do not change while it
runs (only ``uptime_seconds`` does).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any

import anyio
import anyio.to_thread
import msgspec
import yaml
from aiohttp import web
from opentelemetry.trace import SpanKind

from gym_runtime.client import Client
from gym_runtime.data.aggregate import MetricsAccumulator
from gym_runtime.gateway.access import Access, Guard
from gym_runtime.gateway.replies import decoded, json_reply, refusal

ENVIRONMENT_SERVER_TYPE = "single_agent_turn_legacy"  # flat rows and episode requests on one /run, as ours
ENTRYPOINT = "gym-runtime gateway"
MAX_BODY = 64 * 1024 * 1024


def impl_name(module: str) -> str:
    """NeMo Gym's implementation key for an agent module: ``agents.simple`` → ``simple_agent``."""
    short = module.rsplit(".", 1)[-1]
    return short if short.endswith("agent") else f"{short}_agent"


def environment_server_names(client: Client) -> dict[str, str]:
    """Each agent's Environment Server name, ``<agent>_environment_server`` (NeMo Gym's configs' convention),
    with ``_`` added until it names nothing else of the config."""
    cfg = client.config
    taken = {*cfg.agents, *cfg.resources, *cfg.models}
    out: dict[str, str] = {}
    for agent in cfg.agents:
        name = f"{agent}_environment_server"
        while name in taken:
            name += "_"
        taken.add(name)
        out[agent] = name
    return out


class Gateway:
    """The shared state over a started ``Client`` (which owns the bus and, optionally, the workers)."""

    def __init__(
        self,
        client: Client,
        *,
        host: str,
        port: int,
        env_ports: Mapping[str, int] | None = None,
        access: Access | None = None,
    ) -> None:
        self.client = client
        self.guard = Guard(access or Access(token=secrets.token_urlsafe(32)), host)  # a caller of its own: the
        # control token is ``gateway.access.token``
        self.host = self.guard.advertised  # what other nodes reach it by (never 0.0.0.0)
        self.port = port
        self.agents = list(client.config.agents)
        self.started = time.time()
        self.max_rows = client.config.gateway.aggregate_metrics_max_rows
        self._aggregating = anyio.CapacityLimiter(1)  # each may hold a core for seconds
        self.env_names = environment_server_names(client)
        self.env_ports = dict(env_ports or {})  # agent -> its Environment Server's port
        self.limits = client.config.gateway.environment_servers
        n = self.limits.max_concurrent_episodes
        self.admission = {a: asyncio.Semaphore(n) for a in self.agents} if n is not None else {}
        self.config_yaml = yaml.safe_dump(self.global_config(), sort_keys=False)
        self._instances = [
            *(self._instance(name, "responses_api_agents", port) for name in self.agents),
            *(self._instance(self.env_names[a], "environment_servers", p) for a, p in self.env_ports.items()),
        ]

    @property
    def access(self) -> Access:
        return self.guard.access

    def app(self) -> web.Application:
        """An empty app of this gateway: its guard first, its bounds, and the key its handlers find it by."""
        app = web.Application(client_max_size=MAX_BODY, middlewares=[self.guard.middleware])
        app[GATEWAY] = self
        return app

    def global_config(self) -> dict[str, Any]:
        cfg = self.client.config
        out: dict[str, Any] = {"head_server": {"host": self.host, "port": self.port}}
        for name, a in cfg.agents.items():
            out[name] = {
                "responses_api_agents": {
                    impl_name(a.agent): {
                        "entrypoint": ENTRYPOINT,
                        "host": self.host,
                        "port": self.port,
                        "resources_server": {"type": "resources_servers", "name": a.resource},
                        "model_server": {"type": "responses_api_models", "name": a.model},
                    }
                }
            }
        for name, a in cfg.agents.items():
            if name not in self.env_ports:
                continue
            out[self.env_names[name]] = {
                "environment_servers": {
                    ENVIRONMENT_SERVER_TYPE: {
                        "entrypoint": ENTRYPOINT,
                        "host": self.host,
                        "port": self.env_ports[name],
                        "resources_server": {"type": "resources_servers", "name": a.resource},
                        "agent_server": {"type": "responses_api_agents", "name": name},
                        **msgspec.to_builtins(self.limits),
                    }
                }
            }
        return out

    def _instance(self, name: str, server_type: str, port: int) -> dict[str, Any]:
        """One server as NeMo Gym's head server lists it (``uptime_seconds`` added per request)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return {
            "name": name,
            "server_type": server_type,
            "process_name": name,
            "entrypoint": ENTRYPOINT,
            "host": self.host,
            "port": port,
            "url": f"http://{host}:{port}",
            "status": "success",
            "start_time": self.started,
        }

    def server_instances(self) -> list[dict[str, Any]]:
        uptime = round(time.time() - self.started, 3)
        return [{**i, "uptime_seconds": uptime} for i in self._instances]

    def agent_of(self, row: dict[str, Any]) -> str:
        """The agent a row names (``agent_ref.name``), or the config's only one; else 404/422."""
        ref = row.get("agent_ref")
        name = ref.get("name") if isinstance(ref, dict) else None
        listed = ", ".join(self.agents)
        if name:
            if name not in self.agents:
                detail = f"agent_ref.name {name!r} is not an agent of this gateway ({listed})"
                raise refusal(web.HTTPNotFound, detail)
            return str(name)
        if len(self.agents) == 1:
            return self.agents[0]
        raise refusal(
            web.HTTPUnprocessableEntity, f"the row names no agent_ref and this gateway has several agents ({listed})"
        )

    def traced(self, headers: Mapping[str, str]) -> AbstractContextManager[Any]:
        """The request's span: the caller's ``traceparent`` (NeMo Gym's client sends one) is the parent of the
        rollout's task, so the rollout's trace continues the caller's."""
        tel = self.client.telemetry
        return tel.span("gateway /run", kind=SpanKind.SERVER, parent=tel.extract(headers))

    async def aggregate_metrics(self, request: web.Request, agent: str | None) -> web.Response:
        """``/aggregate_metrics``: computed in a worker thread, one at a time; rows naming no agent are
        ``agent``'s (an Environment Server's), else the config's only agent's."""
        raw = await request.read()
        status, answer = await anyio.to_thread.run_sync(self._aggregate, raw, agent, limiter=self._aggregating)
        return json_reply(answer, status)

    def _aggregate(self, raw: bytes, agent: str | None = None) -> tuple[int, Any]:
        """``/aggregate_metrics``' status and body, from its raw body (in a worker thread)."""
        body = decoded(raw)
        rows = body.get("verify_responses") if isinstance(body, dict) else None
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            return 422, {"detail": 'expected {"verify_responses": [rows]}'}
        if len(rows) > self.max_rows:
            detail = (
                f"{len(rows)} rows: more than gateway.aggregate_metrics_max_rows ({self.max_rows}); post fewer "
                "(per agent, or per part of the batch), or raise it in the config"
            )
            return 413, {"detail": detail}
        acc = MetricsAccumulator()
        for i, r in enumerate(rows):
            ref = r.get("agent_ref")
            name = ref.get("name") if isinstance(ref, dict) and ref.get("name") else agent or self.agent_of(r)
            acc.add({**r, "agent_ref": {"name": name}, "_ng_task_index": r.get("_ng_task_index", i)})
        entries = acc.result()
        if len(entries) > 1:
            return 422, {"detail": "rows of several agents: post each agent's rows separately"}
        if not entries:
            return 200, {"agent_metrics": {}, "key_metrics": {}, "group_level_metrics": []}
        return 200, entries[0]


GATEWAY = web.AppKey("gateway", Gateway)  # each app's Gateway (``served.app[GATEWAY]``: its servers' ports)


async def liveness(_: web.Request) -> web.Response:
    """NeMo Gym's liveness body."""
    return json_reply({"status": "ok"})
