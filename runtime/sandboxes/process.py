"""The ``process`` backend: the project's own process sandbox (``gym_runtime.jail``: namespaces,
seccomp, Landlock, a cgroup) for machines without a container engine.

One sandboxed child per sandbox, serving ``process_payload``. It has no image: commands run on the host's
own (read-only) file system in a private tmpfs working directory, so ``SandboxSpec.image`` is ignored
(``Capabilities.images`` is False). A fork copies that directory (as a tar, through the payload) into new ones;
processes are not copied. A child dies with its worker (PDEATHSIG), so nothing outlives a
SIGKILLed worker and ``list_owned`` has nothing to reap.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

from gym_runtime.errors import Failure
from gym_runtime.jail import JailError, JailExited, JailRunner, JailTimeout, Limits
from gym_runtime.sandboxes.backend import Background, Owned, Resolved, unsupported
from gym_runtime.sandboxes.spec import Capabilities, ExecResult, OnOutput

PAYLOAD = str(Path(__file__).with_name("process_payload.py"))
SESSION_S = 24 * 3600.0  # the child's own wall clock; a lease ends long before


class ProcessBackend:
    name = "process"
    capabilities = Capabilities(exec=True, file_transfer=True, images=False, fork=True)

    def __init__(self, *, pool: str, max_parallel: int = 1024) -> None:
        self.pool = pool
        self.runner = JailRunner(max_parallel)
        self._boxes: dict[str, tuple[Any, Any]] = {}  # id -> (context, session)

    async def create(self, spec: Resolved, *, owner: str, lease: str, expires: float | None = None) -> str:
        limits = Limits(
            wall_s=SESSION_S,
            cpu_s=SESSION_S,
            memory_bytes=spec.memory_mb << 20,
            file_bytes=spec.disk_mb << 20,
            nproc=spec.pids,
            exec_workdir=True,
        )
        ctx = self.runner.session(PAYLOAD, limits)
        try:
            session = await ctx.__aenter__()
        except JailError as e:
            raise Failure("tool_error", f"the process sandbox is unavailable here: {e}") from None
        sid = uuid.uuid4().hex
        self._boxes[sid] = (ctx, session)
        return sid

    async def _call(self, sid: str, req: dict[str, Any], max_body: int) -> tuple[dict[str, Any], bytes]:
        box = self._boxes.get(sid)
        if box is None:
            raise Failure("tool_error", f"sandbox {sid[:12]} is gone")
        try:
            await box[1].send(req)
            head, body = await box[1].recv(max_body=max_body)
        except (JailExited, JailTimeout) as e:
            await self.close(sid)
            raise Failure("tool_error", f"sandbox {sid[:12]} ended: {e}") from None
        if not isinstance(head, dict):
            await self.close(sid)
            raise Failure("tool_error", "the sandbox sent a malformed reply")
        if "error" in head:
            raise Failure("tool_error", str(head["error"])[:2000])
        return head, body or b""

    async def exec(
        self, sid: str, argv: list[str], *, timeout_s: float, max_output: int, on_output: OnOutput | None = None
    ) -> ExecResult:  # the output comes whole at the end (Capabilities.stream is False): on_output is not called
        req = {"op": "exec", "argv": argv, "timeout": timeout_s, "max_output": max_output}
        started = time.monotonic()
        head, body = await self._call(sid, req, 2 * max_output)
        n = int(head.get("stdout", 0))
        return ExecResult(
            exit_code=head.get("exit_code"),
            stdout=body[:n],
            stderr=body[n:],
            truncated=bool(head.get("truncated")),
            timed_out=bool(head.get("timed_out")),
            duration_s=time.monotonic() - started,  # the rollout's sandbox_ms, as the engine backends time theirs
        )

    def spawn(self, sid: str, argv: list[str], *, timeout_s: float, max_output: int) -> Background:
        raise unsupported(self.name, "background", "background processes")

    async def restart(self, sid: str) -> int:
        raise unsupported(self.name, "restart", "restart (ending every process, the files kept)")

    async def fork(self, sid: str, spec: Resolved, *, owner: str, leases: list[str], expires: float) -> list[str]:
        """New sandboxes holding a copy of ``sid``'s working directory; all or none."""
        cap = spec.disk_mb << 20
        files = (await self._call(sid, {"op": "pack", "max": cap}, cap))[1]
        children: list[str] = []
        try:
            for _ in leases:
                children.append(await self.create(spec, owner=owner, lease="", expires=expires))
                await self._call(children[-1], {"op": "unpack", "data": files.decode("latin-1")}, 0)
        except BaseException:
            for child in children:
                await self.close(child)
            raise
        return children

    async def write(self, sid: str, path: str, data: bytes) -> None:
        await self._call(sid, {"op": "write", "path": path, "data": data.decode("latin-1")}, 0)

    async def read(self, sid: str, path: str, *, max_bytes: int) -> bytes:
        return (await self._call(sid, {"op": "read", "path": path, "max": max_bytes}, max_bytes))[1]

    async def cpu_s(self, sid: str) -> float | None:
        box = self._boxes.get(sid)
        return None if box is None else box[1].cpu_s()

    async def close(self, sid: str) -> None:
        box = self._boxes.pop(sid, None)
        if box is not None:
            await box[0].__aexit__(None, None, None)

    async def renew(self, sid: str) -> bool:
        return sid in self._boxes  # its sandboxes are the worker's children: they end with it

    async def list_owned(self) -> list[Owned]:
        return []

    async def image_id(self, sid: str) -> str:
        return ""  # no image: the host's own file system

    async def aclose(self) -> None:
        for sid in list(self._boxes):
            await self.close(sid)
