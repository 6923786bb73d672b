"""Bodies over the max payload: write-once chunks in the blob stream, referenced from the message.

The ``Gym-Blob`` header carries the key, the chunk count and the body's SHA-256, so a reader checks
that what it read is what the sender stored; only the key a message carries reads a body (no role
but admin may list the stream). ``Bodies`` is the part of ``Bus`` that encodes and decodes.
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from typing import TYPE_CHECKING, Any, cast

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from gym_runtime.errors import Failure
from gym_runtime.transport.codec import Codec
from gym_runtime.transport.delivery import Delivery
from gym_runtime.transport.headers import (
    BLOB_HEADER,
    MSG_ID_HEADER,
)
from gym_runtime.transport.jetstream import blob_stream_name, ensure_blob_stream
from gym_runtime.transport.rpc import JS_ACK_TIMEOUT_S

if TYPE_CHECKING:
    from gym_runtime.transport.bus import Bus

MAX_BLOB_BYTES = 256 * 1024 * 1024  # a referenced body larger than this is refused before it is read


class Bodies:
    """Encoding and decoding message bodies, large ones by reference (a part of ``Bus``)."""

    nc: NATS
    ns: str
    codec: Codec
    secured: bool
    max_blob_bytes: int
    _blobs_ready: bool

    async def _store(self, subject: str, data: bytes, headers: dict[str, str]) -> None:
        raise NotImplementedError  # Bus: a JetStream publish acked by the stream

    @property
    def blob_threshold(self) -> int:
        return max(64 * 1024, (self.nc.max_payload or 1024 * 1024) - 64 * 1024)

    def _blob_subject(self, key: str, chunk: int) -> str:
        return f"{self.ns}.blob.{key}.{chunk}"

    async def _put_blob(self, data: bytes) -> str:
        """Store ``data`` as write-once chunks under a fresh key; returns the ``Gym-Blob`` header value.

        The header carries the chunk count and the body's SHA-256, so a reader checks
        that what it read is what the sender stored (a swapped body is refused).
        """
        if not self._blobs_ready:
            if not self.secured:
                await ensure_blob_stream(cast("Bus", self))  # a Bodies is always a Bus's part
            self._blobs_ready = True
        key = uuid.uuid4().hex
        size = self.blob_threshold
        chunks = [data[i : i + size] for i in range(0, len(data), size)] or [b""]

        async def put(i: int, chunk: bytes) -> None:
            subject = self._blob_subject(key, i)
            await self._store(subject, chunk, {MSG_ID_HEADER: subject})

        await asyncio.gather(*(put(i, c) for i, c in enumerate(chunks)))
        return f"{key}.{len(chunks)}.{hashlib.sha256(data).hexdigest()}"

    async def _get_blob(self, ref: str) -> bytes:
        """The body a ``Gym-Blob`` header refers to, checked against its digest (``integrity`` error if not)."""
        key, _, rest = ref.partition(".")
        n_text, _, digest = rest.partition(".")
        if not (key.isalnum() and n_text.isdigit() and len(digest) == 64):
            raise Failure("integrity", f"malformed {BLOB_HEADER} header")
        n = int(n_text)
        if n < 1 or (n - 1) * 64 * 1024 > self.max_blob_bytes:
            raise Failure("integrity", f"a referenced body of {n} chunks is over the {self.max_blob_bytes} B limit")
        api = f"$JS.API.DIRECT.GET.{blob_stream_name(self.ns)}."

        async def get(i: int) -> bytes:
            msg = await self.nc.request(api + self._blob_subject(key, i), b"", timeout=JS_ACK_TIMEOUT_S)
            if msg.headers and msg.headers.get("Status"):
                raise Failure("integrity", f"a referenced body's chunk {i} is missing (expired or never stored)")
            return msg.data

        parts = await asyncio.gather(*(get(i) for i in range(n)))
        data = b"".join(parts)
        if len(data) > self.max_blob_bytes:
            raise Failure("integrity", f"a referenced body of {len(data)} B is over the {self.max_blob_bytes} B limit")
        if hashlib.sha256(data).hexdigest() != digest:
            raise Failure("integrity", "a referenced body does not match the digest its message carries (tampered)")
        return data

    async def encode(self, payload: Any, headers: dict[str, str]) -> bytes:
        """Encode ``payload``; a body over the max payload is stored as a blob and referenced."""
        data = self.codec.encode(payload)
        if len(data) > self.blob_threshold:
            headers[BLOB_HEADER] = await self._put_blob(data)
            return b""
        return data

    async def decode(self, msg: Msg | Delivery) -> Any:
        headers = msg.headers
        if headers and BLOB_HEADER in headers:
            return self.codec.decode(await self._get_blob(headers[BLOB_HEADER]), headers)
        return self.codec.decode(msg.data, headers)
