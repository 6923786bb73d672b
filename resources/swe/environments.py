"""Where a SWE task's repository lives while the model works on it and while it is graded.

One small interface, :class:`Environment` (run a shell command in the
repository, write a file, close), made by a :class:`Backend` from a task:

* :class:`LocalBackend`: the project's own sandbox (``runtime/jail/runner.py``:
  namespaces, no network, Landlock, seccomp, rlimits, a wall clock) with the task's
  repository written into its throw-away working directory from the row's
  ``repo_files``; commands run with the project's Python first on ``PATH``. For
  repositories whose tests run in this Python (tests, air-gapped smoke runs).
* :class:`ContainerBackend` with Docker, Podman or Apptainer/Singularity
  (``containers.py`` builds their command lines): the task's SWE-Gym / SWE-bench
  image, the repository at ``/testbed``.

Cleanup is guaranteed on every path: ``start`` cleans up what it made when it
fails or is cancelled; ``close`` is idempotent and shielded from cancellation;
a killed worker's sandboxes die with it (``PR_SET_PDEATHSIG``), its containers end
by themselves (their main process is ``sleep <lifetime>`` under ``--rm``) and the
next worker removes them earlier (``reap_orphans``: containers whose owner pid is
gone).
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import anyio

from gym_runtime.jail import JailError, JailExited, JailRunner, JailTimeout, Limits

from .containers import ContainerCommands, owner_label

PAYLOAD = str(Path(__file__).resolve().parent / "shell_payload.py")
PATCH_FILE = ".gym_patch.diff"
APPLY = (
    f"(git apply -v {PATCH_FILE} || patch --batch --fuzz=5 -p1 -i {PATCH_FILE}); "
    f"status=$?; rm -f {PATCH_FILE}; exit $status"
)
DIFF = "git add -A && git diff --cached --binary"


class EnvironmentError_(RuntimeError):
    """The environment could not be started or broke down (not the model's fault)."""


@dataclass(frozen=True, slots=True)
class CommandResult:
    returncode: int | None
    output: str
    timed_out: bool = False
    truncated: bool = False


class Environment(Protocol):
    # the shell commands that print the repository's diff (the answer) and apply PATCH_FILE (grading)
    diff_command: str
    apply_command: str

    async def run(self, command: str, timeout_s: float) -> CommandResult: ...

    async def write(self, path: str, text: str) -> None: ...

    async def close(self) -> None: ...


class Backend(Protocol):
    name: str

    async def start(self, task: dict[str, Any]) -> Environment: ...


# ------------------------------------------------------------------ local: the project's sandbox


class LocalEnvironment:
    diff_command, apply_command = DIFF, APPLY

    def __init__(self, ctx: Any, session: Any, max_output: int) -> None:
        self._ctx, self._s, self.max_output = ctx, session, max_output
        self.closed = False

    async def _call(self, req: dict[str, Any]) -> dict[str, Any]:
        """One request, one reply: a small JSON header and, for ``run``, the output as a raw body.

        The reply is the sandbox's (whatever runs in it can write to the channel): the header is
        read with the sandbox's line cap, the body with ``max_output`` bytes, both in bytes as they
        arrive; anything else ends the environment.
        """
        if self.closed:
            raise EnvironmentError_("the environment is closed")
        try:
            await self._s.send(req)
            reply, body = await self._s.recv(max_body=self.max_output)
        except JailTimeout as e:
            await self.close()
            raise EnvironmentError_(f"sandbox {e}") from None
        except JailExited as e:
            await self.close()
            raise EnvironmentError_(f"sandbox ended: {e}") from None
        if not isinstance(reply, dict):
            await self.close()
            raise EnvironmentError_("sandbox sent a malformed reply")
        if "error" in reply:
            raise EnvironmentError_(str(reply["error"])[:2000])
        if body is not None:
            reply["output"] = body.decode("utf-8", "replace")
        return reply

    async def run(self, command: str, timeout_s: float) -> CommandResult:
        r = await self._call({"op": "run", "command": command, "timeout": timeout_s, "max_output": self.max_output})
        try:
            return CommandResult(r["returncode"], r["output"], bool(r["timed_out"]), bool(r["truncated"]))
        except KeyError:
            await self.close()
            raise EnvironmentError_("sandbox sent a malformed reply") from None

    async def write(self, path: str, text: str) -> None:
        await self._call({"op": "write", "path": path, "text": text})

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            with anyio.CancelScope(shield=True):
                await self._ctx.__aexit__(None, None, None)


class LocalBackend:
    """Sandboxed shell over the row's ``repo_files``; the project's Python on ``PATH``."""

    name = "local"

    def __init__(
        self, *, max_parallel: int, wall_s: float, memory_bytes: int, disk_bytes: int, max_output: int
    ) -> None:

        self.runner = JailRunner(max_parallel)
        self.limits = Limits(
            wall_s=wall_s,
            cpu_s=wall_s,
            memory_bytes=memory_bytes,
            file_bytes=disk_bytes,
            nproc=128,
            exec_workdir=True,  # a repository's scripts run
        )
        self.max_output = max_output

    async def start(self, task: dict[str, Any]) -> LocalEnvironment:

        files = task.get("repo_files")
        if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
            raise ValueError(
                "the local backend needs the row's repo_files: {path: text} (the repository at its base commit)"
            )
        ctx = self.runner.session(PAYLOAD, self.limits)
        try:
            session = await ctx.__aenter__()
        except JailError as e:
            raise EnvironmentError_(str(e)) from None
        env = LocalEnvironment(ctx, session, self.max_output)
        try:
            await env._call({"op": "init", "files": files, "path": [os.path.dirname(sys.executable)]})
        except BaseException:
            await env.close()
            raise
        return env


# ------------------------------------------------------------------ containers


async def _exec(argv: list[str], *, stdin: bytes | None = None, timeout_s: float, max_output: int) -> CommandResult:
    """Run a container-engine command on the host; kill it at the timeout."""
    import subprocess

    proc = await anyio.open_process(
        argv,
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    out = bytearray()
    truncated = timed_out = False
    try:
        with anyio.move_on_after(timeout_s) as scope:
            if stdin is not None and proc.stdin is not None:
                await proc.stdin.send(stdin)
                await proc.stdin.aclose()
            assert proc.stdout is not None
            async for chunk in proc.stdout:
                room = max_output - len(out)
                if room > 0:
                    out += chunk[:room]
                truncated = truncated or len(chunk) > room
            await proc.wait()
        timed_out = scope.cancelled_caught
    finally:
        with anyio.CancelScope(shield=True):
            if proc.returncode is None:
                try:
                    os.killpg(proc.pid, 9)
                except (ProcessLookupError, PermissionError):
                    pass
            await proc.aclose()
    return CommandResult(None if timed_out else proc.returncode, out.decode("utf-8", "replace"), timed_out, truncated)


class ContainerEnvironment:
    diff_command, apply_command = DIFF, APPLY

    def __init__(self, cmds: ContainerCommands, name: str, max_output: int) -> None:
        self.cmds, self.name, self.max_output = cmds, name, max_output
        self.closed = False

    async def run(self, command: str, timeout_s: float) -> CommandResult:
        if self.closed:
            raise EnvironmentError_("the environment is closed")
        # the in-container `timeout` kills the command there too; the host side gets a little longer
        return await _exec(
            self.cmds.exec(self.name, command, timeout_s), timeout_s=timeout_s + 10, max_output=self.max_output
        )

    async def write(self, path: str, text: str) -> None:
        res = await _exec(self.cmds.write(self.name, path), stdin=text.encode(), timeout_s=120, max_output=65536)
        if res.returncode != 0:
            raise EnvironmentError_(f"writing {path} failed: {res.output[-500:]}")

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            with anyio.CancelScope(shield=True):
                await _exec(self.cmds.remove(self.name), timeout_s=120, max_output=65536)


class ContainerBackend:
    """Docker, Podman or Apptainer: one container per rollout (and one per grading)."""

    def __init__(self, cmds: ContainerCommands, *, lifetime_s: float, start_timeout_s: float, max_output: int) -> None:
        self.cmds = cmds
        self.name: str = cmds.engine
        self.lifetime_s = lifetime_s
        self.start_timeout_s = start_timeout_s
        self.max_output = max_output

    async def start(self, task: dict[str, Any]) -> ContainerEnvironment:
        name = self.cmds.new_name()
        env = ContainerEnvironment(self.cmds, name, self.max_output)
        try:
            res = await _exec(
                self.cmds.start(name, task, self.lifetime_s), timeout_s=self.start_timeout_s, max_output=65536
            )
            if res.returncode != 0:
                raise EnvironmentError_(
                    f"{self.cmds.engine} could not start {self.cmds.image(task)}: {res.output[-1000:]}"
                )
        except BaseException:
            await env.close()  # also after a timeout or cancellation mid-start
            raise
        return env

    async def reap_orphans(self) -> list[str]:
        """Remove containers of this engine whose owning worker process is gone."""
        if shutil.which(self.cmds.binary) is None:
            return []
        res = await _exec(self.cmds.list_owned(), timeout_s=60, max_output=1 << 20)
        dead = self.cmds.orphans(res.output) if res.returncode == 0 else []
        for name in dead:
            await _exec(self.cmds.remove(name), timeout_s=120, max_output=65536)
        return dead


__all__ = [
    "APPLY",
    "DIFF",
    "PATCH_FILE",
    "Backend",
    "CommandResult",
    "ContainerBackend",
    "Environment",
    "EnvironmentError_",
    "LocalBackend",
    "owner_label",
]
