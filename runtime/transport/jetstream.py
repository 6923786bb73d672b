"""JetStream administration: the streams, consumers and KV buckets the runtime uses.

With ``bus`` (messages) and ``pull`` (slot-based pulling), this is the only
module that handles nats-py objects; collector, batches, status and discovery
speak to it in plain Python values. Stream and durable consumer names are a
contract (KEDA's ``nats-jetstream`` scaler and ``/jsz`` read them):

* streams ``{NS}_TASKS``, ``{NS}_RESULTS``, ``{NS}_MODEL`` (``NS`` = namespace upper-cased, ``-`` → ``_``);
* durable consumers ``agent_{agent}`` on ``{NS}_TASKS`` and ``model_{model}`` on ``{NS}_MODEL``;
* KV bucket ``{NS}_BATCHES`` (manifests), stream ``{NS}_BLOBS`` (large bodies, ``{ns}.blob.{key}.{chunk}``).

Every stream and bucket is created with the config's ``jetstream`` settings
(replicas, max age, max bytes); an existing one keeps its own (a warning names
the difference), so a client with default settings never downgrades a cluster's.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import (
    APIError,
    BadRequestError,
    BucketNotFoundError,
    KeyNotFoundError,
    NotFoundError,
    ServiceUnavailableError,
)

from gym_runtime.errors import UserError
from gym_runtime.observability import logs

if TYPE_CHECKING:
    from gym_runtime.observability.meters import Meters
    from gym_runtime.transport.bus import Bus


def parse_size(text: str | int) -> int:
    """``8MB`` / ``512KB`` / ``1048576`` → bytes."""
    if isinstance(text, int):
        return text
    t = text.strip().upper().removesuffix("B")
    mult = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(t[-1:], 1)
    if mult != 1:
        t = t[:-1]
    try:
        return int(float(t) * mult)
    except ValueError:
        raise UserError(f"not a size: {text!r} (use e.g. 8MB)") from None


log = logs.get("gym.jetstream")

T = TypeVar("T")


class JetStreamSetupError(UserError):
    """A stream or bucket cannot be created as configured (e.g. 3 replicas on one server)."""


INSUFFICIENT_STORAGE = 10047  # JetStream's err_code: the stream's max_bytes cannot be reserved


def _setup_error(what: str, replicas: int, e: APIError) -> Exception:
    if e.err_code == INSUFFICIENT_STORAGE:  # every stream's max_bytes is reserved on the server's disk
        return JetStreamSetupError(
            f"{what}: the server cannot reserve jetstream.max_bytes for it ({e.description}); "
            "lower jetstream.max_bytes (it is reserved per stream) or give the server more storage"
        )
    if replicas > 1:
        return JetStreamSetupError(
            f"{what}: jetstream.replicas={replicas} was refused by the server ({e.description}); "
            f"it needs a NATS cluster of at least {replicas} nodes (gym-runtime server --cluster NAME --routes ...)"
        )
    return e


API_RETRY_S = 20.0  # a stream leader election in a cluster takes seconds; admin calls wait it out


async def retrying(fn: Callable[[], Awaitable[T]], *, what: str, within_s: float = API_RETRY_S) -> T:
    """Run a JetStream API call again while it times out or finds no responder (leader election).

    In a cluster the API briefly answers nothing while a node is lost and a new
    stream leader is elected; that is not an error worth failing a command for.
    """
    give_up = time.monotonic() + within_s
    delay = 0.1
    while True:
        try:
            return await fn()
        except (NatsTimeout, NoRespondersError, ServiceUnavailableError) as e:
            if time.monotonic() + delay > give_up:
                raise
            log.info("jetstream.retry", call=what, error=type(e).__name__)
            await anyio.sleep(delay)
            delay = min(2.0, delay * 2)


MAX_ACK_PENDING = 1_000_000  # consumer-wide cap; must exceed every slot of every replica


def stream_names(ns: str) -> dict[str, str]:
    base = ns.upper().replace("-", "_")
    return {"task": f"{base}_TASKS", "result": f"{base}_RESULTS", "model": f"{base}_MODEL"}


def result_subject(ns: str, agent: str, batch: str) -> str:
    """Where an agent pool stores a batch's results: one subject per (agent, batch), so a pool's
    credentials can be allowed to write its own results and no other pool's."""
    return f"{ns}.result.{agent}.{batch}"


