"""The gateway answers its trainer, not a web page (issue 65, item 1): every Host form of the rebinding check,
Origins, content types and the control token, on the head port and an Environment Server's port alike.

Before: any Host (``evil.example``) was answered 200 with the config listing and the rollout row, an Origin was
never looked at, a ``text/plain`` POST (what a page sends with no preflight) paused the policy, and ``/pause``
needed nothing. Real gateway over a real nats-server and our workers; raw sockets where the Host header itself
is the test (an HTTP client would write its own).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from gym_runtime import Client
from gym_runtime.gateway import GATEWAY, Access, start
from gym_runtime.gateway.access import Guard
from tests.helpers import cli, weather

TOKEN = "test-control-token-0123456789"
JSON = {"Content-Type": "application/json"}
NO_ROWS = json.dumps({"verify_responses": []}).encode()


class Gw:
    def __init__(self, head: int, env: int, client: Client) -> None:
        self.head, self.env, self.client = head, env, client

    def url(self, port: int | None = None) -> str:
        return f"http://127.0.0.1:{port or self.head}"


async def serving(client: Client, access: Access) -> AsyncIterator[Gw]:
    served, port = await start(client, host="127.0.0.1", port=0, access=access)
    try:
        yield Gw(port, served.app[GATEWAY].env_ports["weather_agent"], client)
    finally:
        await served.cleanup()


@pytest.fixture
async def gw(nats_server) -> AsyncIterator[Gw]:
    async with Client(weather(), nats=nats_server.url) as client:
        async for g in serving(client, Access(token=TOKEN)):
            yield g


async def raw(port: int, lines: list[str], body: bytes = b"") -> tuple[int, bytes]:
    """One request written byte for byte (``lines``: the request line and headers); its status and body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        head = "\r\n".join([*lines, f"Content-Length: {len(body)}", "Connection: close", "", ""])
        writer.write(head.encode() + body)
        await writer.drain()
        answer = await reader.read()
    finally:
        writer.close()
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def served_hosts(port: int) -> list[str]:
    return [
        f"127.0.0.1:{port}",
        "127.0.0.1",  # no port: what a TLS proxy in front passes on, taken by its name
        f"localhost:{port}",
        "localhost",
        f"LOCALHOST:{port}",  # host names are case-insensitive
        "LocalHost",
        f"[::1]:{port}",
        "[::1]",
        f"[0:0:0:0:0:0:0:1]:{port}",  # the same address, spelled out
        f"[::ffff:127.0.0.1]:{port}",  # 127.0.0.1, IPv4-mapped
    ]


def refused_hosts(port: int) -> list[str]:
    other = port + 1 if port < 65535 else port - 1
    return [
        "evil.example",
        f"evil.example:{port}",
        f"EVIL.EXAMPLE:{port}",
        f"localhost.evil.example:{port}",
        f"127.0.0.1.evil.example:{port}",
        f"localhost.:{port}",  # a trailing dot: another name to a resolver the attacker may control
        f"::1:{port}",  # an IPv6 literal without brackets is not a Host
        "::1",
        f"[::1]evil:{port}",
        f"[::2]:{port}",
        f"[evil.example]:{port}",
        f"0.0.0.0:{port}",
        f"10.1.2.3:{port}",  # an address this connection did not come in on
        "127.0.0.1:99999",
        f"127.0.0.1:{other}",  # another port: another server's Host (issue 73)
        f"localhost:{other}",
        f"[::1]:{other}",
        "127.0.0.1:abc",
        f"127.0.0.1:{port}@evil.example",
        "",
    ]


async def test_every_host_form_of_the_rebinding_check(gw: Gw) -> None:
    """A DNS-rebinding page reaches the gateway under its own name: refused (421) on every port and route, the
    config listing included; the addresses the gateway serves, in every spelling, answered."""
    wrong: list[tuple[int, str, str, int]] = []
    for port, path in ((gw.head, "/global_config_dict_yaml"), (gw.head, "/server_instances"), (gw.env, "/")):
        for host in served_hosts(port):
            status, _ = await raw(port, [f"GET {path} HTTP/1.1", f"Host: {host}"])
            if status != 200:
                wrong.append((port, path, host, status))
        for host in refused_hosts(port):
            status, body = await raw(port, [f"GET {path} HTTP/1.1", f"Host: {host}"])
            if status != 421 or b"weather" in body:
                wrong.append((port, path, host, status))
        status, _ = await raw(port, [f"GET {path} HTTP/1.0"])  # no Host at all
        if status != 421:
            wrong.append((port, path, "(none)", status))
    # a POST under a rebound name runs nothing (before: the full rollout row)
    for port in (gw.head, gw.env):
        row = json.dumps({"responses_create_params": {"input": "hi"}}).encode()
        status, _ = await raw(port, ["POST /run HTTP/1.1", "Host: evil.example", "Content-Type: application/json"], row)
        if status != 421:
            wrong.append((port, "/run", "evil.example", status))
    assert wrong == []


