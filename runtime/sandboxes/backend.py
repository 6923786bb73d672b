"""What a sandbox worker needs of a backend: a small protocol every engine or provider implements."""

from __future__ import annotations

from typing import Protocol

import msgspec

from gym_runtime.sandboxes.spec import Capabilities, ExecResult


class Resolved(msgspec.Struct, frozen=True, kw_only=True):
    """A spec with every limit decided (the pool's defaults filled in and its ceilings applied)."""

    image: str
    cpu: float
    memory_mb: int
    pids: int
    disk_mb: int
    timeout_s: float
    max_output: int
    env: dict[str, str] = {}
    workdir: str = "/work"  # "": the image's own WORKDIR


class Owned(msgspec.Struct, frozen=True, kw_only=True):
    """A sandbox a backend holds, as the reaper sees it: who created it and for which lease."""

    id: str
    owner: str  # the sandbox worker's id
    lease: str  # the rollout's key
    pool: str
    expires: float = 0.0  # when the lease ends (unix time; 0: unknown)


class Backend(Protocol):
    name: str
    capabilities: Capabilities

    async def create(self, spec: Resolved, *, owner: str, lease: str, expires: float | None = None) -> str:
        """Start a sandbox; its id. ``expires``: when its lease ends (unix time)."""
        ...

    async def exec(self, sid: str, argv: list[str], *, timeout_s: float, max_output: int) -> ExecResult: ...

    async def write(self, sid: str, path: str, data: bytes) -> None: ...

    async def read(self, sid: str, path: str, *, max_bytes: int) -> bytes: ...

    async def close(self, sid: str) -> None:
        """Remove the sandbox (and all it wrote); no error when it is gone already."""
        ...

    async def list_owned(self) -> list[Owned]:
        """Every sandbox of this pool on this backend, whichever worker created it."""
        ...

    async def aclose(self) -> None:
        """Release the backend's own connections (sandboxes stay: the reaper decides)."""
        ...
