"""The bodies a batch keeps so that a task whose stored result was lost can run again (issue 37, item 2): one per
task, a large one by its blob's key, gone with the batch's purge; and the task ids of a task published again."""

from __future__ import annotations

import msgspec
import pytest

from gym_runtime.config import resolve_config
from gym_runtime.data.batches import Manifest, purge_batch
from gym_runtime.data.inputs import publish_rows
from gym_runtime.data.republish import kept_task
from gym_runtime.errors import UserError
from gym_runtime.messages import RolloutResult
from gym_runtime.rollout.checkpoint import checkpoints_kv
from gym_runtime.service.runner import publish_batch
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.jetstream import ensure_streams, subject_count, task_id_slots, task_msg_id
from gym_runtime.transport.subjects import Subjects, blob_role
from tests.helpers import REPO, ROWS, weather, weather_config

DATA = REPO / "resources/weather/data/example.jsonl"
s = Subjects("gym")


async def test_a_batch_keeps_one_body_per_task_no_larger_than_a_queued_task(bus: Bus) -> None:
    await publish_batch(bus, weather(), DATA, batch="k1", repeats=3)
    kept = await bus.js.stream_info(s.kept_stream)
    tasks = await bus.js.stream_info(s.tasks_stream)
    assert (kept.state.messages, tasks.state.messages) == (5, 15)  # per task, not per repeat
    assert kept.state.bytes / 5 <= tasks.state.bytes / 15  # the same body, without the task's id
    for t in range(5):
        body = await kept_task(bus, "k1", t)
        assert body is not None and (body.task_index, body.rollout_index, body.row) == (t, 0, ROWS[t])


async def test_a_large_tasks_body_is_kept_by_its_blob_key(bus: Bus) -> None:
    """A task over the max payload is one blob, referenced by the queued task and the kept body alike."""
    size = bus.blob_threshold + 100_000
    row = {**ROWS[0], "pad": "x" * size}
    await ensure_streams(bus)  # publish_rows stores into the streams its caller ensured
    await publish_rows(bus, [row], batch="big", agents=["weather_agent"], keep=True)
    kept = await bus.js.stream_info(s.kept_stream)
    blobs = await bus.js.stream_info(s.blob_stream(blob_role(bus.blob_space)))
    assert kept.state.messages == 1 and kept.state.bytes < 1000
    assert size < blobs.state.bytes < size * 1.1  # once, not twice
    body = await kept_task(bus, "big", 0)
    assert body is not None and body.row == row


async def test_purge_removes_the_batchs_kept_bodies_and_only_them(bus: Bus) -> None:
    for batch in ("a", "b"):
        await publish_batch(bus, weather(), DATA, batch=batch)
    await purge_batch(bus, "a")
    assert await subject_count(bus, s.kept_stream, s.kept("a", "*")) == 0
    assert await subject_count(bus, s.kept_stream, s.kept("b", "*")) == 5
    assert await kept_task(bus, "a", 0) is None


async def test_purge_removes_the_batchs_checkpoints_and_only_them(bus: Bus) -> None:
    """A purged batch leaves no rollout's checkpoint behind (issue 69): a batch id a key cannot hold too."""
    kv = await checkpoints_kv(bus, 3600.0)
    keys = {b: s.checkpoint_key("agent", b, 1, 0) for b in ("a", "b", "a:b+c/d")}
    for key in keys.values():  # a whole one, as the previous version wrote, and a part of one
        await kv.put(key, b"checkpoint")
        await kv.put(s.checkpoint_part(key, 3), b"part")
    await purge_batch(bus, "a")
    await purge_batch(bus, "a:b+c/d")
    assert [await kv.get(keys[b]) for b in ("a", "b", "a:b+c/d")] == [None, b"checkpoint", None]
    parts = [await kv.get(s.checkpoint_part(keys[b], 3)) for b in ("a", "b", "a:b+c/d")]
    assert parts == [None, b"part", None]


async def test_max_republish_0_keeps_nothing(bus: Bus) -> None:
    cfg = weather_config()
    cfg.jetstream.max_republish = 0
    manifest = await publish_batch(bus, resolve_config(cfg), DATA, batch="n")
    assert manifest.max_republish == 0
    assert await subject_count(bus, s.kept_stream, s.kept("n", "*")) == 0


def test_a_task_published_again_has_an_id_of_its_own_naming_the_same_slots() -> None:
    for batch in ("b1", "a:b+c/d"):
        assert task_id_slots(task_msg_id(batch, 3, 1)) == (batch, 3, 1, 1)
        assert task_id_slots(task_msg_id(batch, 3, 0, 4)) == (batch, 3, 0, 4)
        again = task_msg_id(batch, 3, 1, 0, 2)
        assert again != task_msg_id(batch, 3, 1) and task_id_slots(again) == (batch, 3, 1, 1)
        assert task_id_slots(task_msg_id(batch, 3, 0, 4, 1)) == (batch, 3, 0, 4)
    for junk in ("", "b1", "b1:x:0", "b1:1:0+y", "b1:1"):
        assert task_id_slots(junk) is None


def test_a_manifest_written_before_bodies_were_kept_publishes_nothing_again() -> None:
    old = b'{"batch":"o","expected":2,"tasks":2,"repeats":1,"agents":{"a":2},"input":"-","published":true}'
    assert msgspec.json.decode(old, type=Manifest).max_republish == 0


async def test_an_earlier_versions_blob_store_is_one_line_saying_what_to_do(bus: Bus) -> None:
    """A kept store from before blob streams per role holds ``GYM_BLOBS`` on every blob subject: a large body
    is one line naming it and how to free its subjects, not an API error."""
    await bus.js.add_stream(name="GYM_BLOBS", subjects=["gym.blob.>"])
    big = RolloutResult(batch="b", task_index=0, rollout_index=0, agent="a", row={"p": "x" * (bus.blob_threshold + 1)})
    with pytest.raises(UserError, match=r"holds GYM_BLOBS, the blob store of an earlier gym-runtime.*nats stream rm"):
        await bus.encode(big, {})