def task_subject(ns: str, agent: str, batch: str) -> str:
    """Where a batch's tasks for one agent are queued: one subject per (agent, batch), so the server can say
    how many of a batch's tasks are still queued or held (a task leaves only when acked or terminated)."""
    return f"{ns}.task.{agent}.{batch}"


def task_filter(ns: str, agent: str) -> str:
    """The agent's work queue: its tasks of every batch (the durable ``agent_{agent}`` filters on it)."""
    return f"{ns}.task.{agent}.>"


LOST = "_lost"  # the result subject's agent token for failure rows of tasks that left the queue without a result


def lost_subject(ns: str, batch: str) -> str:
    """Where a collector stores the failure rows of a batch's tasks that were removed without a result; a
    message on it is only ever read as a failure row, so a role allowed to write it can forge no reward."""
    return f"{ns}.result.{LOST}.{batch}"


def batch_results(ns: str, batch: str) -> str:
    """Every agent's results of ``batch`` (the readers' filter)."""
    return f"{ns}.result.*.{batch}"


def blob_stream_name(ns: str) -> str:
    return f"{ns.upper().replace('-', '_')}_BLOBS"


async def ensure_blob_stream(bus: Bus) -> None:
    """The stream of bodies over the max payload: one message per chunk, each subject written once.

    ``discard_new_per_subject`` with one message per subject makes every chunk
    write-once (an overwrite is refused by the server); reads are direct gets of
    a subject whose key only the referring message carries (no role may list it).
    """
    replicas, max_age, max_bytes = settings(bus)
    cfg = StreamConfig(
        name=blob_stream_name(bus.ns),
        subjects=[f"{bus.ns}.blob.>"],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        duplicate_window=120.0,  # a chunk published again after a lost ack is a duplicate, not a refusal
        num_replicas=replicas,
        max_age=max_age or 7 * 24 * 3600.0,
        max_bytes=max_bytes,
        max_msgs_per_subject=1,
        discard=DiscardPolicy.NEW,
        discard_new_per_subject=True,
        allow_direct=True,
    )
    await retrying(lambda: _ensure_stream(bus, cfg, replicas), what=f"stream {cfg.name}")


def durable_name(kind: str, name: str) -> str:
    """The durable consumer of a work queue: ``agent_{name}`` (tasks) or ``model_{name}``."""
    return f"{'agent' if kind == 'task' else kind}_{name}"


def settings(bus: Bus) -> tuple[int, float | None, int]:
    """(replicas, max_age seconds or None, max_bytes) from the bus's JetStreamConfig."""
    cfg = bus.jetstream_config
    if cfg is None:
        return 1, 7 * 24 * 3600.0, -1
    max_age = float(cfg.max_age_s) or None
    return int(cfg.replicas), max_age, parse_size(cfg.max_bytes) if cfg.max_bytes != -1 else -1


async def ensure_streams(bus: Bus) -> None:
    """Create (idempotently) the task, result and model-call streams of a namespace."""
    names = stream_names(bus.ns)
    replicas, max_age, max_bytes = settings(bus)
    configs = [
        StreamConfig(
            name=names["task"],
            subjects=[f"{bus.ns}.task.>"],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            duplicate_window=3600.0,
            num_replicas=replicas,
            max_age=max_age,
            max_bytes=max_bytes,
            discard=DiscardPolicy.NEW,  # a full task queue refuses new tasks; it never drops queued ones
        ),
        StreamConfig(
            name=names["result"],
            subjects=[f"{bus.ns}.result.>"],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            duplicate_window=3600.0,
            num_replicas=replicas,
            max_age=max_age,
            max_bytes=max_bytes,
            discard=DiscardPolicy.OLD,  # the oldest batches' results go first
        ),
        StreamConfig(
            name=names["model"],
            subjects=[f"{bus.ns}.model.>"],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,  # survives a server restart, with its consumers
            duplicate_window=120.0,
            num_replicas=replicas,
        ),
    ]
    for cfg in configs:
        await retrying(partial(_ensure_stream, bus, cfg, replicas), what=f"stream {cfg.name}")


