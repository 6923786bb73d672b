"""The in-memory wire (``interface.Wire``), beside the real one (``wire.NatsWire``): a ``Bus`` on it runs workers
and the collector's parts without a nats-server (``gym_runtime.testing.MemoryTransport``).

It implements only the wire; calls, serving, typed errors, large bodies and discovery are the ``Bus``'s, the
same code as on NATS. What the server does, it does: core publish/subscribe with NATS subject wildcards and
queue groups (one member of a group gets each message), "no responders" (a ``Status: 503`` answer) for a
request nobody subscribes to, stored messages on every subject a runtime stream holds (tasks, model queues,
results, kept tasks, attempt records, large bodies' chunks), each with a sequence number, deduplicated by
``Nats-Msg-Id`` within the duplicate window, a stored publish with a reply answered by its ack, direct gets of
the last message on a subject, work-queue pullers with ack / nak (after a delay) / term and redelivery of a
message left unanswered after ``ack_wait``, acked readers of a subject (in sequence order, ack-all, what is
held for them counted, a reader made again on a consumer that was not deleted gets what it had not acked
again), and KV buckets. Several wires on one ``MemoryBroker`` are several connections to one server.
What it does not do: one stream and one duplicate window for every stored subject (the stream names asked
for are recorded, never enforced), in which only task and model messages leave when acked; a stored message
is not also delivered to core subscribers; no stream limits (never full, nothing evicted, no
``max_msgs_per_subject``, no TTL); no advisories (a reader sees a terminated task at its next tick); a reader's
unacked messages come again only when it is made again, never after an ``ack_wait``; no consumer deleted
under a reader; no permissions; no reconnects. End-to-end behaviour is tested on a real nats-server.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from typing import TYPE_CHECKING, Any

import anyio
import nats.errors

from gym_runtime.observability import logs
from gym_runtime.transport.delivery import Delivery, Message
from gym_runtime.transport.headers import MSG_ID_HEADER
from gym_runtime.transport.interface import Handle, KeyValue, OnMessage, Puller, StreamReader, Subscription, Wire
from gym_runtime.transport.limits import DUPLICATE_WINDOW_S
from gym_runtime.transport.subjects import AckFields, Subjects, ack_reply, direct_get, inbox_prefix, kv_parts

__all__ = ["MemoryBroker", "MemoryMessage", "MemoryWire", "subject_matches"]

log = logs.get("gym.memory")

_DIRECT_GET = direct_get("")  # the prefix of a direct get's subject: ``{prefix}{stream}.{subject}``


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS wildcards: ``*`` one token, ``>`` one or more at the end."""
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)


class _Stored:
    __slots__ = ("seq", "subject", "data", "headers", "stored_at", "delivered", "held", "ready_at")

    def __init__(self, seq: int, subject: str, data: bytes, headers: dict[str, str]) -> None:
        self.seq, self.subject, self.data, self.headers = seq, subject, data, headers
        self.stored_at = time.time()
        self.delivered = 0
        self.held = False  # taken by a puller, not yet acked, nak'd or terminated
        self.ready_at = 0.0  # monotonic: a nak'd message waits until then


def _ack_reply(s: _Stored, delivered: int) -> str:
    """A delivery's reply subject as the server writes it: ``Delivery`` reads its count, sequence and time there."""
    return ack_reply("memory", "c", AckFields(delivered, s.seq, int(s.stored_at * 1e9)))


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

    def __init__(self, broker: MemoryBroker, subject: str, queue: str, cb: OnMessage) -> None:
        self.broker, self.subject, self.queue, self.cb = broker, subject, queue, cb
        broker.subs.append(self)
        self.inbox: asyncio.Queue[MemoryMessage] = asyncio.Queue()
        self.owner: object = None  # the wire that made it (``MemoryWire.close`` ends its own)
        self.task = asyncio.ensure_future(self._pump())

    async def _pump(self) -> None:
        while True:
            msg = await self.inbox.get()
            try:
                await self.cb(msg)
            except Exception as e:  # noqa: BLE001 - a callback's error must not end the subscription
                log.warning("memory.callback_failed", subject=msg.subject, error=repr(e))

    async def unsubscribe(self) -> None:
        with contextlib.suppress(ValueError):
            self.broker.subs.remove(self)
        self.task.cancel()


