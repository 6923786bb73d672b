"""A session's tool replies by call id: no tool call runs twice.

A rollout resumed at its last turn replays that turn's tool calls under the ids they had (``ToolCall.id``: the
same on every attempt of the turn). The session answers an id it answered before with that first reply, and one
still running (the dead attempt's, in flight) with its reply once it ends: it is never run again. Bounded per
session (the oldest forgotten first): a turn's calls are replayed only by the next attempt, right after. A sandbox
worker keeps one per sandbox for the execs a rollout's agent runs under its tool calls' ids (``SandboxCall.id``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

REPLIES_PER_SESSION = 64
R = TypeVar("R")


class ToolReplies(Generic[R]):
    __slots__ = ("_done", "_running")

    def __init__(self) -> None:
        self._done: dict[str, R] = {}
        self._running: dict[str, asyncio.Event] = {}

    async def once(self, call_id: str, run: Callable[[], Awaitable[R]]) -> R:
        """The reply to ``call_id``: the first one given, else the one still running's, else ``run``'s (a call
        that raised is not recorded: it may be asked again)."""
        while True:
            done = self._done.get(call_id)
            if done is not None:
                return done
            running = self._running.get(call_id)
            if running is None:
                break
            await running.wait()  # the first one's reply, once it ends (or, if it raised, run it now)
        self._running[call_id] = ended = asyncio.Event()  # asyncio's: anyio's costs a backend lookup
        try:
            reply = await run()
            self._done[call_id] = reply
            while len(self._done) > REPLIES_PER_SESSION:
                del self._done[next(iter(self._done))]
            return reply
        finally:
            del self._running[call_id]
            ended.set()
