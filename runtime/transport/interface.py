"""The Protocols under the bus: what its parts are written against, so nothing here imports the ``Bus`` and its
parts never import it back.

``Wire`` is the layer under the bus: the NATS basics, twelve methods, implemented by ``wire.NatsWire`` (nats-py)
and ``memory.MemoryWire`` (in memory). Everything above it (calls, serving, large bodies, discovery) is the
``Bus``, written once over either wire; workers and the collector hold the concrete ``Bus`` (on NATS, or
``gym_runtime.testing.MemoryTransport``, the Bus on the in-memory wire), as httpx's client holds a concrete
transport, so no method of it is spelled twice. ``Connection`` is what the JetStream administration
(``transport.jetstream``, ``transport.pull``, ``transport.blobs``) needs of a connection. The handles a wire
returns (``Puller``, ``StreamReader``, ``KeyValue``, ``Subscription``) are small Protocols of their own.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from gym_runtime.transport.delivery import Delivery, Message
from gym_runtime.transport.subjects import Subjects

__all__ = ["Connection", "Handler", "KeyValue", "Puller", "StreamReader", "Subscription", "Wire"]

Handler = Callable[[Any, Delivery], Awaitable[Any]]
OnMessage = Callable[[Message], Awaitable[None]]
Handle = Callable[[Delivery], Awaitable[None]]
INLINE = "gym_inline"  # the attribute ``inline`` marks a callback with: its plain function


def inline(fn: Callable[[Message], None]) -> OnMessage:
    """A subscription's callback that never awaits (a reply resolving its caller's future), marked so that the real
    wire calls it as each message is read: nats-py otherwise queues every message for a task of the subscription's
    own, a queue put, a get and a task switch per message (about 20 Python calls). Elsewhere it is awaited as any."""

    async def cb(msg: Message) -> None:
        fn(msg)

    setattr(cb, INLINE, fn)
    return cb


class Connection(Protocol):
    """What the streams' administration and the blobs use of a connection (nats-py's client and JetStream
    context, the namespace's names, the config's JetStreamConfig, and whether the admin provisioned it all)."""

    subjects: Subjects
    jetstream_config: Any

    @property
    def secured(self) -> bool: ...

    @property
    def nc(self) -> NATS: ...

    @property
    def js(self) -> JetStreamContext: ...


class Subscription(Protocol):
    async def unsubscribe(self) -> None: ...


class KeyValue(Protocol):
    """One KV bucket as bytes in and out; ``get`` of a missing key is None (``jetstream.KV``)."""

    async def get(self, key: str) -> bytes | None: ...

    async def put(self, key: str, value: bytes) -> None: ...

    async def delete(self, key: str) -> None: ...


class Puller(Protocol):
    """Work-queue messages pulled into at most ``slots`` handler tasks (``pull.PullWorker``)."""

    @property
    def busy(self) -> int: ...

    async def run(self) -> None:
        """Pull until ``stop_pulling`` (then wait for the running handlers) or cancelled."""
        ...

    def stop_pulling(self) -> None: ...

    def take_slot(self) -> bool:
        """Reserve a slot for work that came another way (a direct call); False when none is free."""
        ...

    async def give_slot(self) -> None: ...

    async def release(self, msg: Delivery) -> None:
        """Free ``msg``'s slot now (only storing and acking remain). Idempotent."""
        ...


class StreamReader(Protocol):
    """One consumer of a stream's messages on a subject filter, read from the start in stream order, one at a
    time, acked ack-all (one ack covers every message before it) (``readers.Reader``)."""

    async def run(self) -> None:
        """Hand each message to the reader's handler until ``stop_pulling`` or cancelled."""
        ...

    def stop_pulling(self) -> None: ...

    async def settled(self) -> bool:
        """Whether the server holds nothing more for it: nothing undelivered, nothing delivered and unacked."""
        ...

    async def close(self) -> None:
        """Delete its consumer."""
        ...


class Wire(Protocol):
    """The NATS basics a ``Bus`` is built on: core messages (a publish with a ``reply`` into a stream's subjects is a
    stored publish, answered by the stream's ack; a request to ``subjects.direct_get`` is a direct get), the streams
    the runtime makes, pulling, reading a stream back, KV buckets and what a stream holds. nats-py's client
    signatures for the core, so the real wire hands them on as they are. ``subjects``, ``secured``,
    ``jetstream_config`` and ``max_payload`` are the connection's (``Connection``)."""

    subjects: Subjects
    secured: bool
    jetstream_config: Any

    @property
    def max_payload(self) -> int: ...

    # -- core messages (nats-py's signatures)
    async def publish(
        self, subject: str, payload: bytes = b"", reply: str = "", headers: dict[str, str] | None = None
    ) -> None: ...

    async def subscribe(self, subject: str, queue: str = "", cb: OnMessage | None = None) -> Subscription: ...

    async def request(self, subject: str, payload: bytes = b"", timeout: float = 0.5) -> Message:
        """A raw request: the server's own API (a direct get), or one answer of any responder."""
        ...

    def new_inbox(self) -> str: ...

    async def flush(self) -> None: ...

    async def close(self, timeout: float = 10.0) -> None: ...

    # -- streams
    async def ensure_stream(self, kind: str, name: str = "") -> str:
        """Make the stream of ``kind`` (``results`` of agent ``name``, ``attempts``, ``blobs`` of role ``name``)
        when missing; its name."""
        ...

    async def work_queue(self, kind: str, name: str, *, slots: int, ack_wait: float, handle: Handle) -> Puller:
        """A puller of ``{ns}.{kind}.{name}`` (``task`` or ``model``), its stream and consumer ensured."""
        ...

    async def reader(self, stream: str, consumer: str, subject: str, *, handle: Handle) -> StreamReader: ...

    async def kv(
        self, bucket: str, *, within_s: float, ttl_s: float = 0.0, direct: bool = False, msg_ttl: bool = False
    ) -> KeyValue: ...

    async def subject_count(self, stream: str, subjects: str) -> int: ...

    async def stream_full(self, stream: str) -> bool: ...
