"""Wire encoding: msgpack by default, JSON accepted; the ``Content-Type`` header says which.

Encoders and decoders are built once (msgspec caches type info in them); a
message without a ``Content-Type`` header is msgpack, so the hot path needs no
header for the body format.
"""

from __future__ import annotations

from typing import Any

import msgspec

from gym_runtime.messages import Envelope

CONTENT_TYPE = "Content-Type"
MSGPACK = "application/msgpack"
JSON = "application/json"


class Codec:
    """Encodes envelopes as msgpack (or JSON on request) and decodes either."""

    __slots__ = ("_mp_enc", "_mp_dec", "_js_enc", "_js_dec")

    def __init__(self) -> None:
        self._mp_enc = msgspec.msgpack.Encoder()
        self._mp_dec = msgspec.msgpack.Decoder(Envelope)
        self._js_enc = msgspec.json.Encoder()
        self._js_dec = msgspec.json.Decoder(Envelope)

    def encode(self, msg: Any, *, json: bool = False) -> bytes:
        return self._js_enc.encode(msg) if json else self._mp_enc.encode(msg)

    def decode(self, data: bytes | bytearray, headers: dict[str, str] | None) -> Any:
        if headers and headers.get(CONTENT_TYPE) == JSON:
            return self._js_dec.decode(data)
        return self._mp_dec.decode(data)
