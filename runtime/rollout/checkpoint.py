"""A rollout's checkpoint: when one is written, where it is kept, and how a redelivered attempt reads it back.

A long rollout whose agent worker dies resumes at its last turn instead of starting over
(docs/operations.md#resume-at-the-last-turn). Its checkpoint is kept in a JetStream KV bucket
(``Subjects.checkpoints_bucket``), not in the attempts stream: one key per rollout, replaced as it goes (history
1: the server keeps only the last), deleted with its row in one call, and aged out by the bucket's TTL
(``jetstream.checkpoint_ttl_s``) where nothing deleted it. The attempts stream is append-only: a record per turn
would grow it by every turn of every long rollout, and a resume would read back only the last one anyway.

A write is off the critical path: it is put while the rollout goes on (the next write, and the attempt's end,
wait for it); only the tool calls of a turn wait for that turn's checkpoint to be stored, so a resume replays
the calls the model made, never samples new ones. A resume reads only what the server stored, and only its own
pool's: a key starts with its agent pool's name (``Subjects.checkpoint_key``) and each pool may read its own keys
only, each by a last-by-subject direct get (a checkpoint names its sessions and sandboxes). The delete that
goes with the row is sent without waiting for the server's ack, as the task's own ack right after it is (one
round trip a rollout less; a delete the server never got, e.g. one sent during a leader election, is the TTL's
to age out, and a read right after it may still see the key).
"""

from __future__ import annotations

import asyncio
from typing import Literal

import msgspec

from gym_runtime.messages import Checkpoint, GenerationProgress, SandboxHandle, SessionHandle
from gym_runtime.observability import logs
from gym_runtime.rollout.ledger import Ledger, TrajectoryState
from gym_runtime.transport.bus import Bus
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
_encoder, _decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(Checkpoint)
KV_OPERATION, DELETE = "KV-Operation", "DEL"  # a KV key's delete marker, as nats-py's KV writes it (its get: None)
_GONE = (DELETE, "PURGE")
_DELETE = {KV_OPERATION: DELETE}


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
    """What a checkpoint holds: the trajectory so far (in a failure row's shape), where its last generation starts,
    the ledger's cost, turns and policy versions, the clock so far, and the handles of its sessions and sandboxes;
    ``generating``: the next turn's generation so far (its turn answered, that generation still running)."""
    last = traj.last
    assert last is not None
    partial = msgspec.structs.replace(last, output=list(traj.outputs), usage=traj.usage)
    partial.status = "incomplete"  # the shape of a failure row's partial trajectory
    return Checkpoint(
        turn=turn,
        phase="generated" if phase == "generated" and generating is None else "answered",
        response=partial,
        last_status=last.status,
        last_from=traj.last_from,
        cost=ledger.cost,
        turns=ledger.turns,
        policy_versions=ledger.policy_versions,
        elapsed_s=max(0.0, elapsed_s),
        sessions=sessions,
        sandboxes=sandboxes,
        generating=generating,
    )


async def checkpoints_kv(bus: Bus, ttl_s: float) -> KeyValue:
    """The checkpoints bucket, made on first use with its TTL and direct gets (a secured server's: by
    ``provision``): an agent worker makes sure of it once, as it starts; its rollouts then write their keys as
    stored publishes, and read them back by direct gets."""
    return await bus.kv(bus.subjects.checkpoints_bucket, ttl_s=ttl_s, direct=True)


class Checkpointer:
    """One rollout's checkpoints under its key: written in the background, read once by a redelivered
    attempt, deleted with the row (``remove``). A write is the bus's own stored publish to the key's subject
    (nats-py's KV put costs a request machinery and a bucket lookup per rollout)."""

    __slots__ = ("_bus", "key", "mode", "_stream", "_subject", "_pending", "written", "stored", "_ok")

    def __init__(self, bus: Bus, key: str, mode: Mode) -> None:
        self._bus = bus
        self.key = key
        self.mode = mode
        bucket = bus.subjects.checkpoints_bucket
        self._stream, self._subject = kv_stream(bucket), kv_key(bucket, key)
        self._pending: asyncio.Task[None] | None = None
        self.written = False  # a write was asked (so the key may exist: ``remove`` deletes it)
        self.stored = 0  # checkpoints the server acknowledged
        self._ok = True  # whether the last write was stored

    def due(self, turn: int, elapsed_s: float) -> bool:
        """Whether a checkpoint is written at model turn ``turn``, ``elapsed_s`` into the rollout."""
        if self.mode == "every_turn":
            return True
        return self.mode == "auto" and (turn >= AUTO_TURNS or elapsed_s >= AUTO_S)

    def write(self, cp: Checkpoint) -> None:
        """Put ``cp`` in the background, after the write before it (so the last one asked is the one kept)."""
        body = _encoder.encode(cp)
        self.written = True
        self._pending = asyncio.ensure_future(self._put(self._pending, body))

    async def _put(self, before: asyncio.Task[None] | None, body: bytes) -> None:
        if before is not None:
            await before  # never raises (below)
        try:
            await self._bus.store(self._subject, body, {})
        except Exception as e:  # noqa: BLE001 - a checkpoint not stored costs a resume, never the rollout
            self._ok = False
            self._bus.warn_limited("checkpoint.not_stored", f"{type(e).__name__}: {e}", subject=self.key)
            return
        self._ok = True
        self.stored += 1

    async def settled(self) -> bool:
        """Wait for the writes asked so far; whether the last one was stored."""
        if self._pending is not None:
            await self._pending
        return self._ok

    async def read(self) -> Checkpoint | None:
        """The checkpoint stored under the key (None: none, or one that cannot be read: the rollout starts over):
        once per redelivered attempt, by a last-by-subject direct get of the key, the one read of the bucket the
        pool's credential allows. With replicas, a follower may answer (as for any direct get): one behind its
        leader by more than the time from the last write to this read would answer the checkpoint before it."""
        try:
            stored = await self._bus.last_stored(self._stream, self._subject)
        except Exception as e:  # noqa: BLE001 - no checkpoint to read: the attempt starts over, as without one
            log.warning("checkpoint.unreadable", key=self.key, error=str(e))
            return None
        if stored is None or not stored.data or (stored.headers or {}).get(KV_OPERATION) in _GONE:
            return None
        raw = stored.data
        try:
            cp = _decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            log.warning("checkpoint.unreadable", key=self.key, error=str(e))
            return None
        self.written = True  # a key to delete with the row
        return cp

    async def remove(self) -> None:
        """Delete the rollout's checkpoint (its row or failure row is stored, or its batch cancelled): after
        any write still in flight, so none lands after it; sent, not acknowledged (the TTL is the backstop)."""
        if not self.written:
            return
        await self.settled()
        try:
            await self._bus.publish_raw(self._subject, b"", headers=_DELETE)
        except Exception as e:  # noqa: BLE001 - the bucket's TTL removes it later
            self._bus.warn_limited("checkpoint.not_deleted", f"{type(e).__name__}: {e}", subject=self.key)
        self.written = False
