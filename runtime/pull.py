"""Slot-based pulling from a JetStream consumer, and the streams it pulls from.

A worker asks the server for exactly as many messages as it has free slots
(backpressure), so a slow replica takes proportionally less than a fast one —
unlike a core queue group, which deals messages out blindly. Pull requests are
raw ``$JS.API.CONSUMER.MSG.NEXT`` publishes with a credit count, not nats-py's
``fetch`` (which waits for whole batches); a supervisor re-pulls after expiry or
a server restart, and in-flight messages get ``+WPI`` heartbeats so long
rollouts are not redelivered while they still run.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable

import anyio
from nats.aio.msg import Msg
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError, NotFoundError

from runtime import logs
from runtime.bus import Bus

log = logs.get("gym.pull")

ACK_WAIT_S = 30.0
MAX_ACK_PENDING = 1_000_000  # consumer-wide cap; must exceed every slot of every replica


def stream_names(ns: str) -> dict[str, str]:
    base = ns.upper().replace("-", "_")
    return {"task": f"{base}_TASKS", "result": f"{base}_RESULTS", "model": f"{base}_MODEL"}


async def ensure_streams(bus: Bus) -> None:
    """Create (idempotently) the task, result and model-call streams of a namespace."""
    names = stream_names(bus.ns)
    configs = [
        StreamConfig(
            name=names["task"],
            subjects=[f"{bus.ns}.task.>"],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            duplicate_window=3600.0,
        ),
        StreamConfig(
            name=names["result"],
            subjects=[f"{bus.ns}.result.>"],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            duplicate_window=3600.0,
        ),
        StreamConfig(
            name=names["model"],
            subjects=[f"{bus.ns}.model.>"],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,  # survives a server restart, with its consumers
            duplicate_window=120.0,
        ),
    ]
    for cfg in configs:
        try:
            await bus.js.stream_info(cfg.name)
        except NotFoundError:
            try:
                await bus.js.add_stream(cfg)
            except BadRequestError as e:  # another process created it first
                if "already in use" not in str(e):
                    raise


async def ensure_consumer(bus: Bus, stream: str, durable: str, subject: str, *, ack_wait: float) -> None:
    cfg = ConsumerConfig(
        durable_name=durable,
        filter_subject=subject,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=ack_wait,
        max_deliver=-1,  # attempts are capped by the worker, which writes a failure row
        max_ack_pending=MAX_ACK_PENDING,
        max_waiting=4096,
    )
    try:
        await bus.js.consumer_info(stream, durable)
    except NotFoundError:
        await bus.js.add_consumer(stream, cfg)


class PullWorker:
    """Pull messages into at most ``slots`` concurrent handler tasks."""

    def __init__(
        self,
        bus: Bus,
        *,
        stream: str,
        consumer: str,
        slots: int,
        handle: Callable[[Msg], Awaitable[None]],
        expires_s: float = 5.0,
        heartbeat_s: float = ACK_WAIT_S / 3,
    ) -> None:
        self.bus = bus
        self.stream = stream
        self.consumer = consumer
        self.slots = max(1, slots)
        self.handle = handle
        self.expires_s = expires_s
        self.heartbeat_s = heartbeat_s
        self.busy = 0
        self.credits = 0
        self.delivered = 0
        self._inflight: dict[int, Msg] = {}
        self._wake = anyio.Event()
        self._stopping = False
        self._last_answer = 0.0
        # Re-pull in chunks so a busy worker does not send one request per finished task.
        self._min_pull = max(1, min(32, self.slots // 8))

    def stop_pulling(self) -> None:
        """Drain: ask for nothing more; running handlers finish."""
        self._stopping = True
        self._wake.set()

    async def run(self) -> None:
        nc = self.bus.nc
        inbox = nc.new_inbox()
        api = f"$JS.API.CONSUMER.MSG.NEXT.{self.stream}.{self.consumer}"
        expires_ns = int(self.expires_s * 1e9)
        async with anyio.create_task_group() as tg:

            async def on_msg(msg: Msg) -> None:
                headers = msg.headers
                if headers and "Status" in headers and not msg.data:
                    self._last_answer = time.monotonic()
                    status = headers.get("Status")
                    if status in ("408", "409"):
                        pending = int(headers.get("Nats-Pending-Messages", "0") or 0)
                        self.credits = max(0, self.credits - pending) if pending else 0
                        self._wake.set()
                    return
                self._last_answer = time.monotonic()
                self.credits = max(0, self.credits - 1)
                self.busy += 1
                self.delivered += 1
                self._inflight[id(msg)] = msg
                tg.start_soon(self._run_one, msg)

            sub = await nc.subscribe(inbox, cb=on_msg)
            tg.start_soon(self._heartbeats)
            try:
                last_pull = 0.0
                while not self._stopping:
                    want = self.slots - self.busy - self.credits
                    now = time.monotonic()
                    if self.credits and now - max(last_pull, self._last_answer) > self.expires_s + 2:
                        self.credits = 0  # requests lost (server restart): start over
                        want = self.slots - self.busy
                    if want >= self._min_pull or (want > 0 and self.credits == 0):
                        if nc.is_connected:
                            req = json.dumps({"batch": want, "expires": expires_ns}).encode()
                            await nc.publish(api, req, reply=inbox)
                            self.credits += want
                            last_pull = now
                    self._wake = anyio.Event()
                    with anyio.move_on_after(self.expires_s / 2):
                        await self._wake.wait()
                # drain: wait for in-flight handlers
                while self.busy:
                    self._wake = anyio.Event()
                    with anyio.move_on_after(0.5):
                        await self._wake.wait()
            finally:
                await sub.unsubscribe()
                tg.cancel_scope.cancel()

    async def _run_one(self, msg: Msg) -> None:
        try:
            await self.handle(msg)
        except Exception as exc:  # the handler owns acking; a crash here must not kill the loop
            log.error("pull.handler_crashed", consumer=self.consumer, error=repr(exc))
        finally:
            self._inflight.pop(id(msg), None)
            self.busy -= 1
            self._wake.set()

    async def _heartbeats(self) -> None:
        while True:
            await anyio.sleep(self.heartbeat_s)
            for msg in list(self._inflight.values()):
                try:
                    await msg.in_progress()
                except Exception:  # disconnected: the redelivery path takes over
                    break
