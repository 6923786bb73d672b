"""The shared timers of request-reply (``transport.rpc``): a server's keepalives and a bus's ack deadlines, one
timer each for all of their calls. End to end, through a real server: ``tests/test_rpc.py`` (a slow handler is
waited for, a cancelled one goes silent) and ``tests/test_durability.py`` (a stored publish retried)."""

from __future__ import annotations

import asyncio
import time

import nats.errors
import pytest

from gym_runtime.transport.rpc import AckDeadlines, Keepalives


async def test_a_call_running_past_keepalive_s_is_told_about_every_keepalive_s_until_it_stops() -> None:
    beats: list[tuple[str, float]] = []
    started = time.monotonic()

    async def publish(subject: str, data: bytes, *, headers: dict[str, str]) -> None:
        assert data == b"" and headers == {"Gym-Progress": "1"}
        beats.append((subject, time.monotonic() - started))

    keepalives = Keepalives(publish, every_s=0.2)
    slow = keepalives.start("_INBOX.slow")
    quick = keepalives.start("_INBOX.quick")
    keepalives.stop(quick)  # ended before its first beat: never told
    while len(beats) < 3:
        await asyncio.sleep(0.01)
    keepalives.stop(slow)
    told = len(beats)
    await asyncio.sleep(0.5)
    assert {s for s, _ in beats} == {"_INBOX.slow"} and len(beats) == told  # nothing after the stop
    gaps = [b - a for (_, a), (_, b) in zip(beats, beats[1:], strict=False)]
    assert beats[0][1] >= 0.2 and all(g >= 0.2 for g in gaps)  # never sooner than keepalive_s
    assert keepalives._timer is None  # nothing runs: no timer armed


async def test_an_ack_not_back_by_its_deadline_fails_as_nats_py_times_out_and_a_discarded_one_never() -> None:
    deadlines = AckDeadlines(tick_s=0.05)
    loop = asyncio.get_running_loop()
    late, answered = loop.create_future(), loop.create_future()
    t0 = time.monotonic()
    deadlines.add(late, 0.2)
    deadlines.add(answered, 0.2)
    deadlines.discard(answered)  # its ack came
    with pytest.raises(nats.errors.TimeoutError):
        await late
    assert 0.2 <= time.monotonic() - t0 < 5
    await asyncio.sleep(0.3)
    assert not answered.done() and deadlines._timer is None
