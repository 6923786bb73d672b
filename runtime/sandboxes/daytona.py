"""The ``daytona`` backend: sandboxes of a hosted provider, Daytona, through its REST API.

Written against Daytona's documented API (``/sandbox`` to create, list by labels and delete;
``/toolbox/{id}/toolbox/process/execute`` and ``/toolbox/{id}/toolbox/files/upload|download`` inside one);
tested here against a test double of that API (``tests/daytona_double.py``), never the paid service.
The API key comes from ``DAYTONA_API_KEY`` in the worker's environment (never the config, argv or logs).

What differs from a local engine: the provider returns an exec's output whole, with stdout and stderr
together (``stdout``; ``stderr`` stays empty), and the cap is applied when it arrives; its network is
blocked by ``networkBlockAll``; its disk, memory and cpu are whole GiB and cores; the labels the reaper
reads are the provider's sandbox labels.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import time
from typing import Any

import aiohttp

from gym_runtime.errors import ConfigError, Failure
from gym_runtime.sandboxes.backend import Background, Owned, Resolved, unsupported
from gym_runtime.sandboxes.engine_api import EXPIRES, LEASE, OWNER, POOL
from gym_runtime.sandboxes.spec import Capabilities, ExecResult, OnOutput

KEY_ENV = "DAYTONA_API_KEY"


class DaytonaBackend:
    name = "daytona"
    capabilities = Capabilities(exec=True, file_transfer=True, images=True)

    def __init__(self, url: str, *, pool: str, where: str) -> None:
        key = os.environ.get(KEY_ENV, "")
        if not url or not key:
            raise ConfigError(f"{where}: the daytona backend needs engine: its API URL, and {KEY_ENV} set")
        self.url = url.rstrip("/")
        self.pool = pool
        self._session = aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {key}"}, timeout=aiohttp.ClientTimeout(total=None)
        )

    async def _call(self, method: str, path: str, *, timeout_s: float = 120.0, **kw: Any) -> Any:
        try:
            async with self._session.request(
                method, self.url + path, timeout=aiohttp.ClientTimeout(total=timeout_s), **kw
            ) as r:
                body = await r.read()
                if r.status == 404:
                    raise Failure("tool_error", f"daytona: {path}: not found (the sandbox is gone)")
                if r.status >= 400:
                    raise Failure(
                        "tool_error", f"daytona: {method} {path}: {r.status} {body[:300]!r}", retryable=r.status >= 500
                    )
                return json.loads(body) if r.content_type == "application/json" and body else body
        except aiohttp.ClientError as e:
            raise Failure("tool_error", f"daytona: {self.url} cannot be reached: {e}", retryable=True) from e

    async def create(self, spec: Resolved, *, owner: str, lease: str, expires: float | None = None) -> str:
        expires = time.time() + 3600 if expires is None else expires
        body = {
            "snapshot": spec.image,
            "env": dict(spec.env),
            "labels": {OWNER: owner, LEASE: lease, POOL: self.pool, EXPIRES: f"{expires:.0f}"},
            "cpu": max(1, math.ceil(spec.cpu)),
            "memory": max(1, math.ceil(spec.memory_mb / 1024)),
            "disk": max(1, math.ceil(spec.disk_mb / 1024)),
            "networkBlockAll": True,
            "autoStopInterval": max(1, math.ceil((expires - time.time()) / 60)),  # minutes: the lease's end
        }
        out = await self._call("POST", "/sandbox", json=body, timeout_s=300)
        return str(out["id"])

    async def exec(
        self, sid: str, argv: list[str], *, timeout_s: float, max_output: int, on_output: OnOutput | None = None
    ) -> ExecResult:  # the output comes whole at the end (Capabilities.stream is False): on_output is not called
        started = time.monotonic()
        body = {"command": shlex.join(argv), "timeout": max(1, math.ceil(timeout_s)), "cwd": "/work"}
        try:
            out = await self._call(
                "POST", f"/toolbox/{sid}/toolbox/process/execute", json=body, timeout_s=timeout_s + 30
            )
        except TimeoutError:
            return ExecResult(exit_code=None, timed_out=True, duration_s=time.monotonic() - started)
        result = str(out.get("result", "")).encode()
        code = out.get("exitCode", out.get("code"))
        duration = time.monotonic() - started
        timed_out = code in (124, 137, -1) and duration >= timeout_s * 0.98
        return ExecResult(
            exit_code=None if timed_out else code,
            stdout=result[:max_output],
            truncated=len(result) > max_output,
            timed_out=timed_out,
            duration_s=duration,
        )

    def spawn(self, sid: str, argv: list[str], *, timeout_s: float, max_output: int) -> Background:
        raise unsupported(self.name, "background", "background processes")

    async def restart(self, sid: str) -> int:
        raise unsupported(self.name, "restart", "restart (ending every process, the files kept)")

    async def fork(self, sid: str, spec: Resolved, *, owner: str, leases: list[str], expires: float) -> list[str]:
        raise unsupported(self.name, "fork", "fork (copies of a sandbox)")

    async def write(self, sid: str, path: str, data: bytes) -> None:
        form = aiohttp.FormData()
        form.add_field("file", data, filename=os.path.basename(path) or "file")
        await self._call("POST", f"/toolbox/{sid}/toolbox/files/upload", params={"path": _abs(path)}, data=form)

    async def read(self, sid: str, path: str, *, max_bytes: int) -> bytes:
        data = bytes(await self._call("GET", f"/toolbox/{sid}/toolbox/files/download", params={"path": _abs(path)}))
        if len(data) > max_bytes:
            raise Failure("tool_error", f"{path} is larger than {max_bytes} bytes (the pool's max_output)")
        return data

    async def cpu_s(self, sid: str) -> float | None:
        return None  # Daytona's API reports no CPU use: its sandboxes' cost is their exec time

    async def close(self, sid: str) -> None:
        try:
            await self._call("DELETE", f"/sandbox/{sid}", params={"force": "true"})
        except Failure as e:
            if "not found" not in str(e):
                raise

    async def image_id(self, sid: str) -> str:
        return ""  # a provider's snapshot: its name is all the pool knows of it

    async def renew(self, sid: str) -> bool:
        return True  # the provider stops it at its lease's end by itself (``autoStopInterval``)

    async def list_owned(self) -> list[Owned]:
        out = await self._call("GET", "/sandbox", params={"labels": json.dumps({POOL: self.pool})})
        return [
            Owned(
                id=str(s["id"]),
                owner=(s.get("labels") or {}).get(OWNER, ""),
                lease=(s.get("labels") or {}).get(LEASE, ""),
                pool=self.pool,
                expires=float((s.get("labels") or {}).get(EXPIRES) or 0),
            )
            for s in out
        ]

    async def aclose(self) -> None:
        await self._session.close()


def _abs(path: str) -> str:
    """A relative path is under ``/work``, as in the local backends."""
    return path if path.startswith("/") else f"/work/{path}"
