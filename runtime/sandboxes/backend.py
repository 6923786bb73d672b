"""What a sandbox worker needs of a backend: a small protocol every engine or provider implements."""

from __future__ import annotations

from typing import Protocol

import anyio
import anyio.abc
import msgspec

from gym_runtime.errors import Failure
from gym_runtime.sandboxes.spec import Capabilities, ExecResult, OnOutput


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
    restartable: bool = False  # ``SandboxSpec.restartable``


class Owned(msgspec.Struct, frozen=True, kw_only=True):
    """A sandbox a backend holds, as the reaper sees it: who created it and for which lease."""

    id: str
    owner: str  # the sandbox worker's id
    lease: str  # its lease's tag (``leases.lease_tag``: never the lease itself), or "warm"
    pool: str
    expires: float = 0.0  # when the lease ends (unix time; 0: unknown)
    running: bool = True  # False: its processes ended (exited, dead): provably nobody's any more


class Background(Protocol):
    """A command running in the background of a sandbox (``Capabilities.background``), read by its worker for
    as long as it runs; its output capped as an exec's is. It dies with its sandbox."""

    done: anyio.Event
    failure: Failure | None  # set when it ended because its backend stopped answering (its caller is told this)

    async def run(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """Start the command, report it started, then read its output until it ends (never raises after)."""
        ...

    def result(self) -> ExecResult:
        """Its output so far; ``exit_code`` None while it runs."""
        ...

    async def kill(self) -> None:
        """Kill it and what it started (its process group)."""
        ...


def unsupported(backend: str, capability: str, what: str, *, where: str = "") -> Failure:
    """An author's call that needs a capability the backend does not declare: one line naming both (and the
    pool, ``where``)."""
    line = f"the {backend} backend has no {what} (Capabilities.{capability} is False)"
    return Failure("tool_error", f"{where}: {line}" if where else line)


class Backend(Protocol):
    name: str
    capabilities: Capabilities

    async def create(self, spec: Resolved, *, owner: str, lease: str, expires: float | None = None) -> str:
        """Start a sandbox; its id. ``expires``: when its lease ends (unix time)."""
        ...

    async def exec(
        self, sid: str, argv: list[str], *, timeout_s: float, max_output: int, on_output: OnOutput | None = None
    ) -> ExecResult:
        """Run a command; ``on_output`` (where ``Capabilities.stream``) is given its output as it comes."""
        ...

    def spawn(self, sid: str, argv: list[str], *, timeout_s: float, max_output: int) -> Background:
        """A background command (not started: its ``run`` starts it), killed after ``timeout_s`` at the latest."""
        ...

    async def write(self, sid: str, path: str, data: bytes) -> None: ...

    async def read(self, sid: str, path: str, *, max_bytes: int) -> bytes: ...

    async def restart(self, sid: str) -> int:
        """End every process of the sandbox, its files kept (``Capabilities.restart``); how many it ended."""
        ...

    async def fork(self, sid: str, spec: Resolved, *, owner: str, leases: list[str], expires: float) -> list[str]:
        """Copies of sandbox ``sid`` (``Capabilities.fork``): one new sandbox per lease tag in ``leases``, in that
        order, made as ``spec`` with ``sid``'s files; all or none (what each backend copies: docs/sandboxes.md)."""
        ...

    async def close(self, sid: str) -> None:
        """Remove the sandbox (and all it wrote); no error when it is gone already."""
        ...

    async def renew(self, sid: str) -> bool:
        """Tell a sandbox its holder lives (a backend whose sandboxes end by themselves once their worker is gone;
        a no-op True elsewhere); False: it is gone."""
        ...

    async def image_id(self, sid: str) -> str:
        """The content id of the image the sandbox was created from (an engine's ``sha256:...``; rows'
        provenance), "" where the backend has none (the host's file system, a provider's snapshot)."""
        ...

    async def cpu_s(self, sid: str) -> float | None:
        """The CPU seconds the sandbox has used so far (read at its release: its holder's cost); None where
        this backend does not count them."""
        ...

    async def list_owned(self) -> list[Owned]:
        """Every sandbox of this pool on this backend, whichever worker created it."""
        ...

    async def aclose(self) -> None:
        """Release the backend's own connections (sandboxes stay: the reaper decides)."""
        ...
