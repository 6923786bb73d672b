"""What ``run`` and ``collect`` keep beside the output of what only the bus knew: the batch's attempt records
(``explain``'s, which go with ``run``'s temporary server and with ``purge``) and its manifest and config.

``<out>_attempts.jsonl``: one JSON object a line, sorted by (task, rollout): each attempt's start
(``attempt.start.v1``: worker, node, pid, time), each attempt given back (``attempt.nak.v1``: why, its calls)
and each result the collector read (``result``: the attempt, its class when it failed, its calls and its
sandbox commands, ``kept`` for the one the slot keeps). A group task's records are written once per rollout.
``<out>_batch.json``: ``{"batch", "manifest", "config"}``, the config with its secrets replaced (``redact``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import anyio
import msgspec

from gym_runtime.data.batches import get_manifest
from gym_runtime.data.history import batch_records
from gym_runtime.data.intake import is_ok
from gym_runtime.messages import AttemptRetried, AttemptStart, RolloutResult, SandboxCommand
from gym_runtime.observability import logs
from gym_runtime.transport import jetstream
from gym_runtime.transport.bus import Bus

_enc = msgspec.json.Encoder()
log = logs.get("gym.sidecars")
# a worker sends its attempt records 0.5 s after an attempt starts (``workers.attempts.RECORDS_EVERY_S``) without
# waiting for the server: the last ones may still be on their way when the last result is read. They are read
# once that long after it (each read is every record of the batch), then again each SENT_S until RECORDS_WAIT_S.
SENT_S = 0.6
RECORDS_WAIT_S = 5.0


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
    kept: bool = False


def note(res: RolloutResult) -> ResultNote:
    """What the attempts sidecar keeps of a result the collector read."""
    err = None if is_ok(res) else res.error
    return ResultNote(
        task_index=res.task_index,
        rollout_index=res.rollout_index,
        attempt=res.attempts,
        error_class=err.error_class if err else None,
        message=err.message if err else None,
        calls=res.calls or None,
        commands=res.commands or None,
    )


async def write_batch_sidecars(
    bus: Bus,
    batch: str,
    out: str | Path,
    notes: list[ResultNote],
    *,
    config: dict[str, Any] | None = None,
    last_at: float | None = None,
) -> None:
    """Both sidecars of ``batch`` beside ``out`` (each written whole, then renamed into place). They are history,
    not the batch's result: one that cannot be written (the server busy, the folder full) is a warning, and the
    command ends as its rows say. ``last_at``: when the last result was read (``time.monotonic()``)."""
    try:
        await _write_sidecars(bus, batch, out, notes, config, last_at)
    except Exception as e:  # the rows and their sidecars are on disk already: these are extra
        log.warning("batch.sidecars_not_written", batch=batch, out=str(out), error=f"{type(e).__name__}: {e}")


async def _write_sidecars(
    bus: Bus, batch: str, out: str | Path, notes: list[ResultNote], config: dict[str, Any] | None, last_at: float | None
) -> None:
    manifest = await get_manifest(bus, batch)
    agents = sorted(manifest.agents) if manifest is not None else []
    records = await _records_of(bus, batch, agents, notes, last_at) if agents else []
    lines: list[tuple[int, int, int, int, bytes]] = []
    for n, rec in enumerate(records):
        body = _enc.encode(rec)
        for r in range(rec.rollout_index, rec.rollout_index + max(rec.group, 1)):
            line = body if not rec.group else _enc.encode(msgspec.structs.replace(rec, rollout_index=r, group=0))
            lines.append((rec.task_index, r, rec.attempt, n, line))
    base = len(records)
    for n, rn in enumerate(notes):
        lines.append((rn.task_index, rn.rollout_index, rn.attempt, base + n, _enc.encode(rn)))
    lines.sort(key=lambda t: t[:4])
    _write(attempts_path(out), b"".join(line + b"\n" for *_, line in lines))
    whole = {"batch": batch, "manifest": msgspec.to_builtins(manifest), "config": config}
    _write(batch_path(out), msgspec.json.format(_enc.encode(whole), indent=2) + b"\n")


async def _records_of(
    bus: Bus, batch: str, agents: list[str], notes: list[ResultNote], last_at: float | None
) -> list[AttemptStart | AttemptRetried]:
    """The batch's attempt records, once every result read has its attempt's start record, or after
    ``RECORDS_WAIT_S``."""
    if await jetstream.stream_config(bus, bus.subjects.attempts_stream) is None:
        return []  # a server provisioned before attempts were recorded
    wanted = {(n.task_index, n.rollout_index, n.attempt) for n in notes if n.attempt >= 1}
    deadline = time.monotonic() + RECORDS_WAIT_S
    if wanted and last_at is not None:
        await anyio.sleep(max(0.0, last_at + SENT_S - time.monotonic()))
    while True:
        records = await batch_records(bus, batch, agents)
        started = {
            (r.task_index, i, r.attempt)
            for r in records
            if isinstance(r, AttemptStart)
            for i in range(r.rollout_index, r.rollout_index + max(r.group, 1))
        }
        if wanted <= started or time.monotonic() >= deadline:
            return records
        await anyio.sleep(SENT_S)


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
