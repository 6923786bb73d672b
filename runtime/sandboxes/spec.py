"""What a sandbox is asked to be (``SandboxSpec``) and what a backend can do (``Capabilities``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypedDict

import msgspec

from gym_runtime.messages import SandboxSpec

# SandboxSpec travels in SandboxCall: defined there
__all__ = ["Capabilities", "ExecResult", "OnOutput", "SandboxAsk", "SandboxSpec"]

OnOutput = Callable[[int, bytes], Awaitable[None]]  # a part of a command's output as it comes: stream (1, 2), bytes


class SandboxAsk(TypedDict, total=False):
    """The keywords of ``sandbox(image, **ask)`` (``ctx.sandbox``, ``Resource.sandbox``, ``Sandboxes.sandbox``),
    written once for all of them: a ``SandboxSpec``'s fields an author may ask (None: the pool's default)."""

    cpu: float | None
    memory_mb: int | None
    pids: int | None
    disk_mb: int | None
    timeout_s: float | None  # the longest one exec may run
    env: dict[str, str] | None
    restartable: bool  # ``box.restart()`` may be asked of it


class Capabilities(msgspec.Struct, frozen=True, kw_only=True):
    """What a backend offers, declared (an author's call that needs a missing one fails with one line)."""

    exec: bool = True
    file_transfer: bool = True
    pty: bool = False
    background: bool = False  # processes that outlive the call that started them (``box.spawn``)
    stream: bool = False  # exec output reaches ``on_output`` as it is produced (else: once, at the end)
    pause: bool = False
    restart: bool = False  # every process ended, the files kept (``box.restart``: before a verify in the same box)
    network: bool = False  # never, on these machines
    images: bool = True  # False: the host's own file system (the process backend)
    fork: bool = False  # a held sandbox copied into new ones, its files kept (``box.fork``; docs/sandboxes.md)


class ExecResult(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One command's outcome as an author sees it: ``exit_code`` None when the wall clock killed it."""

    exit_code: int | None
    stdout: bytes = b""
    stderr: bytes = b""
    truncated: bool = False
    timed_out: bool = False
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @property
    def text(self) -> str:
        """stdout decoded (invalid UTF-8 replaced)."""
        return self.stdout.decode("utf-8", "replace")
