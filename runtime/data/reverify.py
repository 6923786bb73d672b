"""``gym-runtime reverify``: recompute the rewards of recorded rollouts.

Each row of a NeMo Gym rollouts file (its task fields + ``response``) goes to
the resource's stateless verify path — the ``Subjects.stateless_verify`` queue
group, so every replica shares the work. A resource whose state comes from its
tools (``reverify = "replay"``) rebuilds it by running the response's function
calls first. Rows are written in input order; at most ``in_flight`` rows are in
memory at once. The report says how many rewards changed and by how much.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import msgspec

from gym_runtime.data.atif import from_atif, is_atif, is_atif_file, is_ours, read_atif
from gym_runtime.data.collector import sidecar_paths
from gym_runtime.data.drift import Drift
from gym_runtime.data.rowkeys import DEFAULT_REWARD_BOUND, bounded_reward, own_fields
from gym_runtime.errors import Failure, UserError
from gym_runtime.messages import (
    Cost,
    ItemError,
    Response,
    VerifyReply,
    VerifyRequest,
    parse_items,
)
from gym_runtime.transport.bus import Bus

_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()

# Fields of a rollout row that are outputs, not task fields (``cost``, ``provenance``: gym-runtime's own).
_OUTPUT_FIELDS = ("response", "reward", "cost", "provenance")


@dataclass
class ReverifyReport:
    rows: int = 0
    changed: int = 0
    failed: int = 0
    sum_before: float = 0.0
    sum_after: float = 0.0
    sum_abs_delta: float = 0.0
    max_abs_delta: float = 0.0
    field_changes: dict[str, int] = field(default_factory=dict)
    # task fields the environment reads that rows lacked (older NeMo Gym rollout files keep none), and whether
    # task rows were joined (--tasks): a changed reward with fields missing is most likely that
    lacking: dict[str, int] = field(default_factory=dict)
    joined: bool = False
    drift: Drift = field(default_factory=Drift)  # rows made with another environment or grader
    resource: str = ""

    def lacks(self, task: dict[str, Any], task_fields: tuple[str, ...]) -> None:
        """Count the fields the environment reads that ``task`` lacks."""
        for name in task_fields:
            if name not in task:
                self.lacking[name] = self.lacking.get(name, 0) + 1

    def redone(self, row: dict[str, Any], reward: float, fields: dict[str, Any]) -> dict[str, Any]:
        """``row`` with its new ``reward`` and ``fields``, counted into the report (changes, sums)."""
        before = row.get("reward")
        new_row = dict(row)
        new_row["reward"] = reward
        for k, v in fields.items():
            if k in row and row[k] != v:
                self.field_changes[k] = self.field_changes.get(k, 0) + 1
            new_row[k] = v
        if isinstance(before, (int, float)):
            delta = abs(float(before) - reward)
            self.sum_before += float(before)
            self.sum_abs_delta += delta
            self.max_abs_delta = max(self.max_abs_delta, delta)
            self.changed += delta > 1e-9
        self.sum_after += reward
        return new_row

    def lines(self) -> list[str]:
        done = self.rows - self.failed
        out = [f"{self.rows} rows re-verified, {self.failed} failed, {self.changed} rewards changed"]
        if done:
            out.append(
                f"mean reward {self.sum_before / done:.4f} -> {self.sum_after / done:.4f}; "
                f"|change| mean {self.sum_abs_delta / done:.4f}, max {self.max_abs_delta:.4f}"
            )
        for k, n in sorted(self.field_changes.items()):
            out.append(f"  field {k!r} changed in {n} rows")
        fix = "; if another environment made these rows (their provenance.env), reverify them with its config"
        out.extend(self.drift.lines(f"resources.{self.resource}", fix))
        if self.changed and self.lacking and not self.joined:
            counts = ", ".join(f"{k!r} in {n}" for k, n in sorted(self.lacking.items()))
            out.append(
                f"the rows lack task fields the environment reads ({counts} rows): rollout files written without "
                "them (NeMo Gym's older ones) re-verify against defaults; pass --tasks with the task rows "
                "(joined by input messages)"
            )
        return out


def task_of(row: dict[str, Any], tasks: dict[str, dict[str, Any]] | None, where: str) -> dict[str, Any]:
    """A rollout row's task fields (its outputs dropped), joined with its task row from ``tasks`` where given."""
    task = {k: v for k, v in row.items() if k not in _OUTPUT_FIELDS}
    if tasks is None:
        return task
    joined = tasks.get(prompt_key(row.get("responses_create_params")))
    if joined is None:
        raise UserError(f"{where}: no task row in --tasks has this rollout's input messages")
    return {**joined, **task}


