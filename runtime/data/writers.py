"""Two collectors of one output: each writes through files of its own, and the second says the first is there.

A collector's spool (``OUT.partial``) is taken with an exclusive ``flock``. A second ``collect`` of the same
output while the first still holds it (frozen, or slow) writes through names of its own (``OUT.partial.HOST-PID``,
and its temporary copies likewise), so neither truncates, overwrites or removes the other's; both read every
result from the bus, so the last to finish puts the same rows in place. The lock goes with the process, so a
killed collector's spool is taken over by the next one, as before.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path
from typing import IO


def open_spool(path: Path) -> tuple[IO[bytes], str]:
    """The spool at ``path``, or at a name of this process's own when another live collector holds ``path``:
    (the file, opened empty for writing; the suffix every file of this collector takes, ``""`` for the usual
    names)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        suffix = f".{socket.gethostname()}-{os.getpid()}"
        return Path(f"{path}{suffix}").open("wb"), suffix
    os.ftruncate(fd, 0)
    return os.fdopen(fd, "wb"), ""


def holder(path: Path) -> str:
    """Who holds the lock on ``path``, in words: ``pid P, stopped`` (``/proc/locks`` and the process's state),
    or ``""`` when this host cannot tell (the lock is another host's, or gone)."""
    try:
        inode = path.stat().st_ino
        locks = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return ""
    for line in locks:
        f = line.split()
        if len(f) >= 6 and f[1] == "FLOCK" and f[5].rsplit(":", 1)[-1] == str(inode) and f[4] != str(os.getpid()):
            return f"pid {f[4]}, {_state(f[4])}"
    return ""


def _state(pid: str) -> str:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"
    return "stopped (SIGSTOP, or a debugger)" if state in ("T", "t") else "running"
