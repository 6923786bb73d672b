"""A sandbox's lease: the secret its holder proves with every operation (``SandboxCall.lease``).

A sandbox id is no key to a sandbox: checkpoints, handles and log lines name ids, so the worker that holds a
sandbox serves an operation only under the lease it was created (or reattached) with, from the caller that created
it. A lease is random (128 bits, never derived from a rollout's key, which anyone who sees a row knows), and only
its holder, its checkpoint and the worker hold it: logs and container labels carry its ``tag`` instead.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

LEASE_BYTES = 16  # 128 random bits: no lease is guessed


def new_lease() -> str:
    """A fresh lease (hex)."""
    return secrets.token_hex(LEASE_BYTES)


def lease_tag(lease: str) -> str:
    """What a log line or a container label may name a lease by: a short hash (the same lease, the same tag),
    from which the lease cannot be had back."""
    return hashlib.sha256(lease.encode()).hexdigest()[:12]


def proves(held: str, asked: str) -> bool:
    """Whether ``asked`` is the lease ``held`` (in constant time: a reply's delay says nothing of how close it
    came); an empty lease proves nothing."""
    return bool(held) and hmac.compare_digest(held.encode(), asked.encode())
