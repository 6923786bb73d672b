"""The transport as its users see it: Protocols, so a worker runs on a real ``Bus`` or on the in-memory
double (``gym_runtime.testing.MemoryTransport``) without a nats-server.

``Wire`` is the layer under the bus: the NATS basics, twelve methods, implemented by ``wire.NatsWire`` (nats-py)
and ``memory.MemoryWire`` (in memory). Everything above it (calls, serving, large bodies, discovery) is the
``Bus``, written once over either wire.

``Transport`` is exactly what the workers (``gym_runtime.workers``) and the collector (``gym_runtime.data``:
its batch reader, intake, manifests and republishing) ask of a bus: subjects, telemetry, core publish/subscribe
and request-reply, a discovery round, stored (JetStream) publishes, a work-queue puller, an acked reader of a
stream, what a stream holds, a KV bucket, serving handlers, and bodies decoded. ``Connection`` is what the
JetStream administration (``transport.jetstream``, ``transport.pull``, ``transport.blobs``) needs of a
connection: the Bus has both; nothing here imports the Bus, so its parts never import it back.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from anyio.abc import TaskGroup
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from gym_runtime.observability.tracing import Telemetry
from gym_runtime.transport.delivery import Delivery, Message
from gym_runtime.transport.rpc import Timings
from gym_runtime.transport.subjects import Subjects

__all__ = ["Connection", "Handler", "KeyValue", "Puller", "StreamReader", "Subscription", "Transport", "Wire"]

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

    async def kv(self, bucket: str, *, within_s: float, ttl_s: float = 0.0) -> KeyValue: ...

    async def subject_count(self, stream: str, subjects: str) -> int: ...

    async def stream_full(self, stream: str) -> bool: ...


class Transport(Protocol):
    """A worker's view of the bus (``transport.bus.Bus`` on NATS; ``testing.MemoryTransport`` in memory)."""

    ns: str
    subjects: Subjects
    telemetry: Telemetry
    timings: Timings
    caller: str  # who this connection calls as (``subjects.caller_of``)

    # -- core messages
    async def publish(self, subject: str, payload: Any, *, headers: dict[str, str] | None = None) -> None: ...

    async def publish_raw(self, subject: str, data: bytes, *, headers: dict[str, str] | None = None) -> None:
        """A body sent as it is (no codec, no trace context): beacons, discovery answers."""
        ...

    async def subscribe(
        self, subject: str, cb: Callable[[Delivery], Awaitable[None]], *, queue: str = ""
    ) -> Subscription: ...

    async def flush(self) -> None: ...

    async def request(
        self,
        subject: str,
        payload: Any,
        *,
        timeout: float,
        op: str,
        liveness_s: float | None = None,
        on_output: Callable[[int, bytes], None] | None = None,
    ) -> Any: ...

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
    ) -> Any: ...

    async def gather(
        self,
        subject: str,
        payload: Any,
        *,
        done: Callable[[list[Any]], bool],
        timeout: float,
        headers: dict[str, str] | None = None,
    ) -> list[Any]: ...

    async def scatter(
        self, subject: str, *, wait_s: float, until: Callable[[str, bytes], bool] | None = None
    ) -> list[tuple[str, bytes]]:
        """Raw answers to an empty request sent to every subscriber, each with its subject (discovery)."""
        ...

    # -- streams
    async def js_publish(self, subject: str, payload: Any, *, msg_id: str, keep: str | None = None) -> None: ...

    async def record(self, subject: str, data: bytes, *, msg_id: str) -> None: ...

    async def ensure_results_stream(self, agent: str) -> str: ...

    async def ensure_attempts_stream(self) -> None: ...

    async def work_queue(
        self, kind: str, name: str, *, slots: int, ack_wait: float, handle: Callable[[Delivery], Awaitable[None]]
    ) -> Puller:
        """A puller of ``{ns}.{kind}.{name}`` (``task`` or ``model``), its stream and consumer ensured."""
        ...

    async def kv(self, bucket: str, *, ttl_s: float = 0.0) -> KeyValue: ...

    # -- streams read back (the collector's readers)
    async def reader(
        self, stream: str, consumer: str, subject: str, *, handle: Callable[[Delivery], Awaitable[None]]
    ) -> StreamReader:
        """A new acked consumer ``consumer`` of ``subject`` in ``stream``, read from the start."""
        ...

    async def subject_count(self, stream: str, subjects: str) -> int:
        """Messages ``stream`` holds on subjects matching ``subjects`` (0 when it does not exist)."""
        ...

    async def stream_full(self, stream: str) -> bool:
        """Whether ``stream`` is at its size limit: its next store is refused."""
        ...

    async def store(self, subject: str, data: bytes, headers: dict[str, str]) -> None:
        """A body as it is into a stream (a KV key's subject too), after its ack."""
        ...

    async def last_stored(self, stream: str, subject: str) -> Delivery | None:
        """The last message ``stream`` holds on ``subject``, headers as stored; None when it holds none."""
        ...

    # -- serving
    async def serve(
        self,
        tg: TaskGroup,
        subject: str,
        handler: Handler,
        *,
        queue: str = "",
        concurrency: int = 256,
        default_error: str = "internal",
    ) -> Subscription: ...

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
    ) -> Subscription: ...

    async def handle(
        self,
        msg: Delivery,
        handler: Handler,
        *,
        reply_to: str | None,
        default_error: str,
        attributes: dict[str, Any] | None = None,
        body: Any = ...,
    ) -> bool: ...

    def expired(self, msg: Delivery) -> bool: ...

    async def taken(self, reply_to: str | None) -> None: ...

    def pause_caller(self, took: float | None) -> None: ...

    async def send_output(self, stream: int, data: bytes) -> None: ...

    def count_junk(self, subject: str, cause: str, exc: BaseException | None = None) -> None: ...

    def warn_limited(self, event: str, cause: str, *, subject: str, exc: BaseException | None = None) -> None: ...

    # -- bodies
    async def decode(self, msg: Delivery) -> Any: ...

    async def decode_sized(self, msg: Delivery) -> tuple[Any, int]: ...