async def test_a_name_given_with_hostname_is_served_and_advertised(nats_server) -> None:
    """Across a cluster the trainer reaches the gateway by a name: given with --hostname, it is served and it is
    what the config listing and the server list advertise (never the bind address)."""
    async with Client(weather(), nats=nats_server.url) as client:
        async for g in serving(client, Access(token=TOKEN, hostnames=("head.example", "10.9.8.7"))):
            for host in ("head.example", f"HEAD.example:{g.head}", f"10.9.8.7:{g.head}", f"localhost:{g.head}"):
                status, _ = await raw(g.head, ["GET / HTTP/1.1", f"Host: {host}"])
                assert status == 200, host
            status, _ = await raw(g.env, ["GET / HTTP/1.1", f"Host: head.example:{g.env}"])
            assert status == 200
            for host in ("other.example", f"other.example:{g.head}", f"head.example:{g.env}"):
                status, _ = await raw(g.head, ["GET / HTTP/1.1", f"Host: {host}"])
                assert status == 421, host
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{g.url()}/global_config_dict_yaml") as r:
                    cfg = yaml.safe_load(json.loads(await r.text()))
                async with http.get(f"{g.url()}/server_instances") as r:
                    instances = await r.json()
    assert cfg["head_server"]["host"] == "head.example"
    assert next(iter(cfg["weather_agent"]["responses_api_agents"].values()))["host"] == "head.example"
    assert cfg["weather_agent_environment_server"]["environment_servers"]["single_agent_turn_legacy"] == {
        **cfg["weather_agent_environment_server"]["environment_servers"]["single_agent_turn_legacy"],
        "host": "head.example",
        "port": g.env,
    }
    assert {(i["host"], i["url"].split("//")[1].split(":")[0]) for i in instances} == {("head.example",) * 2}


def test_a_wildcard_bind_advertises_this_machines_name_not_0_0_0_0() -> None:
    for bind in ("0.0.0.0", "::"):
        guard = Guard(Access(token=TOKEN), bind)
        assert guard.advertised == socket.gethostname()
        assert "0.0.0.0" not in guard.hosts and "::" not in guard.hosts
        assert Guard(Access(token=TOKEN, hostnames=("head.example",)), bind).advertised == "head.example"


async def test_a_request_with_an_origin_not_allowed_is_refused(gw: Gw) -> None:
    """A page's request carries its Origin: refused on every port, GETs included, whatever the content type."""
    async with aiohttp.ClientSession() as http:
        for url, path in ((gw.url(), "/global_config_dict_yaml"), (gw.url(gw.env), "/")):
            for origin in ("http://evil.example", "null", "http://127.0.0.1:1", f"http://localhost:{gw.head}"):
                async with http.get(f"{url}{path}", headers={"Origin": origin}) as r:
                    assert r.status == 403 and "Access-Control-Allow-Origin" not in r.headers, (path, origin)
            async with http.post(f"{url}/run", json={}, headers={"Origin": "http://evil.example"}) as r:
                assert r.status == 403
            async with http.options(f"{url}/run", headers={"Origin": "http://evil.example"}) as r:  # a preflight
                assert r.status == 403 and "Access-Control-Allow-Origin" not in r.headers


async def test_an_allowed_origin_is_answered_with_cors(nats_server) -> None:
    async with Client(weather(), nats=nats_server.url) as client:
        async for g in serving(client, Access(token=TOKEN, origins=("https://dash.example",))):
            async with aiohttp.ClientSession() as http:
                origin = {"Origin": "https://dash.example"}
                preflight = {**origin, "Access-Control-Request-Method": "POST"}
                async with http.options(f"{g.url()}/pause", headers=preflight) as r:
                    assert r.status == 204 and r.headers["Access-Control-Allow-Origin"] == "https://dash.example"
                    assert "Authorization" in r.headers["Access-Control-Allow-Headers"]
                async with http.post(
                    f"{g.url(g.env)}/aggregate_metrics", data=NO_ROWS, headers={**origin, **JSON}
                ) as r:
                    assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == "https://dash.example"
                async with http.post(f"{g.url()}/run", json={}, headers={"Origin": "https://other.example"}) as r:
                    assert r.status == 403


ACCEPTED_TYPES = ["application/json", "application/json; charset=utf-8", "Application/JSON; Charset=UTF-8"]
REFUSED_TYPES = [
    None,
    "text/plain",
    "text/plain;charset=UTF-8",  # what fetch() sends a string body as: a "simple" request, no preflight
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "text/json",
    "application/jsonx",
    "application/json; charset=latin-1",
    "application/x-json",
]


