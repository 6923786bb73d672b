"""JetStream administration: the streams, consumers and KV buckets the runtime uses.

With ``bus`` (messages) and ``pull`` (slot-based pulling), this is the only
module that handles nats-py objects; collector, batches, status and discovery
speak to it in plain Python values. Stream, durable consumer and bucket names are a
contract (KEDA's ``nats-jetstream`` scaler and ``/jsz`` read them); they are built by
``gym_runtime.transport.subjects`` (``bus.subjects``), as every subject is.

Every stream and bucket is created with the config's ``jetstream`` settings
(replicas, max age, max bytes); an existing one keeps its own (a warning names
the difference), so a client with default settings never downgrades a cluster's.
"""

from __future__ import annotations

import json
import random
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import anyio
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    ConsumerInfo,
    DeliverPolicy,
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
    StreamInfo,
)
from nats.js.errors import (
    APIError,
    BadRequestError,
    BucketNotFoundError,
    KeyNotFoundError,
    NoKeysError,
    NoStreamResponseError,
    NotFoundError,
    ServiceUnavailableError,
)
from nats.js.kv import KeyValue

from gym_runtime.errors import StorageFull, UserError
from gym_runtime.observability import logs
from gym_runtime.transport.interface import Connection
from gym_runtime.transport.limits import (
    DUPLICATE_WINDOW_S,
    KV_MAX_BYTES,
    KV_MIN_BYTES,
    MIN_DEFAULT_BYTES,
    MIN_STARVED_BYTES,
    STREAM_LIMITS,
    parse_size,
    size_text,
)
from gym_runtime.transport.subjects import (
    LOST,
    Subjects,
    blob_role,
    every_namespace_tasks,
    kv_key,
    kv_stream,
    namespace_of,
)
from gym_runtime.transport.subjects import stream_names as stream_names_subject

if TYPE_CHECKING:
    from gym_runtime.observability.meters import Meters
    from gym_runtime.transport.delivery import Message


log = logs.get("gym.jetstream")

T = TypeVar("T")
InfoT = TypeVar("InfoT", StreamInfo, ConsumerInfo)


class JetStreamSetupError(UserError):
    """A stream or bucket cannot be created as configured (e.g. 3 replicas on one server)."""


INSUFFICIENT_STORAGE = 10047  # JetStream's err_code: the stream's max_bytes cannot be reserved


class Limit(NamedTuple):
    """A stream's size limit, the config key that sets it, and whether the user set it."""

    max_bytes: int
    key: str
    explicit: bool


def limit(bus: Connection, stream: str) -> Limit:
    """The size limit of ``stream`` (``tasks``/``results``/``model``/``blobs``) from the bus's JetStreamConfig:
    its own key, else ``max_bytes``, else the default."""
    key = f"{stream}_max_bytes"
    for name in (key, "max_bytes"):
        value = getattr(bus.jetstream_config, name, None)
        if value is not None:
            return Limit(-1 if value == -1 else parse_size(value), f"jetstream.{name}", True)
    return Limit(STREAM_LIMITS[stream], f"jetstream.{key}", False)


# what a stream at its limit answers a publish (discard new); "maximum messages per subject exceeded" (a blob
# chunk written twice) is not one of them
_FULL = ("maximum bytes exceeded", "maximum messages exceeded", "resource limits exceeded", "insufficient resources")


def full_error(bus: Connection, subject: str, error: dict[str, Any]) -> StorageFull | None:
    """The ``StorageFull`` a refused publish to ``subject`` means (None when it was refused for another reason):
    its message names the stream, its limit and the key that raises it."""
    description = str(error.get("description", ""))
    if not any(description.startswith(f) for f in _FULL):
        return None
    names = bus.subjects
    kind = names.kind(subject)
    stream = {"task": "tasks", "result": "results", "model": "model", "blob": "blobs", "kept": "kept"}.get(kind)
    if stream is None:
        return StorageFull(f"the stream of {subject} is full ({description})")
    size = limit(bus, stream)
    if stream == "results":
        name = names.results_stream((names.result_parts(subject) or ("?", ""))[0])
    elif stream == "blobs":
        name = names.blob_stream(blob_role(subject[len(names.ns) + len(".blob.") :]))
    else:
        name = names.kept_stream if stream == "kept" else names.stream(kind)
    limit_text = "-1 (unbounded)" if size.max_bytes < 0 else size_text(size.max_bytes)
    free = {
        "tasks": "let workers drain it",
        "results": "collect and purge this agent's finished batches (gym-runtime purge --batch ID); other "
        "agents' results are not affected",
        "model": "let the model's workers drain it",
        "blobs": "bodies of calls leave it after jetstream.blob_ttl_s, stored ones after jetstream.max_age_s",
        "kept": "purge finished batches (gym-runtime purge --batch ID)",
    }[stream]
    return StorageFull(f"stream {name} is full ({description}; {size.key} = {limit_text}): raise {size.key}, or {free}")


