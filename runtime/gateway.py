"""NeMo Gym's head-server and agent HTTP protocol on one port, backed by the bus.

Trainer integrations written for NeMo Gym (TRL's rollout function, NeMo RL) fetch
``GET /global_config_dict_yaml``, find each agent's ``host``/``port`` under
``cfg[agent][<kind>][<impl>]``, and ``POST /run`` a task row. Here every agent is listed with
the gateway's own address, so all of those requests land on this one server, which runs each
row through ``Client.run`` (one task publish, one result message).

Reply shapes, decided from NeMo Gym's code (``nemo_gym/server_utils.py``, ``simple_agent``):

* ``GET /`` → ``{"status": "ok"}`` (NeMo Gym's liveness body).
* ``GET /global_config_dict_yaml`` → a JSON *string* holding YAML (FastAPI JSON-encodes the str that
  ``OmegaConf.to_yaml`` returns; clients do ``OmegaConf.create(json.loads(body))``).
* ``GET /server_instances`` → a JSON list, one entry per agent and per Environment Server, with the display
  fields NeMo Gym's head server lists (``name``, ``server_type``, ``host``, ``port``, ``url``, ``status``, ...).
* ``POST /run`` → the verify response: the row as ``collect`` writes it, without the collector's
  ``_ng_task_index``/``_ng_rollout_index`` (NeMo Gym's agent returns the request's extra fields, so
  those appear only when the request carried them, with the request's values) and with
  ``agent_ref`` only when the request had one. A failed rollout answers HTTP 500 with a JSON string
  body ``"RolloutFailed(error_class='timeout', error='...')"`` — NeMo Gym's exception middleware
  answers 500 with ``repr(e)`` — plus a ``Gym-Error-Class`` header; a body that is not a task row
  answers 422 ``{"detail": ...}`` like FastAPI's validation error.
* ``POST /aggregate_metrics`` with ``{"verify_responses": [rows]}`` → the agent's entry of
  ``<out>_aggregate_metrics.json`` (``agent_metrics``, ``key_metrics``, ``group_level_metrics``),
  decoded and computed in a worker thread, one request at a time (pass@k for every k costs the square
  of a task's rollouts: the event loop keeps serving ``/run`` meanwhile); past
  ``gateway.aggregate_metrics_max_rows`` rows, 413.
* ``POST /pause`` with ``{"mode": "drain"|"interrupt"|"abort", "model": name?, "timeout": s?}`` →
  ``{"acknowledged": replicas}`` once the model's replicas hold new calls (``Client.pause``); ``POST /resume``
  with ``{"model": name?}`` → ``{"resumed": true}``. gym-runtime's own, for a trainer that reaches the cluster
  only over HTTP; a wrong mode or model answers 422 with the client's one line.
* A body that cannot be decoded (not JSON, not UTF-8, nested past the decoder's depth) answers 422.

NeMo Gym 0.7's client reaches agents only through **Environment Servers** (``environment_servers:`` entries of
the global config, one per agent it routes to). The gateway lists one per agent, ``<agent>_environment_server``
of type ``single_agent_turn_legacy`` (it takes flat rows and episode requests alike), each on a port of its own
(an episode request names no agent: the port it arrives on does, as in NeMo Gym, where each server has its
port). There ``POST /run`` is the Environment Server protocol (``gym_runtime.data.episodes``): a flat row is
answered with its verify response or, on failure, HTTP 200 with a ``_ng_failure_*`` row; an episode request
with an episode response (``result`` or a typed ``failure``); ``gateway.environment_servers`` limits apply per
server; ``POST /aggregate_metrics`` as above, rows without ``agent_ref`` counted for the server's agent. The
head port keeps the older agent protocol above unchanged.

aiohttp: one well-kept dependency that is both a fast asyncio HTTP server and the client our tests
and NeMo Gym itself use; no ASGI layer between the request and the bus.
"""

from __future__ import annotations

import asyncio
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
from gym_runtime.data import episodes
from gym_runtime.data.aggregate import MetricsAccumulator
from gym_runtime.data.episodes import EpisodeFailure
from gym_runtime.errors import ClientError, PublishTimeout, RolloutFailed
from gym_runtime.ops.nats_server import free_port

_dec = msgspec.json.Decoder()
_enc = msgspec.json.Encoder()
BOOKKEEPING = ("_ng_task_index", "_ng_rollout_index")
ENVIRONMENT_SERVER_TYPE = "single_agent_turn_legacy"  # flat rows and episode requests on one /run, as ours


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=_enc.encode(body), status=status, content_type="application/json", headers=headers)


