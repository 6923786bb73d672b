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
only its own durable (``agent_NAME``) and stores only its own results
(``{ns}.result.NAME.>``); a resource pool serves only ``{ns}.res.NAME.>``; a
model pool only its own queue and direct calls. A node holding a pool's file
connects with it for that entry (one connection per pool) and falls back to
the role's file for entries it has no pool file for. What stays shared inside
one pool: its replicas hold one key, so one replica can do what any other can.

Replies: every connection's inbox prefix is ``_INBOX.{role}.{pool or _}`` (a
pool may subscribe only to its own), and each call's reply subject names the
callee: ``{inbox}.{nuid}.res.{resource}.{n}`` or ``{inbox}.{nuid}.model.{model}.{n}``.
A resource pool may publish only into ``_INBOX.*.*.*.res.{its name}.*`` and a
model pool only into ``...model.{its name}.*``, so the server refuses a model
answering a verify call or one environment answering another's (replies and
keepalives go to the subject in the ``Gym-Reply`` header, several per request;
one-off answers to ``$SRV``, status and pause requests use ``allow_responses``).
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gym_runtime.errors import AuthError

ROLES = ("publisher", "agent", "model", "resource", "admin")
CA_CERT, CA_KEY = "ca.pem", "ca-key.pem"
SERVER_CERT, SERVER_KEY = "server.pem", "server-key.pem"
AUTH_DIR_ENV = "GYM_AUTH_DIR"
CERT_DAYS = 5 * 365


POOL_ROLES = {"agents": "agent", "resources": "resource", "models": "model"}  # config section -> role


def inbox_prefix(role: str, pool: str | None = None) -> str:
    return f"_INBOX.{role}.{pool or '_'}"


def creds_path(auth_dir: str | Path, role: str, pool: str | None = None) -> Path:
    return Path(auth_dir) / (f"{role}.{pool}.creds" if pool else f"{role}.creds")


def parse_pool(spec: str) -> tuple[str, str]:
    """``agents.NAME`` (or ``agent.NAME``) -> ("agent", "NAME"); a NAME must be one subject token."""
    section, _, name = spec.partition(".")
    role = POOL_ROLES.get(section, section)
    if role not in POOL_ROLES.values() or not name or not all(c.isalnum() or c in "_-" for c in name):
        raise AuthError(f"--pool {spec!r}: expected agents.NAME, resources.NAME or models.NAME (NAME a config entry)")
    return role, name


def pools_in(auth_dir: str | Path) -> list[tuple[str, str]]:
    """The pool credentials issued in ``auth_dir``: (role, name) of every ``{role}.{name}.creds``."""
    out = []
    for p in sorted(Path(auth_dir).glob("*.*.creds")):
        role, _, name = p.name[: -len(".creds")].partition(".")
        if role in POOL_ROLES.values() and name:
            out.append((role, name))
    return out


# ---------------------------------------------------------------------------------------- files


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


# ---------------------------------------------------------------------------------- permissions


def _base(ns: str) -> str:
    return ns.upper().replace("-", "_")