class MemoryBroker:
    """The server several ``MemoryWire`` connections share: subscriptions, the stored messages (one stream for
    every stored subject, large bodies' chunks among them) and KV buckets."""

    def __init__(self, *, duplicate_window_s: float = DUPLICATE_WINDOW_S) -> None:
        self.subs: list[_Sub] = []
        self.stored: dict[int, _Stored] = {}  # by sequence, oldest first
        self.kv: dict[str, dict[str, bytes]] = {}
        self.consumers: dict[tuple[str, str], _Consumer] = {}  # (stream, name) -> a reader's place
        self.duplicate_window_s = duplicate_window_s
        self.seq = 0  # the last stored message's
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
        the server would; after the window the same id is stored again). Its sequence is ``self.seq``."""
        msg_id = headers.get(MSG_ID_HEADER)
        if msg_id is not None:
            now = time.monotonic()
            first = self._ids.get(msg_id)
            if first is not None and now - first < self.duplicate_window_s:
                return False
            self._ids[msg_id] = now
        self.seq += 1
        self.stored[self.seq] = _Stored(self.seq, subject, data, dict(headers))
        self._notify()
        return True

    def take(self, pattern: str) -> MemoryMessage | None:
        """The oldest stored message on ``pattern`` that is not held and not waiting out a nak, now held."""
        now = time.monotonic()
        for s in self.stored.values():
            if not s.held and s.ready_at <= now and subject_matches(pattern, s.subject):
                s.held = True
                s.delivered += 1
                reply = _ack_reply(s, s.delivered)
                return MemoryMessage(s.subject, s.data, dict(s.headers), reply, stored=s, broker=self)
        return None

    def settle(self, s: _Stored, *, remove: bool, delay: float = 0.0) -> None:
        """Ack or term (``remove``: a work queue forgets it), else nak: takeable again after ``delay``."""
        if not s.held:
            return
        s.held = False
        if remove:
            self.stored.pop(s.seq, None)
            self._notify()  # for whoever waits for a queue to empty
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


async def _either(a: asyncio.Event, b: asyncio.Event) -> None:
    """Until one of two events is set (the broker's news, or a puller's or reader's own)."""
    waits = [asyncio.ensure_future(a.wait()), asyncio.ensure_future(b.wait())]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


class MemoryKV:
    """A KV bucket in memory (``interface.KeyValue``)."""

    def __init__(self, values: dict[str, bytes]) -> None:
        self.values = values

    async def get(self, key: str) -> bytes | None:
        return self.values.get(key)

    async def put(self, key: str, value: bytes) -> None:
        self.values[key] = value

    async def delete(self, key: str) -> None:
        self.values.pop(key, None)


class MemoryPuller:
    """Takes work-queue messages into at most ``slots`` handler tasks (``interface.Puller``).

    A message its handler left unanswered (no ack, nak or term) is delivered again after ``ack_wait``,
    as the server does; ``attempt`` counts deliveries."""

    def __init__(
        self,
        broker: MemoryBroker,
        pattern: str,
        *,
        slots: int,
        ack_wait: float,
        handle: Handle,
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
                await _either(changed, self._freed)
            while self._busy:  # drain: the running handlers finish
                self._freed = asyncio.Event()
                await self._freed.wait()

    async def _run_one(self, delivery: Delivery, msg: MemoryMessage) -> None:
        try:
            await self.handle(delivery)
        except Exception as e:  # noqa: BLE001 - the handler owns acking; a crash must not end the loop
            log.error("memory.handler_crashed", error=repr(e))
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
        reply = _ack_reply(stored, n)
        super().__init__(stored.subject, stored.data, dict(stored.headers), reply, stored=stored, broker=broker)

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
    (``interface.StreamReader``). Made on a consumer that exists (not deleted), it starts after
    what that consumer acked: what was delivered and not acked comes again."""

    def __init__(self, broker: MemoryBroker, key: tuple[str, str], pattern: str, handle: Handle) -> None:
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
                await _either(changed, self._wake)
                continue
            c.next = s.seq + 1
            c.deliveries[s.seq] = c.deliveries.get(s.seq, 0) + 1
            try:
                await self.handle(Delivery(_ReadMessage(s, c, self.broker)))
            except Exception as e:  # noqa: BLE001 - as ``PullWorker``: a crash must not end the reader
                log.error("memory.reader_crashed", error=repr(e))
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


class MemoryWire:
    """A connection to a ``MemoryBroker`` as an ``interface.Wire`` (nats-py's signatures for the core)."""

    def __init__(
        self, broker: MemoryBroker | None = None, *, namespace: str = "gym", max_payload: int = 1 << 20
    ) -> None:
        self.broker = broker or MemoryBroker()
        self.subjects = Subjects(namespace)
        self.secured = False
        self.jetstream_config: Any = None
        self._max_payload = max_payload
        self.streams: set[str] = set()  # the streams asked for (ensure_stream, reader): recorded, not enforced
        n = self.subjects  # what the runtime's streams hold (their subject filters), all there from the start
        self._stored = (n.all_tasks, n.all_model_queues, n.all_results, n.all_kept, n.all_attempts, n.all_blobs)
        self._inbox = inbox_prefix("memory", uuid.uuid4().hex[:8])  # this connection's replies
        self._seq = itertools.count()

    @property
    def max_payload(self) -> int:
        return self._max_payload

    # -- core messages
    async def publish(
        self, subject: str, payload: bytes = b"", reply: str = "", headers: dict[str, str] | None = None
    ) -> None:
        """A stream's subject is stored (a reply gets the stream's ack); any other is delivered, and a request
        nobody subscribes to is answered "no responders" (``Status: 503``), as the server does."""
        broker = self.broker
        if (kv := kv_parts(subject)) is not None:  # a KV key written as a stored publish (a checkpoint)
            bucket, key = kv
            values = broker.kv.setdefault(bucket, {})
            if (headers or {}).get("KV-Operation") in ("DEL", "PURGE"):
                values.pop(key, None)
            else:
                values[key] = payload
            if reply:
                broker.publish(reply, b'{"stream":"KV_%s","seq":0}' % bucket.encode(), None)
            return
        if any(subject_matches(f, subject) for f in self._stored):
            new = broker.store(subject, payload, headers or {})
            if reply:
                ack = b'{"stream":"memory","seq":%d%s}' % (broker.seq, b"" if new else b',"duplicate":true')
                broker.publish(reply, ack, None)
            return
        if not broker.publish(subject, payload, headers, reply) and reply:
            broker.publish(reply, b"", {"Status": "503"})

    async def subscribe(self, subject: str, queue: str = "", cb: OnMessage | None = None) -> Subscription:
        assert cb is not None, "a memory subscription needs its callback"
        sub = _Sub(self.broker, subject, queue, cb)
        sub.owner = self
        return sub

    async def request(self, subject: str, payload: bytes = b"", timeout: float = 0.5) -> Message:
        """A direct get (``subjects.direct_get``: the last message on its subject, headers as stored, else a
        ``Status: 404``), or the first answer of a responder."""
        if subject.startswith(_DIRECT_GET):
            stored = subject[len(_DIRECT_GET) :].partition(".")[2]
            if (kv := kv_parts(stored)) is not None:  # a KV key's value (a checkpoint)
                value = self.broker.kv.get(kv[0], {}).get(kv[1])
                if value is not None:
                    return MemoryMessage(stored, value, {})
            s = self.broker.last(stored)
            if s is None:
                return MemoryMessage(subject, b"", {"Status": "404", "Description": "Message Not Found"})
            return MemoryMessage(s.subject, s.data, dict(s.headers))
        fut: asyncio.Future[Message] = asyncio.get_running_loop().create_future()

        async def on_answer(msg: Message) -> None:
            if not fut.done():
                fut.set_result(msg)

        inbox = self.new_inbox()
        sub = await self.subscribe(inbox, cb=on_answer)
        try:
            if not self.broker.publish(subject, payload, None, inbox):
                raise nats.errors.NoRespondersError
            try:
                return await asyncio.wait_for(fut, timeout)
            except TimeoutError:
                raise nats.errors.TimeoutError from None
        finally:
            await sub.unsubscribe()

    def new_inbox(self) -> str:
        return f"{self._inbox}.{next(self._seq)}"

    async def flush(self) -> None:
        """Subscriptions take effect at once here; one turn lets the messages already sent be handed on."""
        await asyncio.sleep(0)

    async def close(self, timeout: float = 10.0) -> None:
        """End this connection's subscriptions."""
        for sub in [s for s in self.broker.subs if s.owner is self]:
            await sub.unsubscribe()

    # -- streams
    async def ensure_stream(self, kind: str, name: str = "") -> str:
        names = self.subjects
        stream = {"results": names.results_stream, "blobs": names.blob_stream}.get(kind)
        made = names.attempts_stream if stream is None else stream(name)
        self.streams.add(made)
        return made

    async def work_queue(self, kind: str, name: str, *, slots: int, ack_wait: float, handle: Handle) -> Puller:
        pattern = self.subjects.queue_filter(kind, name)
        return MemoryPuller(self.broker, pattern, slots=slots, ack_wait=ack_wait, handle=handle)

    async def reader(self, stream: str, consumer: str, subject: str, *, handle: Handle) -> StreamReader:
        self.streams.add(stream)
        return MemoryReader(self.broker, (stream, consumer), subject, handle)

    async def kv(  # no ages here; a key's direct get reads it (``request``)
        self, bucket: str, *, within_s: float, ttl_s: float = 0.0, direct: bool = False, msg_ttl: bool = False
    ) -> KeyValue:
        return MemoryKV(self.broker.kv.setdefault(bucket, {}))

    async def subject_count(self, stream: str, subjects: str) -> int:
        return self.broker.count(subjects)

    async def stream_full(self, stream: str) -> bool:
        return False  # no stream limits here


if TYPE_CHECKING:  # mypy holds it to the wire the Bus is built on
    _memory_is_a_wire: type[Wire] = MemoryWire
