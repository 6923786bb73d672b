"""One environment session of a rollout, as the rollout holds it (``agent.Session`` is its face): where it lives,
what a checkpoint keeps of it (``handle``), and how a resumed attempt takes it up again (``resume``).

Nothing is sent when the session is opened: its first operation travels with the seed request to the
environment's queue group, and the reply names the worker that now owns the session; later operations go
straight to that worker, through the rollout's ``Port``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import anyio
import msgspec

from gym_runtime.errors import Failure
from gym_runtime.messages import (
    Cost,
    HeldSandboxes,
    RestoreSession,
    ResumeReply,
    ResumeSession,
    RowCheck,
    SeedReply,
    SeedRequest,
    SessionHandle,
    ToolCall,
    ToolReply,
)
from gym_runtime.rollout.ledger import Ledger
from gym_runtime.rollout.port import Port
from gym_runtime.transport.rpc import NoResponders, pauses_counted

ABSENT_BACKOFF_S = (0.1, 0.2, 0.5, 1.0, 2.0)  # waits between seeds while a resource has no worker
RESUME_S = 30.0  # a resume's question to the worker that held the session
RESTORE_TRIES = 3  # a restore whose seed a silent worker took is asked again (``restore``)
RESTORE_S = 300.0  # a restore (its sandboxes taken up, the environment set back), as long as a tool call may take


class SessionLink:
    """A session's state (its seed reply once opened, its last snapshot and the sandboxes held at it, closed or
    not) and the port its operations go through; its tool calls' time is booked in ``ledger`` (and ``also``: a
    group task's repeat's)."""

    __slots__ = (
        "port",
        "resource",
        "row",
        "indices",
        "check",
        "absent_grace_s",
        "rollout",
        "ledger",
        "also",
        "seed",
        "snapshot",
        "held",
        "kept",
        "keep_s",
        "closed",
        "_lock",
    )

    def __init__(
        self,
        port: Port,
        resource: str,
        row: dict[str, Any],
        *,
        absent_grace_s: float = 0.0,
        rollout: str = "",
        check: RowCheck | None = None,
        indices: dict[str, int] | None = None,
        ledger: Ledger | None = None,
        also: Cost | None = None,
        keep_s: float = 0.0,
    ) -> None:
        self.port = port
        self.resource = resource  # the environment's name (a checkpoint's handle of it)
        # The rollout's place (``_ng_task_index``, ``_ng_rollout_index``) on the rows the resource gets at seed
        # and verify where the row has none, as NeMo Gym's runner puts them on every row its agents forward:
        # a server that scores a task's repeats together (genrm_compare's cohorts) reads them there.
        self.indices = indices or {}
        self.row = {**self.indices, **row} if self.indices else row
        self.check = check  # the row is checked by the resource worker at seed time (RolloutTask.check)
        self.absent_grace_s = absent_grace_s
        self.rollout = rollout  # the rollout's key, sent with the seed: its sandboxes' lease is bound to it
        self.ledger = ledger
        self.also = also
        self.seed: SeedReply | None = None
        self.snapshot: bytes | None = None  # the environment's last snapshot (``Resource.snapshot``), if asked
        self.held: HeldSandboxes | None = None  # the session's sandboxes at that snapshot, and their lease
        # a rollout kept for branching (``keep_checkpoints_s``): its snapshots ask for copies of its sandboxes, kept
        # that long (``sandboxes.kept``), and the last ones made
        self.keep_s = keep_s
        self.kept: HeldSandboxes | None = None
        self.closed = False
        self._lock = asyncio.Lock()

    async def op(self, first: Any, kind: str, *, timeout: float, op: str) -> Any:
        """One operation: the seed's first while the session is not open yet, else straight to its worker."""
        if self.seed is None:
            async with self._lock:
                if self.seed is None:
                    reply = await self._first(first, timeout=timeout, op=op)
                    self.seed = reply
                    return reply.result
        seed = self.seed
        message = msgspec.structs.replace(first, session=seed.session)
        return await self.port.operate(seed.address, kind, message, timeout=timeout, op=op, by=seed.by)

    async def _first(self, first: Any, *, timeout: float, op: str) -> SeedReply:
        """The seed request; while no worker serves the resource at all (a pool restarting),
        wait with backoff up to ``absent_grace_s``: nothing was delivered, so asking again is safe
        and an absence is not a failed attempt."""
        give_up = time.monotonic() + self.absent_grace_s
        waits = 0
        while True:
            try:
                request = SeedRequest(row=self.row, then=first, check=self.check, rollout=self.rollout)
                return await self.port.seed(self.resource, request, timeout=timeout, op=op)
            except NoResponders:
                delay = ABSENT_BACKOFF_S[min(waits, len(ABSENT_BACKOFF_S) - 1)]
                if time.monotonic() + delay > give_up:
                    raise
                waits += 1
                await anyio.sleep(delay)

    async def tool(self, call: ToolCall, timeout: float, op: str) -> ToolReply:
        """A tool call or operation, its round trip booked (less its waits for a sandbox lease: the row's
        ``sandbox_wait_s``; waiting is not tool time)."""
        if call.snapshot and self.keep_s:
            call.keep_s = self.keep_s
        started = time.perf_counter()
        with pauses_counted() as paused:
            try:
                reply: ToolReply = await self.op(call, "tool", timeout=timeout, op=op)
            finally:
                if self.ledger is not None:
                    ms = round(1000 * (time.perf_counter() - started))
                    self.ledger.tool_call(started, max(0, ms - round(1000 * paused.total())), self.also)
        if call.snapshot and reply.snapshot is not None:
            self.snapshot, self.held, self.kept = reply.snapshot, reply.held, reply.kept
        return reply

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.seed is not None:  # else never opened on any worker
            await self.port.close(self.seed.address, self.seed.session)

    def handle(self) -> SessionHandle | None:
        """What a checkpoint keeps of this session (None: never opened on a worker)."""
        seed = self.seed
        if seed is None or self.closed:
            return None
        return SessionHandle(
            resource=self.resource,
            session=seed.session,
            address=seed.address,
            snapshot=self.snapshot,
            held=self.held,
            kept=self.kept,
        )

    async def resume(self, handle: SessionHandle) -> str:
        """Take up the session a checkpoint names: ``reattached`` (its worker still holds it), ``restored`` (a
        fresh session set back to the environment's snapshot), or ``restarted`` (a fresh session: the rollout
        starts over). Typed messages, each served by the resource worker's own handler (never a tool call)."""
        self.seed = SeedReply(session=handle.session, address=handle.address)
        try:
            alive: ResumeReply = await self.op(ResumeSession(session=""), "resume", timeout=RESUME_S, op="resume")
            if alive.ok:
                self.snapshot, self.held = handle.snapshot, handle.held
                return "reattached"
        except (NoResponders, Failure):  # its worker is gone, or no longer holds it
            pass
        self.seed = None
        if handle.snapshot is not None and (await self.restore(handle)).ok:
            return "restored"
        return "restarted"

    async def restore(self, handle: SessionHandle, branch_of: str = "") -> ResumeReply:
        """A fresh session of this rollout's (seeded with its row, bound to its key) set back to the snapshot
        ``handle`` names (a resume whose worker lost the session; a branch of the rollout ``branch_of``:
        ``rollout.branch``, holding forks of the sandboxes kept there, never the parent's own). Not ok: the session it
        opened is closed, and the next operation seeds a fresh one. A branch whose forks find no room in their pool
        raises ``sandbox_unavailable``."""
        if branch_of:
            ask = RestoreSession(session="", snapshot=handle.snapshot or b"", kept=handle.kept, branch_of=branch_of)
        else:
            ask = RestoreSession(session="", snapshot=handle.snapshot or b"", held=handle.held)
        for tries in range(1, RESTORE_TRIES + 1):
            try:
                restored: ResumeReply = await self.op(ask, "resume", timeout=RESTORE_S, op="restore")
                break
            except Failure as e:  # e.g. a worker of an older version, which knows no such message
                if branch_of and e.info.error_class in ("sandbox_unavailable", "invalid_task"):
                    raise  # a branch's forks found no room, or no copy: said as they are
                restored = ResumeReply(ok=False, reason=e.info.message)
                # a seed taken by a frozen worker (the one that held the session, until the server drops it) is
                # lost, not refused: the snapshot is still good, so ask again (another worker takes it)
                if e.info.error_class != "worker_lost" or tries == RESTORE_TRIES:
                    break
        if restored.ok:
            self.snapshot, self.held = handle.snapshot, None if branch_of else handle.held
            return restored
        await self.close()  # it could not be set back
        self.closed, self.seed = False, None
        return restored

    async def abandon(self, handle: SessionHandle) -> None:
        """Close the session a checkpoint names without taking it up (its rollout starts over): its worker
        need not keep it until its ``session_ttl_s``."""
        await self.port.close(handle.address, handle.session)
