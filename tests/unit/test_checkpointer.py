"""A rollout's checkpoint on the in-memory bus (the server's behaviour: tests/e2e/test_checkpoints.py): written in
the background and read back, the last one asked kept, gone once removed; ``auto`` writes from the 4th turn or
the 60th second, ``every_turn`` always, ``off`` never. A turn writes what it added (a part), so a late turn's
write is the size of an early one's; a part missing, undecodable, forged or left by an older chain is read as
the last good turn, and a whole checkpoint written by the previous version still reads."""

from __future__ import annotations

from typing import Any

import msgspec

from gym_runtime.messages import (
    Checkpoint,
    CheckpointPart,
    CreateParams,
    FunctionCall,
    FunctionCallOutput,
    Item,
    Response,
    Usage,
)
from gym_runtime.rollout.checkpoint import AUTO_S, AUTO_TURNS, Checkpointer, checkpoints_kv, holding
from gym_runtime.rollout.ledger import Ledger, TrajectoryState
from gym_runtime.testing import MemoryTransport
from gym_runtime.transport.subjects import kv_key

KEY = "agent.b1.0.0"


def checkpoint(turn: int) -> Checkpoint:
    return Checkpoint(turn=turn, phase="answered", response=Response(id="r", created_at=0.0))


class Rollout:
    """A trajectory and ledger growing a turn at a time: a tool call and its output, the policy's turn."""

    def __init__(self) -> None:
        self.items: list[Item] = []
        self.turns: list[str] = []

    def turn(self, n: int) -> None:
        self.items.append(FunctionCall(name=f"step_{n:03d}", arguments="{}", call_id=f"c{n}"))
        self.items.append(FunctionCallOutput(call_id=f"c{n}", output=f'{{"step": {n}}}'))
        self.turns.append("policy")

    def whole(self, turn: int) -> Checkpoint:
        cp = checkpoint(turn)
        cp.response.output, cp.turns = list(self.items), list(self.turns)
        return cp


def kv(bus: MemoryTransport) -> dict[str, bytes]:
    return bus.broker.kv.setdefault(bus.subjects.checkpoints_bucket, {})


async def written(turns: int, key: str = KEY) -> tuple[MemoryTransport, Rollout]:
    bus = MemoryTransport()
    await checkpoints_kv(bus, 60.0)
    box, r = Checkpointer(bus, key, "every_turn"), Rollout()
    for n in range(1, turns + 1):
        r.turn(n)
        box.write(checkpoint(n), r.items, r.turns)
    assert await box.settled() and box.stored == turns
    return bus, r


async def test_the_last_write_is_kept_and_a_removed_one_is_gone() -> None:
    bus, r = await written(3)
    again = Checkpointer(bus, KEY, "every_turn")  # a redelivered attempt's
    assert await again.read() == r.whole(3)
    await again.remove()
    assert await Checkpointer(bus, KEY, "every_turn").read() is None
    assert not kv(bus)  # every part deleted


async def test_a_late_turns_write_holds_what_its_turn_added_only() -> None:
    bus, r = await written(200)
    sizes = {n: len(kv(bus)[f"{KEY}.{n}"]) for n in (1, 2, 10, 200)}
    assert sizes[1] <= sizes[2] <= sizes[10] <= sizes[200] <= sizes[2] + 16, sizes  # only its numbers grow
    assert await Checkpointer(bus, KEY, "every_turn").read() == r.whole(200)


async def test_a_turns_second_write_replaces_its_part() -> None:
    bus = MemoryTransport()
    box, r = Checkpointer(bus, KEY, "every_turn"), Rollout()
    r.turn(1)
    r.items.pop()  # generated: its call not answered yet
    box.write(checkpoint(1), r.items, r.turns)
    r.items.append(FunctionCallOutput(call_id="c1", output="{}"))  # answered
    box.write(checkpoint(1), r.items, r.turns)
    r.turn(2)
    box.write(checkpoint(2), r.items, r.turns)
    assert await box.settled()
    assert sorted(kv(bus)) == [f"{KEY}.1", f"{KEY}.2"]
    assert await Checkpointer(bus, KEY, "every_turn").read() == r.whole(2)


