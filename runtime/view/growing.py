"""A rollouts file that grows while ``view`` shows it (a trainer's ``rows_path`` file, a ``run`` in progress): each
request first indexes the lines appended since (whole lines only: a line still being written, with no newline yet,
waits for the next request). A file that got shorter was replaced, not appended to: it is left as indexed."""

from __future__ import annotations

from pathlib import Path

from gym_runtime.errors import UserError
from gym_runtime.view.index import CHUNK, Builder, Index
from gym_runtime.view.runs import Part


def indexed_end(ix: Index) -> int:
    """The byte just past the last indexed line (and its newline)."""
    return ix.offsets[-1] + ix.lengths[-1] + 1 if len(ix) else 0


def grow(part: Part) -> bool:
    """Index ``part``'s whole lines appended since it was indexed; whether any were."""
    try:
        size = part.path.stat().st_size
    except OSError:
        return False
    ix = part.ix
    start = max(indexed_end(ix), 0)
    if size <= ix.size or size <= start:
        return False
    builder = Builder(ix.size, ix.mtime_ns)
    builder.ix = ix
    builder._ids = {name: i for i, name in enumerate(ix.names)}  # noqa: SLF001 (the builder's own table, resumed)
    added = False
    with Path(part.path).open("rb") as f:
        f.seek(start)
        offset, rest = start, b""
        while chunk := f.read(CHUNK):
            buf = rest + chunk
            begin = 0
            while (end := buf.find(b"\n", begin)) >= 0:
                line = buf[begin:end]
                if line.strip():
                    try:
                        builder.add(offset + begin, line, f"{part.path}: line at byte {offset + begin}")
                        added = True
                    except UserError:  # not a row: left out (what was indexed before stays)
                        pass
                begin = end + 1
            offset += begin
            rest = buf[begin:]
    ix.size = offset  # what is indexed: up to the last whole line (a torn one is read again next time)
    return added
