"""One Host rule for the gateway and ``view`` (issue 73 item 9, issue 74 item 4): the same ``Host`` values are
answered or refused alike by both, by name and by port, from one module (``ops.hosts``). The servers themselves:
``tests/e2e/test_gateway_access.py::test_every_host_form_of_the_rebinding_check`` and
``tests/test_view.py::test_on_loopback_a_host_naming_another_port_is_refused_cookie_and_all``."""

from __future__ import annotations

from typing import Any

from aiohttp.test_utils import make_mocked_request

from gym_runtime.gateway import access as gateway_access
from gym_runtime.ops import hosts
from gym_runtime.view import access as view_access

PORT = 8123


class _Transport:
    """A connection's own address, as a socket reports it (what both checks compare the Host with)."""

    def __init__(self, sockname: tuple[Any, ...]) -> None:
        self.sockname = sockname

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.sockname if name == "sockname" else default

    def is_closing(self) -> bool:
        return False


def _request(host: str | None, sockname: tuple[Any, ...] = ("127.0.0.1", PORT)) -> Any:
    headers = {"Host": host} if host is not None else {}
    return make_mocked_request("GET", "/", headers=headers, transport=_Transport(sockname))


ANSWERED = [
    f"127.0.0.1:{PORT}",
    f"localhost:{PORT}",
    f"LocalHost:{PORT}",
    f"[::1]:{PORT}",
    f"[::ffff:127.0.0.1]:{PORT}",
    "127.0.0.1",  # no port: taken by its name (a TLS proxy in front passes it on so)
    "localhost",
    "[::1]",
]
REFUSED = [
    f"127.0.0.1:{PORT + 1}",  # another port: another server
    f"localhost:{PORT + 1}",
    f"[::1]:{PORT - 1}",
    f"127.0.0.1:0{PORT + 1}",
    f"evil.example:{PORT}",
    f"localhost.:{PORT}",
    f"::1:{PORT}",
    f"127.0.0.1:{PORT}@evil.example",
    "127.0.0.1:99999",
    "127.0.0.1:",
    f"[::1]evil:{PORT}",
    "",
    None,
]


def test_the_gateway_and_view_answer_the_same_hosts_by_name_and_port() -> None:
    guard = gateway_access.Guard(gateway_access.Access(token="t" * 32), "127.0.0.1")
    view = view_access.Access.resolve("127.0.0.1")
    for host in ANSWERED:
        assert guard.host_refused(_request(host)) is None, host
        assert view.host_ok(_request(host)), host
    for host in REFUSED:
        assert guard.host_refused(_request(host)) is not None, host
        assert not view.host_ok(_request(host)), host


def test_one_module_holds_the_rule() -> None:
    """Neither access module keeps a loopback list or a Host parser of its own."""
    for module in (gateway_access, view_access):
        assert module.names_this_server is hosts.names_this_server
        assert module.LOOPBACK_NAMES is hosts.LOOPBACK_NAMES
        assert not hasattr(module, "host_name") and not hasattr(module, "_normal")


def test_a_host_is_parsed_once_into_its_name_and_port() -> None:
    assert hosts.parse(f"LOCALHOST:{PORT}") == ("localhost", PORT)
    assert hosts.parse("[0:0:0:0:0:0:0:1]:80") == ("::1", 80)
    assert hosts.parse("[::ffff:127.0.0.1]") == ("127.0.0.1", None)
    assert hosts.parse("example.org") == ("example.org", None)
    for bad in ("", ":80", "::1", "[::1", "[nope]:80", "a:b", "a:1:2", "a:+80", "a:１２"):
        assert hosts.parse(bad) is None, bad
    assert not hosts.names_this_server(f"127.0.0.1:{PORT}", frozenset({"127.0.0.1"}), None)  # no connection
