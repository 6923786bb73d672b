"""The head port: NeMo Gym's head server and, for every agent, the agent protocol before 0.7 (``POST /run`` a
task row, routed by ``agent_ref.name``), plus gym-runtime's own ``/pause`` and ``/resume``."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from gym_runtime.errors import ClientError, PublishTimeout, RolloutFailed
from gym_runtime.gateway.replies import TASK_ROW, decoded, json_reply, refusal, run_reply
from gym_runtime.gateway.state import Gateway, liveness


class HeadServer:
    """The head app over the gateway's shared state."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.client = gateway.client

    def app(self) -> web.Application:
        app = self.gateway.app()
        app.router.add_get("/", liveness)
        app.router.add_get("/global_config_dict_yaml", self.global_config_dict_yaml)
        app.router.add_get("/server_instances", self.server_instances)
        app.router.add_post("/run", self.run)
        app.router.add_post("/aggregate_metrics", self.aggregate_metrics)
        app.router.add_post("/pause", self.pause)
        app.router.add_post("/resume", self.resume)
        return app

    async def global_config_dict_yaml(self, _: web.Request) -> web.Response:
        return json_reply(self.gateway.config_yaml)

    async def server_instances(self, _: web.Request) -> web.Response:
        return json_reply(self.gateway.server_instances())

    async def run(self, request: web.Request) -> web.Response:
        row = decoded(await request.read(), TASK_ROW)
        if not isinstance(row, dict):
            return json_reply({"detail": f"the body must be a JSON object: {TASK_ROW}"}, 422)
        agent = self.gateway.agent_of(row)
        try:
            with self.gateway.traced(request.headers):
                out = await self.client.run(row, agent=agent)
        except PublishTimeout as e:  # the bus is overloaded or unreachable, not the row: try again later
            return json_reply({"detail": str(e)}, 503)
        except ClientError as e:  # the row itself is invalid
            return json_reply({"detail": str(e)}, 422)
        except RolloutFailed as e:
            body = f"RolloutFailed(error_class={e.error_class!r}, error={e.row.get('error')!r})"
            return json_reply(body, 500, headers={"Gym-Error-Class": e.error_class})
        return json_reply(run_reply(out, row))

    async def aggregate_metrics(self, request: web.Request) -> web.Response:
        return await self.gateway.aggregate_metrics(request, None)

    async def _steer_body(self, request: web.Request, fields: tuple[str, ...]) -> dict[str, Any]:
        """A ``/pause`` or ``/resume`` body: an object (or nothing) with only ``fields``; else 422."""
        raw = await request.read()
        body = decoded(raw) if raw.strip() else {}
        unknown = sorted(set(body) - set(fields)) if isinstance(body, dict) else None
        if unknown is None or unknown:
            what = f"unknown fields {unknown}" if unknown else "the body must be a JSON object"
            raise refusal(web.HTTPUnprocessableEntity, f"{what}; expected {{{', '.join(fields)}}}")
        return body

    async def pause(self, request: web.Request) -> web.Response:
        body = await self._steer_body(request, ("mode", "model", "timeout"))
        try:
            timeout = float(body.get("timeout", 60.0))
            acked = await self.client.pause(model=body.get("model"), mode=body.get("mode", "drain"), timeout=timeout)
        except (ClientError, TypeError, ValueError) as e:
            return json_reply({"detail": str(e)}, 422)
        return json_reply({"acknowledged": acked})

    async def resume(self, request: web.Request) -> web.Response:
        body = await self._steer_body(request, ("model",))
        try:
            await self.client.resume(model=body.get("model"))
        except ClientError as e:
            return json_reply({"detail": str(e)}, 422)
        return json_reply({"resumed": True})