def permissions(role: str, namespaces: list[str], pool: str | None = None) -> dict[str, Any]:
    """What ``role`` (or one ``pool`` of it) may publish and subscribe to, in every namespace it works in.

    Allow-lists only: anything not listed is refused by the server (so e.g. no
    role but admin can create or delete a stream, and only agents publish results).
    """
    if role == "admin":
        return {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}}
    api = "$JS.API"
    # nats-py finds a subject's stream by name; the inbox: the role's, or only the pool's own
    pub: list[str] = [f"{api}.INFO", f"{api}.STREAM.NAMES"]
    sub: list[str] = [f"{inbox_prefix(role, pool)}.>" if pool else f"_INBOX.{role}.>"]
    mine = pool or "*"  # the entry this user serves (a role credential: every entry)
    for ns in namespaces:
        b = _base(ns)
        tasks, results, model = f"{b}_TASKS", f"{b}_RESULTS", f"{b}_MODEL"
        kv, blobs, ctl = f"KV_{b}_BATCHES", f"{b}_BLOBS", f"KV_{b}_CONTROL"
        pub += [f"{api}.STREAM.INFO.{s}" for s in (tasks, results, model, kv, ctl)]
        # bodies over the max payload: write-once chunks, read only by the key their message carries (a
        # last-by-subject direct get); no stream info (its subjects_filter lists keys), consumer or get by
        # sequence on the blob stream, so no role can list or read bodies it was not sent
        pub += [f"{ns}.blob.>", f"{api}.DIRECT.GET.{blobs}.{ns}.blob.>"]

        def pull(stream: str, subject: str, durable: str = "*", *, ack: bool = True) -> list[str]:
            out = [
                # named creation only: the filter is in the API subject, so the server checks it against the allow
                # list (the legacy DURABLE.CREATE carries it in the body, where a pool could name any queue)
                f"{api}.CONSUMER.CREATE.{stream}.{durable}.{subject}",
                f"{api}.CONSUMER.INFO.{stream}.{durable}",
                f"{api}.CONSUMER.MSG.NEXT.{stream}.{durable}",
            ]
            return out + ([f"$JS.ACK.{stream}.{durable}.>"] if ack else [])

        worker_sub = ["$SRV.>", f"{ns}.status.*", f"{ns}.ctl.>"]
        # the batch manifests and the trainer's control state (policy versions, pauses, cancelled batches)
        kv_read = [
            x
            for k in (kv, ctl)
            for x in (f"{api}.DIRECT.GET.{k}", f"{api}.DIRECT.GET.{k}.>", f"{api}.STREAM.MSG.GET.{k}")
        ]
        calls_models = [f"{ns}.model.>", f"{ns}.call.model.>"]
        if role == "publisher":
            pub += [
                f"{ns}.task.>",
                f"{ns}.ctl.>",
                f"$KV.{b}_BATCHES.>",
                f"$KV.{b}_CONTROL.>",
                *kv_read,
                *pull(results, f"{ns}.result.>", ack=False),
                f"{api}.CONSUMER.DELETE.{results}.*",
                f"{api}.CONSUMER.LIST.{tasks}",
                f"{api}.CONSUMER.LIST.{model}",
                f"{api}.CONSUMER.LIST.{results}",
                "$SRV.>",
                f"{ns}.status.*",  # status: discovery and live counters
                f"{ns}.res.*.verify",
            ]  # reverify: the stateless verify group
        elif role == "agent":
            queue = pull(tasks, f"{ns}.task.{pool}", f"agent_{pool}") if pool else pull(tasks, f"{ns}.task.>")
            # the pool's liveness beacons (a dead peer's tasks are nak'd at once)
            live = f"{ns}.live.agent_{pool}" if pool else f"{ns}.live.*"
            pub += [f"{ns}.result.{mine}.>", *calls_models, f"{ns}.res.>", *kv_read, *queue, live]
            sub += [*worker_sub, live]
        elif role == "model":
            queue = pull(model, f"{ns}.model.{pool}", f"model_{pool}") if pool else pull(model, f"{ns}.model.>")
            # replies (and keepalives) only into the reply subjects of calls made to this model
            live = f"{ns}.live.model_{pool}" if pool else f"{ns}.live.*"
            pub += [f"_INBOX.*.*.*.model.{mine}.*", *kv_read, *queue, live]
            sub += [*worker_sub, f"{ns}.call.model.{mine}", live]  # direct calls (core NATS) while a slot is free
        elif role == "resource":
            # replies only into calls made to this environment; models for LLM judges and user simulators
            pub += [f"_INBOX.*.*.*.res.{mine}.*", *calls_models]
            sub += [*worker_sub, f"{ns}.res.{mine}.>"]
        else:
            raise AuthError(f"unknown role {role!r} (one of {', '.join(ROLES)})")
    perms: dict[str, Any] = {
        "publish": {"allow": list(dict.fromkeys(pub))},
        "subscribe": {"allow": list(dict.fromkeys(sub))},
    }
    if role != "publisher":
        perms["allow_responses"] = True  # one answer to $SRV discovery, status and pause requests
    return perms