async def test_a_turns_generation_is_encoded_once_and_again_when_it_changed() -> None:
    bus = MemoryTransport()
    box, r = Checkpointer(bus, KEY, "every_turn"), Rollout()
    last = Response(id="gen-1", created_at=1.0, usage=Usage(input_tokens=3, output_tokens=1, total_tokens=4))
    r.turn(1)
    for phase, tokens in (("generated", 1), ("answered", 1), ("answered", 9)):  # the last: its usage moved on
        cp = checkpoint(1)
        cp.phase = phase  # type: ignore[assignment]
        cp.response = msgspec.structs.replace(last, usage=Usage(input_tokens=3, output_tokens=tokens))
        box.write(cp, r.items, r.turns, last)
    assert await box.settled()
    got = await Checkpointer(bus, KEY, "every_turn").read()
    assert (
        got is not None and got.response.id == "gen-1" and got.response.usage == Usage(input_tokens=3, output_tokens=9)
    )
    assert got.response.output == r.items


async def test_a_generation_echoing_its_trajectorys_own_tools_is_written_without_them() -> None:
    """The generation's tools are the trajectory's own list (the model worker said they were the ones asked): left
    out of every write, said so (``offered_tools``); a generation with other tools keeps them, even equal ones."""
    tools = [{"type": "function", "name": f"step_{i:03d}", "parameters": {"type": "object"}} for i in range(200)]
    traj = TrajectoryState(CreateParams(input=[], tools=tools))
    r = Rollout()
    r.turn(1)
    traj.outputs = r.items
    sizes = {}
    for own, echoed in (("own", traj.offered), ("equal", [dict(t) for t in tools])):
        bus = MemoryTransport()
        box = Checkpointer(bus, KEY, "every_turn")
        traj.last = Response(id="gen-1", created_at=1.0, tools=echoed or [])
        cp = holding(traj, Ledger(), 1, "answered", 1.0, [], [], None)
        assert cp.offered_tools is (own == "own") and cp.response.tools == ([] if own == "own" else tools)
        box.write(cp, r.items, r.turns, traj.last)
        assert await box.settled()
        got = await Checkpointer(bus, KEY, "every_turn").read()
        assert got is not None and got.offered_tools is (own == "own")
        sizes[own] = len(kv(bus)[f"{KEY}.1"])
    assert sizes["equal"] - sizes["own"] >= len(msgspec.msgpack.encode(tools)) - 32, sizes  # the tools, once less


async def test_a_trajectory_not_appended_to_is_written_whole_again() -> None:
    bus, r = await written(5)
    box = Checkpointer(bus, KEY, "every_turn")
    assert await box.read() == r.whole(5)
    r.items = r.items[2:]  # an agent that drops its oldest turn: the list replaced
    box.write(checkpoint(6), r.items, r.turns)
    assert await box.settled()
    again = Checkpointer(bus, KEY, "every_turn")
    assert await again.read() == r.whole(6)  # part 1 again; parts 2-5 of the older chain end the read
    await again.remove()
    assert not kv(bus)


class Unstored(MemoryTransport):
    """The in-memory bus whose next ``fail`` stored publishes get no ack (a server down, a leader election)."""

    fail = 0

    async def store(self, subject: str, data: bytes, headers: dict[str, str]) -> None:
        if self.fail:
            self.fail -= 1
            raise TimeoutError("no ack")
        await super().store(subject, data, headers)


async def test_after_a_write_not_stored_the_next_is_written_whole() -> None:
    bus, r = Unstored(), Rollout()
    box = Checkpointer(bus, KEY, "every_turn")
    for n in range(1, 6):
        r.turn(n)
        bus.fail = int(n == 4)  # turn 4's part never stored: turn 5's cannot follow it
        box.write(checkpoint(n), r.items, r.turns)
        await box.settled()
    assert box.stored == 4
    assert await Checkpointer(bus, KEY, "every_turn").read() == r.whole(5)


