"""Which ``Host`` a local HTTP server answers: one rule for the gateway and ``view`` (each keeps its own token).

A page open in the operator's browser can rebind a name it controls to this machine's address (DNS rebinding):
its requests then reach the server with that name as ``Host``. So a server answers a ``Host`` only when it names
this server, by name and by port: a name it serves (the loopback names, its bound address, names its operator
gave) or the address the connection came in on, and, when it names a port, the port the connection came in on.
A browser always writes the port it sends to (unless 80), so another port is never a page's request to this
server; a ``Host`` without one is what a TLS proxy in front passes on as it got it, and is taken by its name. A
malformed one (an IPv6 address without brackets, a port that is not one, trailing junk) names nothing. A tunnel
keeps the port (``ssh -L PORT:127.0.0.1:PORT``).
"""

from __future__ import annotations

import functools
import ipaddress
from typing import Any

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def normal(name: str) -> str:
    """A host name lowercased, an IP address in its one spelling (brackets off; an IPv4-mapped IPv6 as its IPv4)."""
    name = name.lower()
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        return name
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped or ip)


def is_loopback(host: str) -> bool:
    """``host`` (a name or an address) is this machine's loopback."""
    host = normal(host)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def shown(host: str) -> str:
    """``host`` as a URL writes it (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


@functools.lru_cache(maxsize=256)  # a client sends one or two values, each request: parsed once
def parse(value: str) -> tuple[str, int | None] | None:
    """The name (normalised) and port a ``Host`` header names (None: no port), or None when it is malformed."""
    if value.startswith("["):
        name, sep, rest = value[1:].partition("]")
        if not sep:
            return None
        try:
            ipaddress.IPv6Address(name)
        except ValueError:
            return None
    else:
        name, sep, port = value.partition(":")
        rest = sep + port
    if not name:
        return None
    if not rest:
        return normal(name), None
    digits = rest[1:]
    if rest[:1] != ":" or not (digits.isascii() and digits.isdigit()) or len(digits) > 5 or int(digits) > 65535:
        return None
    return normal(name), int(digits)


def names_this_server(value: str, names: frozenset[str], sockname: Any) -> bool:
    """Whether the ``Host`` header ``value`` names the server a connection reached: one of ``names`` (normalised,
    as ``normal`` gives them) or the address the connection came in on (``sockname``, the socket's own), and the
    port it came in on if it names one. No socket address (not a connection): names nothing."""
    parsed = parse(value)
    if parsed is None or not sockname or len(sockname) < 2:
        return False
    name, port = parsed
    return port in (None, sockname[1]) and (name in names or name == normal(str(sockname[0])))


def sockname(request: Any) -> Any:
    """The local address an aiohttp request's connection came in on (None: none, as for a request made in
    process)."""
    transport = request.transport
    return transport.get_extra_info("sockname") if transport is not None else None
