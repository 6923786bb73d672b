"""`gym-runtime gateway` driven the way NeMo Gym trainer integrations drive NeMo Gym's servers.

The HTTP client here is written from the protocol alone (aiohttp, as NeMo Gym's own client):
fetch ``/global_config_dict_yaml`` (a JSON string of YAML), find the agent's ``host``/``port`` under
``cfg[name][<kind>][<impl>]``, ``POST /run`` each row, collect replies in completion order.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import requests
import yaml

from gym_runtime import Client
from gym_runtime.config import resolve_config
from gym_runtime.gateway import Access, start
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.service.runner import run_batch
from gym_runtime.transport.discovery import discover
from tests.helpers import REPO, ROWS, cli, read_jsonl, weather, weather_config


def agent_url(global_cfg: dict[str, Any], name: str) -> str:
    """NeMo Gym's get_first_server_config_dict: the first server under the top-level key."""
    kind = next(iter(global_cfg[name].values()))
    server = next(iter(kind.values()))
    return f"http://{server['host']}:{server['port']}"


async def nemo_gym_client_rollouts(head: str, rows: list[dict[str, Any]]) -> tuple[list[Any], dict[str, Any]]:
    connector = aiohttp.TCPConnector(limit=1024)
    async with aiohttp.ClientSession(connector=connector) as http:
        async with http.get(f"{head}/global_config_dict_yaml") as r:
            assert r.status == 200
            cfg = yaml.safe_load(json.loads(await r.text()))

        async def one(row: dict[str, Any]) -> Any:
            name = (row.get("agent_ref") or {}).get("name") or "weather_agent"
            async with http.post(f"{agent_url(cfg, name)}/run", json=row) as r:
                return r.status, await r.json()

        replies = [await f for f in asyncio.as_completed([one(r) for r in rows])]  # completion order
    return replies, cfg


TOKEN = "test-control-token-0123456789"  # the gateway's control token (a file's contents, from the command)


@pytest.fixture
async def gateway(nats_server) -> AsyncIterator[tuple[str, Client]]:
    async with Client(weather(), nats=nats_server.url) as client:
        runner, port = await start(client, host="127.0.0.1", port=0, access=Access(token=TOKEN))
        try:
            yield f"http://127.0.0.1:{port}", client
        finally:
            await runner.cleanup()


