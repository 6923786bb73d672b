"""Reading input rows and publishing them as rollout tasks.

Every row is validated before anything is published: a malformed line is
reported with its file and line number, and a file with any bad line publishes
nothing (so nothing is half-done or lost). Tasks are published with
``Nats-Msg-Id = {batch}:{task_index}:{rollout_index}``: a publish retried after a lost
ack is deduplicated by the server (within the stream's duplicate window). A publish
of the same batch run again later starts after its ``Watermark`` (kept in the batch's
manifest), not on the server's memory of ids. With ``keep``, each task's body is stored
in the stream of kept tasks too, with its first repeat (``data.republish`` reads it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import anyio
import msgspec
from opentelemetry.trace import SpanKind

from gym_runtime.data.batches import Owners
from gym_runtime.data.routing import Router
from gym_runtime.errors import InputError, StorageFull
from gym_runtime.messages import RolloutTask, RowCheck
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.jetstream import ensure_kept_stream, task_msg_id
from gym_runtime.transport.tasks import TaskSet

_decoder = msgspec.json.Decoder()


@dataclass(frozen=True, slots=True)
class Plan:
    """What a publish will do: rows validated, agent chosen per row."""

    path: Path
    count: int  # rows that will be used (after --limit)
    owners: Owners  # each row's agent, as index ranges (the batch manifest records it)
    # agents whose rows this process could not check against their environment: checked at seed time
    seed_checks: dict[str, RowCheck] = field(default_factory=dict)

    @property
    def agents(self) -> dict[str, int]:
        """Rows per agent."""
        return self.owners.counts()


@dataclass
class Watermark:
    """How far a publish got, counted in tasks in publish order: every task before ``through()`` was
    stored (it has its stream ack); a publish of the same batch run again starts there (``start``)."""

    start: int = 0
    _next: int = 0  # the ordinal of the next task in publish order
    _open: set[int] = field(default_factory=set)  # sent, not acknowledged (or failed)

    def take(self) -> int | None:
        """The next task's ordinal, to send it; ``None``: stored by an earlier run, skip it."""
        ordinal = self._next
        self._next += 1
        if ordinal < self.start:
            return None
        self._open.add(ordinal)
        return ordinal

    def stored(self, ordinal: int) -> None:
        self._open.discard(ordinal)

    def skips(self) -> bool:
        """Whether the next task was stored by an earlier run (``take`` will answer None)."""
        return self._next < self.start

    def through(self) -> int:
        return min(self._open) if self._open else max(self._next, self.start)