def parse_response(raw: Any, where: str) -> Response:
    """A recorded ``response`` → ``Response``; nulls NeMo Gym writes for absent fields are accepted."""
    if not isinstance(raw, dict):
        raise UserError(f"{where}: 'response' must be an object")
    try:
        items = parse_items(raw.get("output") or [])
    except ItemError as e:
        raise UserError(f"{where}: response.output: {e}") from None
    fields = {k: v for k, v in raw.items() if k != "output" and v is not None}
    fields.setdefault("id", "resp_reverify")
    fields.setdefault("created_at", 0.0)
    try:
        resp = msgspec.convert(fields, Response, strict=False)
    except msgspec.ValidationError as e:
        raise UserError(f"{where}: response: {e}") from None
    resp.output = items
    return resp


def prompt_key(params: Any) -> str:
    """A task's identity in older rollout files: the role and content of its input messages."""
    items = params.get("input") if isinstance(params, dict) else None
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    pairs = [(m.get("role"), m.get("content")) for m in items or [] if isinstance(m, dict) and "role" in m]
    return _encoder.encode(pairs).decode()


def load_tasks(path: str | Path) -> dict[str, dict[str, Any]]:
    """Task rows by prompt, to join older NeMo Gym rollouts (which lack task fields) with their tasks."""
    tasks: dict[str, dict[str, Any]] = {}
    with Path(path).open("rb") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    row = _decoder.decode(line)
                except msgspec.DecodeError as e:
                    raise UserError(f"{path}:{lineno}: not valid JSON ({e})") from None
                tasks[prompt_key(row.get("responses_create_params"))] = row
    return tasks


