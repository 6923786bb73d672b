"""Who the gateway answers: its trainer, never a web page (issue 65).

A page open in the operator's browser can send "simple" requests to any address, loopback included, with no
preflight: a ``text/plain`` POST with its own body, carrying an ``Origin`` header, or, through a name it
rebinds to the gateway's address, with that name as ``Host``. So every app of the gateway, before any handler:

* refuses a ``Host`` that is not one it serves (421), by name and port (``ops.hosts``, the rule ``view`` keeps):
  the address it is bound to, the address the connection came in on, ``localhost`` and the loopback addresses,
  and the names given with ``--hostname`` (the first of which it advertises in ``/global_config_dict_yaml`` and
  ``/server_instances``), and, when it names a port, the port the connection came in on;
* refuses a request carrying an ``Origin`` not given with ``--allow-origin`` (none by default: 403); an allowed
  origin gets CORS answers, its preflights included;
* wants ``Authorization: Bearer TOKEN`` (the control token: ``--token-file``) on ``/pause`` and ``/resume``
  always, and on every other route but the liveness ``/`` with ``--require-token`` (401);
* takes a POST only as ``application/json`` (a charset, if named, UTF-8: 415), which a browser cannot send to
  another origin without a preflight, refused above.

NeMo Gym's own clients send JSON with their ``Host`` the address they were given and no ``Origin``, so they
pass unchanged on loopback and, with ``--hostname``, across a cluster.
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
import os
import re
import secrets
import socket
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
from aiohttp import web

from gym_runtime.errors import UserError
from gym_runtime.gateway.replies import json_reply
from gym_runtime.ops.hosts import LOOPBACK_NAMES, names_this_server, normal, sockname

CONTROL_PATHS = frozenset({"/pause", "/resume"})  # the gateway's own: the token always
OPEN_PATHS = frozenset({"/"})  # liveness: no token even with --require-token
TOKEN_HEADER = "Authorization"  # "Bearer TOKEN"
WILDCARDS = frozenset({"", "0.0.0.0", "::"})
_CORS_HEADERS = "Authorization, Content-Type, traceparent"
_DNS_NAME = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*", re.IGNORECASE)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Access(msgspec.Struct, frozen=True, kw_only=True):
    """The gateway's access options (``gym-runtime gateway``'s flags)."""

    token: str  # the control token (``--token-file``'s contents)
    hostnames: tuple[str, ...] = ()  # --hostname: Host values served beyond the bound address and loopback
    origins: tuple[str, ...] = ()  # --allow-origin: origins whose requests are answered (with CORS)
    require_token: bool = False  # --require-token: the token on NeMo Gym's routes too


def default_token_file() -> Path:
    """``$XDG_CONFIG_HOME/gym-runtime/gateway.token`` (``~/.config`` without it)."""
    root = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(root) / "gym-runtime" / "gateway.token"


def control_token(path: Path) -> str:
    """The token in ``path``, made (random, mode 0600) when there is none; a file others may read is refused."""
    if not path.exists():
        try:
            _make_token(path)
        except OSError as e:
            raise UserError(
                f"--token-file {path}: cannot make it ({e.strerror or e}); name a file you can write"
            ) from None
    try:
        mode = path.stat().st_mode
        token = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--token-file {path}: cannot read it ({e}); remove it to have a new one made") from None
    if mode & 0o077:
        raise UserError(f"--token-file {path}: others may read it (mode {mode & 0o777:o}); run: chmod 600 {path}")
    if len(token) < 16 or any(c.isspace() for c in token):
        raise UserError(f"--token-file {path}: not a token of 16 characters or more; remove it to have one made")
    return token


def _make_token(path: Path) -> None:
    """A new random token in ``path``, written whole under another name, then linked: no reader sees it
    half-written, and of two gateways making it at once, one wins and both read its token."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".gateway-token-")  # mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
        os.link(tmp, path)
    except FileExistsError:  # another gateway made it first
        pass
    finally:
        os.unlink(tmp)


def check_hostname(value: str) -> str:
    """A ``--hostname`` value: a DNS name or an IP address (one line and exit 2 otherwise)."""
    name = value[1:-1] if value.startswith("[") and value.endswith("]") else value
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        pass
    if _DNS_NAME.fullmatch(name) is None:
        raise UserError(f"--hostname {value!r}: not a host name or address (e.g. --hostname head.example)")
    return name.lower()


