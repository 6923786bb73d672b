"""NATS security for ``server --secure DIR`` and every client's ``--auth-dir DIR``.

One directory holds a cluster's trust: a CA (``ca.pem``, its key ``ca-key.pem``),
the server certificate (``server.pem``/``server-key.pem``, also used for
mutually authenticated routes between nodes) and one NATS nkey seed per role
(``publisher.creds``, ``agent.creds``, ``model.creds``, ``resource.creds``,
``admin.creds``). Only NATS's own mechanisms are used: TLS (certificates made
with ``cryptography``), nkey challenge-response (the seed never leaves the
client; the server only knows public keys) and per-user subject permissions
in the server config. Missing files are created, existing ones reused, so
copying the directory to other nodes keeps one CA per cluster. Clients speak
TLS first (the server allows 300 ms for it), so one holding credentials never
reads a plaintext INFO nor signs a nonce for a server that is not ours.

Who creates what: the secured server provisions each namespace's streams, KV
bucket and object store with ``admin.creds`` when it starts; no other role
may create, update, purge or delete a stream. Each worker role creates only
the durable consumer it pulls from; the collector (publisher) its own readers
on the results stream.

A process running several roles opens one connection per role, each with that
role's credential (so it holds exactly their union); ``admin.creds`` may stand
in for any role.

Pools (``server --secure DIR --pool agents.NAME`` ...): a credential
``{role}.{NAME}.creds`` scoped to one entry of the config. An agent pool pulls
only its own durable (``agent_NAME``), stores only its own results
(``{ns}.result.NAME.>``) and calls only its own environment (from the config the
server is given: ``permissions.Reach``); a resource pool serves only
``{ns}.res.NAME.>`` and calls only what its ``calls`` lists; a model pool only
its own queue and direct calls. A node holding a pool's file connects with it
for that entry (one connection per pool) and falls back to the role's file for
entries it has no pool file for. What stays shared inside one pool: its
replicas hold one key, so one replica can do what any other can.

Replies: every connection's inbox prefix is ``_INBOX.{role}.{pool or _}`` (a
pool may subscribe only to its own), and each reply subject names who answers
(its lane): ``{inbox}.{nuid}.res.{resource}.{n}``, ``...model.{model}.{n}`` or
``...agent.{agent}.{n}``. A pool may publish only into its own lane
(``_INBOX.*.*.*.res.{its name}.*`` ...), so the server refuses a model answering a
verify call or one environment answering another's. No role has NATS's
``allow_responses``: with it, a credential that may both publish and subscribe a
subject (its liveness beacons, its own lane) could send itself a message whose
reply names any subject, and answer it there (the borrowed reply). So every
answer goes into a lane: call replies and keepalives to the subject the caller
named (``Gym-Reply`` for queued calls), a pause's acknowledgements into the
model's lane, discovery answers (``{ns}.status``) to the request's reply root
plus the worker's own lane. All names come from ``gym_runtime.transport.subjects``.

JetStream publishes its own answers (acks, direct gets, pull statuses) to
whatever reply subject a request names, past every permission. So it lives in
an account of its own (``JS``) and every user in ``APP``, which imports what
they use (``permissions.accounts``): an answer comes back as a service response,
delivered to subscribers only, never through an import into JetStream. A seed
request names its caller in its subject (``{ns}.res.{R}.seed.{role}.{pool}``,
each pool allowed only its own), which a worker bounds sessions by.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from pathlib import Path
from typing import Any

from gym_runtime.config import ENTRY_NAME, NAME_RULE
from gym_runtime.errors import AuthError

CA_CERT, CA_KEY = "ca.pem", "ca-key.pem"
SERVER_CERT, SERVER_KEY = "server.pem", "server-key.pem"
ROLES = ("publisher", "agent", "model", "resource", "sandbox", "admin")

AUTH_DIR_ENV = "GYM_AUTH_DIR"

CERT_DAYS = 5 * 365

POOL_ROLES = {"agents": "agent", "resources": "resource", "models": "model", "sandboxes": "sandbox"}  # section -> role


def creds_path(auth_dir: str | Path, role: str, pool: str | None = None) -> Path:
    return Path(auth_dir) / (f"{role}.{pool}.creds" if pool else f"{role}.creds")


def parse_pool(spec: str) -> tuple[str, str]:
    """``agents.NAME`` (or ``agent.NAME``) -> ("agent", "NAME"); NAME follows the config's rule for entry names
    (one subject token, none of the runtime's own ``_`` names)."""
    section, _, name = spec.partition(".")
    role = POOL_ROLES.get(section, section)
    if role not in POOL_ROLES.values() or not name:
        raise AuthError(
            f"--pool {spec!r}: expected agents.NAME, resources.NAME, models.NAME or sandboxes.NAME "
            "(NAME a config entry)"
        )
    if ENTRY_NAME.fullmatch(name) is None:
        raise AuthError(f"--pool {spec!r}: {name!r} is not a valid name: {NAME_RULE}")
    return role, name


def pools_in(auth_dir: str | Path) -> list[tuple[str, str]]:
    """The pool credentials issued in ``auth_dir``: (role, name) of every ``{role}.{name}.creds``."""
    out = []
    for p in sorted(Path(auth_dir).glob("*.*.creds")):
        role, _, name = p.name[: -len(".creds")].partition(".")
        if role in POOL_ROLES.values() and name:
            out.append((role, name))
    return out


def _write_secret(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _default_names(host: str | None) -> list[str]:
    names = ["localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()]
    if host and host not in ("0.0.0.0", "::", ""):
        names.append(host)
    return list(dict.fromkeys(n for n in names if n))


def _new_key() -> Any:
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _make_ca(d: Path) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID

    key = _new_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gym-runtime cluster CA")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write_secret(d / CA_KEY, _key_pem(key))
    (d / CA_CERT).write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _make_server_cert(d: Path, names: list[str]) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if not (d / CA_KEY).is_file():
        raise AuthError(f"{d} has no {SERVER_CERT} and no {CA_KEY} to sign one: copy them from the first node")
    ca_key = serialization.load_pem_private_key((d / CA_KEY).read_bytes(), password=None)
    ca = x509.load_pem_x509_certificate((d / CA_CERT).read_bytes())
    key = _new_key()
    sans: list[x509.GeneralName] = []
    for n in names:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            sans.append(x509.DNSName(n))
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        # clientAuth too: nodes present this certificate to each other on cluster routes
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.public_key()), critical=False)  # type: ignore[arg-type]
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    _write_secret(d / SERVER_KEY, _key_pem(key))
    (d / SERVER_CERT).write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def ensure_auth_dir(
    auth_dir: str | Path,
    *,
    host: str | None = None,
    names: list[str] | None = None,
    pools: list[tuple[str, str]] | None = None,
) -> Path:
    """Create whatever is missing in ``auth_dir`` (CA, server cert, role seeds); keep what is there.

    A node given a copy without ``server.pem`` gets its own certificate for its own
    names, signed by the shared CA (which needs ``ca-key.pem``).
    """
    import nkeys

    d = Path(auth_dir)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    if not (d / CA_CERT).is_file():
        if (d / SERVER_CERT).is_file() or any(creds_path(d, r).is_file() for r in ROLES):
            raise AuthError(f"{d} has credentials but no {CA_CERT}: copy the whole directory from the first node")
        _make_ca(d)
    if not (d / SERVER_CERT).is_file() or not (d / SERVER_KEY).is_file():
        _make_server_cert(d, list(dict.fromkeys([*(names or []), *_default_names(host)])))
    for role, pool in [*((r, None) for r in ROLES), *(pools or [])]:
        p = creds_path(d, role, pool)
        if not p.is_file():
            # a user nkey seed (``SU...``): nkeys' own encoding of 32 random bytes
            _write_secret(p, nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER) + b"\n")
    return d


def unnamed(auth_dir: str | Path, names: list[str]) -> list[str]:
    """Which of ``names`` the existing server certificate does not cover (clients dialing them would fail)."""
    from cryptography import x509

    cert = x509.load_pem_x509_certificate((Path(auth_dir) / SERVER_CERT).read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    have = {str(v) for v in sans.get_values_for_type(x509.DNSName)}
    have |= {str(v) for v in sans.get_values_for_type(x509.IPAddress)}
    out = []
    for n in names:
        try:
            key = str(ipaddress.ip_address(n))
        except ValueError:
            key = n
        if key not in have:
            out.append(n)
    return out


def public_key(auth_dir: str | Path, role: str, pool: str | None = None) -> str:
    import nkeys

    kp = nkeys.from_seed(bytearray(creds_path(auth_dir, role, pool).read_bytes().strip()))
    try:
        return kp.public_key.decode()
    finally:
        kp.wipe()
