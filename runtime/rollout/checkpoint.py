"""A rollout's checkpoint: when one is written, where it is kept, and how a redelivered attempt reads it back.

A long rollout whose agent worker dies resumes at its last turn instead of starting over
(docs/operations.md#resume-at-the-last-turn). Its checkpoint is kept in a JetStream KV bucket
(``Subjects.checkpoints_bucket``), not in the attempts stream, in parts (``CheckpointPart``): one key per turn of
the rollout, under its own (``{rollout key}.{part}``), so a turn writes what it added, not the whole trajectory
again, and a late turn's checkpoint costs what an early one's does. Part 1 holds the trajectory from its start
(an attempt's first write, or the first after a write that was not stored); each next turn's write adds a part
with that turn's items and the rest of the checkpoint (its ``head``: cost, clock, handles), and a turn's second
write (its calls answered, or its next generation so far) replaces its own part (history 1: the server keeps
only the last of each key). A rollout's parts are deleted with its row, and aged out by the bucket's TTL
(``jetstream.checkpoint_ttl_s``) where nothing deleted them. The attempts stream is append-only: a record per
turn there would outlive its rollout.

A write is off the critical path: it is put while the rollout goes on (the next write, and the attempt's end,
wait for it; parts are stored in order); only the tool calls of a turn wait for that turn's checkpoint to be
stored, so a resume replays the calls the model made, never samples new ones. A resume reads only what the
server stored, and only its own pool's: a key starts with its agent pool's name (``Subjects.checkpoint_key``)
and each pool may read its own keys only, each by a last-by-subject direct get (a checkpoint names its sessions
and sandboxes). It reads parts 1, 2, ... in order while each one follows the one before (the same rollout and
chain, its items where the parts before end): a part missing, undecodable, forged or of an older chain ends the
read at the last good turn, and a part 1 that cannot be read is no checkpoint (the rollout starts over). A
checkpoint written whole under the rollout's own key by the previous version is read as it was. The deletes that
go with the row (one per part) are sent without waiting for the server's ack, as the task's own ack right after
them is (a delete the server never got, e.g. one sent during a leader election, is the TTL's to age out, and a
read right after it may still see the part).

Items are taken as appended: a trajectory whose list is replaced, shortened or whose last written item moved is
written whole again (part 1); an agent that edits an item it already gave the trajectory in place must replace the
list for the edit to be kept.
"""

from __future__ import annotations

import asyncio
import math
import secrets
from collections.abc import Awaitable
from typing import Any, Literal

import msgspec

from gym_runtime.messages import (
    Checkpoint,
    CheckpointPart,
    GenerationProgress,
    HeldSandboxes,
    Item,
    Response,
    SandboxHandle,
    SessionHandle,
)
from gym_runtime.observability import logs
from gym_runtime.rollout.ledger import Ledger, TrajectoryState
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.delivery import Delivery
from gym_runtime.transport.interface import KeyValue
from gym_runtime.transport.subjects import kv_key, kv_stream

__all__ = ["AUTO_S", "AUTO_TURNS", "GENERATING_S", "Checkpointer", "Mode", "checkpoints_kv", "holding"]

log = logs.get("gym.checkpoint")

# ``checkpoint: auto`` writes from this model turn, or from this second of the rollout: a shorter rollout costs
# nothing (no write, no delete), a longer one loses at most one turn to a dead worker.
AUTO_TURNS = 4
AUTO_S = 60.0
# A policy generation longer than this sends its tokens so far this often (an adapter that can stop one: ``vllm``
# with ``interruptible: true``, ``vllm_engine``), each kept in a checkpoint when one is due: a worker killed
# mid-generation loses at most this much of it. A shorter generation sends nothing.
GENERATING_S = 2.0

Mode = Literal["auto", "every_turn", "off"]
_encoder = msgspec.msgpack.Encoder()
_checkpoint, _part = msgspec.msgpack.Decoder(Checkpoint), msgspec.msgpack.Decoder(CheckpointPart)
_response = msgspec.msgpack.Decoder(Response)
_APART = Response(id="", created_at=0.0)  # a head's response: the part holds it (``CheckpointPart.response``)
KV_OPERATION, DELETE = "KV-Operation", "DEL"  # a KV key's delete marker, as nats-py's KV writes it (its get: None)
_GONE = (DELETE, "PURGE")
_DELETE = {KV_OPERATION: DELETE}
TTL_HEADER = "Nats-TTL"  # a message's own age limit (the bucket allows them: ``checkpoints_kv``)
_UNREADABLE = (msgspec.DecodeError, msgspec.ValidationError)


