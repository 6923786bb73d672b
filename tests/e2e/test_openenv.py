"""OpenEnv environments as gym-runtime resources: in process, and through OpenEnv's own server.

Real parts: `gym-runtime run` in a child process (embedded nats-server, real workers),
tests/envs/openenv_counter.py written against OpenEnv's ``Environment`` API, OpenEnv's own
server (its FastAPI app under uvicorn) on loopback and its own client (``GenericEnvClient``).
The LLM double is the vLLM emulator (tests/stub_openai.py) with a policy that plays the
deltas the prompt names.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gym_runtime.resources.openenv import action_tool
from tests.envs.openenv_counter import CountAction
from tests.helpers import REPO, read_jsonl, wait_healthy, write_jsonl
from tests.stub_openai import Gen, StubOpenAI, VLLMEmulator


def _prompt_text(em: VLLMEmulator, body: dict[str, Any]) -> str:
    """What the model was shown: the chat messages as JSON, or the decoded prompt."""
    if "messages" in body:
        return json.dumps(body["messages"])
    p = body.get("prompt")
    return em.tokenizer.decode(p) if isinstance(p, list) else str(p)


def _emulator() -> VLLMEmulator:
    em = VLLMEmulator()

    def policy(path: str, body: dict[str, Any]) -> Gen:
        s = _prompt_text(em, body)
        how, a, b = re.findall(r"(steps|turns) (\d+) (\d+)", s)[0]
        done = s.count("total")  # one per observation the model has read
        if done < 2 and how == "steps":  # act through the action tool
            return Gen(text=VLLMEmulator.tool_call_text("step", {"delta": int((a, b)[done])}))
        if done < 2:  # act with the turn's text (agents.multi_turn, user: env)
            return Gen(text=json.dumps({"delta": int((a, b)[done])}))
        return Gen(text="finished")

    em.policy = policy
    return em


def _rows(pairs: list[tuple[int, int]], *, turns: bool = False) -> list[dict[str, Any]]:
    if turns:
        return [
            {"responses_create_params": {"input": [{"role": "user", "content": f"turns {a} {b}"}]}} for a, b in pairs
        ]
    tool = action_tool(CountAction)
    return [
        {"responses_create_params": {"input": [{"role": "user", "content": f"steps {a} {b}"}], "tools": [tool]}}
        for a, b in pairs
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def work(tmp_path: Path) -> Path:
    w = tmp_path / "work"
    w.mkdir()
    shutil.copy(REPO / "tests/envs/openenv_counter.py", w / "openenv_counter.py")
    return w


def _env(work: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(work), "TMPDIR": str(work)}


@pytest.fixture
def server(work: Path) -> Iterator[str]:
    """OpenEnv's own server for the counter environment, a child process on loopback."""
    yield from _serve(work, "openenv_counter.py")


@pytest.fixture
def mcp_server(work: Path) -> Iterator[str]:
    """OpenEnv's own server for the MCP environment, a child process on loopback."""
    shutil.copy(REPO / "tests/envs/openenv_mcp.py", work / "openenv_mcp.py")
    yield from _serve(work, "openenv_mcp.py")


@pytest.fixture
def narrow_server(work: Path) -> Iterator[str]:
    """OpenEnv's own server for the counter at its template's default capacity: one session at a time."""
    yield from _serve(work, "openenv_counter.py", "counter", "1")


@pytest.fixture
def say_server(work: Path) -> Iterator[str]:
    """OpenEnv's own server for an environment whose action is one string field."""
    yield from _serve(work, "openenv_counter.py", "say")


def _serve(work: Path, script: str, *args: str) -> Iterator[str]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, script, str(port), *args],
        cwd=work,
        env=_env(work),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        err = proc.stderr
        assert err is not None
        # 240 s: the server came up after more than 60 s here at load 13 (openreward's SDK likewise)
        wait_healthy(url, proc, 240, lambda: f"OpenEnv server did not start: {err.read().decode()[-2000:]}")
        yield url
    finally:
        proc.terminate()  # a step still blocked in the hang test holds uvicorn's shutdown: then kill it
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


