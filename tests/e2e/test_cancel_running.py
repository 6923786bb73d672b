"""``BatchHandle.cancel`` stops the batch's rollouts that are running, not only the unstarted ones: a trainer
that cancels a group it can no longer use (too stale) frees its slots at once, while other batches run on.
Real nats-server, real workers; the scripted policy (the LLM test double) takes 300 s a call, so a rollout that
ends within the test's minute was stopped."""

from __future__ import annotations

from typing import Any

import anyio

from gym_runtime import Client
from gym_runtime.config import config_from_dict, resolve_config
from tests.helpers import FLAKY


def agent_of(client: Client) -> Any:
    return next(w for w in client.workers if hasattr(w, "skipped"))


def row(text: str) -> dict[str, Any]:
    return {"responses_create_params": {"input": [{"role": "user", "content": text}]}}


async def until(check: Any, within: float = 60.0) -> None:
    with anyio.fail_after(within):
        while not check():
            await anyio.sleep(0.05)


async def test_cancel_stops_the_batchs_running_rollouts_and_only_them(nats_server) -> None:
    cfg = {**FLAKY, "models": {"policy": {"adapter": "scripted", "delay_s": 300.0}}}
    async with Client(resolve_config(config_from_dict(cfg)), nats=nats_server.url) as client:
        agent = agent_of(client)
        stale = await client.submit([row("stale")], repeats=2)  # one group: its own batch
        kept = await client.submit([row("kept")], repeats=1)
        await until(lambda: agent.stats()["in_flight"] == 3)  # all three are waiting on the model
        await stale.cancel()
        await until(lambda: agent.stats()["in_flight"] == 1)  # the cancelled group's two stopped
        assert agent.skipped == 2 and agent.completed == 2  # each stored as a `cancelled` result
        assert not kept.done and not kept.cancelled  # the other batch's rollout runs on
