"""A rollout's checkpoint on the in-memory bus (the server's behaviour: tests/e2e/test_checkpoints.py): written in
the background and read back, the last one asked kept, gone once removed; ``auto`` writes from the 4th turn or
the 60th second, ``every_turn`` always, ``off`` never."""

from __future__ import annotations

from gym_runtime.messages import Checkpoint, Response
from gym_runtime.rollout.checkpoint import AUTO_S, AUTO_TURNS, Checkpointer, checkpoints_kv
from gym_runtime.testing import MemoryTransport


def checkpoint(turn: int) -> Checkpoint:
    return Checkpoint(turn=turn, phase="answered", response=Response(id="r", created_at=0.0))


async def test_the_last_write_is_kept_and_a_removed_one_is_gone() -> None:
    bus = MemoryTransport()
    await checkpoints_kv(bus, 60.0)
    box = Checkpointer(bus, "agent.b1.0.0", "every_turn")
    for turn in (1, 2, 3):  # each in the background, after the one before
        box.write(checkpoint(turn))
    assert await box.settled() and box.stored == 3
    again = Checkpointer(bus, "agent.b1.0.0", "every_turn")  # a redelivered attempt's
    assert await again.read() == checkpoint(3)
    await again.remove()
    assert await Checkpointer(bus, "agent.b1.0.0", "every_turn").read() is None


def test_when_each_mode_writes() -> None:
    bus = MemoryTransport()
    auto, every, off = (Checkpointer(bus, "k", m) for m in ("auto", "every_turn", "off"))
    assert [auto.due(t, 1.0) for t in (1, AUTO_TURNS - 1, AUTO_TURNS)] == [False, False, True]
    assert auto.due(1, AUTO_S)
    assert every.due(1, 0.0) and not off.due(99, 1e6)