# ------------------------------------------------------------------------------- server config


def server_config(auth_dir: str | Path, namespaces: list[str]) -> str:
    """The ``tls`` and ``authorization`` blocks of a secured ``nats-server`` config (JSON values)."""
    d = Path(auth_dir).resolve()
    # TLS before any plaintext: our clients never read an INFO (or sign a nonce) that could come from a
    # downgrading impostor; other clients get the plaintext INFO (saying TLS is required) after 300 ms
    tls = {
        "cert_file": str(d / SERVER_CERT),
        "key_file": str(d / SERVER_KEY),
        "ca_file": str(d / CA_CERT),
        "timeout": 5,
        "handshake_first": "300ms",
    }
    users = [{"nkey": public_key(d, r), "permissions": permissions(r, namespaces)} for r in ROLES]
    users += [
        {"nkey": public_key(d, r, pool), "permissions": permissions(r, namespaces, pool)} for r, pool in pools_in(d)
    ]
    return f"tls: {json.dumps(tls)}\nauthorization: {json.dumps({'users': users, 'timeout': 5})}\n"


def route_tls(auth_dir: str | Path) -> dict[str, Any]:
    """The ``cluster { tls {...} }`` value: routes encrypted and mutually authenticated by the cluster CA.

    Every node presents the server certificate (it carries clientAuth) and
    accepts only peers whose certificate the same CA signed.
    """
    d = Path(auth_dir).resolve()
    return {
        "cert_file": str(d / SERVER_CERT),
        "key_file": str(d / SERVER_KEY),
        "ca_file": str(d / CA_CERT),
        "verify": True,
        "timeout": 5,
    }


# ------------------------------------------------------------------------------- client side


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


# ------------------------------------------------------------------------------ secrets in argv

SECRET_NAMES = frozenset(
    {
        "api_key",
        "apikey",
        "password",
        "passwd",
        "secret",
        "client_secret",
        "token",
        "access_token",
        "auth_token",
        "bearer_token",
        "authorization",
        "credential",
        "credentials",
    }
)
SECRET_SUFFIXES = ("_api_key", "_apikey", "_password", "_secret", "_access_token", "_auth_token")


def _secret_key(key: str) -> bool:
    """A config path that holds a secret: ``*.api_key``, ``*.password``, any HTTP header value, ...

    (Not ``max_tokens`` or ``stop_token``: those are ordinary options.)
    """
    parts = key.strip().lower().replace("-", "_").split(".")
    return "headers" in parts[:-1] or parts[-1] in SECRET_NAMES or parts[-1].endswith(SECRET_SUFFIXES)


def check_argv_secret(option: str, value: str) -> None:
    """Refuse a literal secret given on the command line (every local user sees argv in ``ps``).

    ``--set KEY=VALUE``: a secret-named key with a literal value (``${VAR}`` references
    are fine), a ``sk-``/``Bearer`` value, or a URL with a password; any other option: a
    URL with credentials.
    """
    from urllib.parse import urlparse

    key, sep, val = value.partition("=") if option == "--set" else ("", "", value)
    val = val.strip()
    if "://" in val:
        for part in val.split(","):
            u = urlparse(part.strip())
            if u.username or u.password:
                raise AuthError(
                    f"{option}: credentials in a URL on the command line are visible to every local "
                    f"user; use --auth-dir DIR (or ${AUTH_DIR_ENV}) for NATS, or put the URL in the "
                    f"config / env.yaml"
                )
    if not sep:
        return
    literal = bool(val) and "${" not in val  # a ${VAR} reference is resolved from the environment
    if literal and (_secret_key(key) or val.startswith(("sk-", "Bearer "))):
        raise AuthError(
            f"{option} {key.strip()}=...: a literal secret on the command line is visible to every local "
            f"user; put it in the environment and pass --set '{key.strip()}=${{MY_VAR}}' (or write it in "
            f"env.yaml beside the config)"
        )