async def test_the_docs_client_snippet_runs_a_bundled_row_as_written(gateway) -> None:
    """docs/trainer.md's client lines, run as written (with requests) on the bundled example row, which names
    no agent_ref (rows from `prepare` do)."""
    head, _ = gateway
    text = (REPO / "docs/trainer.md").read_text()
    snippet = text.split("What such a client does, unchanged", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    row = read_jsonl(REPO / "resources/weather/data/example.jsonl")[0]
    assert "agent_ref" not in row
    scope: dict[str, Any] = {"json": json, "yaml": yaml, "requests": requests, "head": head, "row": row}
    await asyncio.to_thread(exec, snippet, scope)
    assert scope["result"]["reward"] == 1.0


async def test_a_thousand_concurrent_runs_answer_nemo_gym_rows(gateway, tmp_path: Path) -> None:
    head, client = gateway
    rows = [ROWS[i % 5] for i in range(1000)]
    replies, cfg = await nemo_gym_client_rollouts(head, rows)
    assert cfg["head_server"]["port"] == int(head.rsplit(":", 1)[1])
    assert len(replies) == 1000 and {s for s, _ in replies} == {200}

    # the reference: the same rows through `collect` (run_batch writes what collect writes)
    out = tmp_path / "ref.jsonl"
    await run_batch(
        client.config,
        client.url,
        input_path=REPO / "resources/weather/data/example.jsonl",
        out=out,
        telemetry=Telemetry(),
        start_local_workers=False,
    )
    ref = read_jsonl(out)[0]
    expected_keys = set(ref) - {"_ng_task_index", "_ng_rollout_index", "agent_ref"}
    by_prompt = {json.dumps(r["responses_create_params"], sort_keys=True): r for r in read_jsonl(out)}
    for _, body in replies:
        assert set(body) == expected_keys
        want = by_prompt[json.dumps(body["responses_create_params"], sort_keys=True)]
        assert body["reward"] == want["reward"] == 1.0
        assert [i["type"] for i in body["response"]["output"]] == [i["type"] for i in want["response"]["output"]]
        assert body["response"]["output"][-1]["content"] == want["response"]["output"][-1]["content"]

    async with aiohttp.ClientSession() as http:
        async with http.post(f"{head}/aggregate_metrics", json={"verify_responses": [b for _, b in replies]}) as r:
            assert r.status == 200
            metrics = await r.json()
    assert metrics["num_rollouts"] == 1000
    assert metrics["agent_metrics"]["mean/reward"] == 1.0


async def test_run_keeps_the_requests_own_ids_and_agent_ref(gateway) -> None:
    head, _ = gateway
    row = {
        **ROWS[0],
        "agent_ref": {"type": "responses_api_agents", "name": "weather_agent"},
        "_ng_task_index": 41,
        "_ng_rollout_index": 3,
    }
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{head}/run", json=row) as r:
            body = await r.json()
        async with http.get(f"{head}/") as r:
            assert await r.json() == {"status": "ok"}
        async with http.get(f"{head}/server_instances") as r:
            instances = await r.json()
    assert body["_ng_task_index"] == 41 and body["_ng_rollout_index"] == 3
    assert body["agent_ref"] == row["agent_ref"] and body["reward"] == 1.0
    assert [i["name"] for i in instances] == ["weather_agent", "weather_agent_environment_server"]
    assert instances[0]["url"] == head and instances[0]["server_type"] == "responses_api_agents"
    assert instances[1]["server_type"] == "environment_servers" and instances[1]["url"] != head  # its own port


async def test_bad_requests_get_clear_http_errors(gateway) -> None:
    head, _ = gateway
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{head}/run", json={**ROWS[0], "agent_ref": {"name": "nope"}}) as r:
            assert r.status == 404 and "nope" in (await r.json())["detail"]
        async with http.post(f"{head}/run", json={"input": "hi"}) as r:
            assert r.status == 422 and "responses_create_params" in (await r.json())["detail"]
        async with http.post(f"{head}/run", data=b"{not json", headers={"Content-Type": "application/json"}) as r:
            # issue 75: the shape it expected, not only that it is not JSON
            detail = (await r.json())["detail"]
            assert r.status == 422 and "not JSON" in detail, detail
            assert 'expected a JSON object: {"responses_create_params": {"input": [{"role": "user"' in detail, detail
        async with http.post(f"{head}/run", json=["a", "list"]) as r:
            assert r.status == 422 and '{"responses_create_params": {"input"' in (await r.json())["detail"]
        async with http.post(f"{head}/aggregate_metrics", json=[1]) as r:
            assert r.status == 422


async def test_a_failed_rollout_answers_500_naming_the_error_class(nats_server) -> None:
    cfg = weather_config(delay_s=2.0)
    cfg.agents["weather_agent"] = msgspec.structs.replace(cfg.agents["weather_agent"], timeout_s=0.3)
    async with Client(resolve_config(cfg), nats=nats_server.url) as client:
        runner, port = await start(client, host="127.0.0.1", port=0)
        try:
            async with aiohttp.ClientSession() as http:
                async with http.post(f"http://127.0.0.1:{port}/run", json=ROWS[0]) as r:
                    assert r.status == 500
                    assert r.headers["Gym-Error-Class"] == "timeout"
                    body = await r.json()
        finally:
            await runner.cleanup()
    assert isinstance(body, str) and body.startswith("RolloutFailed(error_class='timeout'")


def test_cli_gateway_serves_and_stops_on_sigterm(tmp_path: Path) -> None:
    """The command as an operator runs it: its token file made (0600) where it says, /pause only with it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "gym_runtime.cli", "gateway", "resources/weather/config.yaml", "--port", "0"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**__import__("os").environ, "TMPDIR": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "cfg")},
    )
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("gateway listening on http://127.0.0.1:"), line + proc.stderr.read()  # type: ignore[union-attr]
        url = line.split()[-1]
        proc.stdout.readline()  # type: ignore[union-attr]  # the environment servers
        token_line = proc.stdout.readline()  # type: ignore[union-attr]
        token_file = tmp_path / "cfg/gym-runtime/gateway.token"
        assert token_line.startswith(f"token: {token_file} (send 'Authorization: Bearer"), token_line
        assert token_file.stat().st_mode & 0o777 == 0o600
        json_type = {"Content-Type": "application/json"}
        with requests.post(f"{url}/run", data=json.dumps(ROWS[1]), headers=json_type, timeout=60) as r:
            assert r.status_code == 200 and r.json()["reward"] == 1.0
        assert requests.post(f"{url}/resume", json={}, timeout=60).status_code == 401
        bearer = {"Authorization": f"Bearer {token_file.read_text().strip()}"}
        with requests.post(f"{url}/resume", json={}, headers=bearer, timeout=60) as r:
            assert r.status_code == 200 and r.json() == {"resumed": True}
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(30)
    assert rc == 0


def test_cli_gateway_usage_errors_are_one_line() -> None:
    res = cli("gateway", "resources/weather/config.yaml", "--port", "70000")
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0 and "--port 70000" in res.stderr
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        start_t = time.monotonic()
        res = cli("gateway", "resources/weather/config.yaml", "--port", str(taken))
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert f"--port {taken}: 127.0.0.1:{taken} is already in use" in res.stderr, res.stderr
    assert "give a free port, e.g. --port " in res.stderr and "or --port 0" in res.stderr, res.stderr
    assert time.monotonic() - start_t < 60
    res = cli(
        "gateway",
        "resources/weather/config.yaml",
        "--nats",
        f"nats://127.0.0.1:{taken}",
        env={"GYM_CONNECT_TIMEOUT_S": "1"},
    )
    assert res.returncode == 2 and res.stderr.startswith("gym-runtime: error: cannot reach a NATS server")


async def test_several_agents_are_listed_and_routed_by_agent_ref(nats_server) -> None:
    cfg = weather_config()
    cfg.agents["second_agent"] = msgspec.structs.replace(cfg.agents["weather_agent"], max_steps=3)
    async with Client(resolve_config(cfg), nats=nats_server.url) as client:
        runner, port = await start(client, host="127.0.0.1", port=0)
        head = f"http://127.0.0.1:{port}"
        try:
            rows = [
                {**ROWS[i], "agent_ref": {"type": "responses_api_agents", "name": n}}
                for i, n in enumerate(["weather_agent", "second_agent"] * 2)
            ]
            replies, global_cfg = await nemo_gym_client_rollouts(head, rows)
            async with aiohttp.ClientSession() as http, http.post(f"{head}/run", json=ROWS[0]) as r:
                assert r.status == 422 and "several agents" in (await r.json())["detail"]
        finally:
            await runner.cleanup()
        both = {"weather_agent", "second_agent"}
        seen = await discover(client.bus, wait_s=30, until=lambda ws: {w["name"] for w in ws} >= both)
        agents = {w["name"]: w["completed"] for w in seen if w["role"] == "agent"}
    assert {"weather_agent", "second_agent"} <= set(global_cfg)
    assert agent_url(global_cfg, "second_agent") == head
    assert sorted(b["agent_ref"]["name"] for _, b in replies) == ["second_agent"] * 2 + ["weather_agent"] * 2
    assert agents == {"weather_agent": 2, "second_agent": 2}  # each row ran on the agent it named


async def test_pause_and_resume_over_http_hold_and_release_model_calls(gateway) -> None:
    """A trainer that reaches the cluster only over HTTP steers its updates as ``Client.pause`` does."""
    head, client = gateway
    (model,) = [w for w in client.workers if hasattr(w, "gate")]
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        async with http.post(f"{head}/pause", json={"mode": "drain"}) as r:
            assert r.status == 200 and await r.json() == {"acknowledged": 1}
        run = asyncio.ensure_future(http.post(f"{head}/run", json=ROWS[0]))
        async with asyncio.timeout(30):  # the rollout's model call is held, not served
            while model.gate.held == 0:
                await asyncio.sleep(0.02)
        assert model.served == 0 and not run.done()
        async with http.post(f"{head}/resume", json={}) as r:
            assert r.status == 200 and await r.json() == {"resumed": True}
        async with await run as r:
            assert r.status == 200 and (await r.json())["reward"] == 1.0
        async with http.post(f"{head}/pause", json={"mode": "later"}) as r:
            assert r.status == 422 and (await r.json())["detail"] == (
                "pause mode must be one of drain, interrupt, abort, got 'later'"
            )
        async with http.post(f"{head}/pause", json={"mode": "interrupt"}) as r:  # the stub has no token ids
            assert r.status == 422 and "models.policy: cannot pause with mode='interrupt'" in (await r.json())["detail"]
        async with http.post(f"{head}/resume", json={"model": "nope"}) as r:
            assert r.status == 422 and "no model named 'nope'" in (await r.json())["detail"]
        async with http.post(f"{head}/pause", json={"mode": "drain", "wait": 1}) as r:
            assert r.status == 422 and "unknown fields ['wait']" in (await r.json())["detail"]