def check_origin(value: str) -> str:
    """An ``--allow-origin`` value: ``scheme://host[:port]``, as a browser sends it."""
    scheme, sep, rest = value.partition("://")
    if value == "null" or not sep or scheme not in ("http", "https") or not rest or "/" in rest:
        raise UserError(
            f"--allow-origin {value!r}: not an origin; give it as a browser sends it (e.g. https://dash.example:8443)"
        )
    return value.lower()


class Guard:
    """``Access`` resolved against the bound address, once: the middleware every gateway app runs first."""

    def __init__(self, access: Access, bind: str) -> None:
        if len(access.token) < 16:
            raise ValueError("the gateway's control token must have 16 characters or more")
        self.access = access
        wildcard = bind in WILDCARDS
        local = [] if wildcard else [bind]
        if wildcard and not access.hostnames:  # 0.0.0.0 reaches nothing from another node: this host's name does
            local.append(socket.gethostname())
        self.advertised = (access.hostnames or tuple(local))[0]
        self.hosts = frozenset(normal(h) for h in (*LOOPBACK_NAMES, *local, *access.hostnames))
        self.origins = frozenset(o.lower() for o in access.origins)
        self._token = access.token.encode()

    def host_refused(self, request: web.Request) -> str | None:
        value = request.headers.get("Host", "")
        if names_this_server(value, self.hosts, sockname(request)):
            return None
        return (
            f"Host {value!r} is not a name this gateway serves (give it with --hostname NAME; a port it names "
            "must be the one connected to)"
        )

    def authorised(self, request: web.Request) -> bool:
        scheme, _, given = request.headers.get(TOKEN_HEADER, "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self._token)

    def refusal(self, request: web.Request) -> web.Response | None:
        """Why ``request`` is not answered (the reply saying so), or None."""
        if (why := self.host_refused(request)) is not None:
            return json_reply({"detail": why}, 421)
        origin = request.headers.get("Origin")
        if origin is not None and origin.lower() not in self.origins:
            return json_reply({"detail": f"Origin {origin!r} is not allowed (start with --allow-origin ORIGIN)"}, 403)
        if request.method == "OPTIONS" and origin is not None:  # an allowed origin's preflight
            return web.Response(status=204)
        resource = request.match_info.route.resource  # the route the router chose (None: no route, 404)
        path = resource.canonical if resource is not None else request.path
        if (path in CONTROL_PATHS or (self.access.require_token and path not in OPEN_PATHS)) and not (
            self.authorised(request)
        ):
            detail = f"{path} needs {TOKEN_HEADER}: Bearer TOKEN (the gateway's --token-file)"
            return json_reply({"detail": detail}, 401, headers={"WWW-Authenticate": 'Bearer realm="gym-runtime"'})
        if request.method == "POST" and (why := _not_json(request.headers.get("Content-Type", ""))) is not None:
            return json_reply({"detail": why}, 415)
        return None

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        cors = (
            {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
            if origin is not None and origin.lower() in self.origins
            else {}
        )
        refused = self.refusal(request)
        if refused is not None:
            if cors and refused.status == 204:
                cors |= {
                    "Access-Control-Allow-Methods": "GET, POST",
                    "Access-Control-Allow-Headers": _CORS_HEADERS,
                    "Access-Control-Max-Age": "600",
                }
            refused.headers.update(cors)
            return refused
        try:
            response = await handler(request)
        except web.HTTPException as e:
            e.headers.update(cors)
            raise
        response.headers.update(cors)
        return response


@functools.lru_cache(maxsize=64)
def _not_json(value: str) -> str | None:
    """Why a POST's ``Content-Type`` is not JSON (``application/json``, with a UTF-8 charset or none), or None."""
    kind, *params = (p.strip().lower() for p in value.split(";"))
    charset = next((p.partition("=")[2].strip('"') for p in params if p.startswith("charset=")), "utf-8")
    if kind == "application/json" and charset in ("utf-8", "utf8"):
        return None
    return f"Content-Type {value!r}: a POST takes application/json (UTF-8)"
