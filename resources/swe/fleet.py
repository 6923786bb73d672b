"""The swe environment on the sandbox fleet: the task's image in a sandbox of the entry's pool.

The resource asks its pool (``resources.NAME.sandbox``) for a sandbox of the task's image
(``containers.swe_image``: the row's ``image_name``, else SWE-Gym's or SWE-bench's name) through
``Resource.sandbox``; the pool's worker holds the container, every command travels over the bus, and the
sandbox ends with the session (or the pool's idle timeout and reaper when the holder dies). Nothing here
touches an engine.

A fleet sandbox's root file system is read-only (docs/sandboxes.md): the repository, at ``repo_dir`` in
the image (``/testbed`` in SWE-Gym's and SWE-bench's images), is copied into ``/work`` at start and
worked on there; the image's own copy stays as it was, the base the answer is measured against when
the image has no ``git`` (``patch_tool.py``, shipped into the sandbox's ``/tmp``).
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .containers import swe_image
from .environments import PATCH_FILE, CommandResult, EnvironmentError_

WORK = "/work"
TOOL = "/tmp/.gym_swe_patch_tool.py"
TOOL_SOURCE = (Path(__file__).resolve().parent / "patch_tool.py").read_bytes()


def _commands(repo_dir: str) -> tuple[str, str]:
    """The diff and apply commands: git's where the image has it (and the repository its ``.git``),
    Python's (``patch_tool.py``) where not."""
    base = shlex.quote(repo_dir)
    diff = (
        "if command -v git >/dev/null 2>&1 && [ -d .git ]; then git add -A && git diff --cached --binary; "
        f"else python3 {TOOL} diff {base} .; fi"
    )
    apply = (
        "if command -v git >/dev/null 2>&1; then "
        f"git apply -v {PATCH_FILE} || patch --batch --fuzz=5 -p1 -i {PATCH_FILE}; "
        f"else python3 {TOOL} apply {PATCH_FILE} .; fi; status=$?; rm -f {PATCH_FILE}; exit $status"
    )
    return diff, apply


class FleetEnvironment:
    """One sandbox of the pool holding the task's repository in ``/work``."""

    def __init__(self, box: Any, *, shell_setup: str, repo_dir: str) -> None:
        self._box, self._setup = box, shell_setup
        self.diff_command, self.apply_command = _commands(repo_dir)
        self.closed = False

    async def run(self, command: str, timeout_s: float) -> CommandResult:
        if self.closed:
            raise EnvironmentError_("the environment is closed")
        # one stream, as mini-swe-agent shows it; a new shell per command, in the repository
        script = f"exec 2>&1\ncd {WORK}\n" + (f"{self._setup}\n" if self._setup else "") + command
        r = await self._box.exec(["bash", "-c", script], timeout_s=timeout_s)
        output = r.stdout.decode("utf-8", "replace")
        return CommandResult(r.exit_code, output, timed_out=r.timed_out, truncated=r.truncated)

    async def write(self, path: str, text: str) -> None:
        await self._box.write(path, text)

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            await self._box.close()  # shielded by the client; a failure is left to the pool's reaper


class FleetBackend:
    """Sandboxes of the resource's pool (``open`` is its ``self.sandbox``), one per session and per grading."""

    name = "fleet"

    def __init__(
        self,
        open_sandbox: Callable[..., Any],
        *,
        flavour: Any,
        repo_dir: str,
        shell_setup: str,
        start_timeout_s: float,
    ) -> None:
        self._open, self.flavour, self.repo_dir = open_sandbox, flavour, repo_dir
        self.shell_setup, self.start_timeout_s = shell_setup, start_timeout_s

    async def start(self, task: dict[str, Any]) -> FleetEnvironment:
        box = await self._open(image=swe_image(task, self.flavour))
        try:
            await box.write(TOOL, TOOL_SOURCE)
            src = shlex.quote(self.repo_dir.rstrip("/") + "/.")
            r = await box.exec(["sh", "-c", f"cp -a {src} {WORK}/"], timeout_s=self.start_timeout_s)
            if r.exit_code != 0:
                why = (r.stderr or r.stdout).decode("utf-8", "replace").strip()[-500:]
                raise EnvironmentError_(f"copying the repository from {self.repo_dir} failed: {why}")
        except BaseException:
            await box.close()
            raise
        return FleetEnvironment(box, shell_setup=self.shell_setup, repo_dir=self.repo_dir)