def validate_rollouts(path: str | Path) -> int:
    """Check every line before any work starts; raises ``ValueError`` naming file:line."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: file not found; give -i the rollouts JSONL that `run` or `collect` wrote (its -o)")
    if is_atif_file(p):  # (a document, a list of them or one a line: read as view and export read it)
        docs = read_atif(p)
        foreign = next((i for i, doc in enumerate(docs) if not is_ours(doc)), None)
        if foreign is not None:
            raise UserError(
                f"{p}: trajectory {foreign + 1} is a foreign ATIF trajectory: no task to grade (reverify redoes "
                "the rewards of rollouts rows and of gym-runtime's own ATIF exports; view shows this file)"
            )
        return len(docs)
    problems: list[str] = []
    n = 0
    with p.open("rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            n += 1
            try:
                row = _decoder.decode(line)
            except msgspec.DecodeError as e:
                problems.append(f"{p}:{lineno}: not valid JSON ({e})")
                continue
            if is_atif(row):
                if not is_ours(row):
                    problems.append(f"{p}:{lineno}: an ATIF trajectory without gym-runtime's rows (no reward to redo)")
                    continue
                row = from_atif(row)
            if not isinstance(row, dict) or not isinstance(row.get("response"), dict):
                problems.append(f"{p}:{lineno}: not a rollout row (an object with a 'response' object)")
    if problems:
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise UserError(
            "invalid rollout rows (nothing was re-verified; -i takes the rollouts `run` or `collect` wrote, its -o, "
            "not the task rows):\n  " + "\n  ".join(problems[:20]) + more
        )
    if not n:
        raise UserError(f"{p}: no rows")
    return n


async def reverify_file(
    bus: Bus,
    resource: str,
    src: str | Path,
    out: str | Path,
    *,
    in_flight: int = 64,
    timeout_s: float = 600.0,
    tasks: dict[str, dict[str, Any]] | None = None,
    on_row: Callable[[bool, float | None], None] | None = None,
    task_fields: tuple[str, ...] = (),
    grader: Callable[[Cost | None], str | None] | None = None,
    reward_bound: float = DEFAULT_REWARD_BOUND,
) -> ReverifyReport:
    """Re-verify every row; ``on_row(ok, new_reward)`` is called as each finishes (progress). ``task_fields``:
    the fields the environment's verify reads (its ``Resource.task_fields``), counted where rows lack them.
    ``grader``: the grader identity of a verdict's model calls (``config.fingerprints.grader_identity``), compared
    with each row's ``provenance`` as the environment's code identity is (drift)."""
    src, out = Path(src), Path(out)
    failures_path = sidecar_paths(out)[0]
    subject = bus.subjects.stateless_verify(resource)
    report = ReverifyReport(joined=tasks is not None, resource=resource)
    limiter = anyio.Semaphore(in_flight)
    results: dict[int, tuple[bytes, bool]] = {}
    next_to_write = 0

    with src.open("rb") as fin, out.open("wb") as fout, failures_path.open("wb") as ffail:

        def flush() -> None:
            nonlocal next_to_write
            while next_to_write in results:
                line, ok = results.pop(next_to_write)
                (fout if ok else ffail).write(line + b"\n")
                next_to_write += 1

        async def one(index: int, lineno: int, row: dict[str, Any]) -> None:
            try:
                where = f"{src}:{lineno}"
                try:
                    response = parse_response(row.get("response"), where)
                    task = task_of(row, tasks, where)
                    report.lacks(task, task_fields)
                    reply: VerifyReply = await bus.request(
                        subject,
                        VerifyRequest(session=None, row=task, response=response),
                        timeout=timeout_s,
                        op="verify",
                    )
                    reward = bounded_reward(reply.reward, reward_bound)
                    mine = {**row, "reward": reward}  # the row it re-verified: an echo of its keys is none
                    fields = own_fields(reply.fields, mine, task, who="the environment's verify")
                except (ValueError, Failure) as e:
                    report.failed += 1
                    err = e.info.error_class if isinstance(e, Failure) else "invalid_task"
                    results[index] = (_encoder.encode({"line": lineno, "error_class": err, "error": str(e)}), False)
                    if on_row is not None:
                        on_row(False, None)
                    return
                served = reply.served
                report.drift.check(
                    row.get("provenance"),
                    served.code or None if served else None,
                    grader(served.cost if served else None) if grader else None,
                )
                results[index] = (_encoder.encode(report.redone(row, reward, fields)), True)
                if on_row is not None:
                    on_row(True, reward)
            finally:
                flush()
                limiter.release()

        async with anyio.create_task_group() as tg:
            index = 0
            for lineno, row in _rows(src, fin):
                await limiter.acquire()
                report.rows += 1
                tg.start_soon(one, index, lineno, row)
                index += 1
    if not report.failed:
        failures_path.unlink(missing_ok=True)
    return report


def _rows(src: Path, fin: Any) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line, row) of each row of ``src`` (open as ``fin``): a rollouts JSONL's lines, or our ATIF export's
    documents, read as ``view`` reads them (``validate_rollouts`` refused a foreign one)."""
    if is_atif_file(src):
        for n, doc in enumerate(read_atif(src), 1):
            yield n, from_atif(doc)
        return
    for lineno, line in enumerate(fin, 1):
        if not line.strip():
            continue
        try:
            row = _decoder.decode(line)
            if not isinstance(row, dict):
                raise UserError("a row must be a JSON object")
            if is_atif(row):  # our ATIF export (``gym-runtime export``): the row it carries
                row = from_atif(row)
        except (msgspec.DecodeError, ValueError) as e:
            raise UserError(f"{src}:{lineno}: not a valid rollout row ({e})") from None
        yield lineno, row


__all__ = ["ReverifyReport", "parse_response", "reverify_file"]