async def test_every_post_wants_a_json_content_type(gw: Gw) -> None:
    """A browser sends these three without a preflight; a gateway POST takes none of them (415), on every port,
    and the control routes not even with the token."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession() as http:
        for url in (gw.url(), gw.url(gw.env)):
            for ctype in ACCEPTED_TYPES:
                async with http.post(f"{url}/aggregate_metrics", data=NO_ROWS, headers={"Content-Type": ctype}) as r:
                    assert r.status == 200, ctype
            for ctype in REFUSED_TYPES:
                headers = {"Content-Type": ctype} if ctype else {}
                async with http.post(f"{url}/aggregate_metrics", data=NO_ROWS, headers=headers) as r:
                    assert r.status == 415, ctype
                async with http.post(f"{url}/run", data=b"{}", headers=headers) as r:
                    assert r.status == 415, ctype
        async with http.post(
            f"{gw.url()}/pause", data=b'{"mode": "drain"}', headers={**auth, "Content-Type": "text/plain"}
        ) as r:
            assert r.status == 415
    (model,) = [w for w in gw.client.workers if hasattr(w, "gate")]
    assert model.gate.is_open and model.served == 0


async def test_pause_and_resume_want_the_control_token(gw: Gw) -> None:
    """``/pause`` and ``/resume`` with no token, a wrong one, another scheme: 401 and nothing paused; with it,
    paused and resumed."""
    (model,) = [w for w in gw.client.workers if hasattr(w, "gate")]
    wrong = [
        {},
        {"Authorization": "Bearer"},
        {"Authorization": "Bearer "},
        {"Authorization": "Bearer wrong-token-0123456789"},
        {"Authorization": f"Bearer {TOKEN}x"},
        {"Authorization": f"Bearer {TOKEN[:-1]}"},
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": TOKEN},
        {"X-Token": TOKEN},
    ]
    async with aiohttp.ClientSession() as http:
        for headers in wrong:
            for path, body in (("/pause", {"mode": "abort"}), ("/resume", {})):
                async with http.post(f"{gw.url()}{path}", json=body, headers=headers) as r:
                    assert r.status == 401 and r.headers["WWW-Authenticate"].startswith("Bearer"), (path, headers)
                    assert "Authorization: Bearer TOKEN" in (await r.json())["detail"]
        assert model.gate.is_open
        for scheme in ("Bearer", "bearer"):
            async with http.post(
                f"{gw.url()}/pause", json={"mode": "drain"}, headers={"Authorization": f"{scheme} {TOKEN}"}
            ) as r:
                assert r.status == 200 and await r.json() == {"acknowledged": 1}
            assert not model.gate.is_open
            async with http.post(f"{gw.url()}/resume", json={}, headers={"Authorization": f"{scheme} {TOKEN}"}) as r:
                assert r.status == 200
            async with asyncio.timeout(30):  # the resume reaches the replica over the bus
                while not model.gate.is_open:
                    await asyncio.sleep(0.02)
        # NeMo Gym's routes need none by default: its own clients send none
        async with http.post(f"{gw.url(gw.env)}/aggregate_metrics", data=NO_ROWS, headers=JSON) as r:
            assert r.status == 200


async def test_require_token_puts_nemo_gyms_routes_behind_the_token(nats_server) -> None:
    async with Client(weather(), nats=nats_server.url) as client:
        async for g in serving(client, Access(token=TOKEN, require_token=True)):
            auth = {"Authorization": f"Bearer {TOKEN}"}
            async with aiohttp.ClientSession() as http:
                for url in (g.url(), g.url(g.env)):
                    async with http.get(f"{url}/") as r:  # liveness stays open
                        assert r.status == 200
                    async with http.post(f"{url}/aggregate_metrics", data=NO_ROWS, headers=JSON) as r:
                        assert r.status == 401
                    async with http.post(
                        f"{url}/run", json={}, headers={"Authorization": "Bearer nope-nope-nope-nope"}
                    ) as r:
                        assert r.status == 401
                    async with http.post(f"{url}/aggregate_metrics", data=NO_ROWS, headers={**JSON, **auth}) as r:
                        assert r.status == 200
                for path in ("/global_config_dict_yaml", "/server_instances"):
                    async with http.get(f"{g.url()}{path}") as r:
                        assert r.status == 401
                    async with http.get(f"{g.url()}{path}", headers=auth) as r:
                        assert r.status == 200


def _gateway(tmp_path: Path, *args: str) -> Any:
    return cli("gateway", "resources/weather/config.yaml", "--port", "0", *args, env={"XDG_CONFIG_HOME": str(tmp_path)})


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--hostname", "evil example"], "--hostname 'evil example': not a host name or address"),
        (["--hostname", "*"], "--hostname '*': not a host name or address"),
        (["--allow-origin", "*"], "--allow-origin '*': not an origin"),
        (["--allow-origin", "null"], "--allow-origin 'null': not an origin"),
        (["--allow-origin", "https://dash.example/page"], "not an origin"),
    ],
)
def test_a_wrong_access_flag_is_one_line(tmp_path: Path, args: list[str], line: str) -> None:
    res = _gateway(tmp_path, *args)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and line in res.stderr, res.stderr


def test_a_token_file_others_may_read_is_refused(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("a-token-of-more-than-sixteen-chars\n")
    os.chmod(token, 0o644)
    res = _gateway(tmp_path, "--token-file", str(token))
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert f"--token-file {token}: others may read it (mode 644); run: chmod 600 {token}" in res.stderr


def test_a_token_file_that_cannot_be_made_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    res = _gateway(tmp_path, "--token-file", str(tmp_path / "file" / "token"))  # under a file: no folder there
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert f"--token-file {tmp_path / 'file' / 'token'}: cannot make it (" in res.stderr