def holding(
    traj: TrajectoryState,
    ledger: Ledger,
    turn: int,
    phase: str,
    elapsed_s: float,
    sessions: list[SessionHandle],
    sandboxes: list[SandboxHandle],
    generating: GenerationProgress | None,
) -> Checkpoint:
    """What a checkpoint holds besides its items and turns (``Checkpointer.write`` takes what the turn added of
    those): where its last generation starts, the ledger's cost and policy versions, the clock so far, and the
    handles of its sessions and sandboxes; ``generating``: the next turn's generation so far (its turn answered,
    that generation still running). ``response`` is the last generation in a failure row's shape, its output
    left to the parts."""
    last = traj.last
    assert last is not None
    offered = last.tools is traj.offered and bool(last.tools)  # the trajectory's own tools: left out, taken up
    partial = msgspec.structs.replace(last, output=[], usage=traj.usage, tools=[] if offered else last.tools)
    partial.status = "incomplete"  # the shape of a failure row's partial trajectory
    return Checkpoint(
        turn=turn,
        phase="generated" if phase == "generated" and generating is None else "answered",
        response=partial,
        last_status=last.status,
        last_from=traj.last_from,
        cost=ledger.cost,
        policy_versions=ledger.policy_versions,
        elapsed_s=max(0.0, elapsed_s),
        sessions=sessions,
        sandboxes=sandboxes,
        generating=generating,
        offered_tools=offered,
    )


async def checkpoints_kv(bus: Bus, ttl_s: float) -> KeyValue:
    """The checkpoints bucket, made on first use with its TTL and direct gets (a secured server's: by
    ``provision``): an agent worker makes sure of it once, as it starts; its rollouts then write their keys as
    stored publishes, and read them back by direct gets."""
    return await bus.kv(bus.subjects.checkpoints_bucket, ttl_s=ttl_s, direct=True, msg_ttl=True)


_Asked = tuple[list[Item], int, "Item | None", list[str], int]


def _appended(asked: _Asked, items: list[Item], n: int, turns: list[str], t: int) -> bool:
    """Whether ``items`` and ``turns`` were only appended to since a write was last asked with them: the same
    lists, as long or longer, the last item then still in its place."""
    was, m, last, was_turns, u = asked
    return items is was and turns is was_turns and n >= m and t >= u and (not m or items[m - 1] is last)


class _Chain:
    """Where the parts stored so far end: the chain they share, the last part's number and turn, and the items and
    turns before it and up to its end (the next turn's part starts there; the same turn's replaces it)."""

    __slots__ = ("chain", "part", "turn", "start", "end", "turns_start", "turns_end")

    def __init__(self) -> None:
        self.chain = secrets.token_hex(6)
        self.part = self.turn = self.start = self.end = self.turns_start = self.turns_end = 0


