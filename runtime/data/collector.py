"""Collects a batch's results into NeMo Gym-shaped JSONL plus sidecars.

Results arrive in any order (``BatchReader``: only the task's owner's, checked against the manifest). Each
is appended to a spool file as it comes (an index of byte offsets is all that stays in memory); a slot
keeps one row by the rule for attempts (``intake.replaces``: a result is never replaced, a failure row
gives way to a later attempt's). When every slot has a row (or a ``lost`` failure row), the spool is
rewritten in ``aabbcc`` order to ``OUT``; failures go to ``<out>_failures.jsonl`` and metrics to
``<out>_aggregate_metrics.json``. Results are read back from the result stream from the start, so a
collector that is interrupted and run again ends with the same file.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import msgspec

from gym_runtime.data.aggregate import MetricsAccumulator
from gym_runtime.data.attribution import attribute
from gym_runtime.data.batches import Manifest
from gym_runtime.data.durable import sync_paths
from gym_runtime.data.intake import is_ok, replaces
from gym_runtime.data.reader import BatchReader, budget_slots
from gym_runtime.data.sidecars import AttemptsSpool
from gym_runtime.data.writers import holder, open_spool
from gym_runtime.messages import RolloutResult, RolloutTask
from gym_runtime.observability import logs
from gym_runtime.transport.bus import Bus

_json_enc = msgspec.json.Encoder()
_json_dec = msgspec.json.Decoder()
log = logs.get("gym.collector")


def sidecar_paths(out: str | Path) -> tuple[Path, Path]:
    p = Path(out)
    stem = str(p.with_suffix("")) if p.suffix == ".jsonl" else str(p)
    return Path(stem + "_failures.jsonl"), Path(stem + "_aggregate_metrics.json")


def failure_row(res: RolloutResult) -> dict[str, Any]:
    """The ``<out>_failures.jsonl`` line of a result that has no row (also what the client yields): its class, who
    caused it (``failure_attribution``, the runtime's rule: ``data.attribution``) and, where the policy had
    generated, its trajectory so far as ``response`` (status ``incomplete``) with ``partial: true``."""
    info = res.error
    error_class = info.error_class if info else "internal"
    row: dict[str, Any] = {
        "_ng_task_index": res.task_index,
        "_ng_rollout_index": res.rollout_index,
        "agent_ref": {"type": "responses_api_agents", "name": res.agent},
        "error_class": error_class,
        "error": info.message if info else "no row and no error",
        "failure_attribution": attribute(error_class, res.time_split),
        "attempts": res.attempts,
        "input": res.input_row,
    }
    if res.time_split is not None:
        row["time_split"] = msgspec.to_builtins(res.time_split)
    if res.partial is not None:  # what the policy produced before the failure: a policy failure is trained on
        row["response"] = msgspec.to_builtins(res.partial)
        row["partial"] = True
    if res.policy_versions is not None:  # as a scored row carries them: which policy made those turns
        row["policy_versions"] = res.policy_versions
    if res.cost is not None:  # what the attempt used before it failed
        row["cost"] = msgspec.to_builtins(res.cost)
    if res.branch is not None:  # a branch's: its parent and turn, as its scored row would say
        row["branch_of"], row["branch_turn"] = res.branch.parent(), res.branch.turn
    return row


def budget_results(task: RolloutTask, repeats: int, message: str) -> list[tuple[int, RolloutResult]]:
    """The ``budget`` failure results of a task held back by its batch's budget, with their slots (never
    stored: the task never started, and a run of the batch again may still run it)."""
    repeats = max(1, repeats)
    base = task.task_index * repeats
    slots = [base + r for r in range(task.group)] if task.group else [base + task.rollout_index]
    return budget_slots(task.batch, slots, repeats, lambda _t: task.agent, message, task.row)


@dataclass
class CollectStats:
    rows: int = 0
    failures: int = 0
    duplicates: int = 0
    budget: int = 0  # of the failures, rollouts the batch's budget held back (never started, never stored)
    refused: int = 0  # stored results no reader may take (another agent's, another batch's, no such slot)
    reward_sum: float = 0.0
    metrics: list[dict[str, Any]] = field(default_factory=list)  # per agent, without per-task entries

    @property
    def mean_reward(self) -> float | None:
        return self.reward_sum / self.rows if self.rows else None


class Collector:
    """Read ``{ns}.result.*.{batch}`` until every slot of the manifest's batch has a row (or a failure row)."""

    def __init__(
        self,
        bus: Bus,
        manifest: Manifest,
        out: str | Path,
        *,
        on_progress: Callable[[int, int], None] | None = None,
        on_result: Callable[[bool, float | None], None] | None = None,
        max_republish: int | None = None,
        on_stored: Callable[[RolloutResult], None] | None = None,
        keep_attempts: bool = False,
        on_note: Callable[[str], None] | None = None,
    ) -> None:
        """``max_republish``: rounds of publishing again the tasks of slots whose results were lost (None: the
        manifest's); ``on_stored``: each slot's first stored result (what a budget counts); ``keep_attempts``:
        write each result read to the attempts sidecar (``data.sidecars.write_batch_sidecars`` ends it); ``on_note``:
        the one line saying another collector writes the same output (default: a log warning)."""
        self.bus = bus
        self.batch = manifest.batch
        self.out = Path(out)
        self.expected = expected = manifest.expected
        self.on_progress = on_progress
        self.on_result = on_result  # (ok, reward) per slot's first row: failures and running reward
        self.on_stored = on_stored
        self.failures_path, self.metrics_path = sidecar_paths(self.out)
        self.spool_path = Path(str(self.out) + ".partial")
        self._own = ""  # the suffix of this collector's files when another holds the usual names (``data.writers``)
        self.on_note = on_note or (lambda line: log.warning("collect.shared_output", out=str(out), note=line))
        # Where each task×repeat's line sits in the spool: flat arrays at task * repeats + rollout
        # (20 bytes a row), so a 100k-row batch costs ~2 MB of index, not rows.
        self.repeats = max(1, manifest.repeats)
        self._offsets = array("q", [-1]) * expected
        self._sizes = array("q", [0]) * expected
        self._attempts = array("i", [0]) * expected
        self._ok = bytearray(expected)
        self._count = 0
        self.stats = CollectStats()
        self._done = anyio.Event()
        self._answer_field: str | None = None
        self._stop = threading.Event()  # set when the collection is abandoned (Ctrl-C): the file thread stops
        # each result read, written to the attempts sidecar as it comes (``data.sidecars``: run and collect)
        self.attempts = AttemptsSpool(out) if keep_attempts else None
        self.reader = BatchReader.of(
            bus, manifest, self._take, self._empty, name="collect", max_republish=max_republish
        )

    async def run(self) -> CollectStats:
        """Read every result of the batch from the start of the stream; returns when every slot has a row.

        A pull consumer of our own bounds what is in memory to one pull's worth, however far behind we start.
        """
        self.out.parent.mkdir(parents=True, exist_ok=True)
        try:
            opened, self._own = open_spool(self.spool_path)
            if self._own:
                who = holder(self.spool_path)
                self.spool_path = Path(f"{self.spool_path}{self._own}")
                if self.attempts is not None:
                    self.attempts.own(self._own)
                self.on_note(
                    f"another collect{f' ({who})' if who else ''} is writing {self.out}: this one writes it too, "
                    "from the results on the bus (each writes every row once; the last to finish puts the file in "
                    "place)"
                )
            with opened as spool:
                self._spool = spool
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self.reader.run)
                    if self.expected:
                        await self._done.wait()
                    tg.cancel_scope.cancel()
                spool.flush()
            self.stats.refused = self.reader.intake.refused
            await _in_daemon_thread(self._finalize)
        except BaseException:
            # interrupted (Ctrl-C) or failed: the spool holds results in arrival order with no index, so
            # nothing can resume from it; it goes, and -o is only ever written whole
            self._stop.set()
            for leftover in (self.spool_path, *self._tmp_paths()):
                leftover.unlink(missing_ok=True)
            if self.attempts is not None:
                self.attempts.discard()
            raise
        return self.stats

    def _empty(self) -> list[int]:
        return [slot for slot in range(self.expected) if self._offsets[slot] < 0] if self._count < self.expected else []

    def hold_back(self, task: RolloutTask, message: str) -> None:
        """``task`` was never started (its batch's budget was spent): its slots get ``budget`` failure rows,
        written to the failures file only, never stored, so a run of the batch again may still run it."""
        for slot, res in budget_results(task, self.repeats, message):
            self._take(res, slot)

    def _take(self, res: RolloutResult, slot: int) -> None:
        """Keep ``res`` as its slot's row unless the slot holds one the rule for attempts keeps."""
        if self.attempts is not None:
            self.attempts.add(res)
        held = self._offsets[slot] >= 0
        if held and not replaces(bool(self._ok[slot]), self._attempts[slot], res):
            self.stats.duplicates += 1
            return
        ok = is_ok(res)
        if res.answer_field and self._answer_field is None:
            self._answer_field = res.answer_field
        line = _json_enc.encode(res.row if ok else failure_row(res))
        offset = self._spool.tell()
        self._spool.write(line)
        self._spool.write(b"\n")
        self._offsets[slot] = offset
        self._sizes[slot] = len(line)
        self._attempts[slot] = res.attempts
        self._ok[slot] = ok
        reward = res.row.get("reward") if ok and res.row else None
        reward = float(reward) if isinstance(reward, (int, float)) else None
        if ok:
            self.stats.rows += 1
            if reward is not None:
                self.stats.reward_sum += reward
        else:
            self.stats.failures += 1
        if held:  # a failure row gave way to a later attempt's row: the slot was counted already
            self.stats.failures -= 1
            return
        self._count += 1
        if res.error is not None and res.error.error_class == "budget":
            self.stats.budget += 1
        elif self.on_stored is not None:
            self.on_stored(res)
        if self.on_result:
            self.on_result(ok, reward)
        if self.on_progress:
            self.on_progress(self._count, self.expected)
        if self._count >= self.expected:
            self._done.set()

    def _tmp_paths(self) -> tuple[Path, Path, Path]:
        """Where the output, failures and metrics are written before each is renamed into place."""
        own = self._own
        return (
            Path(f"{self.out}.tmp{own}"),
            Path(f"{self.failures_path}.tmp{own}"),
            Path(f"{self.metrics_path}.tmp{own}"),
        )

    def _finalize(self) -> None:
        """Rewrite the spool in task×repeat order, then the metrics; runs in a thread (file I/O, pass@k for
        every k up to the repeats: seconds at 4,000 repeats), which an interrupt does not wait for."""
        metrics = MetricsAccumulator(answer_field=self._answer_field)
        tmp_out, tmp_fail, tmp_metrics = self._tmp_paths()
        with self.spool_path.open("rb") as spool, tmp_out.open("wb") as out, tmp_fail.open("wb") as fail:
            for slot in range(self.expected):
                if slot % 4096 == 0 and self._stop.is_set():
                    return
                offset, size, ok = self._offsets[slot], self._sizes[slot], self._ok[slot]
                spool.seek(offset)
                line = spool.read(size)
                (out if ok else fail).write(line)  # not line + b"\n": a copy of a row that may be 90 MB
                (out if ok else fail).write(b"\n")
                if ok:
                    metrics.add_line(line)  # its metrics' values only: the row was decoded when it came
                elif b'"cost":' in line:  # a failed rollout's cost, totalled apart
                    metrics.add_cost(_json_dec.decode(line), failed=True)
        if self._stop.is_set():
            return
        os.replace(tmp_out, self.out)
        if self.stats.failures:
            os.replace(tmp_fail, self.failures_path)
        else:
            tmp_fail.unlink()
            self.failures_path.unlink(missing_ok=True)
        self.stats.metrics = metrics.write_json(tmp_metrics)
        os.replace(tmp_metrics, self.metrics_path)  # whole: another collector of this output may write it too
        self.spool_path.unlink(missing_ok=True)
        # acknowledged means on disk: the command exits 0 (and may purge the batch's results) only after this
        sync_paths((self.out, self.failures_path, self.metrics_path))


async def _in_daemon_thread(fn: Callable[[], None]) -> None:
    """``fn()`` in a daemon thread: awaiting it is cancellable (Ctrl-C is acted on at once), and an
    abandoned thread does not hold the process open at exit, as a worker thread of anyio's would."""
    loop = asyncio.get_running_loop()
    finished: asyncio.Future[None] = loop.create_future()

    def settle(error: BaseException | None) -> None:
        if finished.done():
            return
        if error is None:
            finished.set_result(None)
        else:
            finished.set_exception(error)

    def target() -> None:
        error: BaseException | None = None
        try:
            fn()
        except BaseException as e:  # handed to the awaiting task
            error = e
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
            loop.call_soon_threadsafe(settle, error)

    threading.Thread(target=target, name="gym-collect-finalize", daemon=True).start()
    await finished
