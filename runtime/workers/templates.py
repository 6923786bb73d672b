"""Set up once for the group (``resources.NAME.seed_once``): one seeded session per task, its state and sandboxes
the template every repeat of the task starts from.

The first repeat of a task to reach a worker seeds a session of its own kind (the *template*, never handed to a
rollout), takes its ``snapshot`` and keeps its sandboxes; every repeat (that one too) then gets a fresh session
set back to that snapshot (``restore``) holding forks of those sandboxes. Repeats that arrive while it seeds wait
for it (at most ``WAIT_S``); a seed that fails fails them with its own class, and is forgotten, so a retried
attempt seeds again. A template no repeat took for ``idle_s`` is closed (its session and sandboxes), as is every
template when its worker stops: nothing is left behind. A task is its batch and index (the rollout key less its
repeat), its row less the repeat's index, and the caller: two pools never share one.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import anyio
import msgspec

from gym_runtime.errors import Failure

T = TypeVar("T")

WAIT_S = 1800.0  # the longest a repeat waits for its task's seed (a set-up of many minutes, on a loaded node)
FORK_WAIT_S = 600.0  # the longest a repeat waits for room on the worker that holds its template's sandbox
FORK_BACKOFF_S = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0)  # waits (jittered) between its forks while that worker is full
REPEAT_FIELD = "_ng_rollout_index"  # the one field of a row that tells its task's repeats apart


def task_key(caller: str, rollout: str, row: dict[str, Any]) -> str | None:
    """The task a seed is for, as templates are kept; None: a session of no rollout of a batch (seeded alone)."""
    head, sep, _ = rollout.rpartition(":")
    if not sep or not head:
        return None
    task = {k: v for k, v in row.items() if k != REPEAT_FIELD}
    digest = hashlib.blake2b(msgspec.json.encode([caller, head, task], order="sorted"), digest_size=16)
    return digest.hexdigest()


class Template(Generic[T]):
    """One task's seeded session and its snapshot, once ready; or the failure of its seed."""

    __slots__ = ("ready", "session", "snapshot", "failure", "used", "busy")

    def __init__(self) -> None:
        self.ready = anyio.Event()
        self.session: T | None = None
        self.snapshot = b""
        self.failure: Failure | None = None
        self.used = time.monotonic()
        self.busy = 0  # repeats forking from it now: not closed under them


class Templates(Generic[T]):
    """A worker's templates by task (``task_key``)."""

    def __init__(self, idle_s: float, wait_s: float = WAIT_S) -> None:
        self.idle_s, self.wait_s = idle_s, wait_s
        self._by_key: dict[str, Template[T]] = {}
        self.seeds = 0  # templates seeded here (status, tests)

    def __len__(self) -> int:
        return len(self._by_key)

    async def use(
        self,
        key: str,
        make: Callable[[], Awaitable[tuple[T, bytes]]],
        start: Callable[[Template[T]], Awaitable[Any]],
    ) -> Any:
        """``start(template)`` for the task ``key``, seeding its template first (``make``) where there is none."""
        tpl = self._by_key.get(key)
        if tpl is None:
            tpl = self._by_key[key] = Template()
            await self._seed(key, tpl, make)
        elif not tpl.ready.is_set():
            with anyio.move_on_after(self.wait_s):
                await tpl.ready.wait()
            if not tpl.ready.is_set():
                raise Failure(
                    "tool_error",
                    f"the task's seed (run once for its group: seed_once) took over {self.wait_s:g} s",
                    retryable=True,
                )
        if tpl.failure is not None:
            f = tpl.failure
            raise Failure(f.info.error_class, f.info.message, retryable=f.info.retryable)
        tpl.busy += 1
        try:
            return await start(tpl)
        finally:
            tpl.busy -= 1
            tpl.used = time.monotonic()

    async def _seed(self, key: str, tpl: Template[T], make: Callable[[], Awaitable[tuple[T, bytes]]]) -> None:
        try:
            tpl.session, tpl.snapshot = await make()
            self.seeds += 1
        except Failure as e:
            tpl.failure = e
            raise
        except BaseException as e:  # cancelled (its worker stopping): the repeats waiting are given back
            tpl.failure = Failure("worker_lost", f"the task's seed (seed_once) did not end: {e!r}", retryable=True)
            raise
        finally:
            tpl.ready.set()
            if tpl.failure is not None and self._by_key.get(key) is tpl:
                del self._by_key[key]  # a retried attempt seeds again

    def idle(self, now: float | None = None) -> list[T]:
        """Remove and return the sessions of the templates no repeat took for ``idle_s``."""
        cutoff = (time.monotonic() if now is None else now) - self.idle_s
        out = []
        for key, tpl in list(self._by_key.items()):
            if tpl.ready.is_set() and not tpl.busy and tpl.used < cutoff:
                del self._by_key[key]
                if tpl.session is not None:
                    out.append(tpl.session)
        return out

    def pop_all(self) -> list[T]:
        out = [t.session for t in self._by_key.values() if t.session is not None]
        self._by_key.clear()
        return out


async def fork_for(box: Any, into: Any, wait_s: float = FORK_WAIT_S) -> list[Any]:
    """A repeat's fork of a template's sandbox ``box`` into its lease ``into`` (a ``Sandboxes``). A worker with no
    room refuses a fork at once (``sandbox_unavailable``): a repeat waits for room instead, as a create waits for a
    lease (its rollout's clock stopped meanwhile, ``on_acquire``), at most ``wait_s``."""
    started, tries = time.monotonic(), 0
    if into.on_acquire is not None:
        into.on_acquire(None)
    try:
        while True:
            try:
                forked: list[Any] = await box.fork(1, into=[into])
                return forked
            except Failure as e:
                if e.info.error_class != "sandbox_unavailable" or time.monotonic() - started > wait_s:
                    raise
            await anyio.sleep(FORK_BACKOFF_S[min(tries, len(FORK_BACKOFF_S) - 1)] * random.uniform(0.5, 1.5))
            tries += 1
    finally:
        if into.on_acquire is not None:
            into.on_acquire(time.monotonic() - started)
