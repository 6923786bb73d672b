"""One delivered message as the layers above the transport see it, never a nats-py object.

Workers answer a work-queue message by acking it (done), nak-ing it (try again, maybe
later), terminating it (never again) or telling the server it is still in progress; they
read its subject, headers and body, which attempt this is and when the queue stored it.
Core request-reply messages arrive as the same type (``attempt`` 1, no enqueue time; their
replies go through the bus, not through acks). A ``Delivery`` wraps a nats-py ``Msg``, or anything of the
same shape (``Message``: the in-memory transport's, ``gym_runtime.testing``).
"""

from __future__ import annotations

from typing import Protocol

from gym_runtime.transport import subjects
from gym_runtime.transport.subjects import ack_fields

__all__ = ["Delivery", "Message"]


class Message(Protocol):
    """What a ``Delivery`` reads of a message: nats-py's ``Msg`` has it. A work-queue message's delivery count,
    stream sequence and time stored are read off its reply subject (a JetStream ack subject: ``ack_fields``)."""

    subject: str
    data: bytes
    headers: dict[str, str] | None
    reply: str

    async def ack(self) -> None: ...

    async def nak(self, delay: float | None = None) -> None: ...

    async def term(self) -> None: ...

    async def in_progress(self) -> None: ...


class Delivery:
    """A message taken from a subscription, a work queue or a stream (no copy of the body)."""

    __slots__ = ("_msg", "data", "headers", "reply", "subject")

    def __init__(self, msg: Message) -> None:
        # read once here, plain attributes after (a property each was a Python call per read: 42 a weather rollout)
        self._msg = msg
        self.subject: str = msg.subject
        self.data: bytes = msg.data
        self.headers: dict[str, str] | None = msg.headers
        self.reply: str = msg.reply  # the subject a core request's answer goes to ('' when none)

    @property
    def caller(self) -> str:
        """Whose core request this is: ``{role}.{pool}`` from its reply subject (``_INBOX.{role}.{pool}...``;
        ``{pool}`` is ``_`` for a role-wide credential), '' for a reply of another form. On a secured bus a
        pool subscribes only to its own inbox, so an answer reaches only it; but the reply subject is the
        publisher's choice (the server checks subjects, not replies): a name to share limits by, not proof."""
        return subjects.caller(self.reply)

    @property
    def attempt(self) -> int:
        """Which delivery of a work-queue message this is (1 the first time, and for core messages)."""
        fields = ack_fields(self.reply)
        return (fields.delivered or 1) if fields is not None else 1

    @property
    def stream_seq(self) -> int:
        """The message's sequence in its stream (0 for core messages): where a reader made again reads on."""
        fields = ack_fields(self.reply)
        return fields.stream_seq if fields is not None else 0

    @property
    def enqueued_at(self) -> float | None:
        """When the stream stored the message (seconds since the epoch); None for core messages."""
        fields = ack_fields(self.reply)
        return fields.stored_ns / 1e9 if fields is not None else None

    async def ack(self) -> None:
        """Done: the queue deletes it."""
        await self._msg.ack()

    async def nak(self, delay: float | None = None) -> None:
        """Not done: deliver it again (after ``delay`` seconds)."""
        await self._msg.nak(delay=delay)

    async def term(self) -> None:
        """Never deliver it again (it cannot be decoded or run)."""
        await self._msg.term()

    async def in_progress(self) -> None:
        """Still working on it: restart the server's ack timer."""
        await self._msg.in_progress()