async def _ensure_stream(bus: Bus, cfg: StreamConfig, replicas: int) -> None:
    try:
        assert cfg.name is not None
        info = await bus.js.stream_info(cfg.name)
        have = info.config.num_replicas or 1
        if have != replicas:
            log.warning("stream.replicas_differ", stream=cfg.name, existing=have, configured=replicas)
    except NotFoundError:
        try:
            await bus.js.add_stream(cfg)
        except BadRequestError as e:  # another process created it first
            if "already in use" not in str(e):
                raise _setup_error(f"stream {cfg.name}", replicas, e) from None
        except APIError as e:
            if isinstance(e, ServiceUnavailableError):
                raise  # a leader election: retried
            raise _setup_error(f"stream {cfg.name}", replicas, e) from None


async def ensure_consumer(bus: Bus, stream: str, durable: str, subject: str, *, ack_wait: float) -> None:
    cfg = ConsumerConfig(
        name=durable,  # named: created as CONSUMER.CREATE.{stream}.{name}.{filter}, which a pool may be allowed
        durable_name=durable,
        filter_subject=subject,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=ack_wait,
        max_deliver=-1,  # attempts are capped by the worker, which writes a failure row
        max_ack_pending=MAX_ACK_PENDING,
        max_waiting=4096,
    )

    async def ensure() -> None:
        try:
            info = await bus.js.consumer_info(stream, durable)
        except NotFoundError:
            await bus.js.add_consumer(stream, cfg)
            return
        if info.config.filter_subject != subject:  # made by an older version (tasks were not per batch)
            log.info("consumer.filter_updated", consumer=durable, was=info.config.filter_subject, now=subject)
            await bus.js.add_consumer(stream, cfg)

    await retrying(ensure, what=f"consumer {durable}")


async def add_reader(bus: Bus, stream: str, consumer: str, subject: str, *, start_seq: int | None = None) -> None:
    """A no-ack consumer that reads ``subject`` from the start, or from stream sequence ``start_seq`` on."""
    cfg = ConsumerConfig(
        name=consumer,
        durable_name=consumer,
        filter_subject=subject,
        ack_policy=AckPolicy.NONE,
        deliver_policy=DeliverPolicy.ALL if start_seq is None else DeliverPolicy.BY_START_SEQUENCE,
        opt_start_seq=start_seq,
        inactive_threshold=600.0,
        max_waiting=64,
    )
    await retrying(lambda: bus.js.add_consumer(stream, cfg), what=f"consumer {consumer}")


async def delete_consumer(bus: Bus, stream: str, consumer: str) -> None:
    await bus.js.delete_consumer(stream, consumer)


async def consumers(bus: Bus, stream: str) -> list[dict[str, Any]]:
    """Every consumer of ``stream`` with its pending / ack-pending / redelivered counts ([] if none)."""
    try:
        infos = await bus.js.consumers_info(stream)
    except NotFoundError:
        return []
    return [
        {
            "stream": stream,
            "consumer": c.name,
            "pending": c.num_pending,
            "ack_pending": c.num_ack_pending,
            "redelivered": c.num_redelivered,
            "waiting_pulls": c.num_waiting,
        }
        for c in infos
    ]


async def subject_count(bus: Bus, stream: str, subjects: str) -> int:
    """Messages stored in ``stream`` on subjects matching ``subjects`` (0 when it does not exist)."""
    try:
        info = await bus.js.stream_info(stream, subjects_filter=subjects)
    except NotFoundError:
        return 0
    return sum((info.state.subjects or {}).values())