class PeerOffline(JetStreamSetupError):
    """A cluster could not place a replicated stream because one of its nodes is down ("no suitable peers for
    placement, peer offline"): during a node's restart that passes, so ``retrying`` tries again (the stream
    may even exist already, and a new meta leader not list it yet); past its window, this one line."""


class NoLeader(UserError):
    """A replicated stream's info came from a member that knows no leader: nats-server then answers from that
    member's own copy, which may be behind (a node restarted on a disk that lost its unsynced writes says "empty").
    ``retrying`` asks again until a leader answers; past its window, this one line."""

    def __init__(self, what: str) -> None:
        super().__init__(f"{what} has no leader: fewer than a quorum of its replicas answer, or an election is on")


def _no_storage(e: APIError) -> bool:
    """The server cannot reserve a stream's or bucket's max_bytes: a single server says so with its own
    err_code; a cluster with "no suitable peers for placement" (10005), naming insufficient storage."""
    return e.err_code == INSUFFICIENT_STORAGE or "insufficient storage" in (e.description or "")


def _setup_error(what: str, replicas: int, e: APIError, key: str = "jetstream.max_bytes") -> Exception:
    # every stream's max_bytes is reserved on the server's disk (a cluster: on each replica's)
    if _no_storage(e):
        return JetStreamSetupError(
            f"{what}: the server cannot reserve {key} for it ({e.description}); "
            f"lower {key} (it is reserved per stream) or give the server more storage"
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
    stream leader is elected, and cannot place a replicated stream while a node is
    down; that is not an error worth failing a command for. A bucket write that no
    stream answered (a just-created stream without its leader yet) reached nobody, so
    it is sent again too.
    """
    give_up = time.monotonic() + within_s
    delay = 0.1
    while True:
        try:
            return await fn()
        except (
            NatsTimeout,
            NoRespondersError,
            NoStreamResponseError,
            ServiceUnavailableError,
            PeerOffline,
            NoLeader,
        ) as e:
            if time.monotonic() + delay > give_up:
                raise
            log.info("jetstream.retry", call=what, error=type(e).__name__)
            await anyio.sleep(delay)
            delay = min(2.0, delay * 2)


def _led(info: InfoT, what: str) -> InfoT:
    """``info`` if a leader gave it (a single server names itself), else ``NoLeader`` for ``retrying``."""
    if info.cluster is not None and not info.cluster.leader:
        raise NoLeader(what)
    return info


async def stream_info(bus: Connection, stream: str, subjects: str | None = None) -> StreamInfo | None:
    """``stream``'s info as its leader holds it (``subjects``: with the count on each subject matching it); None
    when it does not exist. Every count a decision rests on is read through this: an answer from a member that
    knows no leader is asked again (``NoLeader``)."""

    async def ask() -> StreamInfo | None:
        try:
            info = await bus.js.stream_info(stream, subjects_filter=subjects)
        except NotFoundError:
            return None
        return _led(info, f"stream {stream}")

    return await retrying(ask, what=f"stream info {stream}")


MAX_ACK_PENDING = 1_000_000  # consumer-wide cap; must exceed every slot of every replica


def result_msg_id(batch: str, task: int, rollout: int, attempt: int) -> str:
    """A stored result's ``Nats-Msg-Id``: its slot, its attempt, and 64 bits the storing worker draws.

    The server drops any later message whose id it has seen (the duplicate window), whatever the subject:
    an id another pool could predict is one it could store first, and the genuine result would be dropped
    as a duplicate. No pool can predict these. A publish retried after a lost ack reuses its id (it is one
    call), which is all the window is for; readers choose between two rows of a slot themselves.
    """
    return f"{batch}:{task}:{rollout}:{attempt}:{secrets.token_hex(8)}"


def lost_msg_id(batch: str, task: int, rollout: int) -> str:
    """The id of a reader's record of a lost slot: attempt ``lost``, which no result's id has."""
    return f"{batch}:{task}:{rollout}:lost:{secrets.token_hex(8)}"


def result_id_slot(msg_id: str) -> tuple[str, int, int] | None:
    """(batch, task, rollout) a result's id names (``result_msg_id``, or ``{batch}:{task}:{rollout}`` as
    stored before); None when it names none."""
    parts = msg_id.rsplit(":", 4)
    if len(parts) != 5 or not (parts[3].isdigit() or parts[3] == "lost"):
        parts = msg_id.rsplit(":", 2)
    if len(parts) < 3 or not (parts[1].isdigit() and parts[2].isdigit()):
        return None
    return parts[0], int(parts[1]), int(parts[2])


def task_msg_id(batch: str, task: int, rollout: int, group: int = 0, again: int = 0) -> str:
    """A task's ``Nats-Msg-Id``: its slot, ``+{group}`` for a group task (the repeats it carries), and ``/{again}``
    for a task published again after its stored result was lost (round ``again``: an id of its own, which the
    stream's duplicate window does not drop as the first publish's, and which a retried round reuses)."""
    return f"{batch}:{task}:{rollout}" + (f"+{group}" if group else "") + (f"/{again}" if again else "")


def task_id_slots(msg_id: str) -> tuple[str, int, int, int] | None:
    """(batch, task, first rollout, repeats) a task's ``task_msg_id`` names; None when it names none."""
    parts = msg_id.rsplit(":", 2)
    if len(parts) != 3:
        return None
    batch, task, rest = parts
    rollout, _, group = rest.partition("/")[0].partition("+")
    if not (task.isdigit() and rollout.isdigit() and (not group or group.isdigit())):
        return None
    return batch, int(task), int(rollout), max(1, int(group or 1))


