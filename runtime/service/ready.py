"""The workers' "ready" line: the first line a worker process (``start --in-process``), a pool of them (``start``)
and ``start --ray`` print on stdout, once they take work; and its one reader.

A parent that starts workers (the supervisor, a Ray actor, ``Client`` over ``start``) waits for that line on the
child's stdout: a child that exits first never prints it (its reason is on stderr, one line). A hosted server's
worker sends its own prints to stderr, so the line is the first on its stdout.
"""

from __future__ import annotations

from typing import IO

__all__ = ["READY", "read_ready", "say_ready"]

READY = "workers ready"


def say_ready(out: IO[str], detail: str = "") -> None:
    """Print the line (``detail``: what is ready, e.g. `` (2 processes)``), flushed: a parent waits on it."""
    print(f"{READY}{detail}", file=out, flush=True)


def read_ready(stdout: IO[str] | IO[bytes]) -> bool:
    """Wait for the child's first line on ``stdout``: whether it is the ready line (False: it exited first, or
    printed something else)."""
    line = stdout.readline()
    text = line.decode(errors="replace") if isinstance(line, bytes) else line
    return text.startswith(READY)
