"""A crash the policy's input causes is the policy's: the calls that killed a resource worker's guest.

A guest process (``isolation: process``) that dies while it runs one call (``GuestCrash``: the page names that call
and no other) loses every session that lived in it; each fails as a retryable ``worker_lost``, the
infrastructure's, and its rollout runs again. If a tool call's input kills the guest every time, that would be an
escape hatch: a policy that answers a hard task with a call that crashes its environment is retried, then kept out
of training, never scored. So the worker remembers the calls that killed its guest, by their rollout (a digest of
the row its session was seeded with) and their input (a tool's name and arguments; a verify's answer): when the
same call of the same rollout kills it again, on the retry its first crash cost, that rollout fails as
``input_crash``, the policy's, scored and not retried. The other sessions lost with the guest stay the
infrastructure's. A crash of another kind (a seed, a guest killed from outside, one of several calls running) is
never the policy's.

The memory is this worker's (bounded, oldest forgotten first): a retry served by another worker of the same
resource starts its count again (docs/trainer.md).
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

from gym_runtime.errors import Failure
from gym_runtime.messages import Response

__all__ = ["Crashes", "answer_digest", "rollout_digest"]

REMEMBERED = 4096  # calls that crashed a guest, kept per worker
_encode = msgspec.msgpack.Encoder().encode


def rollout_digest(row: dict[str, Any]) -> bytes:
    """Which rollout a session serves: the row it was seeded with (the task's, with its ``_ng_task_index`` and
    ``_ng_rollout_index``), the same on every attempt of that rollout."""
    return hashlib.blake2b(_encode(row), digest_size=16).digest()


def answer_digest(response: Response) -> str:
    """The policy's answer as a verify reads it, less its items' ids (an attempt's own): the same answer on the retry
    digests the same."""
    items = [
        {k: v for k, v in item.items() if k != "id"} if isinstance(item, dict) else item
        for item in msgspec.to_builtins(response.output)
    ]
    return hashlib.blake2b(_encode(items), digest_size=16).hexdigest()


class Crashes:
    """The calls (rollout, tool and arguments, or verify and the answer) that killed this worker's guest once."""

    def charge(self, crash: Failure, rollout: bytes, tool: str, given: str) -> Failure:
        """``crash`` (its guest died running the call: ``worker_lost``) the first time; ``input_crash`` when the
        same call of the same rollout killed it before. ``tool``: the tool's name, "" for a verify; ``given``: its
        arguments, or the answer's digest (``answer_digest``)."""
        if not self.again(rollout, tool, given):
            return crash
        what = f"tool {tool!r}: these arguments" if tool else "verify: the policy's answer"
        message = f"{what} killed the environment's guest process again, as on an earlier attempt of this rollout"
        return Failure("input_crash", f"{message} ({crash.info.message})")

    def __init__(self, remembered: int = REMEMBERED) -> None:
        self._seen: dict[bytes, None] = {}
        self._remembered = remembered

    def again(self, rollout: bytes, name: str, arguments: str) -> bool:
        """Whether this call killed the guest before; remembers it if not."""
        h = hashlib.blake2b(rollout, digest_size=16)
        h.update(name.encode())
        h.update(b"\0")
        h.update(arguments.encode())
        key = h.digest()
        if key in self._seen:
            return True
        self._seen[key] = None
        while len(self._seen) > self._remembered:
            del self._seen[next(iter(self._seen))]
        return False