async def ensure_kept_stream(bus: Connection) -> None:
    """The stream of kept tasks (``Subjects.kept``): one message per task (written again, the last one stays),
    read back by a last-by-subject direct get.

    Bounded as the results are (``jetstream.kept_max_bytes``, ``max_age_s``; when full the oldest batches'
    bodies go first: their lost slots are then lost rows, as before bodies were kept). On a ``--secure`` bus
    the admin provisioned it; a server provisioned by an older version has none, which is said in one line.
    """
    names = bus.subjects
    if bus.secured:
        try:
            await bus.js.find_stream_name_by_subject(names.kept("probe", 0))
        except NotFoundError:
            raise UserError(
                f"the secured server has no stream {names.kept_stream} (kept tasks): it was provisioned by "
                "an older gym-runtime; restart it (gym-runtime server --secure ...) to provision it"
            ) from None
        return
    replicas, max_age = settings(bus)
    size = limit(bus, "kept")
    cfg = StreamConfig(
        name=names.kept_stream,
        subjects=[names.all_kept],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        num_replicas=replicas,
        max_age=max_age,
        max_bytes=size.max_bytes,
        max_msgs_per_subject=1,
        discard=DiscardPolicy.OLD,
        allow_direct=True,
    )
    await retrying(lambda: _ensure_stream(bus, cfg, replicas, size), what=f"stream {cfg.name}")


async def ensure_attempts_stream(bus: Connection) -> None:
    """The stream of each attempt's record of itself (``Subjects.attempt``; ``explain`` reads it).

    A history, never needed to finish a batch, so bounded to drop its oldest first rather than refuse: by age
    (``jetstream.max_age_s``, else 7 days) and by size (``jetstream.attempts_max_bytes``, else ``max_bytes``, else
    256 MiB). An attempt's start record is stored before the attempt runs (``workers.attempts``); a stream that
    is gone or refuses costs the history, never the rollout. On a ``--secure`` bus the admin provisions it.
    """
    if bus.secured:
        return
    replicas, max_age = settings(bus)
    size = limit(bus, "attempts")
    cfg = StreamConfig(
        name=bus.subjects.attempts_stream,
        subjects=[bus.subjects.all_attempts],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        num_replicas=replicas,
        max_age=max_age or 7 * 24 * 3600.0,
        max_bytes=size.max_bytes,
        discard=DiscardPolicy.OLD,
    )
    await retrying(lambda: _ensure_stream(bus, cfg, replicas, size), what=f"stream {cfg.name}")


async def last_message(request: Callable[..., Awaitable[Message]], get: str) -> Message | None:
    """What a last-by-subject direct get (``get``: ``subjects.direct_get(stream, subject)``) answers, asked with
    a wire's ``request``: the message with its headers as stored; None when the subject has none."""
    msg = await retrying(lambda: request(get, b"", timeout=5.0), what="direct get")
    if msg.headers and msg.headers.get("Status"):
        return None
    return msg