class Checkpointer:
    """One rollout's checkpoints under its key, a part per turn: written in the background, read once by a
    redelivered attempt, deleted with the row (``remove``). A write is the bus's own stored publish to the part's
    subject (nats-py's KV put costs a request machinery and a bucket lookup per rollout)."""

    __slots__ = (
        "_bus",
        "key",
        "mode",
        "_stream",
        "_pending",
        "written",
        "stored",
        "_ok",
        "_chain",
        "_asked",
        "extent",
        "_whole",
        "_response",
        "_headers",
    )

    def __init__(self, bus: Bus, key: str, mode: Mode, keep_s: float = 0.0) -> None:
        self._bus = bus
        # kept for branching (``RolloutTask.keep_checkpoints_s``): each part lives ``keep_s`` from its write (the
        # server's per-message TTL), and the row does not delete it
        self._headers = {TTL_HEADER: f"{max(1, math.ceil(keep_s))}s"} if keep_s > 0 else {}
        self.key = key
        self.mode = mode
        self._stream = kv_stream(bus.subjects.checkpoints_bucket)
        self._pending: asyncio.Task[None] | None = None
        self.written = False  # a write was asked, or an earlier attempt's parts may be there (``remove``)
        self.stored = 0  # checkpoints the server acknowledged
        self._ok = True  # whether the last write was stored
        self._chain: _Chain | None = None  # the parts stored so far (None: the next write is part 1)
        # the items and turns lists the last write was asked with, their lengths and last item (appended only?)
        self._asked: _Asked | None = None
        self.extent = 0  # the highest part written or seen (``remove`` deletes parts 1 to it)
        self._whole = False  # a whole checkpoint under the key itself, the previous version's, was read
        # the last generation the last write held, its usage then and its response encoded (the turn's next write
        # holds the same: encoded once)
        self._response: tuple[Response, Any, bytes] | None = None

    def _subject(self, part: int) -> str:
        names = self._bus.subjects
        return kv_key(names.checkpoints_bucket, names.checkpoint_part(self.key, part) if part else self.key)

    def due(self, turn: int, elapsed_s: float) -> bool:
        """Whether a checkpoint is written at model turn ``turn``, ``elapsed_s`` into the rollout."""
        if self.mode == "every_turn":
            return True
        return self.mode == "auto" and (turn >= AUTO_TURNS or elapsed_s >= AUTO_S)

    def write(
        self,
        cp: Checkpoint,
        items: list[Item],
        turns: list[str],
        last: Response | None = None,
        kept: Awaitable[HeldSandboxes | None] | None = None,
    ) -> None:
        """Put ``cp`` with the trajectory's ``items`` and the ledger's ``turns`` so far, in the background, after
        the write before it (so the last one asked is the one kept): only what was added since the last write
        stored is sent (``cp``'s own items and turns are left empty: ``holding``). ``last``: the generation
        ``cp.response`` was made of (the same as the last write's, with the same usage: not encoded again).
        ``kept``: the copies of the agent's own sandboxes being made for branching (``sandboxes.kept``), put in
        ``cp.kept`` once made: this write (and those after it) waits for them."""
        response = self._encoded(cp.response, last)
        head = _encoder.encode(msgspec.structs.replace(cp, response=_APART))  # now: its cost and handles change
        n, t = len(items), len(turns)
        asked, self._asked = self._asked, (items, n, items[n - 1] if n else None, turns, t)
        whole = asked is None or not _appended(asked, items, n, turns, t)  # else written whole again: part 1
        self.written = True
        put = self._put(self._pending, cp.turn, (head, response), items, n, turns, t, whole, kept)
        self._pending = asyncio.ensure_future(put)

    def _encoded(self, response: Response, last: Response | None) -> bytes:
        """``response`` encoded, or as the last write encoded it when made of the same generation ``last``."""
        was = self._response
        if last is not None and was is not None and was[0] is last and was[1] == response.usage:
            return was[2]
        body = _encoder.encode(response)
        usage = response.usage
        self._response = None if last is None else (last, usage and msgspec.structs.replace(usage), body)
        return body

    async def _put(
        self,
        before: asyncio.Task[None] | None,
        turn: int,
        head: tuple[bytes, bytes],
        items: list[Item],
        n: int,
        turns: list[str],
        t: int,
        whole: bool,
        kept: Awaitable[HeldSandboxes | None] | None = None,
    ) -> None:
        if before is not None:
            await before  # never raises (below)
        if kept is not None:  # the head as encoded when asked (its cost then), with the copies made since
            try:
                copies = await kept
            except Exception:  # noqa: BLE001 - no copies: the turn is kept without them (a branch there is refused)
                copies = None
            head = (_encoder.encode(msgspec.structs.replace(_checkpoint.decode(head[0]), kept=copies)), head[1])
        chain = self._chain
        if chain is None or whole:  # the first write, or the parts before it are not all stored: part 1
            chain, part, start, turns_start = _Chain(), 1, 0, 0
        elif turn != chain.turn:  # the next turn's part starts where the last part ends
            part, start, turns_start = chain.part + 1, chain.end, chain.turns_end
        else:  # the same turn's later write replaces its part
            part, start, turns_start = chain.part, chain.start, chain.turns_start
        body = _encoder.encode(
            CheckpointPart(
                rollout=self.key,
                chain=chain.chain,
                start=start,
                items=items[start:n],
                turns_start=turns_start,
                turns=turns[turns_start:t],
                head=head[0],
                response=head[1],
            )
        )
        self.extent = max(self.extent, part)
        try:
            await self._bus.store(self._subject(part), body, self._headers)
        except Exception as e:  # noqa: BLE001 - a checkpoint not stored costs a resume, never the rollout
            self._ok, self._chain = False, None  # the next write starts a new chain: part 1, whole
            self._bus.warn_limited("checkpoint.not_stored", f"{type(e).__name__}: {e}", subject=self.key)
            return
        chain.part, chain.turn, chain.start, chain.end = part, turn, start, n
        chain.turns_start, chain.turns_end = turns_start, t
        self._chain, self._ok = chain, True
        self.stored += 1

    async def settled(self) -> bool:
        """Wait for the writes asked so far; whether the last one was stored."""
        if self._pending is not None:
            await self._pending
        return self._ok

    async def _get(self, part: int) -> bytes | None:
        """Part ``part``'s stored bytes (0: the key itself), by a last-by-subject direct get (None: none there)."""
        stored: Delivery | None = await self._bus.last_stored(self._stream, self._subject(part))
        if stored is None or not stored.data or (stored.headers or {}).get(KV_OPERATION) in _GONE:
            return None
        return stored.data

    async def at_turn(self, turn: int) -> Checkpoint | None:
        """The checkpoint stored at model turn ``turn`` with its calls answered, where its parts are still kept
        (a branch point: ``rollout.branch``); None: none such (never kept, expired, or a turn without calls)."""
        try:
            return await self._read(turn)
        except Exception as e:  # noqa: BLE001 - no such checkpoint: said as the branch's own error
            log.warning("checkpoint.unreadable", key=self.key, error=str(e))
            return None

    async def read(self) -> Checkpoint | None:
        """The checkpoint stored under the key (None: none, or one that cannot be read: the rollout starts over):
        once per redelivered attempt, its parts in order by last-by-subject direct gets of their keys, the one read
        of the bucket the pool's credential allows; the last good turn where a part does not follow the one before.
        With replicas, a follower may answer (as for any direct get): one behind its leader by more than the time
        from the last write to this read would answer the checkpoint before it."""
        try:
            return await self._read()
        except Exception as e:  # noqa: BLE001 - no checkpoint to read: the attempt starts over, as without one
            log.warning("checkpoint.unreadable", key=self.key, error=str(e))
            return None

    async def _read(self, turn: int | None = None) -> Checkpoint | None:
        items: list[Item] = []
        turns: list[str] = []
        heads: list[tuple[CheckpointPart, int, int]] = []  # each good part, and the items and turns up to its end
        last: CheckpointPart | None = None
        part = 0
        while (raw := await self._get(part + 1)) is not None:
            part += 1
            self.extent = max(self.extent, part)  # seen: deleted with the row
            if len(heads) < part - 1:
                continue  # past the last good part: only counted
            if (p := self._follows(raw, part, last, len(items), len(turns))) is None:
                continue
            items.extend(p.items)
            turns.extend(p.turns)
            heads.append((p, len(items), len(turns)))
            last = p
        if part == 0:
            return None if turn is not None else self._read_whole(await self._get(0))
        self.written = True  # parts to delete with the row
        for p, n, t in reversed(heads):  # the last good part whose head reads (each names its turn)
            try:
                cp = _checkpoint.decode(p.head)
                cp.response = _response.decode(p.response)
            except _UNREADABLE as e:
                log.warning("checkpoint.unreadable", key=self.key, error=str(e))
                continue
            if turn is not None:  # that turn's, its calls answered (a branch samples its next generation anew)
                if cp.turn != turn or cp.phase != "answered":
                    continue
                cp.generating = None
            if cp.last_from <= n:
                cp.response.output, cp.turns = items[:n], turns[:t]
                return cp
        return None

    def _follows(
        self, raw: bytes, part: int, before: CheckpointPart | None, items: int, turns: int
    ) -> CheckpointPart | None:
        """Part ``part`` decoded, if it follows the part ``before`` it: this rollout's, of the same chain, its items
        and turns starting where the parts before end (None: it ends the read)."""
        try:
            p = _part.decode(raw)
        except _UNREADABLE as e:
            log.warning("checkpoint.unreadable", key=self.key, part=part, error=str(e))
            return None
        chained = before is None or p.chain == before.chain
        if p.rollout != self.key or p.start != items or p.turns_start != turns or not chained:
            log.warning("checkpoint.part_skipped", key=self.key, part=part)
            return None
        return p

    def _read_whole(self, raw: bytes | None) -> Checkpoint | None:
        """A whole checkpoint under the key itself, as the previous version wrote one (None: none)."""
        if raw is None:
            return None
        try:
            cp = _checkpoint.decode(raw)
        except _UNREADABLE as e:
            log.warning("checkpoint.unreadable", key=self.key, error=str(e))
            return None
        self.written = self._whole = True  # a key to delete with the row
        return cp

    async def remove(self) -> None:
        """Delete the rollout's checkpoint, every part of it (its row or failure row is stored, or its batch
        cancelled): after any write still in flight, so none lands after it; sent, not acknowledged (the TTL is
        the backstop). An earlier attempt's parts, never read, are counted first."""
        if not self.written:
            return
        await self.settled()
        if not self.extent and not self._whole:
            await self.read()
        try:
            for part in range(0 if self._whole else 1, self.extent + 1):
                await self._bus.publish_raw(self._subject(part), b"", headers=_DELETE)
        except Exception as e:  # noqa: BLE001 - the bucket's TTL removes it later
            self._bus.warn_limited("checkpoint.not_deleted", f"{type(e).__name__}: {e}", subject=self.key)
        self.written = False
