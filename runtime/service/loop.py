"""The event loop every command runs its async work on: asyncio, with uvloop where it is installed.

Its own module so that a command (``status``, ``purge``) or ``ops`` can take it without importing the
workers that ``runner`` composes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio

T = TypeVar("T")


def run_async(fn: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine function on asyncio, with uvloop where it is installed (faster I/O)."""
    try:
        import uvloop  # noqa: F401

        use_uvloop = True
    except ImportError:
        use_uvloop = False
    return anyio.run(fn, backend="asyncio", backend_options={"use_uvloop": use_uvloop})
