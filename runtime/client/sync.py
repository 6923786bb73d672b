"""The trainer's client from synchronous code: ``SyncClient`` runs a ``Client`` on an event loop of its own.

For trainers that are not async (TRL's rollout function, a notebook): every method blocks until
the ``Client``'s coroutine is done, and a batch iterates row by row as rows land.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Iterator
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import Any

from anyio.from_thread import BlockingPortal, start_blocking_portal

from gym_runtime.client import BatchHandle, Client
from gym_runtime.config import ResolvedConfig

__all__ = ["SyncBatch", "SyncClient"]


class SyncBatch:
    """``BatchHandle`` for synchronous code: iterate rows, ``groups()``, ``gather()``, ``cancel()``."""

    def __init__(self, portal: BlockingPortal, handle: BatchHandle) -> None:
        self._portal = portal
        self.handle = handle
        self.batch = handle.batch

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while True:
            try:
                yield self._portal.call(self.handle.__anext__)
            except StopAsyncIteration:
                return

    def groups(self) -> Iterator[list[dict[str, Any]]]:
        agen = self.handle.groups()
        while True:
            try:
                yield self._portal.call(agen.__anext__)
            except StopAsyncIteration:
                return

    def gather(self) -> list[dict[str, Any]]:
        return self._portal.call(self.handle.gather)

    def cancel(self) -> None:
        self._portal.call(self.handle.cancel)

    def consumed(self, n: int) -> None:
        self._portal.call(self.handle.consumed, n)


class SyncClient:
    """``Client`` for synchronous trainers: same arguments; use ``with SyncClient(config) as client``."""

    def __init__(self, config: ResolvedConfig | str | Path, **kwargs: Any) -> None:
        self._portal_cm = start_blocking_portal(backend="asyncio")
        self._portal = self._portal_cm.__enter__()
        try:  # a config error too: the portal's thread must end, or the interpreter waits for it at exit
            self.client = Client(config, **kwargs)
            self._cm = self._portal.wrap_async_context_manager(self.client)
            self._cm.__enter__()
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise

    def submit(self, rows: Iterable[dict[str, Any]], **kwargs: Any) -> SyncBatch:
        rows = list(rows)
        return SyncBatch(self._portal, self._portal.call(partial(self.client.submit, rows, **kwargs)))

    def branch(self, row: dict[str, Any], **kwargs: Any) -> SyncBatch:
        return SyncBatch(self._portal, self._portal.call(partial(self.client.branch, row, **kwargs)))

    def run(self, row: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        return self._portal.call(partial(self.client.run, row, **kwargs))

    def set_policy_version(self, version: int, **kwargs: Any) -> None:
        self._portal.call(partial(self.client.set_policy_version, version, **kwargs))

    def pause(self, **kwargs: Any) -> int:
        return self._portal.call(partial(self.client.pause, **kwargs))

    def resume(self, **kwargs: Any) -> None:
        self._portal.call(partial(self.client.resume, **kwargs))

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Future[Any]:
        """Run ``fn(*args)`` on the client's event loop, in the background (a producer that keeps submitting, such
        as an asynchronous trainer's rollout worker); its result or error comes through the returned future."""
        return self._portal.start_task_soon(fn, *args)

    @property
    def policy_version(self) -> int | None:
        return self.client.policy_version

    def close(self) -> None:
        try:
            self._cm.__exit__(None, None, None)
        finally:
            self._portal_cm.__exit__(None, None, None)

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
