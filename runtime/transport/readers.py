"""An acked reader of one stream's messages: a consumer of its own, pulled in stream order, one at a time.

What a batch's results reader (``data.reader``) needs of JetStream, kept here so the data layer is typed
against ``interface.StreamReader`` and runs on the in-memory double too. It acks ack-all, so the consumer's
counts say whether anything stored is still on its way (``settled``); a consumer deleted under it by someone
else is made again from the message after the last one handled.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from gym_runtime.transport import jetstream
from gym_runtime.transport.delivery import Delivery
from gym_runtime.transport.interface import Connection, StreamReader
from gym_runtime.transport.pull import PullWorker

SLOTS = 512  # messages asked for at once (handled one at a time, in order)


class Reader:
    """``handle`` gets each message of ``subject`` in ``stream``, in order (``interface.StreamReader``)."""

    def __init__(
        self,
        bus: Connection,
        stream: str,
        consumer: str,
        subject: str,
        handle: Callable[[Delivery], Awaitable[None]],
    ) -> None:
        self.bus, self.stream, self.consumer, self.subject = bus, stream, consumer, subject
        self._handle = handle
        self.last_seq = 0  # the stream sequence of the last one handled: where a consumer made again reads on
        self.puller = PullWorker(
            bus,
            stream=stream,
            consumer=consumer,
            slots=SLOTS,
            handle=self._on_msg,
            heartbeat_s=3600.0,
            inline=True,  # in stream order, one at a time: an ack of one message says every one before was handled
            recreate=self._recreate,
        )

    async def _on_msg(self, msg: Delivery) -> None:
        await self._handle(msg)
        self.last_seq = max(self.last_seq, msg.stream_seq)

    async def _recreate(self) -> None:
        """Its consumer was deleted by someone else: read on from where it was."""
        await jetstream.add_reader(
            self.bus, self.stream, self.consumer, self.subject, start_seq=self.last_seq + 1, acked=True
        )

    async def run(self) -> None:
        await self.puller.run()

    def stop_pulling(self) -> None:
        self.puller.stop_pulling()

    async def settled(self) -> bool:
        return await jetstream.reader_settled(self.bus, self.stream, self.consumer)

    async def close(self) -> None:
        await jetstream.delete_consumer(self.bus, self.stream, self.consumer)


async def open_reader(
    bus: Connection, stream: str, consumer: str, subject: str, handle: Callable[[Delivery], Awaitable[None]]
) -> StreamReader:
    """Make the consumer (it reads ``subject`` from the start, whenever ``run`` starts) and its reader."""
    await jetstream.add_reader(bus, stream, consumer, subject, acked=True)
    return Reader(bus, stream, consumer, subject, handle)
