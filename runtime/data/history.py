"""A rollout's history (``gym-runtime explain``): each attempt's own records beside the results stored for its
slot, with the batch's manifest.

An attempt writes a record when it starts (``AttemptStart``: worker, node, time, delivery count) and, when it
is given back for another, why (``AttemptRetried``), into the attempts stream (``Subjects.attempt``); one that
ends stores its result, which carries its calls (``RolloutResult.calls``). So an attempt whose worker was
killed is its start record alone, and the next attempt says it was redelivered.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable

import anyio
import msgspec

from gym_runtime.data.batches import Manifest, TaskOwners, get_manifest, other_namespaces
from gym_runtime.data.intake import Intake, is_ok, read_result, replaces
from gym_runtime.errors import UserError
from gym_runtime.messages import AttemptRecord, AttemptRetried, AttemptStart, RolloutResult
from gym_runtime.transport import jetstream
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.delivery import Delivery
from gym_runtime.transport.pull import PullWorker
from gym_runtime.transport.subjects import LOST

READ_TIMEOUT_S = 120.0  # reading a batch's stored results (every one of its agent's, once)


class Attempt(msgspec.Struct, kw_only=True):
    """One attempt at a slot: its start record, why it was given back, the results it stored."""

    number: int
    start: AttemptStart | None = None
    retried: AttemptRetried | None = None
    results: list[RolloutResult] = []


class History(msgspec.Struct, kw_only=True):
    """A slot's attempts in order and the result a reader keeps for it (``kept``; a lost slot's record)."""

    batch: str
    task: int
    rollout: int
    agent: str
    attempts: list[Attempt] = []
    kept: RolloutResult | None = None


async def histories(bus: Bus, batch: str, task: int, rollout: int | None) -> tuple[Manifest, list[History]]:
    """The manifest of ``batch`` and the history of each asked slot of ``task`` (``rollout`` None: every repeat).
    An unknown batch, or a task or rollout index the batch does not have, is the user's mistake."""
    manifest = await get_manifest(bus, batch)
    if manifest is None:
        raise UserError(
            f"no batch {batch!r} in namespace {bus.ns!r} (was it published here, or purged?); "
            + await other_namespaces(bus, batch)
        )
    if not 0 <= task < manifest.tasks:
        raise UserError(f"batch {batch} has tasks 0..{manifest.tasks - 1}, not {task}")
    repeats = max(1, manifest.repeats)
    if rollout is not None and not 0 <= rollout < repeats:
        raise UserError(f"batch {batch} has rollouts 0..{repeats - 1} of each task, not {rollout}")
    owners = TaskOwners(manifest)
    agents = [owners.owner(task)] if owners.owner(task) else sorted(manifest.agents)
    wanted = list(range(repeats)) if rollout is None else [rollout]
    records = await _records(bus, agents, batch, task)
    intake = Intake(bus, batch, repeats=repeats, tasks=manifest.tasks, allows=owners.allows)
    stored, lost = await _results(bus, intake, [*agents, LOST], task)
    out = []
    for r in wanted:
        h = History(batch=batch, task=task, rollout=r, agent=agents[0] if len(agents) == 1 else "")
        by_number: dict[int, Attempt] = {}
        for rec in records:
            if rec.rollout_index <= r < rec.rollout_index + max(rec.group, 1):
                attempt = by_number.setdefault(rec.attempt, Attempt(number=rec.attempt))
                if isinstance(rec, AttemptStart):
                    attempt.start = rec
                else:
                    attempt.retried = rec
        for res in stored:
            if res.rollout_index == r:
                by_number.setdefault(res.attempts, Attempt(number=res.attempts)).results.append(res)
                if not h.agent:
                    h.agent = res.agent
                held = h.kept
                if held is None or replaces(is_ok(held), held.attempts, res):
                    h.kept = res
        if h.kept is None:
            h.kept = next((x for x in lost if x.rollout_index == r), None)
        h.attempts = [by_number[n] for n in sorted(by_number)]
        out.append(h)
    return manifest, out


async def _records(bus: Bus, agents: list[str], batch: str, task: int) -> list[AttemptStart | AttemptRetried]:
    """The attempt records of one task, oldest first (none when the server has no attempts stream: provisioned by
    an older version); each agent's records of the batch read once."""
    out: list[AttemptStart | AttemptRetried] = []
    stream = bus.subjects.attempts_stream
    if await jetstream.stream_config(bus, stream) is None:
        return out

    async def take(msg: Delivery) -> None:
        with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
            out.extend(r for r in _decode_records(msg.data) if r.task_index == task)

    for agent in agents:
        await _read_all(bus, stream, bus.subjects.attempt(agent, batch), take)
    return out


_decode_records = msgspec.msgpack.Decoder(list[AttemptRecord]).decode


async def each_record(
    bus: Bus, batch: str, agents: list[str], take: Callable[[AttemptStart | AttemptRetried], None]
) -> None:
    """Hand ``take`` every attempt record of a batch, in stream order, none kept (``run`` and ``collect`` write
    them beside the output)."""

    async def one(msg: Delivery) -> None:
        with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
            for r in _decode_records(msg.data):
                take(r)

    for agent in agents:
        await _read_all(bus, bus.subjects.attempts_stream, bus.subjects.attempt(agent, batch), one)


async def _results(
    bus: Bus, intake: Intake, agents: list[str], task: int
) -> tuple[list[RolloutResult], list[RolloutResult]]:
    """The results of ``task`` its agents stored, in stream order, and readers' records of its lost slots: each
    agent's stored results of the batch read once, by a no-ack consumer of its own."""
    stored: list[RolloutResult] = []
    lost: list[RolloutResult] = []

    async def take(msg: Delivery) -> None:
        res = await read_result(bus, msg)
        if res is not None and res.task_index == task:
            if intake.slot(res, msg.subject, msg.headers) is not None:
                stored.append(res)
            elif intake.lost_record(res, msg.subject, msg.headers) is not None:
                lost.append(res)

    for agent in agents:
        stream = await jetstream.find_results_stream(bus, agent)
        if stream is not None:
            await _read_all(bus, stream, bus.subjects.result(agent, intake.batch), take)
    return stored, lost


async def _read_all(bus: Bus, stream: str, subject: str, take: Callable[[Delivery], Awaitable[None]]) -> None:
    """Hand ``take`` every message ``stream`` holds on ``subject`` (as many as it held when asked)."""
    expected = await jetstream.subject_count(bus, stream, subject)
    if not expected:
        return
    handled = 0
    done = anyio.Event()

    async def each(msg: Delivery) -> None:
        nonlocal handled
        await take(msg)
        handled += 1
        if handled >= expected:
            done.set()

    consumer = bus.subjects.reader("explain", subject.rsplit(".", 1)[-1])
    await jetstream.add_reader(bus, stream, consumer, subject)
    puller = PullWorker(bus, stream=stream, consumer=consumer, slots=512, handle=each, heartbeat_s=3600.0, inline=True)
    try:
        with anyio.fail_after(READ_TIMEOUT_S):
            async with anyio.create_task_group() as tg:
                tg.start_soon(puller.run)
                await done.wait()
                tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
            await jetstream.delete_consumer(bus, stream, consumer)
