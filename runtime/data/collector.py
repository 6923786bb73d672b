"""Collects a batch's results into NeMo Gym-shaped JSONL plus sidecars.

Results arrive in any order. Each is appended to a spool file as it comes (an
index of byte offsets is all that stays in memory), duplicates of a
task×repeat are dropped, and when every expected result is in, the spool is
rewritten in ``aabbcc`` order to ``OUT``; failures go to ``<out>_failures.jsonl``
and metrics to ``<out>_aggregate_metrics.json``. Results are read back from the
result stream from the start, so a collector that is interrupted and run again
ends with the same file.
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
from gym_runtime.data.batches import get_manifest
from gym_runtime.errors import Failure
from gym_runtime.messages import ErrorInfo, RolloutResult
from gym_runtime.observability import logs
from gym_runtime.transport import jetstream
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.delivery import Delivery
from gym_runtime.transport.pull import PullWorker
from gym_runtime.transport.subjects import LOST, advisory

_json_enc = msgspec.json.Encoder()
_json_dec = msgspec.json.Decoder()
log = logs.get("gym.collector")
LOST_CHECK_S = 5.0  # with no result for this long, look for tasks that left the queue without one


def sidecar_paths(out: str | Path) -> tuple[Path, Path]:
    p = Path(out)
    stem = str(p.with_suffix("")) if p.suffix == ".jsonl" else str(p)
    return Path(stem + "_failures.jsonl"), Path(stem + "_aggregate_metrics.json")


def failure_row(res: RolloutResult) -> dict[str, Any]:
    """The ``<out>_failures.jsonl`` line of a result that has no row (also what the client yields)."""
    info = res.error
    return {
        "_ng_task_index": res.task_index,
        "_ng_rollout_index": res.rollout_index,
        "agent_ref": {"type": "responses_api_agents", "name": res.agent},
        "error_class": info.error_class if info else "internal",
        "error": info.message if info else "no row and no error",
        "attempts": res.attempts,
        "input": res.input_row,
    }


async def read_result(bus: Bus, msg: Delivery) -> RolloutResult | None:
    """A stored result as every reader of the results stream must see it (collect, the client, status): a
    body that cannot be read is a failure row, and a row on the lost subject is a failure whatever it claims
    (its writers are not the agent pools, so it can carry no reward)."""
    try:
        res = await bus.decode(msg)
    except Exception as e:  # a tampered or missing body: a failure row, never a reward, never a hang
        return unreadable_result(msg, e)
    if not isinstance(res, RolloutResult):
        log.warning("result.unexpected", subject=msg.subject, type=type(res).__name__)
        return None
    if res.error is None and bus.subjects.result_agent(msg.subject) == LOST:
        return msgspec.structs.replace(
            res, row=None, error=ErrorInfo(error_class="integrity", message="a row on the lost subject")
        )
    return res


def unreadable_result(msg: Delivery, e: Exception) -> RolloutResult | None:
    """The failure of a stored result whose body cannot be read, named by its ``Nats-Msg-Id``
    (``{batch}:{task}:{rollout}``); ``None`` when even that is missing (logged: not a result of ours)."""
    parts = (msg.headers or {}).get("Nats-Msg-Id", "").rsplit(":", 2)
    if len(parts) != 3 or not (parts[1].isdigit() and parts[2].isdigit()):
        log.warning("result.unreadable", subject=msg.subject, error=str(e))
        return None
    info = e.info if isinstance(e, Failure) else ErrorInfo(error_class="integrity", message=str(e))
    return RolloutResult(
        batch=parts[0],
        task_index=int(parts[1]),
        rollout_index=int(parts[2]),
        agent=msg.subject.split(".")[-2] if msg.subject.count(".") >= 3 else "",
        error=ErrorInfo(error_class="integrity", message=f"the stored result cannot be read: {info.message}"),
    )


@dataclass
class CollectStats:
    rows: int = 0
    failures: int = 0
    duplicates: int = 0
    reward_sum: float = 0.0
    metrics: list[dict[str, Any]] = field(default_factory=list)  # per agent, without per-task entries

    @property
    def mean_reward(self) -> float | None:
        return self.reward_sum / self.rows if self.rows else None


class Collector:
    """Consume ``{ns}.result.*.{batch}`` until ``expected`` distinct results are in."""

    def __init__(
        self,
        bus: Bus,
        batch: str,
        out: str | Path,
        *,
        expected: int,
        repeats: int = 1,
        on_progress: Callable[[int, int], None] | None = None,
        on_result: Callable[[bool, float | None], None] | None = None,
    ) -> None:
        self.bus = bus
        self.batch = batch
        self.out = Path(out)
        self.expected = expected
        self.on_progress = on_progress
        self.on_result = on_result  # (ok, reward) per distinct result: failures and running reward
        self.failures_path, self.metrics_path = sidecar_paths(self.out)
        self.spool_path = Path(str(self.out) + ".partial")
        # Where each task×repeat's line sits in the spool: flat arrays at task * repeats + rollout
        # (16 bytes a row), so a 100k-row batch costs ~2 MB of index, not rows.
        self.repeats = max(1, repeats)
        self._offsets = array("q", [-1]) * expected
        self._sizes = array("q", [0]) * expected
        self._ok = bytearray(expected)
        self._count = 0
        self.stats = CollectStats()
        self._done = anyio.Event()
        self._answer_field: str | None = None
        self._stop = threading.Event()  # set when the collection is abandoned (Ctrl-C): the file thread stops

    async def run(self) -> CollectStats:
        """Read every result of the batch from the start of the stream; returns when all are in.

        A pull consumer of our own (no acks: the stream keeps the results) bounds
        what is in memory to one pull's worth, however far behind we start.
        """
        self.out.parent.mkdir(parents=True, exist_ok=True)
        names = self.bus.subjects
        stream = names.results_stream
        consumer = names.reader("collect", self.batch)
        subject = names.batch_results(self.batch)
        await jetstream.add_reader(self.bus, stream, consumer, subject)
        last_seq = 0

        async def recreate() -> None:  # deleted by someone else: read on from where we were
            await jetstream.add_reader(self.bus, stream, consumer, subject, start_seq=last_seq + 1)

        async def on_msg(msg: Delivery) -> None:
            nonlocal last_seq
            res = await read_result(self.bus, msg)
            if res is not None:
                self._take(res)
            last_seq = max(last_seq, msg.stream_seq)  # handled: what settle_lost waits for

        puller = PullWorker(
            self.bus,
            stream=stream,
            consumer=consumer,
            slots=512,
            handle=on_msg,
            heartbeat_s=3600.0,
            inline=True,
            recreate=recreate,
        )
        try:
            with self.spool_path.open("wb") as spool:
                self._spool = spool
                try:
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(puller.run)
                        tg.start_soon(self._watch_lost, stream, consumer, lambda: last_seq)
                        if self.expected:
                            await self._done.wait()
                        tg.cancel_scope.cancel()
                finally:
                    with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                        await jetstream.delete_consumer(self.bus, stream, consumer)
                spool.flush()
            await _in_daemon_thread(self._finalize)
        except BaseException:
            # interrupted (Ctrl-C) or failed: the spool holds results in arrival order with no index, so
            # nothing can resume from it; it goes, and -o is only ever written whole
            self._stop.set()
            for leftover in (self.spool_path, Path(f"{self.out}.tmp"), Path(f"{self.failures_path}.tmp")):
                leftover.unlink(missing_ok=True)
            raise
        return self.stats

    async def _watch_lost(self, results: str, reader: str, handled: Callable[[], int]) -> None:
        """Write a failure row for each task that left the queue without a result, so the batch finishes.

        A task is removed from the work queue when it is acked (after its result is stored) or
        terminated (``+TERM`` by a buggy or hostile worker, or past a consumer's max deliveries). Looked
        at when JetStream announces a termination, and every ``LOST_CHECK_S`` while no result arrives:
        once the batch is wholly published, none of its tasks is queued or held any more, and this
        reader has handled every stored result, the slots still empty were lost.
        """
        tasks = self.bus.subjects.tasks_stream
        poke = anyio.Event()

        async def on_advisory(_: Any) -> None:
            poke.set()

        subs = [
            await self.bus.nc.subscribe(advisory(e, tasks), cb=on_advisory)
            for e in ("MSG_TERMINATED", "MAX_DELIVERIES")
        ]
        try:
            seen = -1
            while True:
                with anyio.move_on_after(LOST_CHECK_S):
                    await poke.wait()
                if not poke.is_set() and self._count != seen:  # results are arriving: nothing is stuck
                    seen = self._count
                    continue
                poke = anyio.Event()
                seen = self._count
                try:
                    await self._settle_lost(tasks, results, reader, handled)
                except Exception as e:  # the server is busy or restarting: look again later
                    log.info("collect.lost_check_failed", batch=self.batch, error=str(e))
        finally:
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                for sub in subs:
                    await sub.unsubscribe()

    async def _settle_lost(self, tasks: str, results: str, reader: str, handled: Callable[[], int]) -> None:
        if self._count >= self.expected:
            return
        manifest = await get_manifest(self.bus, self.batch)
        if manifest is None or not manifest.published:  # tasks may still be on their way
            return
        if await jetstream.subject_count(self.bus, tasks, self.bus.subjects.batch_tasks(self.batch)):
            return  # queued or held: a worker may still store its result
        # a result is stored before its task is acked: every result is in the stream now; all read?
        if not await jetstream.read_to_end(self.bus, results, reader, handled()):
            return
        missing = [slot for slot in range(self.expected) if self._offsets[slot] < 0]
        if not missing:
            return
        log.warning("collect.tasks_lost", batch=self.batch, lost=len(missing), then="failure rows")
        agent = next(iter(manifest.agents)) if len(manifest.agents) == 1 else ""
        info = ErrorInfo(
            error_class="terminated",
            message="the task left the queue without a result: terminated by a worker, or past max deliveries",
        )
        subject = self.bus.subjects.lost(self.batch)
        for slot in missing:  # stored with the result's own id: a real result stored first wins, once
            task_index, rollout_index = divmod(slot, self.repeats)
            lost = RolloutResult(
                batch=self.batch, task_index=task_index, rollout_index=rollout_index, agent=agent, error=info
            )
            await self.bus.js_publish(subject, lost, msg_id=f"{self.batch}:{task_index}:{rollout_index}")

    def _take(self, res: RolloutResult) -> None:
        slot = res.task_index * self.repeats + res.rollout_index
        if not (0 <= slot < self.expected and 0 <= res.rollout_index < self.repeats):
            log.warning("result.out_of_range", task_index=res.task_index, rollout_index=res.rollout_index)
            return
        if self._offsets[slot] >= 0:
            self.stats.duplicates += 1
            return
        ok = res.error is None and res.row is not None
        if res.answer_field and self._answer_field is None:
            self._answer_field = res.answer_field
        if ok:
            line = _json_enc.encode(res.row)
        else:
            line = _json_enc.encode(failure_row(res))
        offset = self._spool.tell()
        self._spool.write(line)
        self._spool.write(b"\n")
        self._offsets[slot] = offset
        self._sizes[slot] = len(line)
        self._ok[slot] = ok
        self._count += 1
        reward = res.row.get("reward") if ok and res.row else None
        reward = float(reward) if isinstance(reward, (int, float)) else None
        if ok:
            self.stats.rows += 1
            if reward is not None:
                self.stats.reward_sum += reward
        else:
            self.stats.failures += 1
        if self.on_result:
            self.on_result(ok, reward)
        if self.on_progress:
            self.on_progress(self._count, self.expected)
        if self._count >= self.expected:
            self._done.set()

    def _finalize(self) -> None:
        """Rewrite the spool in task×repeat order, then the metrics; runs in a thread (file I/O, pass@k for
        every k up to the repeats: seconds at 4,000 repeats), which an interrupt does not wait for."""
        metrics = MetricsAccumulator(answer_field=self._answer_field)
        tmp_out = Path(str(self.out) + ".tmp")
        tmp_fail = Path(str(self.failures_path) + ".tmp")
        with self.spool_path.open("rb") as spool, tmp_out.open("wb") as out, tmp_fail.open("wb") as fail:
            for slot in range(self.expected):
                if slot % 4096 == 0 and self._stop.is_set():
                    return
                offset, size, ok = self._offsets[slot], self._sizes[slot], self._ok[slot]
                spool.seek(offset)
                line = spool.read(size)
                if ok:
                    out.write(line + b"\n")
                    metrics.add(_json_dec.decode(line))
                else:
                    fail.write(line + b"\n")
        if self._stop.is_set():
            return
        os.replace(tmp_out, self.out)
        if self.stats.failures:
            os.replace(tmp_fail, self.failures_path)
        else:
            tmp_fail.unlink()
            self.failures_path.unlink(missing_ok=True)
        self.stats.metrics = metrics.write_json(self.metrics_path)
        self.spool_path.unlink(missing_ok=True)


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
