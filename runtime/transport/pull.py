"""Slot-based pulling from a JetStream consumer, and the streams it pulls from.

A worker asks the server for exactly as many messages as it has free slots
(backpressure), so a slow replica takes proportionally less than a fast one —
unlike a core queue group, which deals messages out blindly. Pull requests are
raw ``$JS.API.CONSUMER.MSG.NEXT`` publishes with a credit count, not nats-py's
``fetch`` (which waits for whole batches); a supervisor re-pulls after expiry or
a server restart, and in-flight messages get ``+WPI`` heartbeats so long
rollouts are not redelivered while they still run.

Credits are kept per pull request with the request's expiry: a request lost to a
reconnect or a server restart stops counting when it would have expired (or at
once, on reconnect), so the worker asks for its full share again — even while a
trickle of answers keeps arriving — and returns to full speed within seconds.
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable

import anyio
import msgspec
from nats.aio.msg import Msg

from gym_runtime.observability import logs
from gym_runtime.transport.delivery import Delivery, Message
from gym_runtime.transport.headers import CONTROL, sent_as_control
from gym_runtime.transport.interface import Connection, inline
from gym_runtime.transport.jetstream import ensure_consumer, ensure_streams
from gym_runtime.transport.rpc import process_tag
from gym_runtime.transport.subjects import pull_next
from gym_runtime.transport.tasks import TaskSet

log = logs.get("gym.pull")

ACK_WAIT_S = 30.0
SUPERVISE_S = 0.5  # how often lost requests are forgotten and credit is topped up
LOST_SLACK_S = 1.0  # a request unanswered this long past its expiry was lost
LIVE_S = 1.0  # a work-queue worker says which messages it holds this often: one message, not one per task
LIVE_SOON_S = 0.1  # ... and this soon after it took new ones (at most 10 beacons a second, whatever the load)
DEAD_S = 3.5  # a peer silent this long is dead: its messages are nak'd on its behalf (redelivered at once)
FULL_EVERY = 10  # every FULL_EVERY * LIVE_S a beacon lists everything held (a peer that joined late learns it)
LOST_KEPT_S = 300.0  # how long a peer's process found silent is still named (``gym-runtime why``)


class Beacon(msgspec.Struct, array_like=True):
    """What one worker of a pool holds: ack subjects taken and finished since its last beacon."""

    worker: str
    add: list[str]
    done: list[str]
    full: bool = False
    bye: bool = False  # stopping: it holds nothing, nothing to nak


_beacon_enc = msgspec.msgpack.Encoder()
_beacon_dec = msgspec.msgpack.Decoder(Beacon)


async def work_queue_puller(
    bus: Connection,
    kind: str,
    name: str,
    *,
    slots: int,
    ack_wait: float,
    handle: Callable[[Delivery], Awaitable[None]],
) -> PullWorker:
    """A ``PullWorker`` on ``{ns}.{kind}.{name}`` (kind: ``task`` or ``model``), streams and consumer ensured."""
    await ensure_streams(bus)
    names = bus.subjects
    stream = names.stream(kind)
    durable = names.durable(kind, name)
    await ensure_consumer(bus, stream, durable, names.queue_filter(kind, name), ack_wait=ack_wait)
    return PullWorker(
        bus,
        stream=stream,
        consumer=durable,
        slots=slots,
        handle=handle,
        heartbeat_s=ack_wait / 3,
        liveness=names.live(kind, name),
        component=f"{kind}s.{name}" if kind != "task" else f"agents.{name}",
    )


class Requests:
    """The pull requests still alive, oldest first (the server serves them in order), each with its expiry
    and the credits it has left; their sum is kept as they change, not re-added for every delivery."""

    def __init__(self) -> None:
        self._live: deque[list[float]] = deque()  # [expires_at, credits left] (a whole number)
        self.credits = 0  # messages asked for and not yet delivered

    def __bool__(self) -> bool:
        return bool(self._live)

    def add(self, expires_at: float, credits: int) -> None:
        self._live.append([expires_at, credits])
        self.credits += credits

    def consume(self) -> None:
        """A delivery fills the oldest request."""
        if self._live:
            oldest = self._live[0]
            oldest[1] -= 1
            self.credits -= 1
            if oldest[1] <= 0:
                self._live.popleft()

    def oldest_expires_at(self) -> float:
        return self._live[0][0]

    def drop_oldest(self) -> None:
        """The oldest expired (past its time, or the server's 408 says so): its leftover credits are void."""
        self.credits -= int(self._live.popleft()[1])

    def clear(self) -> None:
        self._live.clear()
        self.credits = 0


class PullWorker:
    """Pull messages into at most ``slots`` concurrent handler tasks.

    Credits are the messages asked for and not yet delivered. A finished handler
    asks for more straight away (in chunks, so a busy worker does not send one
    pull request per message); a supervisor loop re-pulls when requests expire
    or were lost to a reconnect.
    """

    def __init__(
        self,
        bus: Connection,
        *,
        stream: str,
        consumer: str,
        slots: int,
        handle: Callable[[Delivery], Awaitable[None]],
        expires_s: float = 2.0,  # short: a request lost in a leader election is re-sent within ~3 s
        heartbeat_s: float = ACK_WAIT_S / 3,
        inline: bool = False,
        recreate: Callable[[], Awaitable[None]] | None = None,
        liveness: str | None = None,
        component: str = "",
    ) -> None:
        self.bus = bus
        self.component = component or consumer  # what the operator is told to look at (``agents.NAME``)
        self.stream = stream
        self.consumer = consumer
        self.slots = max(1, slots)
        self.handle = handle
        self.expires_s = expires_s
        self.heartbeat_s = heartbeat_s
        # ``handle`` never waits on anything slow (the collector): run it in the delivery
        # callback instead of a task of its own per message
        self.inline = inline
        # the consumer was deleted under us (no responders to our pulls): make it again, or fail with one line
        self.recreate = recreate
        self._recreating = False
        # worker liveness on a pool subject: a peer that falls silent has its messages nak'd by the others,
        # so they are redelivered within seconds instead of after ack_wait (no per-message traffic)
        self.liveness = liveness
        # ``id@node/pid``: a peer that finds this worker silent names its process (``why``, the operator's line)
        self._me = f"{uuid.uuid4().hex[:12]}@{process_tag()}"
        self.lost: dict[str, tuple[float, int]] = {}  # peers' processes found silent lately: (when, nak'd)
        self._held: dict[str, None] = {}  # ack subjects of the messages this worker holds
        self._added: list[str] = []
        self._news: anyio.Event | None = None  # set when a message is taken: its beacon goes out now, not later
        self._done: list[str] = []
        self._peers: dict[str, tuple[float, set[str]]] = {}
        self.nakked_for_peers = 0
        self.busy = 0
        self.delivered = 0
        self._requests = Requests()
        self._inflight: dict[int, Delivery] = {}
        self._stopping = False
        self._reconnects = 0
        self._api = pull_next(stream, consumer)
        self._inbox = ""
        self._expires_ns = int(expires_s * 1e9)
        self._min_pull = max(1, min(32, self.slots // 8))
        self._idle = anyio.Event()

    @property
    def credits(self) -> int:
        """Messages asked for and not yet delivered (by requests still alive)."""
        return self._requests.credits

    def _forget_lost(self, now: float) -> None:
        """Drop requests past their expiry (plus slack): the server restarted or the answer was lost."""
        reconnects = int(self.bus.nc.stats.get("reconnects", 0))
        if reconnects != self._reconnects:
            self._reconnects = reconnects
            self._requests.clear()  # requests went to a connection that no longer exists
            return
        while self._requests and self._requests.oldest_expires_at() + LOST_SLACK_S < now:
            self._requests.drop_oldest()

    def stop_pulling(self) -> None:
        """Drain: ask for nothing more; running handlers finish."""
        self._stopping = True

    async def _pull(self, *, force: bool = False) -> None:
        want = self.slots - self.busy - self.credits
        if self._stopping or want <= 0 or not self.bus.nc.is_connected:
            return
        if want < self._min_pull and self.credits and not force:
            return
        self._requests.add(time.monotonic() + self.expires_s, want)
        req = b'{"batch":%d,"expires":%d}' % (want, self._expires_ns)
        await self.bus.nc.publish(self._api, req, reply=self._inbox)

    async def run(self) -> None:
        nc = self.bus.nc
        self._inbox = nc.new_inbox()
        tasks = TaskSet()
        async with anyio.create_task_group() as tg:
            tg.start_soon(tasks.guard)

            async def on_status(headers: dict[str, str]) -> None:
                status = headers.get("Status")
                if status == "408":  # the oldest request expired: its leftover credits are void
                    if self._requests and self._requests.oldest_expires_at() <= time.monotonic() + 1.0:
                        self._requests.drop_oldest()
                    await self._pull(force=True)
                elif status == "503" or (status == "409" and "Deleted" in headers.get("Description", "")):
                    self._requests.clear()  # no consumer answers: it was deleted
                    if self.recreate is not None and not self._recreating:
                        self._recreating = True
                        tg.start_soon(self._make_again)
                elif status == "409":  # refused or voided (leader change, max waiting)
                    self._requests.clear()
                    await self._pull(force=True)

            def taken(msg: Message) -> Delivery | None:
                """The delivery ``msg`` holds, counted as taken; None for a status (handled in a task of its own)."""
                headers = msg.headers
                if headers and "Status" in headers and not msg.data:
                    tasks.spawn(on_status, headers)
                    return None
                self._requests.consume()
                self.busy += 1
                self.delivered += 1
                delivery = Delivery(msg)
                self._inflight[id(delivery)] = delivery
                if self.liveness is not None:
                    self._held[msg.reply] = None
                    self._added.append(msg.reply)
                    if self._news is not None:  # the beacon loop waits on it: wake it once (it makes the next)
                        self._news.set()
                        self._news = None
                return delivery

            def spawned(msg: Message) -> None:  # each delivery's handler in a task, started as the message is read
                delivery = taken(msg)
                if delivery is not None:
                    tasks.spawn(self._run_one, delivery)

            async def awaited(msg: Message) -> None:  # ``inline``: handlers awaited in turn, in the subscription's task
                delivery = taken(msg)
                if delivery is not None:
                    await self._run_one(delivery)

            sub = await nc.subscribe(self._inbox, cb=awaited if self.inline else inline(spawned))
            tg.start_soon(self._heartbeats)
            live_sub = None
            if self.liveness is not None:
                live_sub = await nc.subscribe(self.liveness, cb=self._on_beacon)
                tg.start_soon(self._beacon_loop)
            try:
                self._reconnects = int(nc.stats.get("reconnects", 0))
                await self._pull(force=True)
                while not self._stopping:
                    await anyio.sleep(SUPERVISE_S)
                    self._forget_lost(time.monotonic())
                    await self._pull(force=True)
                while self.busy:  # drain: let in-flight handlers finish
                    self._idle = anyio.Event()
                    with anyio.move_on_after(0.5):
                        await self._idle.wait()
            finally:
                await sub.unsubscribe()
                if live_sub is not None:
                    with anyio.CancelScope(shield=True):
                        await live_sub.unsubscribe()
                        if nc.is_connected and not self.busy:  # nothing held: the peers forget us now
                            bye = _beacon_enc.encode(Beacon(self._me, [], [], bye=True))
                            await nc.publish(self.liveness or "", bye, headers=dict(CONTROL))
                tg.cancel_scope.cancel()

    async def _make_again(self) -> None:
        assert self.recreate is not None
        log.warning("pull.consumer_gone", stream=self.stream, consumer=self.consumer, then="recreating it")
        try:
            await self.recreate()
        except Exception as e:  # it was not gone: a stream leader election answers 503 too (the consumer
            # exists, "deliver policy can not be updated"), or the server is busy: pull on, ask again later
            log.info("pull.consumer_kept", stream=self.stream, consumer=self.consumer, reason=str(e))
            await anyio.sleep(1.0)
        finally:
            self._recreating = False
        await self._pull(force=True)

    def take_slot(self) -> bool:
        """Reserve a slot for work that arrived another way (a direct call); False when none is free.

        The slot counts like a pulled message's, so the worker pulls less while it
        is taken. Pull requests already out may still deliver: a worker may briefly
        hold a few more than ``slots`` messages, so the handler bounds the work it
        runs itself (the model worker's ``running``).
        """
        if self._stopping or self.busy >= self.slots:
            return False
        self.busy += 1
        return True

    async def give_slot(self) -> None:
        """Free a slot taken with ``take_slot`` (and pull into it)."""
        self.busy -= 1
        if self._stopping:
            if not self.busy:
                self._idle.set()
        else:
            await self._pull()

    async def release(self, msg: Delivery) -> None:
        """Free ``msg``'s slot now (its work is done; only storing/acking remains).

        Pulling the next message overlaps the last round trips of this one, which
        is what keeps a worker busy at concurrency 1. Idempotent.
        """
        if self._inflight.pop(id(msg), None) is None:
            return
        await self.give_slot()

    async def _run_one(self, msg: Delivery) -> None:
        try:
            await self.handle(msg)
        except Exception as exc:  # the handler owns acking; a crash here must not kill the loop
            log.error("pull.handler_crashed", consumer=self.consumer, error=repr(exc))
        finally:
            if self.liveness is not None and self._held.pop(msg.reply, 0) is None:
                self._done.append(msg.reply)
            await self.release(msg)

    async def _on_beacon(self, msg: Msg) -> None:
        if not sent_as_control(msg.headers):  # a server's answer borrowed into the subject: no peer's beacon
            return
        try:
            b = _beacon_dec.decode(msg.data)
        except msgspec.DecodeError:
            return
        if b.worker == self._me:
            return
        if b.bye:
            self._peers.pop(b.worker, None)
            return
        _, held = self._peers.get(b.worker, (0.0, set()))
        if b.full:
            held = set(b.add)
        else:
            held.update(b.add)
        held.difference_update(b.done)
        self._peers[b.worker] = (time.monotonic(), held)

    async def _beacon_loop(self) -> None:
        """Say what this worker holds every ``LIVE_S``, and at once (at most every ``LIVE_SOON_S``) after it
        takes a message: a message taken and not yet announced waits ``ack_wait`` if this worker dies, so
        the window is kept to one event-loop turn; nak on behalf of a peer silent for ``DEAD_S``."""
        nc = self.bus.nc
        last = last_full = time.monotonic()
        while True:
            self._news = anyio.Event()
            if not self._added:
                with anyio.move_on_after(max(0.0, LIVE_S - (time.monotonic() - last))):
                    await self._news.wait()
            soon = LIVE_SOON_S - (time.monotonic() - last)
            if soon > 0:
                await anyio.sleep(soon)
            now = time.monotonic()
            last = now
            full = now - last_full >= FULL_EVERY * LIVE_S
            if full:
                last_full = now
            add = list(self._held) if full else self._added
            beacon = Beacon(self._me, add, [] if full else self._done, full=full)
            self._added, self._done = [], []
            if not nc.is_connected:
                continue
            try:
                await nc.publish(self.liveness or "", _beacon_enc.encode(beacon), headers=dict(CONTROL))
            except Exception:  # disconnected meanwhile: the next beacon says it all again
                continue
            now = time.monotonic()
            for worker, (seen, held) in list(self._peers.items()):
                if now - seen < DEAD_S:
                    continue
                del self._peers[worker]
                self._peer_lost(worker, len(held), now)
                for ack in held:  # every peer may do this; a second nak of one delivery changes nothing
                    await nc.publish(ack, b"-NAK")
                self.nakked_for_peers += len(held)

    def _peer_lost(self, worker: str, held: int, now: float) -> None:
        """A peer silent past ``DEAD_S``: kept for ``why`` and, if it held work, told in one line naming it."""
        process = worker.partition("@")[2] or worker
        for old in [p for p, (at, _) in self.lost.items() if now - at >= LOST_KEPT_S]:
            del self.lost[old]
        self.lost[process] = (now, held)
        if held:
            log.warning(
                "worker.silent",
                component=self.component,
                process=process,
                redelivered=held,
                fix=f"its {held} message(s) go to the live workers now; look at {self.component} process {process} "
                "(frozen? `kill -CONT`, or kill it)",
            )

    async def _heartbeats(self) -> None:
        while True:
            await anyio.sleep(self.heartbeat_s)
            for msg in list(self._inflight.values()):  # released messages are acked within a round trip
                try:
                    await msg.in_progress()
                except Exception:  # disconnected: the redelivery path takes over
                    break