def iter_rows(path: Path, limit: int | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (line number, row) for non-blank lines; raise nothing — see ``validate``."""
    for lineno, line in _row_lines(path, limit):
        yield lineno, _decoder.decode(line)


def _row_lines(path: Path, limit: int | None) -> Iterator[tuple[int, bytes]]:
    """(line number, line) for the first ``limit`` non-blank lines (None: all): the rows, as reading and
    validating both count them."""
    n = 0
    with path.open("rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if limit is not None and n >= limit:
                return
            n += 1
            yield lineno, line


def _bad_utf8(line: bytes) -> str | None:
    """Where ``line`` stops being UTF-8 (None: it is UTF-8). msgspec says only "Invalid UTF-8" (0.23 on, as a
    ``DecodeError``; before, a ``UnicodeDecodeError``): the byte and column are what a user looks for."""
    if line.isascii():
        return None
    try:
        line.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"byte 0x{line[e.start]:02x} at column {e.start + 1}"
    return None


# where a command's rows may come from instead (`run` takes a bundled environment's example rows by its name)
BUNDLED_ROWS = " (a bundled environment's are its data/example.jsonl: `gym-runtime run weather` runs them)"


def not_rows_hint(path: Path) -> str:
    """What a first line that is not JSON suggests: a config YAML given where the rows go."""
    if path.suffix in (".yaml", ".yml"):
        return ": -i takes task rows, one JSON object a line; a config YAML is the command's CONFIG argument"
    return ""


Check = Callable[[Any], tuple[str | None, list[str]]]  # a decoded row -> (its agent or None, its problems)


def validate(
    path: str | Path,
    agents: list[str],
    *,
    agent: str | None = None,
    limit: int | None = None,
    check: Check | None = None,
) -> Plan:
    """The rows of a JSONL file decoded and routed to their agents, each once, in one read (``InputError`` listing
    every problem). ``check``: what a row must pass, its route included (``validation.plan_publish``'s checks
    its environment too); by default the router's (``routing.Router``)."""
    check = check or Router(agents, agent).check
    p = Path(path)
    if not p.is_file():
        raise InputError([f"{p}: file not found; give -i the path of a JSONL file of task rows{BUNDLED_ROWS}"])
    problems: list[str] = []
    owners = Owners()
    n = 0
    for lineno, line in _row_lines(p, limit):
        n += 1
        where = f"{p}:{lineno}"
        try:
            row = _decoder.decode(line)
        except (msgspec.DecodeError, UnicodeDecodeError) as e:
            if (bad := _bad_utf8(line)) is not None:
                problems.append(f"{where}: not UTF-8 text ({bad})")
            else:
                problems.append(f"{where}: not valid JSON ({e}){not_rows_hint(p) if lineno == 1 else ''}")
            continue
        except RecursionError:
            problems.append(f"{where}: nesting too deep (objects/arrays nested hundreds of levels)")
            continue
        name, found = check(row)
        problems += [f"{where}: {p}" for p in found]
        if name is not None and not found:
            owners.add(name)
    if problems:
        raise InputError(problems)
    if n == 0:
        raise InputError([f"{p}: no rows"])
    return Plan(path=p, count=n, owners=owners)


class Gate(Protocol):
    """A budget's admission (``service.budget.BudgetedPublish``): ``admit(task, stored)`` is asked for each task in
    publish order before it is sent (``stored``: sent by an earlier run of this publish, only counted); once it
    answers False, that task and every later one are not published but handed to ``held``."""

    async def admit(self, task: RolloutTask, stored: bool) -> bool: ...

    def held(self, task: RolloutTask) -> None: ...


async def publish_tasks(
    bus: Bus,
    plan: Plan,
    *,
    batch: str,
    agents: list[str],
    repeats: int = 1,
    limit: int | None = None,
    in_flight: int = 256,
    on_sent: Callable[[], None] | None = None,
    task_fields: Callable[[str], dict[str, Any]] = lambda _agent: {},
    grouped: Callable[[str], bool] = lambda _agent: False,
    mark: Watermark | None = None,
    keep: bool = False,
    gate: Gate | None = None,
) -> int:
    """Publish rows × repeats (laid out ``aabbcc``), each to the agent its check found (``plan.owners``: not
    routed again); returns the number of tasks (``publish_rows``)."""
    rows = (row for _, row in iter_rows(plan.path, limit))
    return await publish_rows(
        bus,
        rows,
        batch=batch,
        agents=agents,
        repeats=repeats,
        in_flight=in_flight,
        task_fields=task_fields,
        grouped=grouped,
        on_sent=on_sent,
        mark=mark,
        keep=keep,
        gate=gate,
        routes=plan.owners.each(),
    )


def row_tasks(
    rows: Iterable[dict[str, Any]],
    *,
    batch: str,
    agents: list[str],
    agent: str | None = None,
    repeats: int = 1,
    task_fields: Callable[[str], dict[str, Any]] = lambda _agent: {},
    grouped: Callable[[str], bool] = lambda _agent: False,
    routes: Iterable[str] | None = None,
) -> Iterator[RolloutTask]:
    """The tasks of rows × repeats in publish order (``aabbcc``; a grouped agent's repeats: one group task).
    ``routes``: each row's agent in row order, as a check of the rows found it (``validation.CheckedRows``,
    ``Plan.owners``); else routed here (``routing.Router``)."""
    router = Router(agents, agent) if routes is None else None
    route = iter(routes or ())
    for index, row in enumerate(rows):
        name = router.agent_of(row) if router is not None else next(route)
        group = repeats if repeats > 1 and grouped(name) else 0
        fields = task_fields(name)
        for r in range(1 if group else repeats):
            yield RolloutTask(
                batch=batch, task_index=index, rollout_index=r, agent=name, row=row, group=group, **fields
            )


async def publish_task(bus: Bus, task: RolloutTask, *, keep: bool = False) -> None:
    """Store one task in its agent's queue (``keep``: its body in the kept stream too, with its first repeat)."""
    subject = bus.subjects.task(task.agent, task.batch)
    kept = bus.subjects.kept(task.batch, task.task_index) if keep and task.rollout_index == 0 else None
    msg_id = task_msg_id(task.batch, task.task_index, task.rollout_index, task.group)
    tel = bus.telemetry
    if not tel.recording:
        await bus.js_publish(subject, task, msg_id=msg_id, keep=kept)
        return
    attributes = {
        "messaging.system": "nats",
        "messaging.destination.name": subject,
        "messaging.message.id": msg_id,
        "gym.batch": task.batch,
        "gym.task_index": task.task_index,
        "gym.rollout_index": task.rollout_index,
    }
    with tel.span(f"publish {subject}", kind=SpanKind.PRODUCER, attributes=attributes):
        await bus.js_publish(subject, task, msg_id=msg_id, keep=kept)


class _Window:
    """The publishes in flight: at most ``in_flight`` wait for their stream ack at once; the first that fails
    (after ``Bus.js_publish``'s own retries) stops the rest. Each publish is a plain task (``TaskSet``) and the
    window an ``asyncio.Semaphore``, which does not yield while a permit is free, so the publishes of one turn
    leave in one socket write (10,000 tasks, with anyio's task group and semaphore before: 100 -> 33 us of CPU
    each, 1.07 -> 0.34 s). ``mark``: kept up to date as the acks come; ``on_sent``: after each task sent."""

    def __init__(
        self, bus: Bus, in_flight: int, mark: Watermark, *, keep: bool, on_sent: Callable[[], None] | None
    ) -> None:
        self.bus, self.in_flight, self.mark, self.keep, self.on_sent = bus, in_flight, mark, keep, on_sent
        self.limiter = asyncio.Semaphore(in_flight)
        self.failed: list[Exception] = []
        self.sent = 0  # tasks sent, those stored by an earlier run included
        self.stored = 0  # tasks this run stored

    async def send(self, tasks: TaskSet, task: RolloutTask) -> bool:
        """Send ``task`` (skipped, counted as sent, when an earlier run stored it); False once one failed."""
        await self.limiter.acquire()
        if self.failed:
            self.limiter.release()
            return False
        ordinal = self.mark.take()
        self.sent += 1
        if ordinal is None:  # stored by an earlier run of this publish
            self.limiter.release()
            if self.on_sent is not None:
                self.on_sent()
            return True
        tasks.spawn(self._publish, task, ordinal)
        return True

    async def _publish(self, task: RolloutTask, ordinal: int) -> None:
        try:
            await publish_task(self.bus, task, keep=self.keep)
            self.stored += 1
            self.mark.stored(ordinal)
            if self.on_sent is not None:
                self.on_sent()
        except Exception as e:
            self.failed.append(e)
        finally:
            self.limiter.release()

    async def drain(self) -> None:
        """Until every publish has its ack (or failed)."""
        for _ in range(self.in_flight):
            await self.limiter.acquire()

    def raise_failure(self, batch: str) -> None:
        if not self.failed:
            return
        if isinstance(self.failed[0], StorageFull):  # say what is in: nothing half-published silently
            raise StorageFull(
                f"{self.failed[0]}; {self.mark.start + self.stored} tasks of batch {batch} were stored before it "
                "(publishing the same batch id again adds only the rest)"
            ) from None
        raise self.failed[0]


class _Admitted:
    """A gate's answers in publish order: once it says no, that task and every later one are held back."""

    def __init__(self, gate: Gate | None) -> None:
        self.gate = gate
        self.stopped = False

    async def __call__(self, task: RolloutTask, stored: bool) -> bool:
        if self.gate is None:
            return True
        self.stopped = self.stopped or not await self.gate.admit(task, stored)
        if self.stopped:
            self.gate.held(task)
        return not self.stopped


async def publish_rows(
    bus: Bus,
    rows: Iterable[dict[str, Any]],
    *,
    batch: str,
    agents: list[str],
    agent: str | None = None,
    repeats: int = 1,
    in_flight: int = 256,
    task_fields: Callable[[str], dict[str, Any]] = lambda _agent: {},
    grouped: Callable[[str], bool] = lambda _agent: False,
    on_sent: Callable[[], None] | None = None,
    mark: Watermark | None = None,
    keep: bool = False,
    gate: Gate | None = None,
    routes: Iterable[str] | None = None,
) -> int:
    """Publish validated rows × repeats into streams its caller ensured (``ensure_streams``: ``publish_batch``
    does, and a ``Client`` as it starts), once; returns the number of tasks sent. Three steps, one per concern:
    the tasks laid out (``row_tasks``: ``routes``, ``task_fields``, ``grouped``), each asked of the ``gate``
    (``Gate``: a budget's admission), then sent through the window of publishes in flight (``_Window``:
    ``in_flight``, ``mark``, ``on_sent``).

    ``keep``: each task's body is stored in the stream of kept tasks too, with its first repeat (the same bytes;
    a large body's blob is shared); that repeat counts as stored, in ``mark`` too, only once both are, so a
    batch is ``published`` only with every task's body kept. ``mark``: the tasks before ``mark.start`` (in
    publish order) are stored already and are skipped (counted as sent).
    """
    if keep:
        await ensure_kept_stream(bus)
    mark = mark or Watermark()
    window = _Window(bus, in_flight, mark, keep=keep, on_sent=on_sent)
    admitted = _Admitted(gate)
    laid_out = row_tasks(
        rows,
        batch=batch,
        agents=agents,
        agent=agent,
        repeats=repeats,
        task_fields=task_fields,
        grouped=grouped,
        routes=routes,
    )
    async with anyio.create_task_group() as tg:
        tasks = TaskSet()
        tg.start_soon(tasks.guard)
        for task in laid_out:
            if await admitted(task, mark.skips()) and not await window.send(tasks, task):
                break
        await window.drain()
        tg.cancel_scope.cancel()
    window.raise_failure(batch)
    return window.sent