def forge(bus: MemoryTransport, part: int, **changes: Any) -> None:
    raw = kv(bus)[f"{KEY}.{part}"]
    kv(bus)[f"{KEY}.{part}"] = msgspec.msgpack.encode(
        msgspec.structs.replace(msgspec.msgpack.decode(raw, type=CheckpointPart), **changes)
    )


async def test_a_part_missing_undecodable_or_forged_is_read_as_the_last_good_turn() -> None:
    async def read_after(damage: Any) -> Checkpoint | None:
        bus, _ = await written(6)
        damage(bus)
        box = Checkpointer(bus, KEY, "every_turn")
        cp = await box.read()
        await box.remove()  # every part it saw, the ones after the damage too (past a gap: the TTL's)
        assert set(kv(bus)) <= {f"{KEY}.{n}" for n in range(2, 7)} - {f"{KEY}.{n}" for n in range(2, box.extent + 1)}
        return cp

    r = Rollout()
    for n in range(1, 7):
        r.turn(n)
    at = {n: Rollout() for n in range(7)}
    for n, want in at.items():
        for k in range(1, n + 1):
            want.turn(k)
    assert await read_after(lambda bus: kv(bus).pop(f"{KEY}.4")) == at[3].whole(3)
    assert await read_after(lambda bus: kv(bus).__setitem__(f"{KEY}.4", b"\xc1junk")) == at[3].whole(3)
    assert await read_after(lambda bus: forge(bus, 4, chain="other")) == at[3].whole(3)
    assert await read_after(lambda bus: forge(bus, 4, start=0)) == at[3].whole(3)
    assert await read_after(lambda bus: forge(bus, 6, head=b"\xc1")) == at[5].whole(5)
    assert await read_after(lambda bus: forge(bus, 1, rollout="agent.b1.7.0")) is None
    assert await read_after(lambda bus: kv(bus).pop(f"{KEY}.1")) is None


async def test_another_rollouts_parts_are_never_read_as_this_ones() -> None:
    bus, _ = await written(3, key="agent.b1.9.0")
    for n in (1, 2, 3):  # copied under this rollout's keys (a write the pool's credential allows)
        kv(bus)[f"{KEY}.{n}"] = kv(bus)[f"agent.b1.9.0.{n}"]
    assert await Checkpointer(bus, KEY, "every_turn").read() is None


async def test_a_whole_checkpoint_the_previous_version_wrote_still_resumes() -> None:
    bus, r = MemoryTransport(), Rollout()
    r.turn(1)
    r.turn(2)
    await bus.publish_raw(kv_key(bus.subjects.checkpoints_bucket, KEY), msgspec.msgpack.encode(r.whole(2)))
    box = Checkpointer(bus, KEY, "every_turn")
    assert await box.read() == r.whole(2)
    r.turn(3)
    box.write(checkpoint(3), r.items, r.turns)  # the resumed attempt writes parts from then on
    assert await box.settled()
    assert await Checkpointer(bus, KEY, "every_turn").read() == r.whole(3)
    await box.remove()
    assert not kv(bus)  # the old key too


async def test_an_earlier_attempts_parts_go_with_a_row_that_never_read_them() -> None:
    bus, _ = await written(4)
    box = Checkpointer(bus, KEY, "every_turn")
    box.written = True  # the task ended before it ran (the worker's ``forget``)
    await box.remove()
    assert not kv(bus)


def test_when_each_mode_writes() -> None:
    bus = MemoryTransport()
    auto, every, off = (Checkpointer(bus, "k", m) for m in ("auto", "every_turn", "off"))
    assert [auto.due(t, 1.0) for t in (1, AUTO_TURNS - 1, AUTO_TURNS)] == [False, False, True]
    assert auto.due(1, AUTO_S)
    assert every.due(1, 0.0) and not off.due(99, 1e6)
