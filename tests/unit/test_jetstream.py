"""``transport.jetstream`` without a server: the message ids a batch's slots are found by, and what a full stream
says (the stream, its limit and the key that raises it). Creating streams and consumers is tested on a real
nats-server (``tests/test_storage_limits.py``, ``tests/test_durability.py``).
"""

from __future__ import annotations

from gym_runtime.config import JetStreamConfig
from gym_runtime.testing import MemoryTransport
from gym_runtime.transport.jetstream import (
    full_error,
    limit,
    lost_msg_id,
    result_id_slot,
    result_msg_id,
    task_id_slots,
    task_msg_id,
)


def test_a_tasks_id_names_its_slot_its_group_and_survives_a_batch_name_with_colons() -> None:
    assert task_id_slots(task_msg_id("run:7", 3, 2)) == ("run:7", 3, 2, 1)
    assert task_id_slots(task_msg_id("run:7", 3, 2, group=4, again=1)) == ("run:7", 3, 2, 4)
    assert task_msg_id("b", 3, 2, again=1) != task_msg_id("b", 3, 2)  # published again: not a duplicate
    assert task_id_slots("not-an-id") is None


def test_a_results_id_names_its_slot_and_no_two_attempts_share_one() -> None:
    first, second = result_msg_id("run:7", 3, 2, 1), result_msg_id("run:7", 3, 2, 1)
    assert first != second  # 64 random bits each: no other pool can store one first
    assert result_id_slot(first) == result_id_slot(lost_msg_id("run:7", 3, 2)) == ("run:7", 3, 2)
    assert result_id_slot("b:3:2") == ("b", 3, 2)  # as stored before
    assert result_id_slot("b:x:2") is None


async def test_a_full_stream_is_named_with_its_limit_and_the_key_that_raises_it() -> None:
    async with MemoryTransport(namespace="ns") as bus:
        bus.jetstream_config = JetStreamConfig(results_max_bytes="1GB")
        assert limit(bus, "results").explicit and not limit(bus, "tasks").explicit
        full = full_error(bus, bus.subjects.result("a", "b"), {"description": "maximum bytes exceeded"})
        assert full is not None
        text = str(full.info.message)
        assert bus.subjects.results_stream("a") in text and "jetstream.results_max_bytes" in text
        assert "purge" in text  # and how to make room
        assert full_error(bus, bus.subjects.result("a", "b"), {"description": "wrong last sequence"}) is None
