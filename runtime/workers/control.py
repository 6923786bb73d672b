"""Trainer control on the bus: policy versions, pause/resume of a model, batch cancel.

State lives in one KV bucket (``Subjects.control_bucket``, so a worker that starts later reads it) and
changes are announced on control subjects (so running workers learn them at once):

* ``Subjects.policy_version`` — ``PolicyVersion``; KV key ``version_key``;
* ``Subjects.pause|resume`` — ``PauseModel`` (every live replica answers ``PauseAck`` into the caller's
  ``model.{model}`` lane once it holds new calls and has none in flight) / ``ResumeModel``; KV key
  ``paused_key``;
* ``Subjects.cancel`` — ``CancelBatch``; KV key ``cancelled_key``.

Fingerprints are the config's (``config/fingerprints.py``, computed once by ``resolve_config``; compared with
those live workers announce by ``ResolvedConfig.mismatches``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import anyio
from anyio.abc import TaskGroup

from gym_runtime.messages import CancelBatch, PauseModel, PolicyVersion, ResumeModel
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.headers import CONTROL, sent_as_control
from gym_runtime.transport.interface import KeyValue
from gym_runtime.transport.subjects import Subjects

_CACHE_LIMIT = 10_000


async def control_kv(bus: Bus) -> KeyValue:
    return await bus.kv(bus.subjects.control_bucket)


class ControlView:
    """A worker's cached view of control state: KV read once per key, then kept by announcements."""

    def __init__(self, bus: Bus, *, on_cancel: Callable[[str], None] | None = None) -> None:
        self.bus = bus
        self._on_cancelled = on_cancel  # told each batch cancelled while this worker runs (its running rollouts stop)
        self._kv: KeyValue | None = None
        self._versions: dict[str, int] = {}
        self._read: set[str] = set()  # models whose KV version was read (set or not)
        self._cancelled: set[str] = set()
        self._checked: set[str] = set()  # batches whose KV record was read (not cancelled then)

    async def start(self, tg: TaskGroup) -> None:
        """Listen to version announcements and batch cancels (before any KV read: no gap)."""
        self._kv = await control_kv(self.bus)
        await self.bus.serve(tg, self.bus.subjects.policy_version("*"), self._on_version, concurrency=16)
        await self.bus.serve(tg, self.bus.subjects.cancel("*"), self._on_cancel, concurrency=16)
        await self.bus.flush()

    # An announcement says only where to look: what it announces is read from the KV bucket, which the trainer
    # writes first. A core message is one a server's answer can be sent into (a direct get whose reply names
    # this subject, its body the requester's own), while the bucket takes no such answer (``ops.permissions``'
    # accounts): so a forged announcement cancels no batch and sets no version. A cancel is also taken only as
    # sent (``sent_as_control``).

    async def _on_version(self, msg: Any, _: Any) -> None:
        if isinstance(msg, PolicyVersion):
            await self.refresh_version(msg.model)

    async def refresh_version(self, model: str) -> None:
        """Read ``model``'s version from the bucket now. An announcement says to; so does a resume: the trainer
        writes the version before it resumes, and the announcement may still be being read (its own task)."""
        if self._kv is None:
            return
        raw = await self._kv.get(Subjects.version_key(model))
        if raw is not None and raw.isdigit():
            self._versions[model] = max(int(raw), self._versions.get(model, 0))
        else:  # not there (yet: a replica behind the leader): read it again when next asked
            self._read.discard(model)

    async def _on_cancel(self, msg: Any, delivery: Any) -> None:
        if not sent_as_control(delivery.headers):  # a server's answer borrowed into the subject: not a cancel
            self.bus.warn_limited("control.refused", "not sent as a control message", subject=delivery.subject)
            return
        if isinstance(msg, CancelBatch) and self._kv is not None:
            if await self._kv.get(Subjects.cancelled_key(msg.batch)) is not None:
                self._cancelled.add(msg.batch)
                if self._on_cancelled is not None:
                    self._on_cancelled(msg.batch)
            else:  # not there (yet: a replica behind the leader): read it again when next asked
                self._checked.discard(msg.batch)

    async def version(self, model: str) -> int | None:
        """The current policy version of ``model`` (None: the trainer never set one)."""
        if model not in self._read and self._kv is not None:
            self._read.add(model)  # once: later changes arrive as announcements
            raw = await self._kv.get(Subjects.version_key(model))
            if raw is not None:
                self._versions[model] = max(int(raw), self._versions.get(model, 0))
        return self._versions.get(model)

    def known_cancelled(self, batch: str) -> bool:
        """Whether a cancel of ``batch`` has arrived (no read: for a rollout that just started)."""
        return batch in self._cancelled

    async def is_cancelled(self, batch: str) -> bool:
        if batch in self._cancelled:
            return True
        if batch not in self._checked and self._kv is not None:
            if len(self._checked) > _CACHE_LIMIT:
                self._checked.clear()
            self._checked.add(batch)
            if await self._kv.get(Subjects.cancelled_key(batch)) is not None:
                self._cancelled.add(batch)
        return batch in self._cancelled

    async def failed_attempts(self, key: str) -> int:
        """How many attempts of a rollout failed by its own doing (retryable errors); 0 when none did."""
        raw = await self._kv.get(key) if self._kv is not None else None
        return int(raw) if raw and raw.isdigit() else 0

    async def count_failed(self, key: str, failed: int) -> None:
        """Record ``failed`` attempts of a rollout before it is nak'd (0: it is done, the record goes)."""
        if self._kv is None:
            return
        if failed:
            await self._kv.put(key, str(failed).encode())
        else:
            await self._kv.delete(key)

    async def paused(self, model: str) -> bool:
        """Whether ``model`` was left paused (a replica starting mid-pause holds its calls too)."""
        if self._kv is None:
            return False
        return await self._kv.get(Subjects.paused_key(model)) == b"1"


