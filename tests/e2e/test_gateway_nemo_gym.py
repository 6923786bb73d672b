"""`gym-runtime gateway` driven by NeMo Gym 0.7.0's own rollout client, unchanged.

Real parts only: the gateway over a real nats-server and our workers (the scripted policy is the one test
double), and nemo-gym 0.7.0's own code — ``ng_collect_rollouts`` and NeMo RL's ``run_examples`` recipe
(docs/trainer.md, run as written) — in the shared base layer the hosted servers use (nemo-gym's metadata asks
for Python >= 3.13; built once and cached, CI builds it before the tests). Without a Python >= 3.13 these skip,
unless GYM_REQUIRE_HOSTING=1 (CI).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import yaml

from gym_runtime import Client
from gym_runtime.config import EnvironmentServerLimits, config_from_dict, resolve_config
from gym_runtime.gateway import Access, start
from tests.helpers import FLAKY, REPO, ROWS, cli, read_jsonl, weather, weather_config, write_jsonl
from tests.hosting import nemo_gym_python

ENV = "weather_agent_environment_server"
FULL = {"responses_create_params", "response", "reward"}  # what every verify response (a rollout row) holds


@pytest.fixture(scope="module")
def ng_python() -> str:
    return nemo_gym_python()


async def gateway_on(client: Client) -> AsyncIterator[str]:
    runner, port = await start(client, host="127.0.0.1", port=0)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@pytest.fixture
async def gateway(nats_server) -> AsyncIterator[str]:
    async with Client(weather(), nats=nats_server.url) as client:
        async for head in gateway_on(client):
            yield head


async def run_python(python: str, args: list[str], cwd: Path, timeout: float = 600) -> tuple[int, str, str]:
    """A nemo-gym process, awaited without blocking the gateway it talks to (it serves on this loop)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEMO_GYM")}
    proc = await asyncio.create_subprocess_exec(
        python, *args, cwd=cwd, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return proc.returncode or 0, out.decode(), err.decode()


async def collect_rollouts(
    python: str, head: str, rows: list[dict[str, Any]], tmp: Path, *overrides: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], Path]:
    """``ng_collect_rollouts`` against the gateway: (rollouts, failures sidecar rows, output path)."""
    host, port = head.removeprefix("http://").split(":")
    inp, out = write_jsonl(tmp / "in.jsonl", rows), tmp / "out.jsonl"
    ng = str(Path(python).parent / "ng_collect_rollouts")
    args = [f"++head_server.host={host}", f"++head_server.port={port}", f"+input_jsonl_fpath={inp}"]
    code, stdout, stderr = await run_python(python, [ng, *args, f"+output_jsonl_fpath={out}", *overrides], tmp)
    assert code == 0, (stdout + stderr)[-4000:]
    failures = tmp / "out_failures.jsonl"
    return read_jsonl(out), (read_jsonl(failures) if failures.exists() else []), out