TOOLS_AGENT = "{agent: agents.simple, model: policy, resource: counter, max_steps: 6, max_attempts: 1, timeout_s: 60}"
SERVED_AGENT = TOOLS_AGENT.replace("resource: counter", "resource: served")  # the same agent on a second resource
TURNS_AGENT = (
    "{agent: agents.multi_turn, model: policy, resource: counter, max_steps: 2, max_attempts: 1, timeout_s: 60,"
    " options: {user: env, max_turns: 4}}"
)


def _run(
    work: Path, base_url: str, options: str, rows: list[dict[str, Any]], agent: str = TOOLS_AGENT
) -> subprocess.CompletedProcess[str]:
    return _run_config(work, base_url, {"counter": options}, {"play": agent}, rows)


def _run_config(
    work: Path, base_url: str, resources: dict[str, str], agents: dict[str, str], rows: list[dict[str, Any]]
) -> subprocess.CompletedProcess[str]:
    """One ``run`` of ``rows`` with OpenEnv resources (name: options) and agents (name: entry)."""
    (work / "config.yaml").write_text(
        "nats: embedded\n"
        "models:\n"
        f"  policy: {{adapter: vllm, base_url: '{base_url}', model: tiny, return_token_ids: true,"
        " eos_token_id: 4, timeout_s: 20}\n"
        "resources:\n"
        + "".join(
            f"  {name}: {{server: resources.openenv, options: {options}}}\n" for name, options in resources.items()
        )
        + "agents:\n"
        + "".join(f"  {name}: {entry}\n" for name, entry in agents.items())
    )
    write_jsonl(work / "rows.jsonl", rows)
    cmd = [sys.executable, "-m", "gym_runtime.cli", "run", "config.yaml", "-i", "rows.jsonl", "-o", "out.jsonl", "-q"]
    return subprocess.run(cmd, cwd=work, env=_env(work), capture_output=True, text=True, timeout=180, check=False)


def _run_each(
    work: Path,
    base_url: str,
    resources: dict[str, str],
    agents: dict[str, str],
    inputs: dict[str, list[dict[str, Any]]],
) -> tuple[subprocess.CompletedProcess[str], dict[str, list[dict[str, Any]]]]:
    """One ``run`` of each agent's rows (named by their ``agent_ref``); the output rows by agent, in task order."""
    tagged = [{**row, "agent_ref": {"name": agent}} for agent, rows in inputs.items() for row in rows]
    res = _run_config(work, base_url, resources, agents, tagged)
    by_agent: dict[str, list[dict[str, Any]]] = {agent: [] for agent in agents}
    for r in sorted(read_jsonl(work / "out.jsonl"), key=lambda r: r["_ng_task_index"]):
        by_agent[r["agent_ref"]["name"]].append(r)
    return res, by_agent


async def _own_client(url: str, pairs: list[tuple[int, int]]) -> list[float]:
    """Drive OpenEnv's server with its own client, the same actions as the rows: the summed rewards."""
    from openenv.core.generic_client import GenericEnvClient

    out = []
    for a, b in pairs:
        client = GenericEnvClient(base_url=url)
        await client.connect()
        try:
            await client.reset()
            total = 0.0
            for d in (a, b):
                result = await client.step({"delta": d})
                total += result.reward or 0.0
            out.append(total)
        finally:
            await client.close()
    return out


PAIRS = [(2, 3), (2, 2), (1, 1), (4, 2)]


SEED_IMPORTS = """
import sys, anyio
from gym_runtime.resources.openenv import OpenEnvResource

async def main():
    await OpenEnvResource.setup({"url": sys.argv[1]})
    before = set(sys.modules)
    inst = OpenEnvResource()
    await inst.seed({})
    await inst.close()
    print(sorted(set(sys.modules) - before))

anyio.run(main)
"""