class Flight:
    """One model call running on a replica: how a pause stops it and why (``mode``, set by the pause that
    stopped it). An adapter that can return what it generated so far waits on ``stop``; one that cannot is
    cancelled: its call's ``task`` (set only while that kind of adapter runs) gets a cancel of its own,
    which the call takes back (``uncancel``) and tells from any other by ``cancelled``. A model call builds
    neither an Event nor a cancel scope otherwise."""

    __slots__ = ("_stop", "task", "cancelled", "mode")

    def __init__(self) -> None:
        self._stop: anyio.Event | None = None
        self.task: asyncio.Task[Any] | None = None
        self.cancelled = False
        self.mode: str | None = None

    @property
    def stop(self) -> anyio.Event:
        if self._stop is None:
            self._stop = anyio.Event()
            if self.mode is not None:
                self._stop.set()
        return self._stop

    @property
    def stopped(self) -> bool:
        return self.mode is not None

    def halt(self, mode: str, *, cancel: bool) -> None:
        self.mode = mode
        if self._stop is not None:
            self._stop.set()
        if cancel and self.task is not None and not self.cancelled:
            self.cancelled = True
            self.task.cancel()


class Pausable:
    """A gate for model calls: ``pause()`` holds new calls and returns when none is in flight.

    ``pause("drain")`` waits for the calls in flight; ``"interrupt"`` sets their ``stop`` (an adapter
    that cannot stop cleanly is waited for, as in a drain); ``"abort"`` sets ``stop`` and cancels them."""

    def __init__(self) -> None:
        self._open = anyio.Event()
        self._open.set()
        self._is_open = True  # ``_open``'s state, read per call without the Event's two calls
        self._idle: anyio.Event | None = None  # made by a pause that waits for the calls in flight
        self.flights: set[Flight] = set()
        self.held = 0

    @property
    def active(self) -> int:
        return len(self.flights)

    @property
    def is_open(self) -> bool:
        """Not paused: a call entering now runs at once."""
        return self._is_open

    async def enter(self) -> Flight:
        if not self._is_open:
            self.held += 1
            try:
                await self._open.wait()
            finally:
                self.held -= 1
        flight = Flight()
        self.flights.add(flight)
        return flight

    def exit(self, flight: Flight) -> None:
        self.flights.discard(flight)
        if not self.flights and self._idle is not None:
            self._idle.set()
            self._idle = None

    async def pause(self, mode: str = "drain", *, cancel: bool = False) -> int:
        """Close the gate; stop the calls in flight unless draining (``cancel``: cancel them too, for an
        adapter that cannot stop by itself); return how many were stopped once none is in flight."""
        if self._is_open:
            self._open = anyio.Event()
            self._is_open = False
        stopped = 0
        if mode != "drain":
            for f in self.flights:
                f.halt(mode, cancel=cancel)
                stopped += 1
        if self.flights:
            if self._idle is None:
                self._idle = anyio.Event()
            await self._idle.wait()
        return stopped

    def resume(self) -> None:
        self._is_open = True
        self._open.set()


# ---------------------------------------------------------------------------------- trainer side


async def publish_version(bus: Bus, model: str, version: int) -> None:
    kv = await control_kv(bus)
    await kv.put(Subjects.version_key(model), str(version).encode())
    await bus.publish(bus.subjects.policy_version(model), PolicyVersion(model=model, version=version))
    await bus.flush()


async def read_version(bus: Bus, model: str) -> int | None:
    raw = await (await control_kv(bus)).get(Subjects.version_key(model))
    return int(raw) if raw is not None else None


async def cancel_batch(bus: Bus, batch: str) -> None:
    kv = await control_kv(bus)
    await kv.put(Subjects.cancelled_key(batch), b"1")
    await bus.publish(bus.subjects.cancel(batch), CancelBatch(batch=batch), headers=CONTROL)
    await bus.flush()


async def set_paused(bus: Bus, model: str, paused: bool) -> None:
    kv = await control_kv(bus)
    await kv.put(Subjects.paused_key(model), b"1" if paused else b"0")


async def send_pause(bus: Bus, model: str, workers: set[str], *, timeout: float, mode: str = "drain") -> list[Any]:
    """Ask every replica of ``model`` to pause (``mode``: see ``PauseModel``); returns the acks (by worker)."""

    def done(replies: list[Any]) -> bool:
        return workers <= {getattr(r, "worker", None) for r in replies}

    pause = PauseModel(model=model, mode=mode)
    return await bus.gather(bus.subjects.pause(model), pause, done=done, timeout=timeout, headers=CONTROL)


async def send_resume(bus: Bus, model: str) -> None:
    await bus.publish(bus.subjects.resume(model), ResumeModel(model=model), headers=CONTROL)
    await bus.flush()
