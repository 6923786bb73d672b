"""A rollout's checkpoint on the in-memory bus (the server's behaviour: tests/e2e/test_checkpoints.py): written in
the background and read back, the last one asked kept, gone once removed; ``auto`` writes from the 4th turn or
the 60th second, ``every_turn`` always, ``off`` never."""

from __future__ import annotations

import importlib
import sys

import pytest

from gym_runtime.messages import Checkpoint, Response
from gym_runtime.rollout import checkpoint as room_checkpoint
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


def test_the_checkpoints_old_path_warns_and_is_the_new_one() -> None:
    """``gym_runtime.checkpoint`` moved into the rollout's room (issue 74 item 1): its old path still serves, with
    a ``DeprecationWarning`` naming the new one."""
    sys.modules.pop("gym_runtime.checkpoint", None)
    with pytest.warns(DeprecationWarning, match="gym_runtime.rollout.checkpoint"):
        old = importlib.import_module("gym_runtime.checkpoint")
    assert old.Checkpointer is room_checkpoint.Checkpointer and old.checkpoints_kv is room_checkpoint.checkpoints_kv
