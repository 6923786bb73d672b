"""NeMo Gym's ``sandbox_provider: gym_runtime``: a hosted server's own sandbox code, on gym-runtime's fleet.

NeMo Gym finds providers by name in the ``nemo_gym.sandbox_providers`` entry-point group; gym-runtime publishes
this one there (pyproject.toml), and every hosted server's environment installs gym-runtime, so a server whose
config says ``sandbox_provider: gym_runtime`` (the hosted global config defines that block) creates, drives and
stops its sandboxes through this class, unchanged. It runs in the server's guest process, which holds no bus
and no engine: each operation goes over the guest wire to the resource worker (``ServerHost.sandbox_call``),
which makes it on the entry's sandbox pool under the lease of the session whose request made it. Those
sandboxes therefore end with that session (its rollout, however it ended), and a redelivered rollout, a new
session, gets fresh ones.

Only what NeMo Gym's container servers use is served: create, exec (``cwd``, ``env``, ``timeout_s``; the user
root), upload and download of one file, status, close. Endpoints and port forwarding cannot work under
``--network none``; GPUs, pty sessions, background services and pause are not the fleet's: a spec or call that
needs one is refused with one line.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from nemo_gym.sandbox.providers.base import (
    SandboxExecResult,
    SandboxHandle,
    SandboxStatus,
)
from nemo_gym.sandbox.providers.base import SandboxSpec as NemoSpec

from gym_runtime.messages import SandboxCall, SandboxReply, SandboxSpec
from gym_runtime.nemo_gym.hosting.host import SANDBOX_PROVIDER, ServerHost, current_host

__all__ = ["FleetProvider"]

RUNTIME_FAILURE = 125  # the return code NeMo Gym's providers give a command the sandbox could not run
ROOT = (None, "root", 0, "0")


def fleet_spec(spec: NemoSpec) -> SandboxSpec:
    """NeMo Gym's spec as the fleet's: its image, cpu, memory and env; workdir None is the image's WORKDIR."""
    res = spec.resources
    unsupported = [
        what
        for what, asked in (
            ("ports (endpoints need a network; sandboxes run with --network none)", spec.ports),
            ("an entrypoint (the fleet starts its own)", spec.entrypoint),
            ("a GPU", getattr(res, "gpu", None)),
        )
        if asked
    ]
    if unsupported:
        raise ValueError(f"sandbox_provider {SANDBOX_PROVIDER}: the fleet cannot give {'; '.join(unsupported)}")
    memory = getattr(res, "memory_mib", None)
    return SandboxSpec(
        image=spec.image,
        cpu=getattr(res, "cpu", None),
        memory_mb=int(memory) if memory else None,
        env={str(k): str(v) for k, v in (spec.env or {}).items()},
        workdir=spec.workdir or "",
        restartable=True,  # restarted before the server's verify (``guest``: no process of the policy's left)
    )


def _text(data: bytes) -> str | None:
    return data.decode("utf-8", "replace") if data else None


class FleetProvider:
    """NeMo Gym's ``SandboxProvider`` protocol over gym-runtime's sandbox fleet (module docstring)."""

    name = SANDBOX_PROVIDER

    def __init__(self, **options: Any) -> None:
        if options:  # the pool is the entry's (resources.NAME.sandbox), not the server's to choose
            raise ValueError(f"sandbox_provider {SANDBOX_PROVIDER} takes no options (got {sorted(options)})")

    @staticmethod
    def _host() -> ServerHost:
        host = current_host()
        if host is None:
            raise RuntimeError(
                f"sandbox_provider {SANDBOX_PROVIDER} serves a server hosted by gym-runtime, within one of its requests"
            )
        return host

    async def _call(self, call: SandboxCall) -> SandboxReply:
        return await self._host().sandbox_call(call)

    async def create(self, spec: NemoSpec) -> SandboxHandle:
        reply = await self._call(SandboxCall(op="create", spec=fleet_spec(spec)))
        handle = SandboxHandle(sandbox_id=reply.sandbox, provider_name=self.name, raw="sh")
        probe = await self._call(SandboxCall(op="exec", sandbox=reply.sandbox, argv=["sh", "-c", "command -v bash"]))
        if probe.exit_code == 0:
            handle.raw = "bash"  # as NeMo Gym's docker provider: bash where the image has it
        return handle

    async def exec(
        self,
        handle: SandboxHandle,
        command: str,
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_s: int | float | None = None,
        user: str | int | None = None,
    ) -> SandboxExecResult:
        if user not in ROOT:
            raise ValueError(f"sandbox_provider {SANDBOX_PROVIDER}: commands run as root (user {user!r} was asked)")
        bad = [k for k in env or {} if not k.isidentifier()]
        if bad:
            raise ValueError(f"sandbox_provider {SANDBOX_PROVIDER}: not environment variable names: {bad}")
        lines = [f"cd {shlex.quote(cwd)} || exit {RUNTIME_FAILURE}"] if cwd else []
        lines += [f"export {k}={shlex.quote(str(v))}" for k, v in (env or {}).items()]
        argv = [str(handle.raw or "sh"), "-c", "\n".join([*lines, command])]
        call = SandboxCall(op="exec", sandbox=handle.sandbox_id, argv=argv, timeout_s=timeout_s)
        r = await self._call(call)
        if r.timed_out:
            message = f"the command ran past timeout_s={timeout_s}"
            return SandboxExecResult(
                stdout=_text(r.stdout), stderr=message, return_code=RUNTIME_FAILURE, error_type="timeout"
            )
        assert r.exit_code is not None
        return SandboxExecResult(stdout=_text(r.stdout), stderr=_text(r.stderr), return_code=r.exit_code)

    @staticmethod
    def _remote(path: str) -> str:
        return "/root" + path[1:] if path == "~" or path.startswith("~/") else path

    async def upload_file(self, handle: SandboxHandle, source_path: Path, target_path: str) -> None:
        data = Path(source_path).read_bytes()
        remote = self._remote(target_path)
        await self._call(SandboxCall(op="write", sandbox=handle.sandbox_id, path=remote, data=data))

    async def download_file(self, handle: SandboxHandle, source_path: str, target_path: Path) -> None:
        reply = await self._call(SandboxCall(op="read", sandbox=handle.sandbox_id, path=self._remote(source_path)))
        target = Path(target_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(reply.data)

    async def status(self, handle: SandboxHandle) -> SandboxStatus:
        try:
            r = await self._call(SandboxCall(op="exec", sandbox=handle.sandbox_id, argv=["true"], timeout_s=30))
        except Exception:  # noqa: BLE001 - closed, reaped or its worker lost: not running
            return SandboxStatus.STOPPED
        return SandboxStatus.RUNNING if r.exit_code == 0 else SandboxStatus.UNKNOWN

    async def close(self, handle: SandboxHandle) -> None:
        await self._call(SandboxCall(op="close", sandbox=handle.sandbox_id))

    async def aclose(self) -> None:
        return None  # the provider holds nothing of its own: the worker holds the lease
