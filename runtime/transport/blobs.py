"""Bodies over the max payload: write-once chunks in the sender's role's blob stream, referenced from the message.

Each connection writes into its own key space (``{role}.{pool}``) of its role's stream, so a pool that fills
it refuses no other role's bodies. The ``Gym-Blob`` header carries the key space, the key, the chunk count
and the body's SHA-256, so a reader checks that what it read is what the sender stored; only the key a
message carries reads a body (no role but admin may list a stream), and a count more chunks than the body
limit allows is refused before any is fetched. ``Blobs`` is the part of ``Bus`` (``bus.blobs``) that encodes and
decodes: it stores chunks through the bus's acked publish (``store``), reads them with direct gets on the bus's
wire, and is given nothing else of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from gym_runtime.errors import Failure
from gym_runtime.transport.codec import Codec
from gym_runtime.transport.delivery import Delivery, Message
from gym_runtime.transport.headers import (
    BLOB_HEADER,
    MSG_ID_HEADER,
    TTL_HEADER,
)
from gym_runtime.transport.interface import Wire
from gym_runtime.transport.rpc import JS_ACK_TIMEOUT_S
from gym_runtime.transport.subjects import ANY_ROLE, BLOB_ROLES, blob_role, blob_space

# a publish into a stream that returns once the stream acked it (``Bus.store``)
Store = Callable[[str, bytes, dict[str, str]], Awaitable[None]]

MIN_THRESHOLD = 64 * 1024  # no body this small goes by reference (``Blobs.threshold``)

MAX_BLOB_BYTES = 256 * 1024 * 1024  # a referenced body larger than this is refused before it is read
BLOB_BYTES_IN_FLIGHT = 128 * 1024 * 1024  # default jetstream.blob_bytes_in_flight
BLOB_CHUNKS_IN_FLIGHT = 2  # chunks of one body stored or fetched at once
BLOB_TTL_S = 3600.0  # default jetstream.blob_ttl_s
_NAME = re.compile(r"[A-Za-z0-9_-]+")


class ByteBudget:
    """At most ``cap`` bytes of large bodies held at once by one connection's stores and reads.

    A taker that does not fit waits its turn (first come, first served): back-pressure, never a drop.
    A body larger than the whole cap goes alone, when nothing else is held. ``peak`` is the most held.
    """

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.held = 0
        self.peak = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    def _fits(self, n: int) -> bool:
        return self.held == 0 or self.held + n <= self.cap

    def _take(self, n: int) -> None:
        self.held += n
        self.peak = max(self.peak, self.held)

    def _wake(self) -> None:
        while self._waiters and self._fits(self._waiters[0][0]):
            n, fut = self._waiters.popleft()
            if not fut.done():
                self._take(n)
                fut.set_result(None)

    @contextlib.asynccontextmanager
    async def hold(self, n: int) -> AsyncIterator[None]:
        if not self._waiters and self._fits(n):
            self._take(n)
        else:
            entry = (n, asyncio.get_running_loop().create_future())
            self._waiters.append(entry)
            try:
                await entry[1]
            except asyncio.CancelledError:
                if entry[1].done() and not entry[1].cancelled():  # granted as it was cancelled: give it back
                    self.held -= n
                with contextlib.suppress(ValueError):
                    self._waiters.remove(entry)
                self._wake()
                raise
        try:
            yield
        finally:
            self.held -= n
            self._wake()


class Blobs:
    """Encoding and decoding message bodies, large ones by reference (``bus.blobs``).

    ``wire``: the connection the chunks are read from and whose blob stream is made on first use (unless
    ``secured``: the admin provisioned it); ``store``: its acked stream publish. ``space`` (``{role}.{pool}``,
    ``subjects.blob_space``) is the key space this connection writes; ``budget`` bounds the bytes held at once.
    """

    def __init__(self, wire: Wire, codec: Codec, store: Store) -> None:
        self.wire = wire
        self.codec = codec
        self.store = store
        self.max_bytes = MAX_BLOB_BYTES
        self.space = blob_space(None, None)
        self.ttl_s = BLOB_TTL_S
        self.budget = ByteBudget(BLOB_BYTES_IN_FLIGHT)  # large bodies held at once (back-pressure beyond)
        self.ready = False  # the blob stream exists (provisioned, or created on first use)

    @property
    def threshold(self) -> int:
        """A body larger than this goes by reference: the server's max payload, less room for headers."""
        return max(MIN_THRESHOLD, (self.wire.max_payload or 1024 * 1024) - 64 * 1024)

    async def _put_blob(self, data: bytes, *, ttl: bool) -> str:
        """Store ``data`` as write-once chunks under a fresh key in this connection's key space; returns the
        ``Gym-Blob`` header value.

        The header carries the key space, the chunk count and the body's SHA-256, so a reader checks that what
        it read is what the sender stored (a swapped body is refused). ``ttl``: the body of a call or a reply,
        read at once; its chunks expire after ``blob_ttl_s`` (a stored message's live as long as it may).
        At most ``BLOB_CHUNKS_IN_FLIGHT`` chunks are copied out and on their way at once.
        """
        space = self.space
        if not self.ready:
            if not self.wire.secured:
                await self.wire.ensure_stream("blobs", blob_role(space))
            self.ready = True
        key = uuid.uuid4().hex
        size = self.threshold
        view = memoryview(data)
        n = max(1, -(-len(data) // size))
        extra = {TTL_HEADER: str(int(self.ttl_s))} if ttl else {}
        gate = asyncio.Semaphore(BLOB_CHUNKS_IN_FLIGHT)

        async def put(i: int) -> None:
            async with gate:
                subject = self.wire.subjects.blob(space, key, i)
                await self.store(subject, bytes(view[i * size : (i + 1) * size]), {MSG_ID_HEADER: subject, **extra})

        async with self.budget.hold(len(data)):
            await asyncio.gather(*(put(i) for i in range(n)))
        return f"{space}.{key}.{n}.{hashlib.sha256(data).hexdigest()}"

    def _blob_ref(self, ref: str) -> tuple[str, str, int, str]:
        """(space, key, chunks, digest) of a ``Gym-Blob`` header; an ``integrity`` error if it is malformed, or
        if its chunk count × the chunk size is over the body limit (refused before any chunk is fetched)."""
        parts = ref.split(".")
        if len(parts) != 5:
            raise Failure("integrity", f"malformed {BLOB_HEADER} header")
        role, pool, key, n_text, digest = parts
        if not (
            (role in BLOB_ROLES or role == ANY_ROLE) and _NAME.fullmatch(pool) and key.isalnum() and n_text.isdigit()
        ):
            raise Failure("integrity", f"malformed {BLOB_HEADER} header")
        if len(digest) != 64 or len(n_text) > 9:
            raise Failure("integrity", f"malformed {BLOB_HEADER} header")
        n = int(n_text)
        # every chunk but the last is a full one: more chunks than the limit's share is a lie, or too big
        if n < 1 or (n - 1) * self.threshold >= self.max_bytes:
            raise Failure(
                "integrity",
                f"a referenced body of {n} chunks of {self.threshold} B is over the {self.max_bytes} B limit",
            )
        return blob_space(role, pool), key, n, digest

    async def _get_blob(self, ref: str) -> bytearray:
        """The body a ``Gym-Blob`` header refers to, checked against its digest (``integrity`` error if not).

        Chunks are fetched ``BLOB_CHUNKS_IN_FLIGHT`` at a time and written in order as they come, hashed on
        the way: the body and a couple of chunks are all that is held (a fetch of every chunk at once made the
        server drop the reader as a slow consumer, and held each chunk twice)."""
        space, key, n, digest = self._blob_ref(ref)
        limit, size = self.max_bytes, self.threshold
        # one buffer of what n chunks can hold, filled in place and cut to size: a buffer grown chunk by chunk
        # moved once it outgrew the allocator's heap and left the old copy's pages behind (+1× the body in RSS)
        body = bytearray(min(n * size, limit))
        view = memoryview(body)
        filled = 0
        sha = hashlib.sha256()

        async def get(i: int) -> bytes:
            msg = await self.wire.request(self.wire.subjects.blob_get(space, key, i), b"", timeout=JS_ACK_TIMEOUT_S)
            if msg.headers and msg.headers.get("Status"):
                raise Failure("integrity", f"a referenced body's chunk {i} is missing (expired or never stored)")
            if len(msg.data) > size:
                raise Failure("integrity", f"a referenced body's chunk {i} is larger than a chunk")
            return msg.data

        ahead: deque[asyncio.Future[bytes]] = deque()
        nxt = 0
        try:
            while nxt < n or ahead:
                while nxt < n and len(ahead) < BLOB_CHUNKS_IN_FLIGHT:
                    ahead.append(asyncio.ensure_future(get(nxt)))
                    nxt += 1
                chunk = await ahead.popleft()
                if filled + len(chunk) > len(body):
                    raise Failure("integrity", f"a referenced body is over the {limit} B limit")
                sha.update(chunk)
                view[filled : filled + len(chunk)] = chunk
                filled += len(chunk)
        finally:
            for t in ahead:
                t.cancel()
            view.release()
        del body[filled:]
        if sha.hexdigest() != digest:
            raise Failure("integrity", "a referenced body does not match the digest its message carries (tampered)")
        return body

    async def encode(self, payload: Any, headers: dict[str, str], *, stored: bool = False) -> bytes:
        """Encode ``payload``; a body over the max payload is stored as a blob and referenced. ``stored``: the
        message is kept in a stream (a task, a result), so its body lives as long as it; else it expires."""
        data = self.codec.encode(payload)
        if len(data) > MIN_THRESHOLD and len(data) > self.threshold:  # (most bodies: no lookup of the threshold)
            headers[BLOB_HEADER] = await self._put_blob(data, ttl=not stored)
            return b""
        return data

    async def decode(self, msg: Message | Delivery) -> Any:
        return (await self.decode_sized(msg))[0]

    async def decode_sized(self, msg: Message | Delivery) -> tuple[Any, int]:
        """The body decoded, and its size as stored (a large body's blob)."""
        headers = msg.headers
        if headers and BLOB_HEADER in headers:
            ref = headers[BLOB_HEADER]
            _, _, n, _ = self._blob_ref(ref)  # held from the read until it is decoded: at most n chunks
            async with self.budget.hold(min(n * self.threshold, self.max_bytes)):
                data = await self._get_blob(ref)
                return self.codec.decode(data, headers), len(data)
        return self.codec.decode(msg.data, headers), len(msg.data)
