"""Checkpoints cost nothing where they buy nothing, and never outlive their rows (issue 69, item 1).

Real nats-server, workers in this process (``Client``), the scripted policy (a TEST DOUBLE for the LLM) on the
weather environment: two model turns a rollout. ``checkpoint: auto`` writes none for rollouts this short;
``every_turn`` writes each turn's and leaves none behind once the batch's rows are stored.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import yaml

from gym_runtime import Client
from gym_runtime.checkpoint import checkpoints_kv
from gym_runtime.transport.subjects import Subjects, kv_stream
from tests.helpers import ROWS, WEATHER


def config(tmp: Path, checkpoint: str) -> Path:
    raw = yaml.safe_load(WEATHER.read_text())
    raw["agents"]["weather_agent"]["checkpoint"] = checkpoint
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize("checkpoint", ["auto", "every_turn"])
async def test_short_rollouts_write_none_under_auto_and_none_outlives_its_row(
    nats_server, tmp_path: Path, checkpoint: str
) -> None:
    async with Client(config(tmp_path, checkpoint), nats=nats_server.url) as client:
        batch = await client.submit(ROWS, repeats=2)
        with anyio.fail_after(120):
            rows = await batch.gather()
        assert [r["reward"] for r in rows] == [1.0] * len(ROWS) * 2
        assert not any("resumed_how" in r for r in rows)  # first attempts: nothing resumed
        kv = await checkpoints_kv(client.bus, 3600.0)
        keys = [Subjects.checkpoint_key("weather_agent", batch.batch, t, k) for t in range(len(ROWS)) for k in (0, 1)]
        assert [await kv.get(key) for key in keys] == [None] * len(keys)  # none left behind
        info = await client.bus.js.stream_info(kv_stream(client.bus.subjects.checkpoints_bucket))
    if checkpoint == "auto":
        assert info.state.messages == 0  # never written: a 2-turn rollout costs no checkpoint
    else:
        assert info.state.messages == len(keys)  # written, then each deleted (a delete marker per key)


async def test_a_cancelled_rollouts_checkpoint_goes_with_its_failure_row(nats_server, tmp_path: Path) -> None:
    """A batch cancelled while a checkpointed rollout runs: its failure row is stored, and its checkpoint
    deleted with it (not left to the bucket's TTL)."""
    raw = yaml.safe_load(config(tmp_path, "every_turn").read_text())
    raw["models"]["policy"]["delay_s"] = 2.0  # its second model turn runs while the batch is cancelled
    path = tmp_path / "slow.yaml"
    path.write_text(yaml.safe_dump(raw))
    async with Client(path, nats=nats_server.url) as client:
        batch = await client.submit(ROWS[:1])
        kv = await checkpoints_kv(client.bus, 3600.0)
        key = Subjects.checkpoint_key("weather_agent", batch.batch, 0, 0)
        with anyio.fail_after(60):
            while await kv.get(key) is None:  # its first turn is checkpointed: the rollout is mid-way
                await anyio.sleep(0.05)
            await batch.cancel()  # iteration ends now; the rollout stops and stores its failure row
            while await kv.get(key) is not None:  # ... and its checkpoint goes with it
                await anyio.sleep(0.05)
        stored = await client.bus.subject_count(
            client.bus.subjects.results_stream("weather_agent"), client.bus.subjects.batch_results(batch.batch)
        )
        assert stored == 1  # the cancelled failure row
