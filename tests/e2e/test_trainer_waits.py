"""Issue 77 item 3's shared piece (``trainers.waiting.watched``: what verl's agent loop and TRL's sync adapter wait
through) against a model worker frozen with SIGSTOP: real workers (``start`` processes) on a real nats-server, the
scripted policy as the LLM (slow, so its calls are in flight at the freeze).

The wait says, in one line, the frozen process to look at, and fails with that line at its bound, its batch
cancelled, instead of waiting forever."""

from __future__ import annotations

import json
import logging
import signal
import time
from pathlib import Path

import pytest

from gym_runtime.client import Client
from gym_runtime.errors import ClientError
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.trainers.waiting import StepWait, WaitPolicy, watched
from tests.e2e.test_why import config, report, tag, wait_async
from tests.pools import Pool, tasks_file

BOUND_S = 45.0  # far past the freeze's detection (a few keepalives: why names it within 30 s)


async def test_a_wait_behind_a_frozen_model_worker_names_it_and_fails_at_its_bound(
    nats_server: EmbeddedServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="gym_runtime.trainers.waiting")
    cfg = config(tmp_path, delay_s=25.0)  # a generation takes 25 s: the freeze lands mid-call
    pool = Pool(cfg, nats_server.url)
    model = pool.start("model", "models.policy")
    pool.start("env", "resources.env")
    pool.start("agent", "agents.agent")
    rows = [json.loads(x) for x in tasks_file(tmp_path, 2).read_text().splitlines() if x.strip()]
    frozen = False
    try:
        async with Client(cfg, nats=nats_server.url, workers=False) as client:
            handle = await client.submit(rows)
            seen: dict[str, object] = {}

            async def generating_on_the_replica() -> bool:
                seen["r"] = r = await report(nats_server.url)
                return any(e["stage"] == "generating" and e.get("by") == tag(model.pid) for e in r["rollouts"])

            await wait_async(generating_on_the_replica, 60, seen)
            model.send_signal(signal.SIGSTOP)
            frozen, t0 = True, time.monotonic()
            watch = StepWait(WaitPolicy(say_after_s=5.0, bound_s=BOUND_S))
            with pytest.raises(ClientError) as e:
                await watched(
                    handle.gather, bus=client.bus, watch=watch, batches=lambda: {handle.batch}, cancel=handle.cancel
                )
            took = time.monotonic() - t0
            assert handle.cancelled  # the step's batch stops: nothing keeps running for a step that gave up
    finally:
        if frozen:
            model.send_signal(signal.SIGCONT)
        pool.stop_all()
    text = str(e.value)
    assert f"look at models.policy process {tag(model.pid)}" in text and "\n" not in text, text
    assert f"gave up at WaitPolicy(bound_s={BOUND_S:g})" in text, text
    assert BOUND_S <= took < BOUND_S + 60
    said = [r.getMessage() for r in caplog.records if "gave up" not in r.getMessage()]
    assert said and all("the training step has waited" in s for s in said), said  # said before the bound
    print(f"named and failed after {took:.1f}s: {text}")