async def ensure_blob_stream(bus: Connection, role: str) -> None:
    """The stream of the bodies over the max payload that ``role`` sends: one message per chunk, each
    subject written once.

    ``discard_new_per_subject`` with one message per subject makes every chunk write-once (an overwrite is
    refused by the server); reads are direct gets of a subject whose key only the referring message carries
    (no role may list it). A stream per role, bounded by ``jetstream.blobs_max_bytes`` and refusing new chunks
    when full (never dropping stored ones): a role that fills its own never starves another's. Chunks of calls
    and replies carry a per-message TTL (``Nats-TTL``, ``jetstream.blob_ttl_s``) and leave once read.
    """
    replicas, max_age = settings(bus)
    size = limit(bus, "blobs")
    cfg = StreamConfig(
        name=bus.subjects.blob_stream(role),
        subjects=[bus.subjects.role_blobs(role)],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        duplicate_window=120.0,  # a chunk published again after a lost ack is a duplicate, not a refusal
        num_replicas=replicas,
        max_age=max_age or 7 * 24 * 3600.0,
        max_bytes=size.max_bytes,
        max_msgs_per_subject=1,
        discard=DiscardPolicy.NEW,
        discard_new_per_subject=True,
        allow_direct=True,
        allow_msg_ttl=True,
    )
    try:
        await retrying(lambda: _ensure_stream(bus, cfg, replicas, size), what=f"stream {cfg.name}")
    except BadRequestError as e:
        if "overlap" not in str(e):
            raise
        old = bus.subjects.legacy_blob_stream  # the single blob stream of an earlier version: every role's subjects
        raise UserError(
            f"stream {cfg.name} cannot be made: the server holds {old}, the blob store of an earlier gym-runtime; "
            f"once the batches whose bodies it holds are collected, delete it (nats stream rm {old}) or start on "
            "a fresh store"
        ) from None


def duplicate_window(bus: Connection, max_age: float | None) -> float:
    """The task and result streams' duplicate window: ``jetstream.duplicate_window_s``, at most ``max_age``
    (the server refuses a longer one)."""
    cfg = bus.jetstream_config
    window = float(cfg.duplicate_window_s) if cfg is not None else DUPLICATE_WINDOW_S
    return min(window, max_age) if max_age else window


def settings(bus: Connection) -> tuple[int, float | None]:
    """(replicas, max_age seconds or None) from the bus's JetStreamConfig."""
    cfg = bus.jetstream_config
    if cfg is None:
        return 1, 7 * 24 * 3600.0
    return int(cfg.replicas), float(cfg.max_age_s) or None


async def ensure_streams(bus: Connection, agents: Iterable[str] = ()) -> None:
    """Create (idempotently) the task and model-call streams of a namespace, and the results stream of each of
    ``agents`` (``ensure_results_stream``: on a secured bus, checked to be there)."""
    names = bus.subjects
    replicas, max_age = settings(bus)
    tasks, model = limit(bus, "tasks"), limit(bus, "model")
    window = duplicate_window(bus, max_age)
    configs = [
        StreamConfig(
            name=names.tasks_stream,
            subjects=[names.all_tasks],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            duplicate_window=window,
            num_replicas=replicas,
            max_age=max_age,
            max_bytes=tasks.max_bytes,
            discard=DiscardPolicy.NEW,  # a full task queue refuses new tasks; it never drops queued ones
        ),
        StreamConfig(
            name=names.model_stream,
            subjects=[names.all_model_queues],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,  # survives a server restart, with its consumers
            duplicate_window=120.0,
            num_replicas=replicas,
            max_bytes=model.max_bytes,
            discard=DiscardPolicy.NEW,  # a full queue refuses a new call (the caller fails it); never drops one
        ),
    ]
    for i, (cfg, size) in enumerate(zip(configs, (tasks, model), strict=True)):
        if i == 1:  # the results before the model queue, as they were created when there was one shared stream
            for agent in agents:
                await ensure_results_stream(bus, agent)
        if bus.secured:  # the admin provisioned it: only checked to be there
            await _provisioned(bus, cfg)
        else:
            await retrying(partial(_ensure_stream, bus, cfg, replicas, size), what=f"stream {cfg.name}")


async def _provisioned(bus: Connection, cfg: StreamConfig) -> None:
    """A secured bus's stream, checked to be there by name (STREAM.NAMES with its subject), never by its info:
    a pool may not ask the tasks stream's info, whose subject counts list every agent's queued batch ids."""
    assert cfg.subjects
    if cfg.name not in await _stream_names(bus, cfg.subjects[0]):
        raise UserError(
            f"the secured server has no stream {cfg.name}: start it with `gym-runtime server --secure DIR`, which "
            "provisions the streams"
        )


def results_config(bus: Connection, agent: str | None) -> StreamConfig:
    """The results stream of ``agent`` (``LOST``: the reader's records of lost slots; None: one stream shared
    by every agent, ``Subjects.shared_results_stream``). Full, it refuses new results (discard new): stored
    results are never dropped to make room, and the agent's own results alone are refused."""
    names = bus.subjects
    replicas, max_age = settings(bus)
    return StreamConfig(
        name=names.shared_results_stream if agent is None else names.results_stream(agent),
        subjects=[names.all_results if agent is None else names.agent_results(agent)],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        duplicate_window=duplicate_window(bus, max_age),
        num_replicas=replicas,
        max_age=max_age,
        max_bytes=limit(bus, "results").max_bytes,
        discard=DiscardPolicy.NEW,
    )


