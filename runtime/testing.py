"""Helpers for environment tests against NeMo Gym's recorded data.

An environment's tests check that re-verifying NeMo Gym's recorded rollouts
reproduces their rewards. The steps are the same for every environment — find
the compat data (an error when it is absent: it ships with the repository), join
the older rollout rows with their task rows by input messages, turn a recorded
``response`` into a ``Response``, replay recorded tool calls, open a session and
verify — so they live here once, with the one test double environments need
(``ScriptedJudge``, standing in for an LLM judge).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
from anyio.abc import TaskGroup

from gym_runtime.data.reverify import parse_response
from gym_runtime.errors import Failure
from gym_runtime.messages import (
    CreateParams,
    ErrorInfo,
    ErrorReply,
    FunctionCall,
    FunctionCallOutput,
    Item,
    Reasoning,
    Response,
    assistant_message,
)
from gym_runtime.observability import logs
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.resource import Resource, Verdict
from gym_runtime.transport.codec import Codec
from gym_runtime.transport.delivery import Delivery
from gym_runtime.transport.headers import (
    BLOB_HEADER,
    BUSY_HEADER,
    ERROR_HEADER,
    EXPIRES_HEADER,
    MSG_ID_HEADER,
    OUTPUT_HEADER,
    PAUSE_HEADER,
    PROGRESS_HEADER,
    REPLY_HEADER,
)
from gym_runtime.transport.interface import Handler, KeyValue, Puller, StreamReader, Subscription, Transport
from gym_runtime.transport.limits import DUPLICATE_WINDOW_S
from gym_runtime.transport.rpc import Busy, NoResponders, Timings, error_info, traced
from gym_runtime.transport.serving import expired
from gym_runtime.transport.subjects import JS_ACK_PREFIX, Subjects, answers, caller_of, inbox_prefix
from gym_runtime.transport.subjects import reply as reply_subject

R = TypeVar("R", bound=Resource)
# What a differential case adds to its task row: NeMo Gym's reward and fields for it.
CASE_KEYS = ("expected_reward", "expected_fields", "case")

REPO = Path(__file__).resolve().parents[1]
# The compat data lives in the repository (tests/compat, with its notice); GYM_COMPAT_DIR points elsewhere.
COMPAT = Path(os.environ.get("GYM_COMPAT_DIR") or REPO / "tests" / "compat")


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def compat_dir(*parts: str | Path) -> Path:
    """``tests/compat/<parts>`` (a file or a folder). Missing data is an error, never a skip:
    the data ships with the repo."""
    path = COMPAT.joinpath(*parts)
    if not path.exists():
        raise FileNotFoundError(f"compat data not found at {path} (it ships in tests/compat)")
    return path


def input_key(row: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """How a rollout finds its task row: the role and content of its system/developer/user messages."""
    items = row["responses_create_params"]["input"]
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    return tuple(
        (m["role"], json.dumps(m["content"])) for m in items if m.get("role") in ("system", "developer", "user")
    )


def joined_rollouts(tasks_path: str | Path, rollouts_path: str | Path) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(task row, rollout row) pairs for rollout files that lack the task fields (see NOTICE.md)."""
    tasks = {input_key(t): t for t in read_jsonl(tasks_path)}
    rollouts = read_jsonl(rollouts_path)
    assert len(tasks) == len(rollouts), "rollouts and tasks should correspond one to one"
    return [(tasks[input_key(r)], r) for r in rollouts]


def example_rollouts(env_dir: Path, recorded: Path) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(task row, rollout row) pairs: an environment's ``data/example.jsonl`` joined with
    NeMo Gym's ``example_rollouts.jsonl`` in the compat folder ``recorded``."""
    return joined_rollouts(env_dir / "data" / "example.jsonl", compat_dir(recorded / "example_rollouts.jsonl"))


def recorded_response(raw: dict[str, Any]) -> Response:
    """A recorded ``response`` dict as the ``Response`` a verifier receives."""
    return parse_response(raw, "recorded response")


async def replay_tool_calls(inst: Resource, response: Response) -> int:
    """Run each recorded call in order; each output must equal the recorded one. Returns the count."""
    produced = {
        item.call_id: await inst.call_tool(item.name, item.arguments)
        for item in response.output
        if isinstance(item, FunctionCall)
    }
    recorded = {i.call_id: i.output for i in response.output if isinstance(i, FunctionCallOutput)}
    assert produced == recorded
    return len(produced)


def split_verdict(out: float | Verdict) -> tuple[float, dict[str, Any]]:
    """(reward, extra fields) of whatever ``verify`` returned."""
    return (out.reward, out.fields) if isinstance(out, Verdict) else (float(out), {})


