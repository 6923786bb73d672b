"""Checkpoints cost nothing where they buy nothing, and never outlive their rows (issue 69, items 1 and 6).

Real nats-server, workers in this process (``Client``) or SIGKILLable worker processes (``Pool``), the scripted
policy (a TEST DOUBLE for the LLM) on the weather environment: two model turns a rollout. ``checkpoint: auto``
writes none for rollouts this short; ``every_turn`` writes each turn's and leaves none behind once the batch's
rows are stored, nor once a failure row is (a timeout, a cancel); one whose rollout is gone (its worker killed,
no peer to take it up) is aged out by ``jetstream.checkpoint_ttl_s``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import yaml

from gym_runtime import Client
from gym_runtime.messages import Checkpoint, CheckpointPart, Response
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.rollout.checkpoint import checkpoints_kv
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.subjects import Subjects, kv_stream
from tests.helpers import ROWS, WEATHER, cli, write_jsonl
from tests.pools import Pool


def config(tmp: Path, checkpoint: str, delay_s: float = 0.0, ttl_s: float | None = None, **agent: Any) -> Path:
    """Weather's config with the agent's ``checkpoint`` mode (and ``agent``'s keys), the scripted model taking
    ``delay_s`` a call, and the checkpoints' TTL (``ttl_s``)."""
    raw = yaml.safe_load(WEATHER.read_text())
    raw["agents"]["weather_agent"].update(checkpoint=checkpoint, **agent)
    raw["models"]["policy"]["delay_s"] = delay_s
    if ttl_s is not None:
        raw["jetstream"] = {"checkpoint_ttl_s": ttl_s}
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def part_1(agent: str, batch: str, task_index: int, rollout_index: int) -> str:
    """The key of a rollout's checkpoint's first part (a weather rollout's only one: its one turn with a call)."""
    return Subjects.checkpoint_part(Subjects.checkpoint_key(agent, batch, task_index, rollout_index), 1)


async def wait_for_key(kv: Any, key: str, present: bool) -> None:
    """Until the key is there (``present``) or gone: each read asks the server."""
    while (await kv.get(key) is not None) != present:
        await anyio.sleep(0.05)


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
        keys = [part_1("weather_agent", batch.batch, t, k) for t in range(len(ROWS)) for k in (0, 1)]
        with anyio.fail_after(30):  # each deleted once its row is stored (before its task's ack): none left behind
            for key in keys:
                await wait_for_key(kv, key, present=False)
        info = await client.bus.js.stream_info(kv_stream(client.bus.subjects.checkpoints_bucket))
    if checkpoint == "auto":
        assert info.state.messages == 0  # never written: a 2-turn rollout costs no checkpoint
    else:
        assert info.state.messages == len(keys)  # written, then each deleted (a delete marker per key)


async def test_a_cancelled_rollouts_checkpoint_goes_with_its_failure_row(nats_server, tmp_path: Path) -> None:
    """A batch cancelled while a checkpointed rollout runs: its failure row is stored, and its checkpoint
    deleted with it (not left to the bucket's TTL)."""
    path = config(tmp_path, "every_turn", delay_s=2.0)  # its second model turn runs while the batch is cancelled
    async with Client(path, nats=nats_server.url) as client:
        batch = await client.submit(ROWS[:1])
        kv = await checkpoints_kv(client.bus, 3600.0)
        key = part_1("weather_agent", batch.batch, 0, 0)
        with anyio.fail_after(60):
            await wait_for_key(kv, key, present=True)  # its first turn is checkpointed: the rollout is mid-way
            await batch.cancel()  # iteration ends now; the rollout stops and stores its failure row
            await wait_for_key(kv, key, present=False)  # ... and its checkpoint goes with it
        stored = await client.bus.subject_count(
            client.bus.subjects.results_stream("weather_agent"), client.bus.subjects.batch_results(batch.batch)
        )
        assert stored == 1  # the cancelled failure row


async def test_a_failed_rollouts_checkpoint_goes_with_its_failure_row(nats_server, tmp_path: Path) -> None:
    """A rollout that checkpointed its first turn, then ran past ``timeout_s`` on its last attempt: its failure
    row (with the partial trajectory) is stored, and its checkpoint deleted with it, not left to the TTL."""
    # turn 1 ends at 3 s and is checkpointed; turn 2 would end at 6 s
    path = config(tmp_path, "every_turn", delay_s=3.0, timeout_s=5.0, max_attempts=1)
    async with Client(path, nats=nats_server.url) as client:
        batch = await client.submit(ROWS[:1])
        kv = await checkpoints_kv(client.bus, 3600.0)
        key = part_1("weather_agent", batch.batch, 0, 0)
        with anyio.fail_after(60):
            await wait_for_key(kv, key, present=True)  # checkpointed mid-way
            (row,) = await batch.gather()
            assert row["error_class"] == "timeout" and row["partial"] is True
            await wait_for_key(kv, key, present=False)  # gone with its failure row (deleted once it is stored)
        info = await client.bus.js.stream_info(kv_stream(client.bus.subjects.checkpoints_bucket))
        assert info.state.messages == 1  # deleted (its delete marker), not aged out


async def test_a_checkpoint_leaves_out_the_tools_its_trajectory_offers(nats_server, tmp_path: Path) -> None:
    """A generation echoes the tools it was offered, the same each turn (hundreds of them can be most of a turn's
    checkpoint): the model worker says they are the very ones asked, and the checkpoint leaves the trajectory's
    own out (a resumed attempt takes its task's); the row still has them."""
    path = config(tmp_path, "every_turn", delay_s=2.0)  # turn 2 runs for 2 s after turn 1 is checkpointed
    async with Client(path, nats=nats_server.url) as client:
        batch = await client.submit(ROWS[:1])
        kv = await checkpoints_kv(client.bus, 3600.0)
        key = part_1("weather_agent", batch.batch, 0, 0)
        with anyio.fail_after(60):
            await wait_for_key(kv, key, present=True)
            raw = await kv.get(key)
            (row,) = await batch.gather()
    assert raw is not None
    part = msgspec.msgpack.decode(raw, type=CheckpointPart)
    head = msgspec.msgpack.decode(part.head, type=Checkpoint)
    response = msgspec.msgpack.decode(part.response, type=Response)
    offered = ROWS[0]["responses_create_params"]["tools"]
    assert offered and head.offered_tools and response.tools == []
    assert b"additionalProperties" not in raw  # the offered tool's schema: nowhere in the part
    assert row["reward"] == 1.0 and row["response"]["tools"] == offered


@pytest.mark.parametrize("by", ["ttl", "purge"])
async def test_a_checkpoint_whose_rollout_is_gone_goes_by_its_ttl_or_purge(
    nats_server: EmbeddedServer, tmp_path: Path, by: str
) -> None:
    """The backstops: an agent worker SIGKILLed mid-rollout with no peer to take its task up leaves its checkpoint
    behind; ``jetstream.checkpoint_ttl_s`` (2 s here) ages it out (nothing deleted it: no delete marker is left),
    and ``gym-runtime purge`` of its batch removes it at once (the TTL an hour)."""
    path = config(tmp_path, "every_turn", delay_s=2.0, ttl_s=2.0 if by == "ttl" else 3600.0, max_attempts=1)
    pool = Pool(path, nats_server.url)
    tasks = write_jsonl(tmp_path / "tasks.jsonl", ROWS[:1])
    bus = await Bus.connect(nats_server.url, namespace="gym", telemetry=Telemetry(), name="test-ttl")
    try:
        for only in ("models.policy", "resources.weather", "agents.weather_agent"):
            await anyio.to_thread.run_sync(pool.start, only, only)
        res = await anyio.to_thread.run_sync(
            lambda: cli("publish", str(path), "-i", str(tasks), "--nats", nats_server.url, "--batch", "b1")
        )
        assert res.returncode == 0, res.stderr
        kv = await bus.kv(bus.subjects.checkpoints_bucket)
        key = part_1("weather_agent", "b1", 0, 0)
        with anyio.fail_after(60):
            await wait_for_key(kv, key, present=True)
        await anyio.to_thread.run_sync(pool.kill, "agents.weather_agent")  # the rollout is gone: nobody deletes it
        if by == "purge":
            res = await anyio.to_thread.run_sync(lambda: cli("purge", "--batch", "b1", "--nats", nats_server.url))
            assert res.returncode == 0, res.stderr
            assert await kv.get(key) is None  # gone once purge returns
        with anyio.fail_after(30):
            await wait_for_key(kv, key, present=False)
        info = await bus.js.stream_info(kv_stream(bus.subjects.checkpoints_bucket))
        assert info.state.messages == 0  # aged out or purged, not deleted
    finally:
        await bus.close()
        await anyio.to_thread.run_sync(pool.stop_all)
