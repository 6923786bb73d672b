"""One agent's NeMo Gym 0.7 Environment Server, on a port of its own (an episode request names no agent: the
port it arrives on does, as in NeMo Gym, where each server has its port).

``POST /run`` takes a flat row (answered as ``single_agent_turn_legacy`` answers it: the verify response with
``agent_ref``, or HTTP 200 with a ``_ng_failure_*`` row) or an episode request (an episode response holding a
``result`` or a typed ``failure``), under ``gateway.environment_servers``' limits; ``POST /aggregate_metrics``
counts rows naming no agent as this server's agent's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import anyio
import msgspec
from aiohttp import web

from gym_runtime.errors import ClientError, PublishTimeout, RolloutFailed
from gym_runtime.gateway import episodes
from gym_runtime.gateway.episodes import EpisodeFailure
from gym_runtime.gateway.replies import TASK_ROW, decoded, invalid_episode, json_reply, run_reply, server_error
from gym_runtime.gateway.state import Gateway, liveness


class EnvironmentServer:
    """``agent``'s Environment Server app over the gateway's shared state."""

    def __init__(self, gateway: Gateway, agent: str) -> None:
        self.gateway = gateway
        self.agent = agent
        self.name = gateway.env_names[agent]
        self.limits = gateway.limits
        self.slot = gateway.admission.get(agent)
        self.bound = (gateway.client.config.agents[agent].resource, agent, self.name)  # what task_source may name

    def app(self) -> web.Application:
        app = self.gateway.app()
        app.router.add_get("/", liveness)
        app.router.add_post("/run", self.run)
        app.router.add_post("/aggregate_metrics", self.aggregate_metrics)
        return app

    async def aggregate_metrics(self, request: web.Request) -> web.Response:
        return await self.gateway.aggregate_metrics(request, self.agent)

    async def run(self, request: web.Request) -> web.Response:
        """A flat row or an episode request, failures typed."""
        body = decoded(await request.read(), f"{TASK_ROW}, or an episode request")
        if not isinstance(body, dict):
            return json_reply({"detail": f"the body must be a JSON object: {TASK_ROW}, or an episode request"}, 422)
        episode: episodes.EpisodeRequest | None = None
        if episodes.is_episode_request(body):
            try:
                episode = episodes.decode_request(body)
                row = episodes.task_row(episode.task.task_input)
            except (msgspec.ValidationError, ValueError) as e:
                return invalid_episode(str(e))
        else:
            row = body
            if (routed := self._routing_error(row)) is not None:
                return server_error(routed)
        try:
            out = await self._run_episode(row, request.headers)
        except ClientError as e:  # the row itself is invalid: nothing was run
            return invalid_episode(str(e)) if episode is not None else json_reply({"detail": str(e)}, 422)
        if episode is not None:
            if isinstance(out, EpisodeFailure):
                return json_reply(episodes.episode_response(episode, failure=out))
            return json_reply(episodes.episode_response(episode, result=episodes.result_of(out)))
        if isinstance(out, EpisodeFailure):
            return json_reply(episodes.legacy_failure(out, self.agent))
        reply = run_reply(out, row)
        reply["agent_ref"] = row.get("agent_ref") or {"name": self.agent}
        return json_reply(reply)

    def _routing_error(self, row: dict[str, Any]) -> str | None:
        """Why a flat row is not this server's (as ``single_agent_turn_legacy`` checks it), or None."""
        ref = row.get("agent_ref")
        if ref is not None and (not isinstance(ref, dict) or ref.get("name") != self.agent):
            named = ref.get("name") if isinstance(ref, dict) else ref
            return f"Row agent_ref {named!r} does not match configured agent server {self.agent!r}"
        source = row.get("_ng_environment_server")
        if source is not None and source != self.name:
            return f"Row _ng_environment_server {source!r} is not this Environment Server ({self.name!r})"
        task_source = row.get("task_source")
        if task_source is not None and task_source not in self.bound:
            return (
                f"Row task_source {task_source!r} names none of this Environment Server's instances: {list(self.bound)}"
            )
        return None

    async def _run_episode(self, row: dict[str, Any], headers: Mapping[str, str]) -> dict[str, Any] | EpisodeFailure:
        """One episode under the server's limits: the rollout row, or why it failed (``ClientError``: bad row)."""
        if self.slot is not None:
            with anyio.move_on_after(self.limits.queue_timeout_seconds) as waited:
                await self.slot.acquire()
            if waited.cancelled_caught:
                return EpisodeFailure("Episode admission timed out", terminal=False, stage="admission")
        try:
            with self.gateway.traced(headers):
                with anyio.move_on_after(self.limits.default_episode_timeout_seconds):
                    return await self.gateway.client.run(row, agent=self.agent)
            # past the deadline (the task may still run in a worker: its result is not awaited any more)
            return EpisodeFailure("Episode timed out", terminal=False)
        except PublishTimeout as e:  # the bus did not take the task in time: nothing ran
            return episodes.failure_of("publish_timeout", str(e))
        except RolloutFailed as e:
            return episodes.failure_of(e.error_class, str(e.row.get("error")))
        finally:
            if self.slot is not None:
                self.slot.release()
