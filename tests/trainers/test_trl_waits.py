"""Issue 77 item 3: the TRL adapter says why a step waits for its rollouts, and the wait is bounded.

The policy's model worker is absent (nothing on the bus serves ``models.policy``): every rollout's first call
queues. The step logs a line naming the model after ``say_after_s``, and fails with that line at ``bound_s``
instead of waiting forever."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from gym_runtime import SyncClient
from gym_runtime.errors import ClientError
from gym_runtime.trainers.trl import TRLRollouts
from gym_runtime.trainers.waiting import WaitPolicy
from tests.trainers.world import grpo, need, world

need("trl")


def test_a_step_with_no_model_worker_says_so_and_fails_at_its_bound(
    tmp_path: Path, nats_server, caplog: pytest.LogCaptureFixture
) -> None:
    w = world(tmp_path, rows=2)
    caplog.set_level(logging.WARNING, logger="gym_runtime.trainers.waiting")
    # the agents and the environment run; no model worker serves the policy
    with SyncClient(w.config, nats=nats_server.url, workers=["agents.agent", "resources.env"]) as client:
        rollouts = TRLRollouts(client, w.rows, waits=WaitPolicy(say_after_s=3.0, bound_s=12.0))
        trainer = grpo(w, rollouts, rollouts.dataset(), tmp_path, steps=1, batch=2, generations=2)
        t0 = time.monotonic()
        with pytest.raises(ClientError) as e:
            trainer.train()
        took = time.monotonic() - t0
    text = str(e.value)
    assert "\n" not in text
    assert "look at models.policy" in text and "queued for model policy" in text, text
    assert "gave up at WaitPolicy(bound_s=12)" in text, text
    assert 12.0 <= took < 120.0  # at the bound, not forever (far from both: the machine is loaded)
    said = [r.getMessage() for r in caplog.records if "waited" in r.getMessage() and "gave up" not in r.getMessage()]
    assert said and "models.policy" in said[0], said  # said before the bound, naming the model


def test_the_async_worker_says_why_no_sample_comes_and_fails_at_its_bound(
    tmp_path: Path, nats_server, caplog: pytest.LogCaptureFixture
) -> None:
    trl = need("trl.experimental.async_grpo.async_rollout_worker")
    from gym_runtime.trainers.trl_async import GymRolloutWorker

    w = world(tmp_path, rows=2)
    caplog.set_level(logging.WARNING, logger="gym_runtime.trainers.waiting")
    with SyncClient(w.config, nats=nats_server.url, workers=["agents.agent", "resources.env"]) as client:
        client.set_policy_version(0)
        worker = GymRolloutWorker(
            client,
            w.rows,
            sample=trl.RolloutSample,
            num_generations=2,
            max_staleness=1,
            batch_size=4,
            waits=WaitPolicy(say_after_s=3.0, bound_s=12.0),
        )
        worker.start()
        t0 = time.monotonic()
        try:
            with pytest.raises(ClientError) as e:
                while time.monotonic() - t0 < 120:  # TRL calls check_health while its queue is empty
                    worker.check_health(stale_after_s=300.0)
                    time.sleep(0.2)
        finally:
            worker.stop()
        took = time.monotonic() - t0
    text = str(e.value)
    assert "look at models.policy" in text and "gave up at WaitPolicy(bound_s=12)" in text, text
    assert 12.0 <= took < 120.0
    said = [r.getMessage() for r in caplog.records if "gave up" not in r.getMessage()]
    assert any("queued for model policy" in s for s in said), said