def materialized(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows as a materialized taskset (NeMo Gym's task_id + task_input envelope)."""
    return [{"task_id": {"taskset": "weather", "task_id": str(i)}, "task_input": r} for i, r in enumerate(rows)]


MODES: dict[str, tuple[str, ...]] = {
    "agent": ("+agent_name=weather_agent",),
    "legacy": ("+environment_routing_mode=legacy", f"+environment_server_name={ENV}"),
    "taskset": ("+environment_routing_mode=taskset", f"+environment_server_routes={{weather:{ENV}}}"),
}


@pytest.mark.parametrize("mode", list(MODES))
async def test_ng_collect_rollouts_collects_200_rows_in_each_routing_mode(
    ng_python: str, gateway: str, tmp_path: Path, mode: str
) -> None:
    rows = [ROWS[i % 5] for i in range(200)]
    got, failures, out = await collect_rollouts(
        ng_python, gateway, materialized(rows) if mode == "taskset" else rows, tmp_path, *MODES[mode]
    )
    assert failures == [] and len(got) == 200
    assert len({(r["_ng_task_index"], r["_ng_rollout_index"]) for r in got}) == 200  # every rollout, once
    for r in got:
        assert FULL <= set(r) and r["reward"] == 1.0, r
        assert r["_ng_environment_server"] == ENV and r["_ng_result_type"] == "single_agent_turn_legacy"
        assert r["response"]["output"][-1]["type"] == "message"
    prompts = {json.dumps(r["responses_create_params"], sort_keys=True) for r in got}
    assert prompts == {json.dumps(r["responses_create_params"], sort_keys=True) for r in ROWS}
    # the Environment Server's /aggregate_metrics, as the collector asks for it
    metrics = json.loads(out.with_name("out_aggregate_metrics.json").read_text())
    entry = next(m for m in metrics if m.get("_ng_environment_server") == ENV)
    assert entry["agent_metrics"]["mean/reward"] == 1.0


async def test_ng_collect_rollouts_follows_the_name_the_gateway_advertises(
    ng_python: str, nats_server, tmp_path: Path
) -> None:
    """Across a cluster the gateway is started with ``--hostname``: NeMo Gym's client, given that name for the
    head, finds every server under it in the global config and is served there, unchanged (no token)."""
    async with Client(weather(), nats=nats_server.url) as client:
        served, port = await start(
            client, host="127.0.0.1", port=0, access=Access(token="t" * 32, hostnames=("localhost",))
        )
        try:
            rows = [ROWS[i % 5] for i in range(20)]
            got, failures, _ = await collect_rollouts(
                ng_python, f"http://localhost:{port}", rows, tmp_path, *MODES["legacy"]
            )
        finally:
            await served.cleanup()
    assert failures == [] and len(got) == 20 and all(r["reward"] == 1.0 for r in got)


async def test_nemo_rl_recipe_in_the_docs_runs_as_written(ng_python: str, gateway: str, tmp_path: Path) -> None:
    """docs/trainer.md's NeMo RL recipe (``run_examples`` in the default ``agent`` routing mode), as written."""
    text = (REPO / "docs/trainer.md").read_text()
    snippet = text.split("NeMo RL's recipe, pointed at the", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    port = gateway.rsplit(":", 1)[1]
    assert "port=11000)" in snippet
    rows = [ROWS[i % 5] for i in range(200)]
    script = tmp_path / "recipe.py"
    script.write_text(
        "import json, sys\n"
        "rows = [json.loads(line) for line in open(sys.argv[1])]\n"
        + snippet.replace("port=11000)", f"port={port})")
        + "\njson.dump([result for _row, result in results], open(sys.argv[2], 'w'))\n"
    )
    write_jsonl(tmp_path / "rows.jsonl", rows)
    code, out, err = await run_python(ng_python, [str(script), "rows.jsonl", "results.json"], tmp_path)
    assert code == 0, (out + err)[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert len(results) == 200
    for r in results:
        assert FULL <= set(r) and r["reward"] == 1.0 and r["agent_ref"]["name"] == "weather_agent", r


async def test_a_failing_environments_rows_come_back_as_typed_failures(
    ng_python: str, nats_server, tmp_path: Path
) -> None:
    """tests.envs.flaky's verify raises on rows marked "explode" (our verify_error, after the agent's two
    attempts) and tests.envs.crash_agent on rows marked "crash" (internal): ng_collect_rollouts files those rows in
    its failures sidecar as Environment Server failures, the first of the verification stage and not terminal,
    the second of the agent stage and terminal, and scores the others; on resume it runs each non-terminal one
    again as a new attempt and leaves the terminal ones, in flat and in taskset routing."""
    rows = [{**ROWS[i % 5], **[{}, {"explode": True}, {"crash": True}][i % 3]} for i in range(12)]
    exploding, crashing = [i for i in range(12) if i % 3 == 1], [i for i in range(12) if i % 3 == 2]
    env = "agent_environment_server"
    modes = {
        "legacy": ("+environment_routing_mode=legacy", f"+environment_server_name={env}"),
        "taskset": ("+environment_routing_mode=taskset", f"+environment_server_routes={{weather:{env}}}"),
    }
    agent = {**FLAKY["agents"]["agent"], "agent": "tests.envs.crash_agent"}
    cfg = config_from_dict({**FLAKY, "agents": {"agent": agent}, "base_dir": str(REPO)})
    async with Client(resolve_config(cfg), nats=nats_server.url) as client:
        async for head in gateway_on(client):
            for mode, overrides in modes.items():
                tmp = tmp_path / mode
                tmp.mkdir()
                data = materialized(rows) if mode == "taskset" else rows
                got, failures, _ = await collect_rollouts(ng_python, head, data, tmp, *overrides)
                assert len(got) == 4 and all(r["reward"] == 1.0 for r in got)
                assert sorted(f["_ng_task_index"] for f in failures) == sorted(exploding + crashing)
                for f in failures:
                    crashed = f["_ng_task_index"] in crashing
                    assert f["_ng_failure_class"] == "environment_server_failed", f
                    assert f["_ng_failure_terminal"] is crashed, f
                    assert f["_ng_failure_stage"] == ("agent" if crashed else "verification"), f
                    assert f["_ng_failure_message"].startswith("internal: " if crashed else "verify_error: "), f
                    assert "reward" not in f and "response" not in f
                    if mode == "legacy":  # a flat row's failure names its kind too
                        assert f["failure_kind"] == ("agent_run_error" if crashed else "verifier_error")
                got, failures, _ = await collect_rollouts(
                    ng_python, head, data, tmp, *overrides, "+resume_from_cache=true"
                )
                attempts = sorted((f["_ng_task_index"], f.get("_ng_attempt_index", 0)) for f in failures)
                assert attempts == sorted([(i, 0) for i in exploding + crashing] + [(i, 1) for i in exploding])
                assert len(got) == 4


# ----------------------------------------------------------------------------------- the protocol itself


async def post(url: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http:
        async with http.post(url, json=body, headers=headers) as r:
            return r.status, await r.json()


async def env_url(head: str) -> str:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{head}/global_config_dict_yaml") as r:
            cfg = yaml.safe_load(json.loads(await r.text()))
    server = cfg[ENV]["environment_servers"]["single_agent_turn_legacy"]
    assert server["agent_server"] == {"type": "responses_api_agents", "name": "weather_agent"}
    assert server["resources_server"] == {"type": "resources_servers", "name": "weather"}
    return f"http://{server['host']}:{server['port']}"


def episode(i: int, row: dict[str, Any], **task: Any) -> dict[str, Any]:
    return {
        "episode_id": {"rollout_id": f"{i}-0", "attempt": 0},
        "task": {"task_id": {"taskset": "weather", "task_id": str(i)}, "task_input": row, **task},
    }


async def test_episode_requests_are_answered_field_for_field(gateway: str) -> None:
    url = await env_url(gateway)
    status, body = await post(f"{url}/run", episode(7, ROWS[0]))
    assert status == 200 and set(body) == {"episode_id", "task_id", "result"}
    assert body["episode_id"] == {"rollout_id": "7-0", "attempt": 0}
    assert body["task_id"] == {"taskset": "weather", "task_id": "7"}
    assert body["result"]["reward"] == 1.0 and FULL <= set(body["result"])
    assert not [k for k in body["result"] if k.startswith("_ng_")] and "agent_ref" not in body["result"]
    # the canonical task_data container and flat task fields are one row
    status, body = await post(f"{url}/run", episode(8, {"task_data": {}, **ROWS[1]}))
    assert status == 200 and body["result"]["reward"] == 1.0
    # validated as NeMo Gym's models validate (422, FastAPI's shape)
    for bad in (
        {**episode(1, ROWS[0]), "extra": 1},
        {**episode(1, ROWS[0]), "episode_id": {"rollout_id": "1-0-a2"}},  # the reserved attempt suffix
        {**episode(1, ROWS[0]), "episode_id": {"rollout_id": "1", "attempt": -1}},
        episode(1, {"task_data": {"x": 1}, "x": 2, **ROWS[0]}),  # a field inside and outside task_data
        episode(1, {"task_data": {"x": 1}}),  # no responses_create_params
        episode(1, {"responses_create_params": {"input": 3}}),  # one our row check refuses
    ):
        status, body = await post(f"{url}/run", bad)
        assert status == 422 and isinstance(body["detail"], list), (bad, body)


async def test_a_flat_row_for_another_agent_is_refused_as_nemo_gym_refuses_it(gateway: str) -> None:
    url = await env_url(gateway)
    status, body = await post(f"{url}/run", {**ROWS[0], "agent_ref": {"name": "other_agent"}})
    assert status == 500 and body.startswith("ValueError(") and "'other_agent'" in body
    status, body = await post(f"{url}/run", {**ROWS[0], "task_source": "elsewhere"})
    assert status == 500 and "'elsewhere'" in body
    # the head port keeps the older agent protocol: an unknown agent_ref is 404 there
    status, body = await post(f"{gateway}/run", {**ROWS[0], "agent_ref": {"name": "other_agent"}})
    assert status == 404


async def test_each_port_speaks_its_own_protocol(gateway: str) -> None:
    """The head port is the agent protocol before 0.7 (an episode request is no task row there: 422 with the row
    check's line), an Environment Server's port the 0.7 episode protocol only: the head's listing and its
    control routes are not there (404), its liveness is."""
    url = await env_url(gateway)
    status, body = await post(f"{gateway}/run", episode(3, ROWS[0]))
    assert status == 422 and isinstance(body["detail"], str), body
    status, body = await post(f"{url}/run", episode(3, ROWS[0]))
    assert status == 200 and body["result"]["reward"] == 1.0
    async with aiohttp.ClientSession() as http:
        for path in ("/global_config_dict_yaml", "/server_instances"):
            async with http.get(f"{url}{path}") as r:
                assert r.status == 404, path
        async with http.get(f"{url}/") as r:
            assert r.status == 200 and await r.json() == {"status": "ok"}


async def test_environment_server_limits_are_honoured(nats_server) -> None:
    """One episode at a time, a 0.2 s queue and a 1 s episode deadline, rollouts taking ~1.5 s: the first
    episode times out, and episodes that wait past the queue timeout are refused at admission."""
    cfg = weather_config(delay_s=0.75)
    cfg.gateway = msgspec.structs.replace(
        cfg.gateway,
        environment_servers=EnvironmentServerLimits(
            max_concurrent_episodes=1, queue_timeout_seconds=0.2, default_episode_timeout_seconds=1.0
        ),
    )
    async with Client(resolve_config(cfg), nats=nats_server.url) as client:
        async for head in gateway_on(client):
            url = await env_url(head)
            replies = await asyncio.gather(*(post(f"{url}/run", episode(i, ROWS[i])) for i in range(3)))
    failures = sorted((b["failure"]["failure_reason"], b["failure"]) for s, b in replies if s == 200)
    assert len(failures) == 3, replies
    reasons = [r for r, _ in failures]
    assert reasons == ["Episode admission timed out"] * 2 + ["Episode timed out"], reasons
    assert failures[0][1] == {"failure_reason": "Episode admission timed out", "terminal": False, "stage": "admission"}
    assert failures[2][1] == {"failure_reason": "Episode timed out", "terminal": False}


async def test_the_callers_traceparent_is_the_rollouts_trace(nats_server, caplog: pytest.LogCaptureFixture) -> None:
    """NeMo Gym's client sends a ``traceparent`` with ``/run``: the rollout runs in that trace (its worker's log
    lines carry the trace id), on the Environment Server's port and on the head port alike."""
    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    async with Client(resolve_config(config_from_dict({**FLAKY, "base_dir": str(REPO)})), nats=nats_server.url) as c:
        async for head in gateway_on(c):
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{head}/global_config_dict_yaml") as r:
                    cfg = yaml.safe_load(json.loads(await r.text()))
            server = cfg["agent_environment_server"]["environment_servers"]["single_agent_turn_legacy"]
            for n, url in enumerate((f"http://127.0.0.1:{server['port']}", head)):
                tp = f"00-{trace[:-1]}{n}-00f067aa0ba902b7-01"
                status, body = await post(f"{url}/run", {**ROWS[0], "explode": True}, {"traceparent": tp})
                assert status in (200, 500), body  # a failure: its worker logs it, with the trace id
    failed = [json.loads(r.getMessage()) for r in caplog.records if "rollout.failed" in r.getMessage()]
    assert {e["trace_id"] for e in failed} == {f"{trace[:-1]}0", f"{trace[:-1]}1"}, failed


@pytest.mark.parametrize(
    ("limits", "line"),
    [
        ("{max_concurrent_episodes: 4}", "queue_timeout_seconds is required when max_concurrent_episodes is set"),
        ("{default_episode_timeout_seconds: 0}", "default_episode_timeout_seconds: 0.0 must be > 0"),
    ],
)
def test_a_wrong_environment_server_limit_is_one_line(tmp_path: Path, limits: str, line: str) -> None:
    text = (REPO / "resources/weather/config.yaml").read_text() + f"gateway: {{environment_servers: {limits}}}\n"
    (tmp_path / "config.yaml").write_text(text)
    res = cli("gateway", str(tmp_path / "config.yaml"), "--port", "0")
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert f"gateway.environment_servers: {line}" in res.stderr


def test_cli_gateway_puts_the_environment_servers_on_the_ports_asked_for(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        base = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "gym_runtime.cli", "gateway", "resources/weather/config.yaml", "--port", "0"]
        + ["--environment-port", str(base)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    try:
        assert proc.stdout is not None
        head = proc.stdout.readline().split()[-1]
        assert proc.stdout.readline().strip() == f"environment servers (NeMo Gym 0.7): {ENV} :{base}"
        cfg = yaml.safe_load(json.loads(requests_get(f"{head}/global_config_dict_yaml")))
        assert cfg[ENV]["environment_servers"]["single_agent_turn_legacy"]["port"] == base
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
    res = cli("gateway", "resources/weather/config.yaml", "--environment-port", "70000")
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "--environment-port 70000" in res.stderr


def requests_get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=60) as r:
        return r.read().decode()
