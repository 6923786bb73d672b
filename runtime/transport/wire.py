"""The real wire: nats-py's client and the runtime's JetStream administration (``interface.Wire``).

The core methods are the client's own, handed on unwrapped (nothing is added per message); the stream methods
are ``jetstream``, ``pull`` and ``readers`` applied to this connection. The ``Bus`` above it holds everything
else; ``memory.MemoryWire`` is the same wire in memory.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from nats.aio.client import Client as NATS

from gym_runtime.transport import jetstream as streams
from gym_runtime.transport.interface import Connection, Handle, KeyValue, Puller, StreamReader, Wire
from gym_runtime.transport.pull import work_queue_puller
from gym_runtime.transport.readers import open_reader
from gym_runtime.transport.subjects import Subjects

DRAIN_MARGIN_S = 5.0  # past its own drain timeout, how long a close waits for nats-py's flush and close


class NatsWire:
    """One nats-py connection as a ``Wire`` (and the ``Connection`` the streams' administration reads)."""

    def __init__(self, nc: NATS, subjects: Subjects) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.subjects = subjects
        self.secured = False  # a --secure bus: the admin provisioned the streams, no other role may create them
        self.jetstream_config: Any = None  # JetStreamConfig (replicas, retention) for what it creates; None = defaults
        self.publish, self.subscribe, self.request = nc.publish, nc.subscribe, nc.request
        self.new_inbox, self.flush = nc.new_inbox, nc.flush

    @property
    def max_payload(self) -> int:
        return self.nc.max_payload

    async def close(self, timeout: float = 10.0) -> None:
        """Drain (let handlers finish, flush) and close, each within ``timeout``. A connection whose server
        went away is closed as it is: nats-py's own close can raise on the dead socket, and a process told to
        stop after its server died (the end of a job) must still stop, quietly."""
        if self.nc.is_closed:
            return
        # nats-py times its own drain out: a drain cancelled from outside leaves its gather of the subscriptions'
        # drains with an exception nobody reads ("_GatheringFuture exception was never retrieved" on stderr)
        self.nc.options["drain_timeout"] = timeout
        try:
            await asyncio.wait_for(self.nc.drain(), timeout + DRAIN_MARGIN_S)
        except Exception:  # draining a dead or reconnecting connection: nothing left to flush
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.nc.close(), timeout)

    async def ensure_stream(self, kind: str, name: str = "") -> str:
        """``jetstream.ensure_results_stream`` / ``ensure_attempts_stream`` / ``ensure_blob_stream``."""
        if kind == "results":
            return await streams.ensure_results_stream(self, name)
        if kind == "attempts":
            await streams.ensure_attempts_stream(self)
            return self.subjects.attempts_stream
        await streams.ensure_blob_stream(self, name)
        return self.subjects.blob_stream(name)

    async def work_queue(self, kind: str, name: str, *, slots: int, ack_wait: float, handle: Handle) -> Puller:
        """A puller of ``{ns}.{kind}.{name}`` (``pull.work_queue_puller``)."""
        return await work_queue_puller(self, kind, name, slots=slots, ack_wait=ack_wait, handle=handle)

    async def reader(self, stream: str, consumer: str, subject: str, *, handle: Handle) -> StreamReader:
        """An acked reader of ``subject`` in ``stream`` from the start (``readers.open_reader``)."""
        return await open_reader(self, stream, consumer, subject, handle)

    async def kv(
        self, bucket: str, *, within_s: float, ttl_s: float = 0.0, direct: bool = False, msg_ttl: bool = False
    ) -> KeyValue:
        """The KV bucket, made on first use (``jetstream.kv_bucket``; ``ttl_s``: its keys' age limit, 0: none;
        ``direct``: its keys read by last-by-subject direct gets; ``msg_ttl``: a write may set its own age)."""
        return await streams.kv_bucket(self, bucket, within_s=within_s, ttl_s=ttl_s, direct=direct, msg_ttl=msg_ttl)

    async def subject_count(self, stream: str, subjects: str) -> int:
        return await streams.subject_count(self, stream, subjects)

    async def stream_full(self, stream: str) -> bool:
        return await streams.stream_full(self, stream)


if TYPE_CHECKING:  # mypy holds it to the wire the Bus is built on, and to what the administration uses
    _nats_is_a_wire: type[Wire] = NatsWire
    _nats_is_a_connection: type[Connection] = NatsWire