def impl_name(module: str) -> str:
    """NeMo Gym's implementation key for an agent module: ``agents.simple`` → ``simple_agent``."""
    short = module.rsplit(".", 1)[-1]
    return short if short.endswith("agent") else f"{short}_agent"


def run_reply(row: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
    """What NeMo Gym's ``/run`` answers for ``request``: ``row`` less the collector's bookkeeping."""
    out = {k: v for k, v in row.items() if k not in BOOKKEEPING}
    for k in BOOKKEEPING:
        if k in request:
            out[k] = request[k]
    if "agent_ref" not in request:
        out.pop("agent_ref", None)
    return out


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


def _local_port(request: web.Request) -> int | None:
    sock = request.transport.get_extra_info("sockname") if request.transport is not None else None
    return sock[1] if sock else None


def _invalid_episode(message: str) -> web.Response:
    """FastAPI's answer to a request body its model refuses: 422, a list of errors."""
    return _json({"detail": [{"type": "value_error", "loc": ["body"], "msg": message}]}, 422)


def _server_error(message: str) -> web.Response:
    """What NeMo Gym's exception middleware answers for a ``ValueError`` its handler raised: 500, ``repr(e)``."""
    return _json(repr(ValueError(message)), 500)


class Gateway:
    """The HTTP app over a started ``Client`` (which owns the bus and, optionally, the workers)."""

    def __init__(self, client: Client, *, host: str, port: int, env_ports: Mapping[str, int] | None = None) -> None:
        self.client = client
        self.host = host
        self.port = port
        self.agents = list(client.config.agents)
        self.started = time.time()
        self.max_rows = client.config.config.gateway.aggregate_metrics_max_rows
        self._aggregating = anyio.CapacityLimiter(1)  # each may hold a core for seconds
        self.env_names = environment_server_names(client)
        self.env_ports = dict(env_ports or {})  # agent -> its Environment Server's port
        self._env_at = {p: a for a, p in self.env_ports.items()}
        self.limits = client.config.config.gateway.environment_servers
        n = self.limits.max_concurrent_episodes
        self._admission = {a: asyncio.Semaphore(n) for a in self.agents} if n is not None else {}

    def global_config(self) -> dict[str, Any]:
        cfg = self.client.config
        out: dict[str, Any] = {"head_server": {"host": self.host, "port": self.port}}
        for name, a in cfg.agents.items():
            out[name] = {
                "responses_api_agents": {
                    impl_name(a.agent): {
                        "entrypoint": "gym-runtime gateway",
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
                        "entrypoint": "gym-runtime gateway",
                        "host": self.host,
                        "port": self.env_ports[name],
                        "resources_server": {"type": "resources_servers", "name": a.resource},
                        "agent_server": {"type": "responses_api_agents", "name": name},
                        **msgspec.to_builtins(self.limits),
                    }
                }
            }
        return out

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app[GATEWAY] = self
        app.router.add_get("/", self.liveness)
        app.router.add_get("/global_config_dict_yaml", self.global_config_dict_yaml)
        app.router.add_get("/server_instances", self.server_instances)
        app.router.add_post("/run", self.run)
        app.router.add_post("/aggregate_metrics", self.aggregate_metrics)
        app.router.add_post("/pause", self.pause)
        app.router.add_post("/resume", self.resume)
        return app

    async def liveness(self, _: web.Request) -> web.Response:
        return _json({"status": "ok"})

    async def global_config_dict_yaml(self, _: web.Request) -> web.Response:
        return _json(yaml.safe_dump(self.global_config(), sort_keys=False))

    async def server_instances(self, _: web.Request) -> web.Response:
        now = time.time()
        return _json(
            [
                {
                    "name": name,
                    "server_type": "responses_api_agents",
                    "process_name": name,
                    "entrypoint": "gym-runtime gateway",
                    "host": self.host,
                    "port": self.port,
                    "url": f"http://{self.host}:{self.port}",
                    "status": "success",
                    "start_time": self.started,
                    "uptime_seconds": round(now - self.started, 3),
                }
                for name in self.agents
            ]
            + [
                {
                    "name": self.env_names[agent],
                    "server_type": "environment_servers",
                    "process_name": self.env_names[agent],
                    "entrypoint": "gym-runtime gateway",
                    "host": self.host,
                    "port": port,
                    "url": f"http://{self.host}:{port}",
                    "status": "success",
                    "start_time": self.started,
                    "uptime_seconds": round(now - self.started, 3),
                }
                for agent, port in self.env_ports.items()
            ]
        )

    def _agent_of(self, row: dict[str, Any]) -> str:
        ref = row.get("agent_ref")
        name = ref.get("name") if isinstance(ref, dict) else None
        if name:
            if name not in self.agents:
                raise web.HTTPNotFound(
                    text=_enc.encode(
                        {
                            "detail": (
                                f"agent_ref.name {name!r} is not an agent of this gateway ({', '.join(self.agents)})"
                            )
                        }
                    ).decode(),
                    content_type="application/json",
                )
            return str(name)
        if len(self.agents) == 1:
            return self.agents[0]
        raise web.HTTPUnprocessableEntity(
            text=_enc.encode(
                {"detail": f"the row names no agent_ref and this gateway has several agents ({', '.join(self.agents)})"}
            ).decode(),
            content_type="application/json",
        )

    async def _body(self, request: web.Request) -> Any:
        return _decoded(await request.read())

    async def run(self, request: web.Request) -> web.Response:
        agent = self._env_at.get(_local_port(request) or -1)
        if agent is not None:
            return await self.episode(request, agent)
        row = await self._body(request)
        if not isinstance(row, dict):
            return _json({"detail": "the body must be a JSON object (a task row)"}, 422)
        agent = self._agent_of(row)
        try:
            with self._traced(request.headers):
                out = await self.client.run(row, agent=agent)
        except PublishTimeout as e:  # the bus is overloaded or unreachable, not the row: try again later
            return _json({"detail": str(e)}, 503)
        except ClientError as e:  # the row itself is invalid
            return _json({"detail": str(e)}, 422)
        except RolloutFailed as e:
            body = f"RolloutFailed(error_class={e.error_class!r}, error={e.row.get('error')!r})"
            return _json(body, 500, headers={"Gym-Error-Class": e.error_class})
        return _json(run_reply(out, row))

    async def episode(self, request: web.Request, agent: str) -> web.Response:
        """``/run`` of ``agent``'s Environment Server: a flat row or an episode request, failures typed."""
        body = await self._body(request)
        if not isinstance(body, dict):
            return _json({"detail": "the body must be a JSON object: a task row or an episode request"}, 422)
        request_: episodes.EpisodeRequest | None = None
        if episodes.is_episode_request(body):
            try:
                request_ = episodes.decode_request(body)
                row = episodes.task_row(request_.task.task_input)
            except (msgspec.ValidationError, ValueError) as e:
                return _invalid_episode(str(e))
        else:
            row = body
            if (routed := self._routing_error(row, agent)) is not None:
                return _server_error(routed)
        try:
            out = await self._run_episode(row, agent, request.headers)
        except ClientError as e:  # the row itself is invalid: nothing was run
            return _invalid_episode(str(e)) if request_ is not None else _json({"detail": str(e)}, 422)
        if request_ is not None:
            if isinstance(out, EpisodeFailure):
                return _json(episodes.episode_response(request_, failure=out))
            return _json(episodes.episode_response(request_, result=episodes.result_of(out)))
        if isinstance(out, EpisodeFailure):
            return _json(episodes.legacy_failure(out, agent))
        reply = run_reply(out, row)
        reply["agent_ref"] = row.get("agent_ref") or {"name": agent}
        return _json(reply)

    def _routing_error(self, row: dict[str, Any], agent: str) -> str | None:
        """Why a flat row is not this server's (as ``single_agent_turn_legacy`` checks it), or None."""
        ref = row.get("agent_ref")
        if ref is not None and (not isinstance(ref, dict) or ref.get("name") != agent):
            named = ref.get("name") if isinstance(ref, dict) else ref
            return f"Row agent_ref {named!r} does not match configured agent server {agent!r}"
        source = row.get("_ng_environment_server")
        if source is not None and source != self.env_names[agent]:
            return f"Row _ng_environment_server {source!r} is not this Environment Server ({self.env_names[agent]!r})"
        task_source = row.get("task_source")
        bound = (self.client.config.agents[agent].resource, agent, self.env_names[agent])
        if task_source is not None and task_source not in bound:
            return f"Row task_source {task_source!r} names none of this Environment Server's instances: {list(bound)}"
        return None

    async def _run_episode(
        self, row: dict[str, Any], agent: str, headers: Mapping[str, str]
    ) -> dict[str, Any] | EpisodeFailure:
        """One episode under the server's limits: the rollout row, or why it failed (``ClientError``: bad row)."""
        slot = self._admission.get(agent)
        if slot is not None:
            with anyio.move_on_after(self.limits.queue_timeout_seconds) as waited:
                await slot.acquire()
            if waited.cancelled_caught:
                return EpisodeFailure("Episode admission timed out", terminal=False, stage="admission")
        try:
            with self._traced(headers):
                with anyio.move_on_after(self.limits.default_episode_timeout_seconds):
                    return await self.client.run(row, agent=agent)
            # past the deadline (the task may still run in a worker: its result is not awaited any more)
            return EpisodeFailure("Episode timed out", terminal=False)
        except PublishTimeout as e:  # the bus did not take the task in time: nothing ran
            return episodes.failure_of("publish_timeout", str(e))
        except RolloutFailed as e:
            return episodes.failure_of(e.error_class, str(e.row.get("error")))
        finally:
            if slot is not None:
                slot.release()

    def _traced(self, headers: Mapping[str, str]) -> AbstractContextManager[Any]:
        """The request's span: the caller's ``traceparent`` (NeMo Gym's client sends one) is the parent of the
        rollout's task, so the rollout's trace continues the caller's."""
        tel = self.client.telemetry
        return tel.span("gateway /run", kind=SpanKind.SERVER, parent=tel.extract(headers))

    async def _steer_body(self, request: web.Request, fields: tuple[str, ...]) -> dict[str, Any]:
        """A ``/pause`` or ``/resume`` body: an object (or nothing) with only ``fields``; else 422."""
        raw = await request.read()
        body = _decoded(raw) if raw.strip() else {}
        unknown = sorted(set(body) - set(fields)) if isinstance(body, dict) else None
        if unknown is None or unknown:
            what = f"unknown fields {unknown}" if unknown else "the body must be a JSON object"
            raise web.HTTPUnprocessableEntity(
                text=_enc.encode({"detail": f"{what}; expected {{{', '.join(fields)}}}"}).decode(),
                content_type="application/json",
            )
        return body

    async def pause(self, request: web.Request) -> web.Response:
        body = await self._steer_body(request, ("mode", "model", "timeout"))
        try:
            timeout = float(body.get("timeout", 60.0))
            acked = await self.client.pause(model=body.get("model"), mode=body.get("mode", "drain"), timeout=timeout)
        except (ClientError, TypeError, ValueError) as e:
            return _json({"detail": str(e)}, 422)
        return _json({"acknowledged": acked})

    async def resume(self, request: web.Request) -> web.Response:
        body = await self._steer_body(request, ("model",))
        try:
            await self.client.resume(model=body.get("model"))
        except ClientError as e:
            return _json({"detail": str(e)}, 422)
        return _json({"resumed": True})

    async def aggregate_metrics(self, request: web.Request) -> web.Response:
        raw = await request.read()
        agent = self._env_at.get(_local_port(request) or -1)
        status, answer = await anyio.to_thread.run_sync(self._aggregate, raw, agent, limiter=self._aggregating)
        return _json(answer, status)

    def _aggregate(self, raw: bytes, agent: str | None = None) -> tuple[int, Any]:
        """``/aggregate_metrics``' status and body, from its raw body (in a worker thread)."""
        body = _decoded(raw)
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
            name = ref.get("name") if isinstance(ref, dict) and ref.get("name") else agent or self._agent_of(r)
            acc.add({**r, "agent_ref": {"name": name}, "_ng_task_index": r.get("_ng_task_index", i)})
        entries = acc.result()
        if len(entries) > 1:
            return 422, {"detail": "rows of several agents: post each agent's rows separately"}
        if not entries:
            return 200, {"agent_metrics": {}, "key_metrics": {}, "group_level_metrics": []}
        return 200, entries[0]


GATEWAY = web.AppKey("gateway", Gateway)  # the app's Gateway (``runner.app[GATEWAY]``: its servers' ports)


def _decoded(raw: bytes) -> Any:
    """A request's JSON body, or FastAPI's 422 for one that is not JSON, not UTF-8 or nested too deep."""
    try:
        return _dec.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as e:
        what = "nested too deep" if isinstance(e, RecursionError) else f"not JSON: {e}"
        raise web.HTTPUnprocessableEntity(
            text=_enc.encode({"detail": f"body is {what}"}).decode(), content_type="application/json"
        ) from None


async def start(
    client: Client, *, host: str, port: int, env_ports: Mapping[str, int] | None = None
) -> tuple[web.AppRunner, int]:
    """Listen (port 0: a free one), and each agent's Environment Server on its port (``env_ports``; else a free
    one); returns the runner (``await runner.cleanup()`` to stop) and the head port."""
    port = port or free_port()
    ports = {a: (env_ports or {}).get(a) or free_port() for a in client.config.agents}
    gateway = Gateway(client, host=host, port=port, env_ports=ports)
    runner = web.AppRunner(gateway.app(), access_log=None, handle_signals=False)
    await runner.setup()
    try:
        for p in (port, *ports.values()):
            await web.TCPSite(runner, host, p, backlog=4096).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, port