async def read_to_end(bus: Bus, stream: str, consumer: str, handled_seq: int) -> bool:
    """Whether a reader has nothing left to deliver and its handler saw everything it delivered."""
    info = await bus.js.consumer_info(stream, consumer)
    delivered = info.delivered.stream_seq if info.delivered else 0
    return not info.num_pending and (delivered or 0) <= handled_seq


async def message_count(bus: Bus, stream: str) -> int:
    """Messages stored in ``stream`` (0 when it does not exist yet)."""
    try:
        info = await bus.js.stream_info(stream)
    except NotFoundError:
        return 0
    return int(info.state.messages)


class KV:
    """One KV bucket, as bytes in and out; ``get`` of a missing key is ``None``."""

    def __init__(self, kv: Any) -> None:
        self._kv = kv

    async def get(self, key: str) -> bytes | None:
        async def get() -> bytes | None:
            try:
                entry = await self._kv.get(key)
            except KeyNotFoundError:
                return None
            return bytes(entry.value or b"")

        return await retrying(get, what="kv get")

    async def put(self, key: str, value: bytes) -> None:
        await retrying(lambda: self._kv.put(key, value), what="kv put")

    async def delete(self, key: str) -> None:
        await retrying(lambda: self._kv.delete(key), what="kv delete")


async def kv_bucket(bus: Bus, bucket: str) -> KV:
    """The bucket, created on first use (history 1)."""
    replicas, _, _ = settings(bus)

    async def open_or_create() -> KV:
        try:
            return KV(await bus.js.key_value(bucket))
        except BucketNotFoundError:
            try:
                return KV(await bus.js.create_key_value(KeyValueConfig(bucket=bucket, history=1, replicas=replicas)))
            except APIError as e:
                if isinstance(e, ServiceUnavailableError):
                    raise  # a leader election: retried
                raise _setup_error(f"bucket {bucket}", replicas, e) from None

    return await retrying(open_or_create, what=f"bucket {bucket}")


async def stream_config(bus: Bus, stream: str) -> dict[str, Any] | None:
    """A stream's replicas, retention and size as plain values (None when it does not exist)."""
    try:
        info = await bus.js.stream_info(stream)
    except NotFoundError:
        return None
    c = info.config
    leader = info.cluster.leader if info.cluster else None
    return {
        "name": c.name,
        "replicas": c.num_replicas or 1,
        "max_age_s": c.max_age or 0.0,
        "max_bytes": c.max_bytes,
        "messages": info.state.messages,
        "bytes": info.state.bytes,
        "leader": leader,
    }


async def purge_subject(bus: Bus, stream: str, subject: str) -> int:
    """Remove every message of ``subject`` from ``stream``; returns how many were removed."""
    try:
        before = await bus.js.stream_info(stream, subjects_filter=subject)
    except NotFoundError:
        return 0
    count = sum((before.state.subjects or {}).values()) if before.state.subjects else 0
    await bus.js.purge_stream(stream, subject=subject)
    return count


async def delete_key(bus: Bus, bucket: str, key: str) -> bool:
    """Delete ``key`` from ``bucket``; False when the bucket or key does not exist."""
    try:
        kv = await bus.js.key_value(bucket)
    except BucketNotFoundError:
        return False
    try:
        await kv.get(key)
    except KeyNotFoundError:
        return False
    await kv.purge(key)
    return True


async def watch_queues(bus: Bus, meters: Meters, *, every_s: float = 5.0) -> None:
    """Refresh ``meters.queues`` from JetStream's consumer info until cancelled (queue lag gauges)."""
    names = stream_names(bus.ns)
    while True:
        t0 = time.monotonic()
        try:
            found = await consumers(bus, names["task"]) + await consumers(bus, names["model"])
            meters.queues = {c["consumer"]: c for c in found}
        except Exception as e:  # noqa: BLE001 - a scrape gauge must never take a worker down
            log.debug("metrics.queue_poll_failed", error=str(e))
        await anyio.sleep(max(0.5, every_s - (time.monotonic() - t0)))
