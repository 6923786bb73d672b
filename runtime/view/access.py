"""Who a running ``view`` answers: its access policy, resolved once from the command line before the server
binds, then frozen (no request, and no later step of the start, changes it).

The pages hold every row of every file given (and, with ``--batch`` on a secured bus, the publisher's read of
every result of a namespace), so by default they answer only the one who started the view: a fresh token on
every run, loopback included (on a shared login or GPU node, loopback is every local user), carried in the
URL it prints, then traded for a cookie (HttpOnly: no script reads it; SameSite=Strict: no other site's page
sends it). On loopback, a Host that does not name this server by name and port is refused too (421: a
DNS-rebinding page sends its own name), by the rule the gateway keeps (``ops.hosts``). ``--no-token`` turns the
token off, and the start says what that exposes.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from urllib.parse import urlencode

import msgspec
from aiohttp import web

from gym_runtime.ops.hosts import LOOPBACK_NAMES, is_loopback, names_this_server, normal, shown, sockname


class Access(msgspec.Struct, frozen=True):
    """``hosts``: the Host names answered (normalised), on the port a request came in on (empty: any, beyond
    loopback); ``token``: what every request must carry (None: ``--no-token``); ``cookie``: the cookie's name,
    one per run (two views on one machine share a cookie jar per host, not per port: each keeps its own)."""

    host: str
    hosts: frozenset[str]
    token: str | None
    cookie: str

    @classmethod
    def resolve(cls, host: str, *, token: bool = True) -> Access:
        secret = secrets.token_urlsafe(24) if token else None
        name = "gym_view_" + (hashlib.sha256(secret.encode()).hexdigest()[:12] if secret else "open")
        hosts = frozenset({normal(host), *LOOPBACK_NAMES}) if is_loopback(host) else frozenset()
        return cls(host, hosts, secret, name)

    @property
    def loopback(self) -> bool:
        return bool(self.hosts)

    def url(self, port: int) -> str:
        """The URL to print: the only way in."""
        base = f"http://{shown(self.host)}:{port}/"
        return base + (f"?{urlencode({'token': self.token})}" if self.token else "")

    def exposure(self, port: int) -> str:
        """What ``--no-token`` leaves open, said once at the start."""
        where = f"{shown(self.host)}:{port}"
        who = "every user and process of this machine" if self.loopback else "anyone who can reach this address"
        return (
            f"--no-token: every row of these runs is readable at {where} by {who} (no token asked; "
            "drop --no-token to keep them to the one who opens the printed URL)"
        )

    def host_ok(self, request: web.Request) -> bool:
        """Whether a request's Host header names this server, by name and port (any, off loopback)."""
        if not self.hosts:
            return True
        return names_this_server(request.headers.get("Host", ""), self.hosts, sockname(request))

    def admit(self, request: web.Request) -> None:
        """Raise the answer for a request this policy refuses (or the redirect that trades the URL's token for
        the cookie); return for one it lets in."""
        if not self.host_ok(request):
            raise web.HTTPMisdirectedRequest(
                text="this server answers only at the address it printed, its port included (a tunnel keeps the port)"
            )
        if self.token is None:
            return
        given = request.query.get("token")
        if given is not None and hmac.compare_digest(given.encode(), self.token.encode()):
            rest = {k: v for k, v in request.query.items() if k != "token"}
            resp = web.HTTPSeeOther(request.path + ("?" + urlencode(rest) if rest else ""))
            resp.set_cookie(self.cookie, self.token, httponly=True, samesite="Strict")
            raise resp
        cookie = request.cookies.get(self.cookie, "")
        if not hmac.compare_digest(cookie.encode(), self.token.encode()):
            raise web.HTTPForbidden(text="open the URL gym-runtime view printed (it carries the access token)")