async def provision_results(bus: Connection, agents: list[str] | None) -> None:
    """As admin: the results stream of every agent and of the lost records (``agents`` None: the shared one)."""
    size = limit(bus, "results")
    for agent in [*agents, LOST] if agents is not None else [None]:
        cfg = results_config(bus, agent)
        await retrying(partial(_ensure_stream, bus, cfg, cfg.num_replicas or 1, size), what=f"stream {cfg.name}")


async def ensure_results_stream(bus: Connection, agent: str) -> str:
    """The name of the stream that stores ``agent``'s results (``LOST``: lost records), created when missing
    on an unsecured bus. Found by subject: an older version's (or a config-less secured server's) shared
    stream serves every agent."""
    found = await find_results_stream(bus, agent)
    if found is not None:
        return found
    if bus.secured:
        raise UserError(
            f"the secured server has no results stream for agent {agent!r}: start it with the config that "
            "names the agent (gym-runtime server --secure DIR --config CONFIG)"
        )
    cfg = results_config(bus, agent)
    size = limit(bus, "results")
    await retrying(partial(_ensure_stream, bus, cfg, cfg.num_replicas or 1, size), what=f"stream {cfg.name}")
    assert cfg.name is not None
    return cfg.name


async def find_results_stream(bus: Connection, agent: str) -> str | None:
    """The stream that stores ``agent``'s results (its own, or a shared one); None when there is none."""
    subject = bus.subjects.result(agent, "probe")
    try:
        return str(await retrying(lambda: bus.js.find_stream_name_by_subject(subject), what="stream lookup"))
    except NotFoundError:
        return None


async def results_streams(bus: Connection) -> list[str]:
    """Every stream that stores results in this namespace (the agents', the lost records', a shared one)."""
    return await _stream_names(bus, bus.subjects.all_results)


async def namespaces(bus: Connection) -> list[str]:
    """The namespaces this server holds streams of (each has a tasks stream), this connection's among them."""
    found: set[str] = set()
    for stream in await _stream_names(bus, every_namespace_tasks()):
        info = await stream_info(bus, stream)
        found.update(ns for s in (info.config.subjects if info else None) or [] if (ns := namespace_of(s)))
    return sorted(found)


async def holds_batch(bus: Connection, namespace: str, batch: str) -> bool:
    """Whether ``namespace`` on this server has a manifest of ``batch`` (read, never created)."""
    names = Subjects(namespace)
    bucket = names.batches_bucket
    info = await stream_info(bus, kv_stream(bucket), subjects=kv_key(bucket, names.manifest_key(batch)))
    return bool(info is not None and info.state.subjects)


async def _stream_names(bus: Connection, subject: str) -> list[str]:
    """The streams whose subjects overlap ``subject`` (JetStream's STREAM.NAMES with a subject filter)."""
    msg = await retrying(
        lambda: bus.nc.request(stream_names_subject(), json.dumps({"subject": subject}).encode(), timeout=5.0),
        what="stream names",
    )
    body = json.loads(msg.data or b"{}")
    return sorted(body.get("streams") or [])


async def stream_full(bus: Connection, stream: str) -> bool:
    """Whether ``stream`` is at its size limit (within one max payload of it): a writer's next store is refused."""
    info = await stream_info(bus, stream)
    if info is None:
        return False
    cap = info.config.max_bytes or -1
    return cap > 0 and info.state.bytes + (bus.nc.max_payload or 1 << 20) > cap