def test_a_served_environments_seed_imports_nothing_in_the_event_loop(work: Path, server: str) -> None:
    """Setup imports OpenEnv's client, not the first seed: an import holds the worker's event loop (2.6 s at
    load 4), and seeds waiting behind it past the bus's liveness were worker_lost rows under load."""
    res = subprocess.run(
        [sys.executable, "-c", SEED_IMPORTS, server], env=_env(work), capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "[]"


def test_rewards_equal_in_process_served_and_own_client(work: Path, server: str) -> None:
    """The same scripted actions score the same in process, through OpenEnv's server, and with its client."""
    # one run: an agent per mode (in process, through OpenEnv's server, and the in-process environment driven
    # by policy turns: agents.multi_turn, user: env, each turn's text the action), the rows named by agent
    agents = {
        "in_process": TOOLS_AGENT,
        "server": SERVED_AGENT,
        "turns": TURNS_AGENT,
    }
    resources = {"counter": "{env: 'openenv_counter:CountEnv'}", "served": f"{{url: '{server}'}}"}
    inputs = {"in_process": _rows(PAIRS), "server": _rows(PAIRS), "turns": _rows(PAIRS, turns=True)}
    with StubOpenAI(emulator=_emulator()) as stub:
        res, by_agent = _run_each(work, stub.base_url, resources, agents, inputs)
    assert res.returncode == 0, res.stderr[-3000:]
    rewards = {agent: [r["reward"] for r in rows] for agent, rows in by_agent.items()}
    for r in by_agent["in_process"] + by_agent["server"]:
        calls = [i for i in r["response"]["output"] if i["type"] == "function_call"]
        assert len(calls) == 2 and r["done"] is True and len(r["step_rewards"]) == 2
        outputs = [json.loads(i["output"]) for i in r["response"]["output"] if i["type"] == "function_call_output"]
        assert [o["done"] for o in outputs] == [False, True]
    assert all(r["terminated"] is True and len(r["step_rewards"]) == 2 for r in by_agent["turns"])
    rewards["own_client"] = asyncio.run(_own_client(server, PAIRS))
    assert rewards["in_process"] == rewards["server"] == rewards["own_client"] == [1.0, 0.5, 0.0, 0.5]
    assert rewards["turns"] == rewards["own_client"]


@pytest.mark.parametrize("mode", ["in_process", "server"])
def test_step_that_raises_hangs_or_pays_no_number_is_a_failure_row(work: Path, server: str, mode: str) -> None:
    """A step that raises or outlives step_timeout_s is a tool_error row, a non-number reward a verify_error
    row (never a reward of 0), and the worker serves the good row after them."""
    pairs = [(99, 1), (77, 1), (2, 55), (2, 3)]
    where = "env: 'openenv_counter:CountEnv'" if mode == "in_process" else f"url: '{server}'"
    with StubOpenAI(emulator=_emulator()) as stub:
        res = _run(work, stub.base_url, f"{{{where}, step_timeout_s: 2}}", _rows(pairs))
    failures = {f["_ng_task_index"]: f for f in read_jsonl(work / "out_failures.jsonl")}
    rows = read_jsonl(work / "out.jsonl")
    assert [r["_ng_task_index"] for r in rows] == [3] and rows[0]["reward"] == 1.0, res.stderr[-2000:]
    assert failures[0]["error_class"] == "tool_error" and "step exploded" in failures[0]["error"]
    assert failures[1]["error_class"] == "tool_error" and "step_timeout_s" in failures[1]["error"]
    assert failures[2]["error_class"] == "verify_error" and "not a number" in failures[2]["error"]


def _mcp_emulator() -> VLLMEmulator:
    """A policy that adds the two numbers the prompt names through the MCP tool `add`, then calls `submit`."""
    em = VLLMEmulator()

    def policy(path: str, body: dict[str, Any]) -> Gen:
        s = _prompt_text(em, body)
        a, b = re.findall(r"tally (-?\d+) (-?\d+)", s)[0]
        read = s.count('"role": "tool"') + s.count("<tool_response>")  # tool answers the model has read
        if read < 2:
            return Gen(text=VLLMEmulator.tool_call_text("add", {"n": int((a, b)[read])}))
        if read == 2:
            return Gen(text=VLLMEmulator.tool_call_text("submit", {}))
        return Gen(text="finished")

    em.policy = policy
    return em


def test_mcp_tools_are_offered_to_the_model_and_run_through_the_environment(work: Path, mcp_server: str) -> None:
    """An OpenEnv MCPEnvironment (FastMCP tools `add` and `submit`), in process and through OpenEnv's own
    server: its tools, as the environment lists them, are the row's function tools; each call is a
    CallToolAction through the environment's own step, the model reads what OpenEnv's MCPToolClient
    returns (the data, or its failure text for a raising tool); rewards equal in both modes and equal to
    driving the environment with OpenEnv's own actions."""
    from openenv.core.env_server.mcp_types import CallToolAction, ListToolsAction

    from gym_runtime.resources.openenv import mcp_tools

    shutil.copy(REPO / "tests/envs/openenv_mcp.py", work / "openenv_mcp.py")
    sys.path.insert(0, str(work))
    try:
        from openenv_mcp import TallyEnv  # type: ignore[import-not-found]

        tools = mcp_tools("openenv_mcp:TallyEnv")
        listed = TallyEnv().step(ListToolsAction()).tools
        pairs = [(2, 3), (2, 2), (1, 1), (13, 4)]
        own = []
        for a, b in pairs:  # OpenEnv's own API, the same calls
            env = TallyEnv()
            env.reset()
            for n in (a, b):
                env.step(CallToolAction(tool_name="add", arguments={"n": n}))
            own.append(env.step(CallToolAction(tool_name="submit", arguments={})).reward)
    finally:
        sys.path.remove(str(work))
    assert [(t["name"], t["description"], t["parameters"]) for t in tools] == [
        (t.name, t.description, t.input_schema) for t in listed
    ]
    assert mcp_tools(mcp_server) == tools  # the server lists the same
    rows = [
        {"responses_create_params": {"input": [{"role": "user", "content": f"tally {a} {b}"}], "tools": tools}}
        for a, b in pairs
    ]
    resources = {"counter": "{env: 'openenv_mcp:TallyEnv'}", "served": f"{{url: '{mcp_server}'}}"}
    agents = {"in_process": TOOLS_AGENT, "server": SERVED_AGENT}
    with StubOpenAI(emulator=_mcp_emulator()) as stub:  # one run: an agent per mode
        res, by_agent = _run_each(work, stub.base_url, resources, agents, {agent: rows for agent in agents})
    assert res.returncode == 0, res.stderr[-3000:]
    for mode, out in by_agent.items():
        assert [r["reward"] for r in out] == own == [1.0, 0.5, 0.0, 0.5], mode  # 13 raised: 4 is one off
        assert all(r["done"] is True for r in out)
        outputs = [[i["output"] for i in r["response"]["output"] if i["type"] == "function_call_output"] for r in out]
        assert outputs[0] == ["2", "5", "submitted 5"]
        assert outputs[3][0] == "Tool 'add' failed: Error calling tool 'add': unlucky number (type: execution_error)"


def test_a_server_that_takes_one_session_at_a_time_serves_every_row(work: Path, narrow_server: str) -> None:
    """OpenEnv's server template takes one session at a time (max_concurrent_envs=1) and refuses the others
    with CAPACITY_REACHED: the rows wait for the session to free up instead of failing."""
    with StubOpenAI(emulator=_emulator()) as stub:
        res = _run(work, stub.base_url, f"{{url: '{narrow_server}'}}", _rows(PAIRS))
    assert res.returncode == 0, res.stderr[-3000:]
    assert not (work / "out_failures.jsonl").exists() or not read_jsonl(work / "out_failures.jsonl")
    rows = sorted(read_jsonl(work / "out.jsonl"), key=lambda r: r["_ng_task_index"])
    assert [r["reward"] for r in rows] == [1.0, 0.5, 0.0, 0.5]


def _plain_emulator() -> VLLMEmulator:
    """A policy that answers in plain text, never a JSON object: ``say WORD`` says WORD, ``count`` says 'add two'."""
    em = VLLMEmulator()

    def policy(path: str, body: dict[str, Any]) -> Gen:
        s = _prompt_text(em, body)
        said = re.findall(r"say (\w+)", s)
        return Gen(text=said[0] if said else "add two")

    em.policy = policy
    return em


def _plain_rows(prompts: list[str]) -> list[dict[str, Any]]:
    return [{"responses_create_params": {"input": [{"role": "user", "content": p}]}} for p in prompts]


def test_plain_text_turns_are_the_action_of_one_string_field_on_a_server(work: Path, say_server: str) -> None:
    """Policy turns in plain text against a served environment whose action is one string field: the text
    is that field (read from the server's /schema), as in process, so the turn scores."""
    with StubOpenAI(emulator=_plain_emulator()) as stub:
        for options in ("{env: 'openenv_counter:SayEnv'}", f"{{url: '{say_server}'}}"):
            res = _run(work, stub.base_url, options, _plain_rows(["say five", "say four"]), TURNS_AGENT)
            assert res.returncode == 0, res.stderr[-3000:]
            rows = sorted(read_jsonl(work / "out.jsonl"), key=lambda r: r["_ng_task_index"])
            assert [r["reward"] for r in rows] == [1.0, 0.0], options
            assert all(r["done"] is True and len(r["step_rewards"]) == 1 for r in rows)


@pytest.mark.parametrize("mode", ["in_process", "server"])
def test_plain_text_turns_that_are_no_action_fail_the_row_and_say_why(work: Path, server: str, mode: str) -> None:
    """Policy turns in plain text against an environment whose action is a JSON object (the counter's
    ``delta``): when no turn ever reached the environment, the row is a failure that names the action's
    fields, not a silent reward of 0."""
    where = "env: 'openenv_counter:CountEnv'" if mode == "in_process" else f"url: '{server}'"
    with StubOpenAI(emulator=_plain_emulator()) as stub:
        _run(work, stub.base_url, f"{{{where}}}", _plain_rows(["count", "count"]), TURNS_AGENT)
    assert not (work / "out.jsonl").exists() or not read_jsonl(work / "out.jsonl")
    failures = read_jsonl(work / "out_failures.jsonl")
    assert len(failures) == 2
    for f in failures:
        assert f["error_class"] == "verify_error", f
        assert "no policy turn was an action" in f["error"] and "delta (integer)" in f["error"], f["error"]


def test_a_step_without_an_annotated_action_is_a_config_error_naming_options_action(work: Path) -> None:
    """An Environment whose ``step`` does not annotate its action: one line naming options.action, exit 2;
    naming the action class there runs it (a class that cannot be loaded: one line naming its key)."""
    with StubOpenAI(emulator=_emulator()) as stub:
        res = _run(work, stub.base_url, "{env: 'openenv_counter:UnannotatedEnv'}", _rows(PAIRS[:1]))
        assert res.returncode == 2, res.stderr[-3000:]
        lines = [line for line in res.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "options.action" in lines[0] and "Traceback" not in res.stderr, res.stderr
        assert "UnannotatedEnv" in lines[0]
        res = _run(work, stub.base_url, "{env: 'openenv_counter:NoSuchEnv'}", _rows(PAIRS[:1]))
        assert res.returncode == 2 and "options.env" in res.stderr and "Traceback" not in res.stderr, res.stderr
        options = "{env: 'openenv_counter:UnannotatedEnv', action: 'openenv_counter:CountAction'}"
        res = _run(work, stub.base_url, options, _rows(PAIRS[:1]))
    assert res.returncode == 0, res.stderr[-3000:]
    assert [r["reward"] for r in read_jsonl(work / "out.jsonl")] == [1.0]
