"""A NATS message's header block, written and read with nats-py's rules at a fraction of its steps.

nats-py checks each header name with a regular expression on every send and each received name one character
at a time (``str.isspace`` per character, in a generator): about 400 Python-level steps per weather rollout,
for the same few names (``traceparent``, ``Nats-Msg-Id``). Here a name is checked once per connection and
remembered (at most ``NAMES_KEPT``: a peer that sends many names costs only their checks, never memory); values
are treated as nats-py treats them. The block on the wire and the dict a handler reads are the same bytes and
the same dict nats-py would make (``tests/test_transport.py``)."""

from __future__ import annotations

import re
from collections.abc import Mapping

from nats import errors

HEADER_LINE = "NATS/1.0"
NAMES_KEPT = 64  # names remembered per connection and direction
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # a header name (RFC 9110 token): nats-py's own rule
_NEWLINES = str.maketrans({"\r": " ", "\n": " "})  # a value cannot end its line early
_SPACE = re.compile(r"\s")  # str.isspace's characters: a received name with one inside is dropped


class HeaderBlock:
    """One connection's header names, checked once: ``encode`` for what it sends, ``parse`` for what it reads."""

    def __init__(self) -> None:
        self._sent: dict[str, str] = {}  # a name as given -> as written ("" skipped)
        self._read: dict[bytes, str | None] = {}  # a name's bytes as read -> the key (None: dropped)

    def encode(self, headers: Mapping[str, str]) -> bytes:
        """The block nats-py writes for ``headers``: ``BadHeaderError`` for a name that is not a token, an empty
        name skipped, each value stripped with its line breaks made spaces."""
        lines = [HEADER_LINE]
        sent = self._sent
        for k, v in headers.items():
            key = sent.get(k)
            if key is None:
                key = self._name(k)
            if key:
                v = v.strip()
                if "\r" in v or "\n" in v:
                    v = v.translate(_NEWLINES)
                lines.append(f"{key}: {v}")
        lines += ("", "")
        return "\r\n".join(lines).encode()

    def _name(self, given: str) -> str:
        key = given.strip()
        if key and not _TOKEN.fullmatch(key):
            raise errors.BadHeaderError(key)
        if len(self._sent) < NAMES_KEPT:
            self._sent[given] = key
        return key

    def parse(self, raw: bytes) -> dict[str, str]:
        """The headers in ``raw`` (``Name: Value`` lines) as nats-py reads them: a name that is not ASCII or has
        whitespace inside is dropped, a value is stripped and decoded (malformed UTF-8 as U+FFFD)."""
        out: dict[str, str] = {}
        read = self._read
        for line in raw.split(b"\r\n"):
            if not line:
                continue
            name, sep, value = line.partition(b":")
            if not sep:
                continue
            key = read[name] if name in read else self._key(name)
            if key is not None:
                out[key] = value.strip().decode("utf-8", "replace")
        return out

    def _key(self, name: bytes) -> str | None:
        try:
            key: str | None = name.strip().decode("ascii")
        except UnicodeDecodeError:
            key = None
        if key is not None and _SPACE.search(key):
            key = None
        if len(self._read) < NAMES_KEPT:
            self._read[name] = key
        return key
