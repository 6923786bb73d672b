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
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


def _bad_utf8(line: bytes) -> str:
    try:
        line.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"byte 0x{line[e.start]:02x} at column {e.start + 1}"
    return "invalid UTF-8"


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
        except msgspec.DecodeError as e:
            problems.append(f"{where}: not valid JSON ({e}){not_rows_hint(p) if lineno == 1 else ''}")
            continue
        except UnicodeDecodeError:
            problems.append(f"{where}: not UTF-8 text ({_bad_utf8(line)})")
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


async def publish_tasks(
    bus: Bus,
    plan: Plan,
    *,
    batch: str,
    agents: list[str],
    agent: str | None = None,
    repeats: int = 1,
    limit: int | None = None,
    in_flight: int = 256,
    on_sent: Callable[[], None] | None = None,
    task_fields: Callable[[str], dict[str, Any]] = lambda _agent: {},
    grouped: Callable[[str], bool] = lambda _agent: False,
    mark: Watermark | None = None,
    keep: bool = False,
    admit: Callable[[RolloutTask, bool], Awaitable[bool]] | None = None,
    held: Callable[[RolloutTask], None] | None = None,
) -> int:
    """Publish rows × repeats (laid out ``aabbcc``), each to the agent its check found (``plan.owners``: not
    routed again); returns the number of tasks (``publish_rows``)."""
    rows = (row for _, row in iter_rows(plan.path, limit))
    return await publish_rows(
        bus,
        rows,
        batch=batch,
        agents=agents,
        agent=agent,
        repeats=repeats,
        in_flight=in_flight,
        task_fields=task_fields,
        grouped=grouped,
        on_sent=on_sent,
        mark=mark,
        keep=keep,
        admit=admit,
        held=held,
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
    admit: Callable[[RolloutTask, bool], Awaitable[bool]] | None = None,
    held: Callable[[RolloutTask], None] | None = None,
    routes: Iterable[str] | None = None,
) -> int:
    """Publish validated rows × repeats (``routes``: each row's agent, as their check found it: ``row_tasks``);
    ``task_fields(agent)`` adds trainer fields to each task. Into streams
    its caller ensured (``ensure_streams``: ``publish_batch`` does, and a ``Client`` as it starts), once.

    ``admit(task, stored)``: asked for each task in publish order before it is sent (``stored``: sent by an
    earlier run of this publish, only counted); once it answers False, that task and every later one are
    not published but handed to ``held`` (a budget's admission: ``gym_runtime.admission.Budget``).

    ``keep``: each task's body is stored in the stream of kept tasks too, with its first repeat (the same bytes;
    a large body's blob is shared); that repeat counts as stored, in ``mark`` too, only once both are, so a
    batch is ``published`` only with every task's body kept.

    ``mark``: the tasks before ``mark.start`` (in publish order) are stored already and are skipped
    (counted as sent); the publish keeps ``mark`` up to date as its acks come.

    For an agent that takes groups (``grouped(agent)``, its ``group_repeats``), a row's repeats
    are one group task (``RolloutTask.group``), counted as one task.

    At most ``in_flight`` publishes wait for their stream ack at once; the first that fails
    (after ``Bus.js_publish``'s own retries) stops the rest and is raised. Each publish is a
    plain task (``TaskSet``) and the window an ``asyncio.Semaphore``, which does not yield
    while a permit is free, so the publishes of one turn leave in one socket write (10,000
    tasks, with anyio's task group and semaphore before: 100 -> 33 us of CPU each, 1.07 -> 0.34 s).
    """
    if keep:
        await ensure_kept_stream(bus)
    limiter = asyncio.Semaphore(in_flight)
    failed: list[Exception] = []
    sent = 0
    stored = 0
    mark = mark or Watermark()

    async def send(task: RolloutTask, ordinal: int) -> None:
        nonlocal stored
        try:
            await publish_task(bus, task, keep=keep)
            stored += 1
            mark.stored(ordinal)
            if on_sent is not None:
                on_sent()
        except Exception as e:
            failed.append(e)
        finally:
            limiter.release()

    async with anyio.create_task_group() as tg:
        tasks = TaskSet()
        tg.start_soon(tasks.guard)
        stopped = False
        for task in row_tasks(
            rows,
            batch=batch,
            agents=agents,
            agent=agent,
            repeats=repeats,
            task_fields=task_fields,
            grouped=grouped,
            routes=routes,
        ):
            if admit is not None and not stopped:
                stopped = not await admit(task, mark.skips())
            if stopped:
                if held is not None:
                    held(task)
                continue
            await limiter.acquire()
            if failed:
                limiter.release()
                break
            ordinal = mark.take()
            if ordinal is None:  # stored by an earlier run of this publish
                limiter.release()
                sent += 1
                if on_sent is not None:
                    on_sent()
                continue
            tasks.spawn(send, task, ordinal)
            sent += 1
        for _ in range(in_flight):  # every publish has its ack (or failed)
            await limiter.acquire()
        tg.cancel_scope.cancel()
    if failed:
        if isinstance(failed[0], StorageFull):  # say what is in: nothing half-published silently
            raise StorageFull(
                f"{failed[0]}; {mark.start + stored} tasks of batch {batch} were stored before it (publishing the same "
                "batch id again adds only the rest)"
            ) from None
        raise failed[0]
    return sent