def differential_cases(env: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(task row, case) for each of ``tests/compat/differential/<env>.jsonl``: the row is the
    case without NeMo Gym's expectations (``CASE_KEYS``), which stay on the case."""
    cases = read_jsonl(compat_dir("differential", f"{env}.jsonl"))
    return [({k: v for k, v in c.items() if k not in CASE_KEYS}, c) for c in cases]


def text_response(*texts: str, reasoning: str | None = None, id: str = "r") -> Response:
    """A response of one assistant message per text (``output_text`` parts), after one
    reasoning item with a ``summary_text`` when ``reasoning`` is given."""
    output: list[Item] = []
    if reasoning is not None:
        output.append(Reasoning(summary=[{"type": "summary_text", "text": reasoning}]))
    output += [assistant_message(t) for t in texts]
    return Response(id=id, created_at=0.0, output=output)


async def new_session(
    cls: type[R],
    options: dict[str, Any] | None = None,
    *,
    row: dict[str, Any] | None = None,
    seed: bool = True,
    models: Any = None,
) -> R:
    """``cls.setup(options)``, a new instance (``models`` as its ``self.models``), seeded with ``row``."""
    await cls.setup(dict(options or {}))
    inst = cls()
    if models is not None:
        inst.models = models
    if seed:
        await inst.seed(row if row is not None else {})
    return inst


async def verify_once(
    cls: type[Resource], row: dict[str, Any], response: Response, options: dict[str, Any] | None = None
) -> Verdict:
    """Verify ``response`` for ``row`` in a fresh session set up with ``options``; the class is
    set up with defaults again afterwards, so options do not leak into the next test."""
    try:
        inst = await new_session(cls, options, row=row)
        out = await inst.verify(row, response)
    finally:
        if options:
            await cls.setup({})
    assert isinstance(out, Verdict)
    return out


class ScriptedJudge:
    """TEST DOUBLE for an LLM judge (``Resource.models``): replays scripted replies in order.

    It checks that the environment asks the configured judge model, records every
    request (``calls``, ``prompts()``) and fails the test when asked more often than scripted.
    """

    def __init__(self, replies: list[Response], model: str = "judge") -> None:
        self.replies = list(replies)
        self.model = model
        self.calls: list[CreateParams] = []

    async def generate(self, params: CreateParams, *, model: str) -> Response:
        assert model == self.model, f"judge asked under {model!r}, configured {self.model!r}"
        self.calls.append(params)
        assert self.replies, "the judge was asked more often than the test scripted"
        return self.replies.pop(0)

    def prompts(self) -> list[str]:
        """The text of each request's last input message."""
        return [str(c.input[-1].content) for c in self.calls]  # type: ignore[union-attr]


# ---------------------------------------------------------------------------------------------------------
# The in-memory transport: workers and the collector's parts unit-tested without a nats-server.
#
# ``MemoryTransport`` implements ``transport.interface.Transport`` (the way httpx ships ``MockTransport``):
# core publish/subscribe with NATS subject wildcards and queue groups (one member of a group gets each
# message), request-reply with typed error replies and discovery rounds (``scatter``), a stream of stored
# messages (``js_publish``, deduplicated by ``Nats-Msg-Id`` within the duplicate window, each with a sequence
# number) that work-queue pullers take from with ack / nak (after a delay) / term and redelivery of a message
# left unanswered after ``ack_wait``, acked readers of a subject (``reader``: in sequence order, ack-all, what
# is held for them counted, a reader made again on a consumer that was not deleted gets what it had not acked
# again), the last message on a subject (``last_stored``), KV buckets, and bodies over ``max_payload`` stored
# by reference. Several transports on one ``MemoryBroker`` are several connections to one server.
# What it does not do: no liveness or keepalives (a silent handler ends at the call's timeout); one stream
# and one duplicate window for every stored subject (the stream names asked for are recorded, never
# enforced), in which only task and model messages leave when acked; no stream limits (never full, nothing
# evicted, no ``max_msgs_per_subject``); no advisories (a reader sees a terminated task at its next tick); a
# reader's unacked messages come again only when it is made again, never after an ``ack_wait``; no consumer
# deleted under a reader; no permissions. End-to-end behaviour is tested on a real nats-server.
# ---------------------------------------------------------------------------------------------------------


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS wildcards: ``*`` one token, ``>`` one or more at the end."""
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)


class _Meta:
    """A stored message's delivery metadata, as nats-py's ``Msg.metadata`` gives it."""

    __slots__ = ("num_delivered", "sequence", "timestamp")

    def __init__(self, num_delivered: int, seq: int, stored_at: float) -> None:
        self.num_delivered = num_delivered
        self.sequence = SimpleNamespace(stream=seq, consumer=num_delivered)
        self.timestamp = datetime.fromtimestamp(stored_at, tz=UTC)


class _Stored:
    __slots__ = ("seq", "subject", "data", "headers", "stored_at", "delivered", "held", "ready_at")

    def __init__(self, seq: int, subject: str, data: bytes, headers: dict[str, str]) -> None:
        self.seq, self.subject, self.data, self.headers = seq, subject, data, headers
        self.stored_at = time.time()
        self.delivered = 0
        self.held = False  # taken by a puller, not yet acked, nak'd or terminated
        self.ready_at = 0.0  # monotonic: a nak'd message waits until then


class MemoryMessage:
    """One message as a ``Delivery`` wraps it (``transport.delivery.Message``); a stored one is answered
    with ack / nak / term through its broker."""

    def __init__(
        self,
        subject: str,
        data: bytes,
        headers: dict[str, str] | None,
        reply: str = "",
        *,
        stored: _Stored | None = None,
        broker: MemoryBroker | None = None,
    ) -> None:
        self.subject, self.data, self.headers, self.reply = subject, data, headers, reply
        self._stored, self._broker = stored, broker

    @property
    def metadata(self) -> _Meta:
        s = self._stored
        assert s is not None, "only a stored message has delivery metadata"
        return _Meta(s.delivered, s.seq, s.stored_at)

    async def ack(self) -> None:
        if self._stored is not None and self._broker is not None:
            self._broker.settle(self._stored, remove=True)

    async def term(self) -> None:
        await self.ack()

    async def nak(self, delay: float | None = None) -> None:
        if self._stored is not None and self._broker is not None:
            self._broker.settle(self._stored, remove=False, delay=delay or 0.0)

    async def in_progress(self) -> None:
        return None


class _Sub:
    """A subscription: its messages handed to ``cb`` one at a time, in order (as nats-py does)."""

    def __init__(
        self, broker: MemoryBroker, subject: str, queue: str, cb: Callable[[Delivery], Awaitable[None]]
    ) -> None:
        self.broker, self.subject, self.queue, self.cb = broker, subject, queue, cb
        broker.subs.append(self)
        self.inbox: asyncio.Queue[MemoryMessage] = asyncio.Queue()
        self.owner: object = None  # the transport that made it (``MemoryTransport.close`` ends its own)
        self.task = asyncio.ensure_future(self._pump())

    async def _pump(self) -> None:
        while True:
            msg = await self.inbox.get()
            try:
                await self.cb(Delivery(msg))
            except Exception as e:  # noqa: BLE001 - a callback's error must not end the subscription
                logs.get("gym.testing").warning("memory.callback_failed", subject=msg.subject, error=repr(e))

    async def unsubscribe(self) -> None:
        with contextlib.suppress(ValueError):
            self.broker.subs.remove(self)
        self.task.cancel()


class MemoryBroker:
    """The server several ``MemoryTransport`` connections share: subscriptions, the stored messages (one
    stream for every stored subject), KV buckets and large bodies."""

    def __init__(self, *, duplicate_window_s: float = DUPLICATE_WINDOW_S) -> None:
        self.subs: list[_Sub] = []
        self.stored: dict[int, _Stored] = {}  # by sequence, oldest first
        self.kv: dict[str, dict[str, bytes]] = {}
        self.blobs: dict[str, bytes] = {}
        self.consumers: dict[tuple[str, str], _Consumer] = {}  # (stream, name) -> a reader's place
        self.duplicate_window_s = duplicate_window_s
        self._seq = 0
        self._ids: dict[str, float] = {}  # message id -> when it was first stored (monotonic)
        self._turn: dict[str, int] = {}  # queue group -> next member
        self.changed = asyncio.Event()  # set (and replaced) whenever a stored message becomes takeable

    def _notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    def subscribers(self, subject: str) -> list[_Sub]:
        """Who gets a message on ``subject``: every plain subscriber, and one member of each queue group."""
        plain: list[_Sub] = []
        groups: dict[str, list[_Sub]] = {}
        for sub in self.subs:
            if subject_matches(sub.subject, subject):
                if sub.queue:
                    groups.setdefault(sub.queue, []).append(sub)
                else:
                    plain.append(sub)
        for queue, members in groups.items():
            turn = self._turn.get(queue, 0)
            self._turn[queue] = turn + 1
            plain.append(members[turn % len(members)])
        return plain

    def publish(self, subject: str, data: bytes, headers: dict[str, str] | None, reply: str = "") -> int:
        """Deliver a core message; returns how many subscriptions got it."""
        targets = self.subscribers(subject)
        for sub in targets:
            sub.inbox.put_nowait(MemoryMessage(subject, data, dict(headers) if headers else None, reply))
        return len(targets)

    def store(self, subject: str, data: bytes, headers: dict[str, str]) -> bool:
        """Keep a message (False: a duplicate of a message id stored within the duplicate window, dropped as
        the server would; after the window the same id is stored again)."""
        msg_id = headers.get(MSG_ID_HEADER)
        if msg_id is not None:
            now = time.monotonic()
            first = self._ids.get(msg_id)
            if first is not None and now - first < self.duplicate_window_s:
                return False
            self._ids[msg_id] = now
        self._seq += 1
        self.stored[self._seq] = _Stored(self._seq, subject, data, dict(headers))
        self._notify()
        return True

    def take(self, pattern: str) -> MemoryMessage | None:
        """The oldest stored message on ``pattern`` that is not held and not waiting out a nak, now held."""
        now = time.monotonic()
        for s in self.stored.values():
            if not s.held and s.ready_at <= now and subject_matches(pattern, s.subject):
                s.held = True
                s.delivered += 1
                reply = f"{JS_ACK_PREFIX}memory.{s.seq}.{s.delivered}"
                return MemoryMessage(s.subject, s.data, dict(s.headers), reply, stored=s, broker=self)
        return None

    def settle(self, s: _Stored, *, remove: bool, delay: float = 0.0) -> None:
        """Ack or term (``remove``: a work queue forgets it), else nak: takeable again after ``delay``."""
        if not s.held:
            return
        s.held = False
        if remove:
            self.stored.pop(s.seq, None)
            return
        s.ready_at = time.monotonic() + delay
        if delay > 0:
            asyncio.get_running_loop().call_later(delay, self._notify)
        else:
            self._notify()

    def count(self, pattern: str) -> int:
        """How many stored messages are on subjects matching ``pattern``."""
        return sum(1 for s in self.stored.values() if subject_matches(pattern, s.subject))

    def last(self, subject: str) -> _Stored | None:
        """The newest stored message on ``subject``."""
        return next((s for s in reversed(self.stored.values()) if s.subject == subject), None)

    def after(self, pattern: str, seq: int) -> _Stored | None:
        """The oldest stored message on ``pattern`` with a sequence of at least ``seq``."""
        return next((s for s in self.stored.values() if s.seq >= seq and subject_matches(pattern, s.subject)), None)

    def messages(self, pattern: str) -> list[Delivery]:
        """The stored messages on ``pattern`` (results, attempt records), oldest first, as a reader sees them."""
        return [
            Delivery(MemoryMessage(s.subject, s.data, dict(s.headers), stored=s, broker=self))
            for s in self.stored.values()
            if subject_matches(pattern, s.subject)
        ]


class MemoryKV:
    """A KV bucket in memory (``transport.interface.KeyValue``)."""

    def __init__(self, values: dict[str, bytes]) -> None:
        self.values = values

    async def get(self, key: str) -> bytes | None:
        return self.values.get(key)

    async def put(self, key: str, value: bytes) -> None:
        self.values[key] = value

    async def delete(self, key: str) -> None:
        self.values.pop(key, None)


class MemoryPuller:
    """Takes work-queue messages into at most ``slots`` handler tasks (``transport.interface.Puller``).

    A message its handler left unanswered (no ack, nak or term) is delivered again after ``ack_wait``,
    as the server does; ``attempt`` counts deliveries."""

    def __init__(
        self,
        broker: MemoryBroker,
        pattern: str,
        *,
        slots: int,
        ack_wait: float,
        handle: Callable[[Delivery], Awaitable[None]],
    ) -> None:
        self.broker, self.pattern, self.slots = broker, pattern, max(1, slots)
        self.ack_wait, self.handle = ack_wait, handle
        self._busy = 0
        self._stopping = False
        self._held: dict[int, Delivery] = {}
        self._freed = asyncio.Event()

    @property
    def busy(self) -> int:
        return self._busy

    def _free(self) -> None:
        self._busy -= 1
        self._freed.set()

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            while not self._stopping:
                changed, self._freed = self.broker.changed, asyncio.Event()
                while self._busy < self.slots and (msg := self.broker.take(self.pattern)) is not None:
                    self._busy += 1
                    delivery = Delivery(msg)
                    self._held[id(delivery)] = delivery
                    tg.start_soon(self._run_one, delivery, msg)
                waits = [asyncio.ensure_future(changed.wait()), asyncio.ensure_future(self._freed.wait())]
                try:
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for w in waits:
                        w.cancel()
            while self._busy:  # drain: the running handlers finish
                self._freed = asyncio.Event()
                await self._freed.wait()

    async def _run_one(self, delivery: Delivery, msg: MemoryMessage) -> None:
        try:
            await self.handle(delivery)
        except Exception as e:  # noqa: BLE001 - the handler owns acking; a crash must not end the loop
            logs.get("gym.testing").error("memory.handler_crashed", error=repr(e))
        finally:
            stored = msg._stored
            if stored is not None and stored.held:  # left unanswered: the server sends it again after ack_wait
                asyncio.get_running_loop().call_later(self.ack_wait, lambda: self.broker.settle(stored, remove=False))
            await self.release(delivery)

    def stop_pulling(self) -> None:
        self._stopping = True
        self._freed.set()

    def take_slot(self) -> bool:
        if self._stopping or self._busy >= self.slots:
            return False
        self._busy += 1
        return True

    async def give_slot(self) -> None:
        self._free()

    async def release(self, msg: Delivery) -> None:
        if self._held.pop(id(msg), None) is not None:
            self._free()


class _Consumer:
    """A reader's place in the stream, kept by the broker under its name: every sequence up to ``floor`` is
    acked (ack-all), ``next`` is the next to deliver; ``deliveries`` counts each sequence's deliveries."""

    def __init__(self) -> None:
        self.floor = 0
        self.next = 1
        self.deliveries: dict[int, int] = {}


class _ReadMessage(MemoryMessage):
    """A stored message as a reader gets it: acking it acks every one before it, and removes nothing."""

    def __init__(self, stored: _Stored, consumer: _Consumer, broker: MemoryBroker) -> None:
        self._consumer = consumer
        n = consumer.deliveries[stored.seq]
        reply = f"{JS_ACK_PREFIX}memory.{stored.seq}.{n}"
        super().__init__(stored.subject, stored.data, dict(stored.headers), reply, stored=stored, broker=broker)

    @property
    def metadata(self) -> _Meta:
        s = self._stored
        assert s is not None
        return _Meta(self._consumer.deliveries.get(s.seq, 1), s.seq, s.stored_at)

    async def ack(self) -> None:
        assert self._stored is not None
        c = self._consumer
        c.floor = max(c.floor, self._stored.seq)
        for seq in [seq for seq in c.deliveries if seq <= c.floor]:
            del c.deliveries[seq]

    async def term(self) -> None:
        await self.ack()

    async def nak(self, delay: float | None = None) -> None:
        return None  # an ack-all reader never naks


class MemoryReader:
    """An acked reader of ``pattern``'s stored messages, in sequence order, one at a time
    (``transport.interface.StreamReader``). Made on a consumer that exists (not deleted), it starts after
    what that consumer acked: what was delivered and not acked comes again."""

    def __init__(
        self, broker: MemoryBroker, key: tuple[str, str], pattern: str, handle: Callable[[Delivery], Awaitable[None]]
    ) -> None:
        self.broker, self.key, self.pattern, self.handle = broker, key, pattern, handle
        self.consumer = broker.consumers.setdefault(key, _Consumer())
        self.consumer.next = self.consumer.floor + 1
        self._stopping = False
        self._wake = asyncio.Event()

    async def run(self) -> None:
        c = self.consumer
        while not self._stopping:
            changed = self.broker.changed
            s = self.broker.after(self.pattern, c.next)
            if s is None:
                waits = [asyncio.ensure_future(changed.wait()), asyncio.ensure_future(self._wake.wait())]
                try:
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for w in waits:
                        w.cancel()
                continue
            c.next = s.seq + 1
            c.deliveries[s.seq] = c.deliveries.get(s.seq, 0) + 1
            try:
                await self.handle(Delivery(_ReadMessage(s, c, self.broker)))
            except Exception as e:  # noqa: BLE001 - as ``PullWorker``: a crash must not end the reader
                logs.get("gym.testing").error("memory.reader_crashed", error=repr(e))
            await asyncio.sleep(0)  # one turn for others, as a delivery from the server would give

    def stop_pulling(self) -> None:
        self._stopping = True
        self._wake.set()

    async def settled(self) -> bool:
        """Nothing stored on its subjects is undelivered, or delivered and not acked (purged ones count not)."""
        c = self.consumer
        return not any(s.seq > c.floor for s in self.broker.stored.values() if subject_matches(self.pattern, s.subject))

    async def close(self) -> None:
        self.broker.consumers.pop(self.key, None)


_REPLYING: ContextVar[str | None] = ContextVar("gym_memory_replying", default=None)
_UNSET: Any = object()


class MemoryTransport:
    """A ``transport.interface.Transport`` in memory: workers run on it as on a ``Bus`` (see above for what
    it leaves out). ``async with MemoryTransport() as bus``: its subscriptions end with the block."""

    def __init__(
        self,
        broker: MemoryBroker | None = None,
        *,
        namespace: str = "gym",
        telemetry: Telemetry | None = None,
        timings: Timings | None = None,
        max_payload: int = 1 << 20,
    ) -> None:
        self.broker = broker or MemoryBroker()
        self.ns = namespace
        self.subjects = Subjects(namespace)
        self.telemetry = telemetry or Telemetry()
        self.timings = timings or Timings()
        self.caller = caller_of(None, None)
        self.codec = Codec()
        self.max_payload = max_payload
        self.junk: dict[str, int] = {}
        self.streams: set[str] = set()  # the streams asked for (ensure_results_stream, ...)
        self._seq = itertools.count()
        self._inbox_prefix = inbox_prefix("memory", uuid.uuid4().hex[:8])  # this connection's replies

    async def __aenter__(self) -> MemoryTransport:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        for sub in [s for s in self.broker.subs if s.owner is self]:
            await sub.unsubscribe()

    # -- bodies
    async def encode(self, payload: Any, headers: dict[str, str], *, stored: bool = False) -> bytes:
        """A body over ``max_payload`` is kept by reference (``Gym-Blob``: its key and digest)."""
        data = self.codec.encode(payload)
        if len(data) > self.max_payload:
            key = uuid.uuid4().hex
            self.broker.blobs[key] = data
            headers[BLOB_HEADER] = f"memory.{key}.{hashlib.sha256(data).hexdigest()}"
            return b""
        return data

    async def decode(self, msg: Delivery) -> Any:
        return (await self.decode_sized(msg))[0]

    async def decode_sized(self, msg: Delivery) -> tuple[Any, int]:
        headers = msg.headers
        if headers and BLOB_HEADER in headers:
            _, key, digest = (headers[BLOB_HEADER].split(".") + ["", ""])[:3]
            data = self.broker.blobs.get(key)
            if data is None or hashlib.sha256(data).hexdigest() != digest:
                raise Failure("integrity", "a referenced body is missing or does not match its digest")
            return self.codec.decode(data, headers), len(data)
        return self.codec.decode(msg.data, headers), len(msg.data)

    # -- core messages
    async def publish(self, subject: str, payload: Any, *, headers: dict[str, str] | None = None) -> None:
        h = traced(self.telemetry, headers)
        self.broker.publish(subject, await self.encode(payload, h), h)

    async def publish_raw(self, subject: str, data: bytes, *, headers: dict[str, str] | None = None) -> None:
        self.broker.publish(subject, data, headers)

    async def subscribe(
        self, subject: str, cb: Callable[[Delivery], Awaitable[None]], *, queue: str = ""
    ) -> Subscription:
        sub = _Sub(self.broker, subject, queue, cb)
        sub.owner = self
        return sub

    async def flush(self) -> None:
        """Subscriptions take effect at once here; one turn lets the messages already sent be handed on."""
        await asyncio.sleep(0)

    def _inbox(self) -> str:
        return reply_subject(self._inbox_prefix, "call", next(self._seq))

    async def _answer(
        self, subject: str, on_output: Callable[[int, bytes], None] | None = None
    ) -> tuple[asyncio.Future[Delivery], Subscription]:
        """Subscribe an inbox: the future of its final answer (progress, pauses and output parts are not one),
        and the subscription to end once it came."""
        fut: asyncio.Future[Delivery] = asyncio.get_running_loop().create_future()

        async def on_reply(msg: Delivery) -> None:
            headers = msg.headers or {}
            if PROGRESS_HEADER in headers or PAUSE_HEADER in headers:
                return
            if OUTPUT_HEADER in headers:
                if on_output is not None:
                    on_output(2 if headers[OUTPUT_HEADER] == "2" else 1, msg.data)
                return
            if not fut.done():
                fut.set_result(msg)

        sub = await self.subscribe(subject, on_reply)
        return fut, sub

    async def _wait(self, fut: asyncio.Future[Delivery], sub: Subscription, subject: str, op: str, t: float) -> Any:
        try:
            msg = await asyncio.wait_for(fut, t)
        except TimeoutError:
            info = ErrorInfo(error_class="timeout", message=f"no reply to {op} within {t:g}s", retryable=True)
            raise Failure(info) from None
        finally:
            await sub.unsubscribe()
        if msg.headers and BUSY_HEADER in msg.headers and not msg.data:
            raise Busy(ErrorInfo(error_class="busy", message=f"no free slot on {subject}", retryable=True))
        body = await self.decode(msg)
        if isinstance(body, ErrorReply):
            raise Failure(body.error)
        return body

    async def request(
        self,
        subject: str,
        payload: Any,
        *,
        timeout: float,
        op: str,
        liveness_s: float | None = None,
        on_output: Callable[[int, bytes], None] | None = None,
    ) -> Any:
        """Core request-reply; nobody subscribed is ``NoResponders`` (retryable ``worker_lost``)."""
        inbox = self._inbox()
        fut, sub = await self._answer(inbox, on_output)
        h = traced(self.telemetry)
        data = await self.encode(payload, h)
        if not self.broker.publish(subject, data, h, reply=inbox):
            await sub.unsubscribe()
            info = ErrorInfo(error_class="worker_lost", message=f"no worker is serving {subject}", retryable=True)
            raise NoResponders(info)
        return await self._wait(fut, sub, subject, op, timeout)

    async def queued_request(
        self, subject: str, payload: Any, *, timeout: float, op: str, wait_s: float | None = None
    ) -> Any:
        """Store a request in the work queue, wait for the core reply (``Bus.queued_request``)."""
        inbox = self._inbox()
        fut, sub = await self._answer(inbox)
        h = traced(self.telemetry, {REPLY_HEADER: inbox})
        h[EXPIRES_HEADER] = f"{time.time() + (timeout if wait_s is None else wait_s):.3f}"
        self.broker.store(subject, await self.encode(payload, h, stored=True), h)
        return await self._wait(fut, sub, subject, op, timeout + (wait_s or 0.0))

    async def direct_or_queued(
        self,
        direct: str,
        queued: str,
        payload: Any,
        *,
        timeout: float,
        op: str,
        liveness_s: float | None = None,
        wait_s: float | None = None,
    ) -> Any:
        """A free slot right now (direct), else the work queue (``Bus.direct_or_queued``)."""
        try:
            return await self.request(direct, payload, timeout=timeout, op=op)
        except NoResponders:  # Busy too
            pass
        return await self.queued_request(queued, payload, timeout=timeout, op=op, wait_s=wait_s)

    async def gather(
        self,
        subject: str,
        payload: Any,
        *,
        done: Callable[[list[Any]], bool],
        timeout: float,
        headers: dict[str, str] | None = None,
    ) -> list[Any]:
        inbox = self._inbox()
        replies: list[Any] = []
        finished = asyncio.Event()

        async def on_reply(msg: Delivery) -> None:
            replies.append(await self.decode(msg))
            if done(replies):
                finished.set()

        sub = await self.subscribe(inbox, on_reply)
        try:
            h = traced(self.telemetry, headers)
            self.broker.publish(subject, await self.encode(payload, h), h, reply=inbox)
            if not done(replies):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(finished.wait(), timeout)
        finally:
            await sub.unsubscribe()
        return replies

    async def scatter(
        self, subject: str, *, wait_s: float, until: Callable[[str, bytes], bool] | None = None
    ) -> list[tuple[str, bytes]]:
        """An empty request to every subscriber; their raw answers under its reply root (``Bus.scatter``)."""
        root = self._inbox()
        got: list[tuple[str, bytes]] = []
        enough = asyncio.Event()

        async def on_answer(msg: Delivery) -> None:
            got.append((msg.subject, msg.data))
            if until is not None and until(msg.subject, msg.data):
                enough.set()

        sub = await self.subscribe(answers(root), on_answer)
        try:
            self.broker.publish(subject, b"", None, reply=root)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(enough.wait(), wait_s)
        finally:
            await sub.unsubscribe()
        return got

    # -- streams
    async def js_publish(self, subject: str, payload: Any, *, msg_id: str, keep: str | None = None) -> None:
        h = traced(self.telemetry, {MSG_ID_HEADER: msg_id})
        data = await self.encode(payload, h, stored=True)
        self.broker.store(subject, data, h)
        if keep is not None:
            self.broker.store(keep, data, {k: v for k, v in h.items() if k != MSG_ID_HEADER})

    async def note(self, subject: str, data: bytes) -> None:
        self.broker.store(subject, data, {})

    async def ensure_results_stream(self, agent: str) -> str:
        name = self.subjects.results_stream(agent)
        self.streams.add(name)
        return name

    async def ensure_attempts_stream(self) -> None:
        self.streams.add(self.subjects.attempts_stream)

    async def work_queue(
        self, kind: str, name: str, *, slots: int, ack_wait: float, handle: Callable[[Delivery], Awaitable[None]]
    ) -> Puller:
        pattern = self.subjects.queue_filter(kind, name)
        return MemoryPuller(self.broker, pattern, slots=slots, ack_wait=ack_wait, handle=handle)

    async def kv(self, bucket: str) -> KeyValue:
        return MemoryKV(self.broker.kv.setdefault(bucket, {}))

    # -- streams read back
    async def reader(
        self, stream: str, consumer: str, subject: str, *, handle: Callable[[Delivery], Awaitable[None]]
    ) -> StreamReader:
        self.streams.add(stream)
        return MemoryReader(self.broker, (stream, consumer), subject, handle)

    async def subject_count(self, stream: str, subjects: str) -> int:
        return self.broker.count(subjects)

    async def stream_full(self, stream: str) -> bool:
        return False  # no stream limits here

    async def last_stored(self, stream: str, subject: str) -> Delivery | None:
        s = self.broker.last(subject)
        return None if s is None else Delivery(MemoryMessage(s.subject, s.data, dict(s.headers)))

    # -- serving
    async def reply(self, subject: str | None, payload: Any, *, error: bool = False) -> None:
        if subject:
            h = traced(self.telemetry, {ERROR_HEADER: "1"} if error else None)
            self.broker.publish(subject, await self.encode(payload, h), h)

    async def serve(
        self,
        tg: TaskGroup,
        subject: str,
        handler: Handler,
        *,
        queue: str = "",
        concurrency: int = 256,
        default_error: str = "internal",
    ) -> Subscription:
        """Each message in a task of ``tg``, at most ``concurrency`` at once (``Serving.serve``)."""
        limiter = asyncio.Semaphore(concurrency)

        async def run_one(msg: Delivery) -> None:
            try:
                await self.handle(msg, handler, reply_to=msg.reply, default_error=default_error)
            finally:
                limiter.release()

        async def on_msg(msg: Delivery) -> None:
            await limiter.acquire()
            tg.start_soon(run_one, msg)

        return await self.subscribe(subject, on_msg, queue=queue)

    async def serve_direct(
        self,
        tg: TaskGroup,
        subject: str,
        handler: Handler,
        *,
        queue: str,
        admit: Callable[[Delivery], bool],
        done: Callable[[], Awaitable[None]],
        default_error: str,
        attributes: dict[str, Any] | None = None,
    ) -> Subscription:
        async def run(msg: Delivery) -> None:
            try:
                await self.handle(msg, handler, reply_to=msg.reply, default_error=default_error, attributes=attributes)
            finally:
                await done()

        async def on_msg(msg: Delivery) -> None:
            if not admit(msg):
                await asyncio.sleep(0)
                if not admit(msg):
                    if msg.reply:
                        self.broker.publish(msg.reply, b"", {BUSY_HEADER: "1"})
                    return
            tg.start_soon(run, msg)

        return await self.subscribe(subject, on_msg, queue=queue)

    async def handle(
        self,
        msg: Delivery,
        handler: Handler,
        *,
        reply_to: str | None,
        default_error: str,
        attributes: dict[str, Any] | None = None,
        body: Any = _UNSET,
    ) -> bool:
        """Decode, run ``handler``, answer it: every failure a typed error reply (``Serving.handle``)."""
        try:
            if body is _UNSET:
                body = await self.decode(msg)
            token = _REPLYING.set(reply_to)
            try:
                result = await handler(body, msg)
            finally:
                _REPLYING.reset(token)
        except Exception as exc:
            if not isinstance(exc, Failure):
                self.count_junk(msg.subject, f"handler: {type(exc).__name__}", exc)
            await self.reply(reply_to, ErrorReply(error=error_info(exc, default_error)), error=True)
            return False
        if result is not None:
            await self.reply(reply_to, result)
        return True

    def expired(self, msg: Delivery) -> bool:
        return expired(msg)

    async def taken(self, reply_to: str | None) -> None:
        if reply_to:
            self.broker.publish(reply_to, b"", {PROGRESS_HEADER: "1"})

    def pause_caller(self, took: float | None) -> None:
        reply_to = _REPLYING.get()
        if reply_to:
            self.broker.publish(reply_to, b"", {PAUSE_HEADER: "1" if took is None else f"{took:.6f}"})

    async def send_output(self, stream: int, data: bytes) -> None:
        reply_to = _REPLYING.get()
        if reply_to and data:
            self.broker.publish(reply_to, data, {OUTPUT_HEADER: str(stream)})

    def count_junk(self, subject: str, cause: str, exc: BaseException | None = None) -> None:
        self.warn_limited("requests.refused", cause, subject=subject, exc=exc)

    def warn_limited(self, event: str, cause: str, *, subject: str, exc: BaseException | None = None) -> None:
        self.junk[cause] = self.junk.get(cause, 0) + 1


if TYPE_CHECKING:  # mypy holds the double to the Protocol the workers are typed against
    _memory_is_a_transport: type[Transport] = MemoryTransport