async def _ensure_stream(bus: Connection, cfg: StreamConfig, replicas: int, size: Limit) -> None:
    if not size.explicit:  # marked, so that a stream refused room later may lower it (``_make_room``)
        cfg.metadata = {**(cfg.metadata or {}), DEFAULT_LIMIT: "default"}
    try:
        assert cfg.name is not None
        info = await bus.js.stream_info(cfg.name)
        have = info.config.num_replicas or 1
        if have != replicas:
            log.warning("stream.replicas_differ", stream=cfg.name, existing=have, configured=replicas)
    except NotFoundError:
        room_again = time.monotonic() + ROOM_WAIT_S
        while True:
            try:
                await bus.js.add_stream(cfg)
            except APIError as e:
                if isinstance(e, ServiceUnavailableError):
                    raise  # a leader election: retried
                if replicas > 1 and "peer offline" in (e.description or ""):  # a node is down: retried
                    raise PeerOffline(str(_setup_error(f"stream {cfg.name}", replicas, e, size.key))) from None
                if isinstance(e, BadRequestError) and "already in use" in str(e):
                    return  # made by another first
                if _smaller_default(cfg, size, e):  # no room for it (a single server's or a cluster's refusal)
                    continue
                if _no_storage(e) and not size.explicit and time.monotonic() < room_again:
                    if not await _make_room(bus, cfg.name):  # none to lower: perhaps one made beside it is
                        await anyio.sleep(0.2)  # lowering itself just now
                    cfg.max_bytes = size.max_bytes
                    continue
                raise _setup_error(f"stream {cfg.name}", replicas, e, size.key) from None
            if size.explicit or await _settle(bus, cfg, size, take_back=time.monotonic() < room_again):
                return
            # made again at half the size, after a random pause: two streams taken back at once do not
            # take the same room again together
            await anyio.sleep(random.uniform(0.01, 0.2))
            cfg.max_bytes = max(MIN_STARVED_BYTES, (cfg.max_bytes or size.max_bytes) // 2)


async def _settle(bus: Connection, cfg: StreamConfig, size: Limit, *, take_back: bool) -> bool:
    """Check that a just-made stream with a default limit fits, and leave room for the streams after it;
    False when it was taken back, to be made again smaller.

    A default that fits whole stays whole; one that was halved to fit is halved once more, so the streams
    after it fit too. Streams made at the same moment (a worker per agent, the reader, the publisher) may
    all be accepted beyond what the server holds (each is checked against the others' reservations as they
    were); the server then refuses every update and every new stream until one is deleted. The one made
    last sees it first, here, and is taken back while it is still empty. A cluster places a stream by its
    peers' last reported reservations and may accept one beyond what they hold; its replicas then refuse any
    update, and the stream keeps the limit it was made with (it works: nats-server accepted it)."""
    assert cfg.max_bytes is not None and cfg.name is not None
    made = cfg.max_bytes
    floor = MIN_DEFAULT_BYTES if made >= 2 * MIN_DEFAULT_BYTES else MIN_STARVED_BYTES
    cfg.max_bytes = made if made == size.max_bytes else max(floor, made // 2)
    try:
        await bus.js.update_stream(cfg)
    except APIError as e:
        cfg.max_bytes = made
        if take_back and _no_storage(e) and (cfg.num_replicas or 1) == 1 and await _take_back(bus, cfg.name):
            return False
    if cfg.max_bytes != size.max_bytes:
        _said_lowered(cfg, size)
    return True


async def _take_back(bus: Connection, stream: str) -> bool:
    """Delete ``stream`` just made, if nothing was written to it nor read from it yet."""
    info = await bus.js.stream_info(stream)
    if info.state.messages or info.state.consumer_count:
        return False
    await bus.js.delete_stream(stream)
    log.info("stream.taken_back", stream=stream, why="the server accepted it beyond what it holds")
    return True


def _said_lowered(cfg: StreamConfig, size: Limit) -> None:
    log.warning(
        "stream.limit_lowered",
        stream=cfg.name,
        max_bytes=cfg.max_bytes,
        default=size.max_bytes,
        why="the server cannot reserve the default on its disk",
        key=size.key,
    )


DEFAULT_LIMIT = "gym-runtime.max_bytes"  # a stream's metadata key: "default" when no user set its limit


async def _make_room(bus: Connection, refused: str | None) -> bool:
    """Halve the largest default limit among this namespace's mostly empty streams, so that ``refused`` fits.

    Defaults that fit whole are kept whole; made at the same moment (a worker per agent, the reader, the
    publisher) they can fill the store, and the server may accept a few beyond it. A stream then refused even
    at the floor takes room from them, never from a limit a user set or from another namespace's streams.
    False when none could give any."""
    names = bus.subjects
    infos = [i for n in await _stream_names(bus, names.everything) if (i := await stream_info(bus, n)) is not None]
    givers = sorted(
        (
            i
            for i in infos
            if (i.config.metadata or {}).get(DEFAULT_LIMIT) == "default"
            and (i.config.max_bytes or 0) >= 2 * MIN_STARVED_BYTES
            and i.state.bytes <= (i.config.max_bytes or 0) // 4
        ),
        key=lambda i: i.config.max_bytes or 0,
        reverse=True,
    )
    for info in givers:  # each still at least half empty once halved
        cfg = info.config
        assert cfg.max_bytes is not None
        was = cfg.max_bytes
        cfg.max_bytes = was // 2
        try:
            await bus.js.update_stream(cfg)
        except APIError as e:
            if _no_storage(e):  # the server granted more than it holds: it refuses every update until the
                return False  # streams made last are taken back (``_settle``)
            continue  # a cluster's replicas refuse a lower limit they placed by: try the next
        why = f"room for {refused}"
        log.warning("stream.limit_lowered", stream=cfg.name, max_bytes=cfg.max_bytes, was=was, why=why)
        return True
    return False


# How long a default refused even at MIN_STARVED_BYTES is tried again from the top. Streams made at the same moment
# by other writers (each agent's worker, the reader, the publisher) each reserve what fits, then halve it: until
# they do, the room looks taken. A server that is truly too small is then said in one line.
ROOM_WAIT_S = 10.0


def _smaller_default(cfg: StreamConfig, size: Limit, e: APIError) -> bool:
    """Halve a default limit the server cannot reserve (not one the user set); False at the floor.

    The floor is ``MIN_STARVED_BYTES``, not ``MIN_DEFAULT_BYTES``: a default that fits whole may leave less
    than that for the streams after it, which then start small (said in ``stream.limit_lowered``; full, a
    stream names its key) rather than stop the run."""
    if not _no_storage(e) or size.explicit or cfg.max_bytes is None:
        return False
    if cfg.max_bytes // 2 < MIN_STARVED_BYTES:
        return False
    cfg.max_bytes //= 2
    return True


async def ensure_consumer(bus: Connection, stream: str, durable: str, subject: str, *, ack_wait: float) -> None:
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


# An acking reader acks what it handled every few seconds (``data.reader.TICK_S``); what was delivered and not
# acked this long after is sent again. Deliveries lost with a dropped connection (a reader frozen, or its loop
# blocked, past the server's ping window: the server drops it, and what it had sent it is gone) come back only
# then: at 600 s a resumed ``collect`` sat 10 min without a row, silent. A redelivery of a handled result is
# taken once (``data.reader``'s slots).
READER_ACK_WAIT_S = 60.0
READER_MAX_ACK_PENDING = 16_384  # handled in order and acked every few hundred: never reached by a live reader


async def add_reader(
    bus: Connection, stream: str, consumer: str, subject: str, *, start_seq: int | None = None, acked: bool = False
) -> None:
    """A consumer that reads ``subject`` from the start, or from stream sequence ``start_seq`` on.

    ``acked``: its reader acks what it has handled (ack-all: one ack covers every message before it), so
    the server can say when it holds nothing more for it (``reader_settled``); else no acks at all.
    """
    cfg = ConsumerConfig(
        name=consumer,
        durable_name=consumer,
        filter_subject=subject,
        ack_policy=AckPolicy.ALL if acked else AckPolicy.NONE,
        ack_wait=READER_ACK_WAIT_S if acked else None,
        max_ack_pending=READER_MAX_ACK_PENDING if acked else None,
        deliver_policy=DeliverPolicy.ALL if start_seq is None else DeliverPolicy.BY_START_SEQUENCE,
        opt_start_seq=start_seq,
        inactive_threshold=600.0,
        max_waiting=64,
    )
    await retrying(lambda: bus.js.add_consumer(stream, cfg), what=f"consumer {consumer}")


async def delete_consumer(bus: Connection, stream: str, consumer: str) -> None:
    await bus.js.delete_consumer(stream, consumer)


async def consumers(bus: Connection, stream: str) -> list[dict[str, Any]]:
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


async def subject_count(bus: Connection, stream: str, subjects: str) -> int:
    """Messages stored in ``stream`` on subjects matching ``subjects`` (0 when it does not exist)."""
    info = await stream_info(bus, stream, subjects)
    return sum((info.state.subjects or {}).values()) if info else 0


async def reader_settled(bus: Connection, stream: str, consumer: str) -> bool:
    """Whether the server holds nothing more for an acked reader: no message of its filter undelivered, none
    delivered and not yet acked (handled). What was purged or evicted is in neither count."""

    async def ask() -> bool:
        info = _led(await bus.js.consumer_info(stream, consumer), f"consumer {consumer}")
        return not info.num_pending and not info.num_ack_pending

    return await retrying(ask, what=f"consumer info {consumer}")


async def message_count(bus: Connection, stream: str) -> int:
    """Messages stored in ``stream`` (0 when it does not exist yet)."""
    info = await stream_info(bus, stream)
    return int(info.state.messages) if info else 0


class KV:
    """One KV bucket, as bytes in and out; ``get`` of a missing key is ``None``. Each call is retried for
    ``within_s`` while it gets no answer (the bus's ``Timings.store_retry_s``, as a stored publish is)."""

    def __init__(self, kv: Any, within_s: float = API_RETRY_S) -> None:
        self._kv = kv
        self._within_s = within_s

    async def get(self, key: str) -> bytes | None:
        async def get() -> bytes | None:
            try:
                entry = await self._kv.get(key)
            except KeyNotFoundError:
                return None
            return bytes(entry.value or b"")

        return await retrying(get, what="kv get", within_s=self._within_s)

    async def put(self, key: str, value: bytes) -> None:
        await retrying(lambda: self._kv.put(key, value), what="kv put", within_s=self._within_s)

    async def delete(self, key: str) -> None:
        await retrying(lambda: self._kv.delete(key), what="kv delete", within_s=self._within_s)


async def kv_bucket(
    bus: Connection,
    bucket: str,
    *,
    within_s: float = API_RETRY_S,
    ttl_s: float = 0.0,
    direct: bool = False,
    msg_ttl: bool = False,
) -> KV:
    """The bucket, created on first use (history 1; ``ttl_s``: a key not written for that long is dropped, 0:
    never); its calls retried for ``within_s`` (``KV``). ``direct``: its keys are read by last-by-subject direct
    gets, the one read a permission can scope to a key prefix (one made without them is given them); on a
    ``--secure`` bus the admin provisions it and a pool, which may not read the bucket's info (it lists every
    key), finds it by name. ``msg_ttl``: a write may set its own age limit (``Nats-TTL``: the checkpoints a caller
    keeps for branching), given to one made without it as ``direct`` is."""
    replicas, _ = settings(bus)

    async def open_or_create() -> KV:
        if direct and bus.secured:
            try:
                await bus.js.find_stream_name_by_subject(kv_key(bucket, "probe"))
            except NotFoundError:
                raise BucketNotFoundError from None
            kv = KeyValue(name=bucket, stream=kv_stream(bucket), pre=kv_key(bucket, ""), js=bus.js, direct=True)
            return KV(kv, within_s)
        try:
            kv = await bus.js.key_value(bucket)
            if direct or msg_ttl:
                info = await bus.js.stream_info(kv_stream(bucket))
                wanted = (direct and not info.config.allow_direct, msg_ttl and not info.config.allow_msg_ttl)
                if any(wanted):  # made by an earlier version (its keys read from its leader only, no own ages)
                    info.config.allow_direct = info.config.allow_direct or direct
                    info.config.allow_msg_ttl = info.config.allow_msg_ttl or msg_ttl
                    await bus.js.update_stream(info.config)
                    kv = await bus.js.key_value(bucket)
            return KV(kv, within_s)
        except BucketNotFoundError:
            cfg = KeyValueConfig(bucket=bucket, history=1, replicas=replicas, max_bytes=KV_MAX_BYTES, ttl=ttl_s or None)
            cfg.direct = direct or None
            room_again = time.monotonic() + ROOM_WAIT_S
            while True:
                try:
                    made = KV(await bus.js.create_key_value(cfg), within_s)
                    if msg_ttl:  # nats-py's bucket config has no such key: the stream is given it once made
                        info = await bus.js.stream_info(kv_stream(bucket))
                        info.config.allow_msg_ttl = True
                        await bus.js.update_stream(info.config)
                    return made
                except APIError as e:
                    if isinstance(e, ServiceUnavailableError):
                        raise  # a leader election: retried
                    if _no_storage(e) and cfg.max_bytes and cfg.max_bytes > KV_MIN_BYTES:
                        cfg.max_bytes //= 4  # a small disk: manifests are small
                        continue
                    if _no_storage(e) and time.monotonic() < room_again:  # as a stream's default (_ensure_stream)
                        if not await _make_room(bus, kv_stream(bucket)):
                            await anyio.sleep(0.2)
                        cfg.max_bytes = KV_MAX_BYTES
                        continue
                    raise _setup_error(f"bucket {bucket}", replicas, e) from None

    return await retrying(open_or_create, what=f"bucket {bucket}")


async def stream_config(bus: Connection, stream: str) -> dict[str, Any] | None:
    """A stream's replicas, retention and size as plain values (None when it does not exist)."""
    info = await stream_info(bus, stream)
    if info is None:
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


async def purge_subject(bus: Connection, stream: str, subject: str, *, count: bool = True) -> int:
    """Remove every message of ``subject`` from ``stream``; returns how many were removed (0 without ``count``:
    counting lists every subject it matches, one per task for the kept tasks)."""
    before = await stream_info(bus, stream, subject) if count else None
    try:
        await bus.js.purge_stream(stream, subject=subject)
    except NotFoundError:
        return 0
    return sum((before.state.subjects or {}).values()) if before and before.state.subjects else 0


async def kv_keys(bus: Connection, bucket: str) -> list[str]:
    """The keys ``bucket`` holds now (deleted and purged ones left out); none when it does not exist."""
    try:
        kv = await bus.js.key_value(bucket)
        return sorted(await kv.keys())
    except (BucketNotFoundError, NoKeysError):
        return []


async def delete_key(bus: Connection, bucket: str, key: str) -> bool:
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


async def watch_queues(bus: Connection, meters: Meters, *, every_s: float = 5.0) -> None:
    """Refresh ``meters.queues`` from JetStream's consumer info until cancelled (queue lag gauges)."""
    names = bus.subjects
    while True:
        t0 = time.monotonic()
        try:
            found = await consumers(bus, names.tasks_stream) + await consumers(bus, names.model_stream)
            meters.queues = {c["consumer"]: c for c in found}
        except Exception as e:  # noqa: BLE001 - a scrape gauge must never take a worker down
            log.debug("metrics.queue_poll_failed", error=str(e))
        await anyio.sleep(max(0.5, every_s - (time.monotonic() - t0)))
