"""On disk, not in the page cache: what a command has written survives an OS crash once these return.

A file's ``fsync`` persists its data; a new name (a create, or ``os.replace``) persists only when its
directory is synced too. ``collect`` calls ``sync_paths`` on its output and sidecars before it exits 0
or purges the batch, since after a purge the file is the only copy of the rows.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def fsync_file(path: Path) -> None:
    """Sync a file's data (written through any descriptor: fsync acts on the file, not the descriptor)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Sync a directory: the names created, removed or renamed in it."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_paths(paths: Iterable[Path]) -> None:
    """Sync every existing file of ``paths``, then each directory holding one, once."""
    dirs: dict[Path, None] = {}
    for p in paths:
        if p.exists():
            fsync_file(p)
            dirs[p.resolve().parent] = None
    for d in dirs:
        fsync_dir(d)
