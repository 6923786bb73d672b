"""The event loop every command runs its async work on: asyncio, with uvloop where it is installed.

Its own module so that a command (``status``, ``purge``) or ``ops`` can take it without importing the
workers that ``runner`` composes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

T = TypeVar("T")


def run_async(fn: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine function on asyncio, with uvloop where it is installed (faster I/O)."""
    try:
        import uvloop  # noqa: F401

        use_uvloop = True
    except ImportError:
        use_uvloop = False

    async def quietly() -> T:
        asyncio.get_running_loop().set_exception_handler(_unless_cancelled)
        return await fn()

    return anyio.run(quietly, backend="asyncio", backend_options={"use_uvloop": use_uvloop})


def _unless_cancelled(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The loop's report of an exception nobody retrieved, unless it is a cancellation: a library's gather cancelled
    from outside (``asyncio.wait_for`` does not read it) is no error, and its traceback after a good run reads as
    a crash. Everything else is reported as asyncio does."""
    if isinstance(context.get("exception"), asyncio.CancelledError) and "never retrieved" in context.get("message", ""):
        return
    loop.default_exception_handler(context)
