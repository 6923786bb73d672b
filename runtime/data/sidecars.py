"""What ``run`` and ``collect`` keep beside the output of what only the bus knew: the batch's attempt records
(``explain``'s, which go with ``run``'s temporary server and with ``purge``) and its manifest and config.

``<out>_attempts.jsonl``: one JSON object a line: each result the collector read, in the order read
(``result``: the attempt, its class when it failed, its calls and its sandbox commands; the slot keeps the one
whose attempt its row's ``provenance.attempt`` or failure row's ``attempts`` names), then the bus's records in
stream order: each attempt's start (``attempt.start.v1``: worker, node, pid, time) and each attempt given back
(``attempt.nak.v1``: why, its calls). A group task's records are written once per rollout.
``<out>_batch.json``: ``{"batch", "manifest", "config"}``, the config with its secrets replaced (``redact``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO, Any

import msgspec

from gym_runtime.data.batches import get_manifest
from gym_runtime.data.history import each_record
from gym_runtime.data.intake import is_ok
from gym_runtime.messages import AttemptRetried, AttemptStart, RolloutResult, SandboxCommand
from gym_runtime.observability import logs
from gym_runtime.transport import jetstream
from gym_runtime.transport.bus import Bus

_enc = msgspec.json.Encoder()
log = logs.get("gym.sidecars")


def sidecar_stem(out: str | Path) -> str:
    p = Path(out)
    return str(p.with_suffix("")) if p.suffix == ".jsonl" else str(p)


def attempts_path(out: str | Path) -> Path:
    return Path(sidecar_stem(out) + "_attempts.jsonl")


def batch_path(out: str | Path) -> Path:
    return Path(sidecar_stem(out) + "_batch.json")


class ResultNote(msgspec.Struct, kw_only=True, omit_defaults=True, tag_field="kind", tag="result"):
    """A stored result, as the attempts sidecar keeps it (never its row)."""

    task_index: int
    rollout_index: int
    attempt: int
    error_class: str | None = None
    message: str | None = None
    calls: list[list[int]] | None = None
    commands: list[SandboxCommand] | None = None


class AttemptsSpool:
    """The attempts sidecar as it is written: each result the collector reads, a line at once (nothing of it
    kept in memory: a collector of a million rows holds 20 bytes a row), then the bus's attempt records
    (``finish``), then renamed into place. Every attempt's start record is stored before it runs (``workers.attempts``)
    and a retried one's before its next start, so once the last result is read the bus holds them all."""

    def __init__(self, out: str | Path) -> None:
        self.path = attempts_path(out)
        self.partial = self.path.with_name(self.path.name + ".partial")
        self._opened: IO[bytes] | None = None

    @property
    def _file(self) -> IO[bytes]:
        if self._opened is None:  # (on first use: the collector makes the output's folder when it runs)
            self.partial.parent.mkdir(parents=True, exist_ok=True)
            self._opened = self.partial.open("wb")
        return self._opened

    def add(self, res: RolloutResult) -> None:
        err = None if is_ok(res) else res.error
        n = ResultNote(
            task_index=res.task_index,
            rollout_index=res.rollout_index,
            attempt=res.attempts,
            error_class=err.error_class if err else None,
            message=err.message if err else None,
            calls=res.calls or None,
            commands=res.commands or None,
        )
        self._file.write(_enc.encode(n) + b"\n")

    def own(self, suffix: str) -> None:
        """Write through a name of this collector's own (``data.writers``: another writes the same output)."""
        self.partial = self.partial.with_name(self.partial.name + suffix)

    def discard(self) -> None:
        if self._opened is not None:
            self._opened.close()
        self.partial.unlink(missing_ok=True)

    async def finish(self, bus: Bus, batch: str, agents: list[str]) -> None:
        """Add the batch's attempt records and put the file in place."""
        if agents and await jetstream.stream_config(bus, bus.subjects.attempts_stream) is not None:
            await each_record(bus, batch, agents, self._record)
        self._file.close()
        os.replace(self.partial, self.path)

    def _record(self, rec: AttemptStart | AttemptRetried) -> None:
        if not rec.group:
            self._file.write(_enc.encode(rec) + b"\n")
            return
        for r in range(rec.rollout_index, rec.rollout_index + rec.group):  # a group's: once per rollout
            self._file.write(_enc.encode(msgspec.structs.replace(rec, rollout_index=r, group=0)) + b"\n")


async def write_batch_sidecars(
    bus: Bus,
    batch: str,
    out: str | Path,
    spool: AttemptsSpool | None,
    *,
    config: dict[str, Any] | None = None,
) -> None:
    """Both sidecars of ``batch`` beside ``out``. They are history, not the batch's result: one that cannot be
    written (the server busy, the folder full) is a warning, and the command ends as its rows say."""
    try:
        manifest = await get_manifest(bus, batch)
        if spool is not None:
            await spool.finish(bus, batch, sorted(manifest.agents) if manifest is not None else [])
        whole = {"batch": batch, "manifest": msgspec.to_builtins(manifest), "config": config}
        _write(batch_path(out), msgspec.json.format(_enc.encode(whole), indent=2) + b"\n")
    except Exception as e:  # the rows and their sidecars are on disk already: these are extra
        if spool is not None:
            spool.discard()
        log.warning("batch.sidecars_not_written", batch=batch, out=str(out), error=f"{type(e).__name__}: {e}")


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")  # this process's own: another collect may write it too
    tmp.write_bytes(data)
    os.replace(tmp, path)
