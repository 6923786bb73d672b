"""Reaching a Ray cluster before ``ray.init`` is asked to, each way it cannot be one line naming the address, what
was tried and the fix (``ray.init`` retries a dead address for minutes and answers a refused token with 20 s of its
own log lines, then a traceback).

``HOST:PORT`` (the head's GCS): one gRPC call (``GetClusterId``, 5 s) says whether anything answers, whether it is a
Ray head, and whether it wants a token. Ray 2.60's heads turn token authentication on where a token exists
(``~/.ray/auth_token``, which any local ``ray.init()`` writes), and a client given an explicit address sends none
unless ``RAY_AUTH_MODE=token``: where this node holds a token the head accepts (``RAY_AUTH_TOKEN``,
``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``), token mode is turned on for this process, as Ray itself does for
``auto``; else one line names ``RAY_AUTH_MODE``. ``ray://HOST:PORT`` (Ray Client): a TCP connection, 5 s.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

from gym_runtime.errors import UserError
from gym_runtime.observability import logs

__all__ = ["reach", "refused"]

log = logs.get("gym.placement")

WITHIN_S = 5.0
_MODE = "RAY_AUTH_MODE"
_WANTS_TOKEN = (
    "set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN to the cluster's token (`ray get-auth-token` on the head prints it; "
    "or RAY_AUTH_TOKEN_PATH, a file holding it)"
)


def _split(address: str) -> tuple[str, int] | None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def _token() -> str | None:
    """The token this node would send, where Ray looks for one."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def _ask_gcs(
    address: str, token: str | None, method: str = "/ray.rpc.NodeInfoGcsService/GetClusterId"
) -> tuple[Any, str]:
    """The head's answer to one ``method`` call (an empty request): (gRPC status code, details)."""
    import grpc

    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(
            method,
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        try:
            call(b"", timeout=WITHIN_S, metadata=[("authorization", f"Bearer {token}")] if token else None)
        except grpc.RpcError as e:
            return e.code(), str(e.details() or "")
        return grpc.StatusCode.OK, ""


def _tcp(address: str, host: str, port: int) -> None:
    try:
        socket.create_connection((host, port), timeout=WITHIN_S).close()
    except OSError as e:
        why = "no answer" if isinstance(e, TimeoutError) else (e.strerror or str(e)).lower()
        raise UserError(
            f"--ray {address}: no Ray Client server answers at {host}:{port} (tried a TCP connection for "
            f"{WITHIN_S:g} s: {why}); `ray start --head` serves one on port 10001 (--ray-client-server-port), or give "
            "the head's GCS address HOST:PORT (`ray status` on the head prints it)"
        ) from None


def reach(address: str) -> None:
    """Check ``address`` (``start --ray``'s, ``OnRay``'s) before ``ray.init``; turn token mode on where the head wants
    a token this node holds. ``auto`` is left to ``ray.init`` (see ``refused``)."""
    if address in ("", "auto", "local"):
        return
    if address.startswith("ray://"):
        hp = _split(address.removeprefix("ray://").split("/", 1)[0])
        if hp is None:
            raise UserError(f"--ray {address}: expected ray://HOST:PORT (Ray Client, e.g. ray://head:10001)")
        _tcp(address, *hp)
        code, details = _ask_gcs(f"{hp[0]}:{hp[1]}", _token(), "/ray.rpc.RayletDriver/ClusterInfo")
        if getattr(code, "name", "") in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
            raise UserError(
                f"--ray {address}: something listens at {hp[0]}:{hp[1]}, but no Ray Client server answers there "
                f"(tried a gRPC call for {WITHIN_S:g} s: {details[:120]}); `ray start --head` serves one on port "
                "10001, "
                "or give the head's GCS address HOST:PORT (`ray status` on the head prints it)"
            )
        return
    hp = _split(address)
    if hp is None:
        raise UserError(f"--ray {address}: expected HOST:PORT (the head's GCS address, e.g. head:6379), auto or ray://")
    try:
        import grpc  # noqa: F401  (ray[default] brings it)
    except ImportError:
        _tcp(address, *hp)
        return
    code, details = _ask_gcs(address, None)
    name = getattr(code, "name", str(code))
    if name in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
        raise UserError(
            f"--ray {address}: no Ray head answers there (tried its GCS for {WITHIN_S:g} s: {details or name}); start "
            f"one with `ray start --head --port={hp[1]}`, or give the head's address (`ray status` on the head prints "
            "it), or --ray auto on a node of the cluster"
        )
    if name == "UNAUTHENTICATED":
        _token_mode(address)
    elif name not in ("OK",):
        raise UserError(
            f"--ray {address}: something answers there, but not a Ray head's GCS ({name}: {details[:80]}); give the "
            "head's GCS address (`ray status` on the head prints it), or ray://HOST:10001 for a Ray Client server"
        )


def _token_mode(address: str) -> None:
    """The head wants a token: send this node's where the head takes it, else one line naming RAY_AUTH_MODE."""
    mode = os.environ.get(_MODE, "").lower()
    token = _token()
    if mode == "disabled":
        raise UserError(
            f"--ray {address}: this Ray cluster requires token authentication, and {_MODE}=disabled here; "
            + _WANTS_TOKEN
        )
    if token is None:
        raise UserError(
            f"--ray {address}: this Ray cluster requires token authentication and this node has no "
            f"token; {_WANTS_TOKEN}"
        )
    code, _ = _ask_gcs(address, token)
    if getattr(code, "name", "") == "UNAUTHENTICATED":
        raise UserError(
            f"--ray {address}: this Ray cluster refuses this node's token (RAY_AUTH_TOKEN, "
            f"RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token); {_WANTS_TOKEN}"
        )
    if mode != "token":
        try:  # (what Ray does for ``auto``: the mode for this process, then its config read again)
            from ray._private.authentication.authentication_token_setup import _enable_token_auth
        except ImportError:
            raise UserError(
                f"--ray {address}: this Ray cluster requires token authentication; {_WANTS_TOKEN}"
            ) from None
        _enable_token_auth()
        log.info("ray.token_auth", address=address, why="the head requires a token; this node's is accepted")


def refused(address: str, e: BaseException) -> UserError:
    """``ray.init``'s own failure to connect (``auto`` with no cluster, a Ray Client server that never answered), as
    one line."""
    text = " ".join(str(e).split())[:300]
    return UserError(
        f"--ray {address}: Ray did not connect ({type(e).__name__}: {text}); give the head's address (`ray status` on "
        "the head prints it), or start a cluster first (`ray start --head`)"
    )
