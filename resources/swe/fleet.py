"""The swe environment on the sandbox fleet: the task's image in a sandbox of the entry's pool.

The resource asks its pool (``resources.NAME.sandbox``) for a sandbox of the task's image
(``containers.swe_image``: the row's ``image_name``, else SWE-Gym's or SWE-bench's name) through
``Resource.sandbox``; the pool's worker holds the container, every command travels over the bus, and the
sandbox ends with the session (or the pool's idle timeout and reaper when the holder dies). Nothing here
touches an engine.

A fleet sandbox's root file system is read-only (docs/sandboxes.md), and only its working directory
(``/work`` in a container; a private one in the process backend) is writable on every backend. So the
repository is worked on in ``repo/`` under it: copied there from ``repo_dir`` in the image (``/testbed``
in SWE-Gym's and SWE-bench's images), or written there from the row's ``repo_files`` (the local
backend's rows: then any pool serves them, the process backend's too, in the pool's default image). The
tools live beside it in ``.gym/``: ``patch_tool.py`` makes the answer's diff and applies patches where
the image has no ``git``, against the untouched base (the image's ``repo_dir``, or ``.gym/base``).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .containers import swe_image
from .environments import PATCH_FILE, CommandResult, EnvironmentError_

REPO = "repo"  # under the sandbox's working directory: the repository
TOOL = ".gym/patch_tool.py"
FILES = ".gym/repo.json"
BASE = ".gym/base"  # the repository as the row gave it (repo_files rows), for the answer's diff
TOOL_SOURCE = (Path(__file__).resolve().parent / "patch_tool.py").read_bytes()


def _commands(base: str) -> tuple[str, str]:
    """The diff and apply commands, run in ``repo/``: git's where the image has it (and the repository its
    ``.git``), Python's (``patch_tool.py``) where not."""
    tool = f"../{TOOL}"
    diff = (
        "if command -v git >/dev/null 2>&1 && [ -d .git ]; then git add -A && git diff --cached --binary; "
        f"else python3 {tool} diff {shlex.quote(base)} .; fi"
    )
    apply = (
        "if command -v git >/dev/null 2>&1; then "
        f"git apply -v {PATCH_FILE} || patch --batch --fuzz=5 -p1 -i {PATCH_FILE}; "
        f"else python3 {tool} apply {PATCH_FILE} .; fi; status=$?; rm -f {PATCH_FILE}; exit $status"
    )
    return diff, apply


class FleetEnvironment:
    """One sandbox of the pool holding the task's repository in ``repo/`` under its working directory."""

    def __init__(self, box: Any, *, shell_setup: str, base: str) -> None:
        self._box, self._setup = box, shell_setup
        self.diff_command, self.apply_command = _commands(base)
        self.closed = False

    async def run(self, command: str, timeout_s: float) -> CommandResult:
        if self.closed:
            raise EnvironmentError_("the environment is closed")
        # one stream, as mini-swe-agent shows it; a new shell per command, in the repository
        script = f"exec 2>&1\ncd {REPO}\n" + (f"{self._setup}\n" if self._setup else "") + command
        r = await self._box.exec(["bash", "-c", script], timeout_s=timeout_s)
        output = r.stdout.decode("utf-8", "replace")
        return CommandResult(r.exit_code, output, timed_out=r.timed_out, truncated=r.truncated)

    async def write(self, path: str, text: str) -> None:
        """``path`` relative to the repository (as the other environments take it)."""
        await self._box.write(path if path.startswith("/") else f"{REPO}/{path}", text)

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
        files = task.get("repo_files")
        if files is not None and not (
            isinstance(files, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in files.items())
        ):
            raise ValueError("repo_files must be {path: text} (the repository at its base commit)")
        # a row with its files runs in the row's image or the pool's default; any other in the task's image
        image = (task.get("image_name") or None) if files is not None else swe_image(task, self.flavour)
        box = await self._open(image=image)
        try:
            await box.write(TOOL, TOOL_SOURCE)
            if files is not None:
                await box.write(FILES, json.dumps(files))
                cmd, base, what = f"python3 {TOOL} unpack {FILES} {REPO} {BASE}", f"../{BASE}", "writing repo_files"
            else:
                src = shlex.quote(self.repo_dir.rstrip("/") + "/.")
                cmd, base, what = f"mkdir -p {REPO} && cp -a {src} {REPO}/", self.repo_dir, f"copying {self.repo_dir}"
            r = await box.exec(["sh", "-c", cmd], timeout_s=self.start_timeout_s)
            if r.exit_code != 0:
                why = (r.stderr or r.stdout).decode("utf-8", "replace").strip()[-500:]
                raise EnvironmentError_(f"{what} into the sandbox failed: {why}")
        except BaseException:
            await box.close()
            raise
        return FleetEnvironment(box, shell_setup=self.shell_setup, base=base)
