"""The client side of a secured bus: a role's (or pool's) credentials and the TLS options to connect with.

A creds file is checked before connecting (a damaged seed is one line naming the file); the seed
never leaves the client, which answers the server's nonce with it (nkey challenge-response).
"""

from __future__ import annotations

import os
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gym_runtime.errors import AuthError
from gym_runtime.ops.security import AUTH_DIR_ENV, CA_CERT, creds_path
from gym_runtime.transport.subjects import inbox_prefix


def check_seed(path: Path) -> None:
    """Raise ``AuthError`` naming ``path`` when it does not hold an nkey seed (truncated or edited): nats-py
    would fail deep inside its connect, after which every command ends in an internal error."""
    import nkeys

    try:
        nkeys.from_seed(bytearray(path.read_bytes().strip()))
    except OSError as e:
        raise AuthError(f"{path}: cannot read it ({e.strerror or e})") from None
    except (nkeys.NkeysError, ValueError, TypeError, IndexError):  # bad base32, checksum, length: never quote it
        raise AuthError(
            f"{path}: not a valid nkey seed (truncated or edited?); copy it again from the server's --secure directory"
        ) from None


@dataclass(frozen=True)
class ClientAuth:
    """A node's auth dir: the CA to trust and the role seeds it holds (paths only, never the seeds)."""

    auth_dir: Path

    @classmethod
    def resolve(cls, value: str | None) -> ClientAuth | None:
        """``--auth-dir`` or ``$GYM_AUTH_DIR``; ``None`` when neither is set (an unsecured bus)."""
        value = value or os.environ.get(AUTH_DIR_ENV) or None
        if value is None:
            return None
        d = Path(value).expanduser()
        if not (d / CA_CERT).is_file():
            raise AuthError(
                f"--auth-dir {d}: no {CA_CERT} there (copy the directory `gym-runtime server --secure` wrote)"
            )
        return cls(d)

    def pool_creds(self, role: str, pool: str | None) -> Path | None:
        """This node's credential scoped to one entry (``{role}.{pool}.creds``), if it holds one."""
        p = creds_path(self.auth_dir, role, pool) if pool else None
        return p if p is not None and p.is_file() else None

    def creds(self, role: str) -> Path:
        """The role's seed file (or admin's), checked now: a damaged seed is the user's file, said by name."""
        for r in (role, "admin"):
            p = creds_path(self.auth_dir, r)
            if p.is_file():
                check_seed(p)
                return p
        raise AuthError(
            f"--auth-dir {self.auth_dir}: no {role}.creds (nor admin.creds) for the {role} role this "
            f"command runs; copy it from the server's --secure directory"
        )

    def own(self, role: str, pool: str | None) -> Path:
        """The one credential a worker of one entry needs: its pool's, else its role's, never ``admin.creds``
        (what ``start --ray`` hands that entry's actors, and nothing else of this directory)."""
        p = self.pool_creds(role, pool) or creds_path(self.auth_dir, role)
        if not p.is_file():
            raise AuthError(
                f"--auth-dir {self.auth_dir}: no {role}.creds (nor {role}.{pool}.creds) for the {role} workers; an "
                f"actor is never handed admin.creds: copy {role}.creds from the server's --secure directory"
            )
        check_seed(p)
        return p

    def entry_files(self, role: str, pool: str | None) -> dict[str, bytes]:
        """The files of a directory holding only what one entry's worker needs: the CA and its credential."""
        seed = self.own(role, pool)
        return {CA_CERT: (self.auth_dir / CA_CERT).read_bytes(), seed.name: seed.read_bytes()}

    def connect_options(self, role: str, pool: str | None = None) -> dict[str, Any]:
        """Keyword arguments for ``nats.connect``: TLS trusting only the cluster CA, the pool's nkey when
        this node holds one (its inbox then the pool's own), else the role's."""
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(self.auth_dir / CA_CERT))
        scoped = self.pool_creds(role, pool)
        return {
            "tls": ctx,
            "tls_handshake_first": True,
            "nkeys_seed": str(scoped or self.creds(role)),
            "inbox_prefix": inbox_prefix(role, pool if scoped else None),
        }


def private_auth_dir(files: dict[str, bytes]) -> Path:
    """A new directory only this user reads (0700, each file 0600) holding ``files`` (``entry_files``): a worker's
    ``--auth-dir`` on a node that holds no other credential of the cluster."""
    d = Path(tempfile.mkdtemp(prefix="gym-auth-"))
    for name, data in files.items():
        if Path(name).name != name or name in ("", ".", ".."):
            raise ValueError(f"not a file name: {name!r}")
        fd = os.open(d / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    return d
