"""OpenReward (ORS) environments as gym-runtime resources: in process (the worker's guest) and through the
openreward SDK's own server.

Real parts: `gym-runtime run` in a child process (embedded nats-server, real workers and guests), the
environments of tests/envs/ors_quiz.py and ors_repair.py written as the SDK's template writes one, the SDK's
own ``Server`` (its FastAPI app under uvicorn) in child processes on loopback, and the SDK's own client
(``AsyncEnvironmentsAPI``) as the reference: it drives the same environments with the actions our rows
record, and its rewards, outputs and refusals must be ours. The LLM double is the ``scripted`` model (it
calls each offered tool once with arguments from the tool's schema: ``"example"`` for a string).

One batch runs every case (the SDK's import is ~10 s of CPU per process on the shared 2-core machine);
the tests below read its rows.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.helpers import REPO, cli, read_jsonl, wait_healthy, write_jsonl

# the extra is in dev; imported only where used (the SDK imports anthropic, google-genai, ...: seconds)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("openreward") is None, reason="needs gym-runtime[openreward]")

ENVS = REPO / "tests" / "envs"


def _env_class(path: str) -> Any:
    """An environment class of tests/envs (imported on use: the SDK's import costs seconds at collection)."""
    module, _, name = path.partition(":")
    if str(ENVS) not in sys.path:
        sys.path.insert(0, str(ENVS))
    return getattr(importlib.import_module(module), name)


def _rows(path: str) -> list[dict[str, Any]]:
    from gym_runtime.resources.openreward.rows import rows_in_process

    return rows_in_process(_env_class(path), "train")


def _env(work: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(ENVS),
        "TMPDIR": str(work),
        "OPENREWARD_DISABLE_UPDATE_CHECK": "1",  # the SDK's server would ask PyPI for its latest version
        "NO_PROXY": "127.0.0.1,localhost",
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(work: Path, script: str) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    log = (work / f"{script}.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, str(ENVS / script), str(port)], cwd=work, env=_env(work), stdout=log, stderr=log
    )
    return proc, f"http://127.0.0.1:{port}"


def _wait_up(work: Path, proc: subprocess.Popen[bytes], url: str, script: str) -> None:
    # 240 s: the SDK's import alone took 30-40 s here at load 9
    log = work / f"{script}.log"
    wait_healthy(url, proc, 240, lambda: f"{script}: the SDK's server did not start: {log.read_text()[-2000:]}")


def _tag(rows: list[dict[str, Any]], agent: str, **extra: Any) -> list[dict[str, Any]]:
    return [{**r, "agent_ref": {"type": "responses_api_agents", "name": agent}, **extra} for r in rows]


def _with_tools(row: dict[str, Any], names: list[str], extra: list[dict[str, Any]] = ()) -> dict[str, Any]:  # type: ignore[assignment]
    tools = {t["name"]: t for t in row["responses_create_params"]["tools"]}
    chosen = [*extra, *(tools[n] for n in names)]
    return {**row, "responses_create_params": {**row["responses_create_params"], "tools": chosen}}


PEEK = {
    "type": "function",
    "name": "peek",
    "description": "Not a tool of the environment.",
    "parameters": {"type": "object", "properties": {}},
}


def _cases() -> list[dict[str, Any]]:
    """Every case, for the agents of one environment (``sfx``: "" in process, "_url" through the SDK's server)."""
    quiz, repair, oral = _rows("ors_quiz:Quiz"), _rows("ors_repair:Repair"), _rows("ors_quiz:Oral")
    out = []
    for sfx in ("", "_url"):
        out += _tag(quiz, f"quiz{sfx}", case="quiz")  # single step: 1.0, 0.0, 1.0
        out += _tag([_with_tools(quiz[0], ["answer"], [PEEK])], f"quiz{sfx}", case="unknown_tool")
        out += _tag(repair, f"repair{sfx}", case="repair")  # fix, inspect, submit: three rewards each
        out += _tag([_with_tools(repair[0], ["fix", "submit", "inspect"])], f"repair{sfx}", case="after_finished")
        out += _tag(oral, f"oral{sfx}", case="terminal")
    bad_quiz = {**quiz[1], "task_spec": {**quiz[1]["task_spec"], "explode": True}}
    out += _tag([bad_quiz], "quiz", case="raises")
    out += _tag([{**repair[0], "task_spec": {**repair[0]["task_spec"], "slow": True}}], "repair", case="hangs")
    return out


def _config(quiz_url: str, repair_url: str) -> str:
    agent = "{{agent: agents.simple, model: policy, resource: {r}, max_steps: 4, max_attempts: 1, timeout_s: 240}}"
    resources = {
        "quiz": "{server: resources.openreward, options: {env: 'ors_quiz:Quiz'}}",
        "oral": "{server: resources.openreward, options: {env: 'ors_quiz:Oral'}}",
        "repair": "{server: resources.openreward, options: {env: 'ors_repair:Repair', tool_timeout_s: 5}}",
        # the SDK's client only: no environment code in the worker, so no guest process is needed
        "quiz_url": f"{{server: resources.openreward, isolation: none, options: {{url: '{quiz_url}', name: quiz}}}}",
        "oral_url": f"{{server: resources.openreward, isolation: none, options: {{url: '{quiz_url}', name: oral}}}}",
        "repair_url": f"{{server: resources.openreward, isolation: none, options: {{url: '{repair_url}'}}}}",
    }
    lines = ["nats: embedded", "models:", "  policy: {adapter: scripted}", "resources:"]
    lines += [f"  {k}: {v}" for k, v in resources.items()]
    lines += ["agents:"] + [f"  {k}: {agent.format(r=k)}" for k in resources]
    return "\n".join(lines) + "\n"


class Batch:
    def __init__(
        self,
        work: Path,
        quiz_url: str,
        repair_url: str,
        res: subprocess.CompletedProcess[str],
        took: float,
        reverified: subprocess.CompletedProcess[str],
    ) -> None:
        self.work, self.quiz_url, self.repair_url, self.res, self.took = work, quiz_url, repair_url, res, took
        self.reverified = reverified
        self.rows = read_jsonl(work / "out.jsonl")
        fails = work / "out_failures.jsonl"
        self.failures = read_jsonl(fails) if fails.exists() else []

    def of(self, case: str, agent: str) -> list[dict[str, Any]]:
        got = [r for r in self.rows if r.get("case") == case and r["agent_ref"]["name"] == agent]
        return sorted(got, key=lambda r: r["task_spec"]["id"])

    def failure(self, case: str) -> dict[str, Any]:
        (f,) = [f for f in self.failures if f["input"].get("case") == case]
        return f


@pytest.fixture(scope="module")
def batch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Batch]:
    work = tmp_path_factory.mktemp("ors")
    servers = [_start(work, "ors_quiz.py"), _start(work, "ors_repair.py")]
    try:
        for (proc, url), script in zip(servers, ("ors_quiz.py", "ors_repair.py")):
            _wait_up(work, proc, url, script)
        (quiz_url, repair_url) = (url for _, url in servers)
        (work / "config.yaml").write_text(_config(quiz_url, repair_url))
        write_jsonl(work / "rows.jsonl", _cases())
        started = time.monotonic()
        res = cli(
            "run", "config.yaml", "-i", "rows.jsonl", "-o", "out.jsonl", "-q", timeout=900, cwd=work, env=_env(work)
        )
        assert (work / "out.jsonl").exists(), res.stderr[-3000:]
        took = time.monotonic() - started
        # reverify serves one agent's resource: the multi-step environment's rows (in process)
        write_jsonl(
            work / "repair.jsonl", [r for r in read_jsonl(work / "out.jsonl") if r["agent_ref"]["name"] == "repair"]
        )
        reverify = ["reverify", "config.yaml", "-i", "repair.jsonl", "--agent", "repair", "-o", "reverified.jsonl"]
        again = cli(*reverify, timeout=900, cwd=work, env=_env(work))
        yield Batch(work, quiz_url, repair_url, res, took, again)
    finally:
        for proc, _ in servers:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def _calls(row: dict[str, Any]) -> list[tuple[str, dict[str, Any], str]]:
    """The row's tool calls in order, each with the output the model read."""
    outputs = {i["call_id"]: i["output"] for i in row["response"]["output"] if i["type"] == "function_call_output"}
    return [
        (i["name"], json.loads(i["arguments"] or "{}"), outputs[i["call_id"]])
        for i in row["response"]["output"]
        if i["type"] == "function_call"
    ]


def _answer(row: dict[str, Any]) -> str:
    texts = [i for i in row["response"]["output"] if i["type"] == "message"]
    content = texts[-1]["content"] if texts else ""
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)


async def _own_client(url: str, name: str, row: dict[str, Any], terminal: bool) -> dict[str, Any]:
    """The SDK's own client drives the SDK's own server with the row's actions: its per-step rewards, the
    outputs (or refusals) it reads, and the episode's reward."""
    from openreward.api.environments.client import AsyncEnvironmentsAPI
    from openreward.api.environments.types import Task
    from openreward.api.errors import ToolCallError

    api = AsyncEnvironmentsAPI(base_url=url, api_key=None)  # type: ignore[arg-type]
    try:
        task = Task(server_name=name, environment_name=name, task_spec=row["task_spec"], namespace=None)
        async with api.get(name).session(task=task) as session:
            rewards, outputs = [], []
            for tool, args, _ in _calls(row):
                try:
                    out = await session.call_tool(tool, args)
                except ToolCallError as e:
                    outputs.append(f"Error: {e.detail}")
                    continue
                rewards.append(out.reward)
                outputs.append("\n".join(b.text for b in out.blocks))
            if terminal:
                rewards.append((await session.call_terminal_tool(_answer(row))).reward)
        return {"step_rewards": rewards, "outputs": outputs, "reward": sum(r for r in rewards if r is not None)}
    finally:
        await api.aclose()


@pytest.mark.slow
@pytest.mark.parametrize("where", ["", "_url"])
def test_rewards_equal_the_sdks_own_client(batch: Batch, where: str) -> None:
    """Single-step (quiz), multi-step with a reward per step (repair) and a @terminal answer (oral): each row's
    step rewards, the outputs the model read and the episode's reward equal what the SDK's own client gets
    driving the SDK's own server with the same actions, in process and through the server alike."""
    expected = {"quiz": [1.0, 0.0, 1.0], "repair": [1.3, -0.05, 1.8], "terminal": [1.0, 0.0]}
    for case, agent, url, name in [
        ("quiz", "quiz", batch.quiz_url, "quiz"),
        ("repair", "repair", batch.repair_url, "repair"),
        ("terminal", "oral", batch.quiz_url, "oral"),
    ]:
        rows = batch.of(case, agent + where)
        assert len(rows) == len(expected[case]), (case, batch.res.stderr[-3000:], batch.failures)
        for row in rows:
            own = anyio.run(_own_client, url, name, row, case == "terminal")
            assert row["step_rewards"] == own["step_rewards"], (case, row["task_spec"])
            assert [out for _, _, out in _calls(row)] == own["outputs"]
            assert row["reward"] == own["reward"]
        assert [r["reward"] for r in rows] == pytest.approx(expected[case]), case
    repair = batch.of("repair", "repair" + where)
    assert [s["tool"] for s in repair[0]["ors_steps"]] == ["fix", "inspect", "submit"]
    assert len(repair[0]["step_rewards"]) == 3 and all(r["finished"] for r in repair)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["", "_url"])
def test_unknown_tool_and_calls_after_finished_are_answered_as_the_sdk_answers(batch: Batch, where: str) -> None:
    """A tool the environment does not have is answered with the SDK server's own refusal (the model reads it,
    the episode goes on); ``finished`` ends the episode: the turn's later call is refused as the SDK refuses it,
    and the agent makes no further model call."""
    (row,) = batch.of("unknown_tool", "quiz" + where)
    (peek, answer) = _calls(row)
    own = anyio.run(_own_client, batch.quiz_url, "quiz", row, False)
    assert peek[0] == "peek" and peek[2] == "Error: 'peek' is not a valid tool" == own["outputs"][0]
    assert answer[2] == "Correct!" and row["reward"] == 1.0 and row["step_rewards"] == [1.0]

    (row,) = batch.of("after_finished", "repair" + where)
    calls = _calls(row)
    assert [c[0] for c in calls] == ["fix", "submit", "inspect"]
    own = anyio.run(_own_client, batch.repair_url, "repair", row, False)
    assert calls[2][2] == own["outputs"][2] and "the episode has finished" in calls[2][2]
    assert row["step_rewards"] == own["step_rewards"] == [0.25, 1.0] and row["finished"] is True
    assert row["response"]["output"][-1]["type"] == "function_call_output"  # no model turn after the episode ended


@pytest.mark.slow
def test_failures_map_to_the_projects_classes(batch: Batch) -> None:
    """A tool that raises and one that hangs past tool_timeout_s are tool_error rows (the SDK's client marks the
    session dead on the first); the other rows are unaffected, and the batch exits 1 (it has failure rows)."""
    raised = batch.failure("raises")
    assert raised["error_class"] == "tool_error" and "grader exploded" in raised["error"]
    hung = batch.failure("hangs")
    assert hung["error_class"] == "tool_error" and "tool_timeout_s=5" in hung["error"]
    assert len(batch.failures) == 2 and len(batch.rows) == 2 * 10, batch.res.stderr[-3000:]
    assert batch.res.returncode == 1, batch.res.stderr[-3000:]


@pytest.mark.slow
def test_prepare_writes_the_environments_own_tasks_and_validate_wants_a_task_spec(tmp_path: Path) -> None:
    """``prepare -i AGENT=env:SPLIT`` writes the environment's tasks as rows (prompt, the tools a session of
    the task lists, the task spec), as the SDK's server serves them; a row without a task spec is one line,
    exit 2, before any rollout."""
    (tmp_path / "config.yaml").write_text(
        "models:\n  policy: {adapter: scripted}\n"
        "resources:\n  repair: {server: resources.openreward, options: {env: 'ors_repair:Repair'}}\n"
        "agents:\n  fixer: {agent: agents.simple, model: policy, resource: repair}\n"
    )
    env = _env(tmp_path)
    prepare = ["prepare", "config.yaml", "-i", "fixer=env:train", "-o", "data", "--val-fraction", "0"]
    res = cli(*prepare, timeout=300, cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    got = sorted(read_jsonl(tmp_path / "data" / "train.jsonl"), key=lambda r: r["task_spec"]["id"])
    want = _rows("ors_repair:Repair")
    assert [{k: r[k] for k in ("responses_create_params", "task_spec")} for r in got] == want
    assert [t["name"] for t in got[0]["responses_create_params"]["tools"]] == ["fix", "inspect", "submit"]

    write_jsonl(tmp_path / "bad.jsonl", [{"responses_create_params": {"input": "hi"}}])
    res = cli("validate", "config.yaml", "-i", "bad.jsonl", cwd=tmp_path, env=env)
    assert res.returncode == 2 and "bad.jsonl:1" in res.stderr and "task_spec" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.slow
def test_reverify_replays_the_tool_calls_and_gets_the_same_rewards(batch: Batch) -> None:
    """``gym-runtime reverify`` rebuilds each episode by running its recorded tool calls through a fresh
    session (``reverify = "replay"``): every reward and step reward comes out the same."""
    assert batch.reverified.returncode == 0, batch.reverified.stderr[-3000:]
    again = read_jsonl(batch.work / "reverified.jsonl")
    assert len(again) == 4  # three tasks, and the one whose last call came after finished
    before = {(r["case"], r["task_spec"]["id"]): r for r in batch.rows if r["agent_ref"]["name"] == "repair"}
    for r in again:
        old = before[(r["case"], r["task_spec"]["id"])]
        assert (r["reward"], r["step_rewards"]) == (old["reward"], old["step_rewards"])
        assert r["step_rewards"] and r["finished"] is True
    assert "0 rewards changed" in batch.reverified.stdout + batch.reverified.stderr


@pytest.mark.slow
def test_the_sdks_own_template_runs_unchanged(tmp_path: Path) -> None:
    """The environment `orwd init` writes (the SDK's basic template, copied as it ships: code not written for
    these tests) is prepared from its own tasks and run; its rewards equal its own client's on its own server."""
    import openreward

    template = Path(openreward.__file__).parent / "templates" / "basic" / "server.py.tmpl"
    (tmp_path / "basic_env.py").write_bytes(template.read_bytes())
    (tmp_path / "config.yaml").write_text(
        "nats: embedded\nmodels:\n  policy: {adapter: scripted}\n"
        "resources:\n  basic: {server: resources.openreward, options: {env: 'basic_env:BasicEnvironment'}}\n"
        "agents:\n  solver: {agent: agents.simple, model: policy, resource: basic, max_steps: 4, max_attempts: 1}\n"
    )
    env = {**_env(tmp_path), "PYTHONPATH": str(tmp_path)}
    for split in ("train", "test"):
        prepare = ["prepare", "config.yaml", "-i", f"solver=env:{split}", "-o", split, "--val-fraction", "0"]
        res = cli(*prepare, timeout=600, cwd=tmp_path, env=env)
        assert res.returncode == 0, res.stderr[-2000:]
    write_jsonl(
        tmp_path / "rows.jsonl",
        [*read_jsonl(tmp_path / "train/train.jsonl"), *read_jsonl(tmp_path / "test/train.jsonl")],
    )
    res = cli("run", "config.yaml", "-i", "rows.jsonl", "-o", "out.jsonl", "-q", timeout=900, cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "tool_call" not in res.stdout + res.stderr, res.stdout  # the SDK's line per tool call is not shown
    rows = sorted(read_jsonl(tmp_path / "out.jsonl"), key=lambda r: r["task_spec"]["id"])
    assert [r["task_spec"]["id"] for r in rows] == ["test-0", "train-0"]
    assert [r["responses_create_params"]["input"] for r in rows] == ["What is 2*4?", "What is 2+2?"]

    port = _free_port()
    log = (tmp_path / "server.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-c", f"import basic_env as m; m.Server([m.BasicEnvironment]).run('127.0.0.1', {port})"],
        cwd=tmp_path, env=env, stdout=log, stderr=log,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_up(tmp_path, proc, url, "server")
        for row in rows:
            own = anyio.run(_own_client, url, "basicenvironment", row, False)
            assert row["step_rewards"] == own["step_rewards"] and row["reward"] == own["reward"]
            assert (
                [out for _, _, out in _calls(row)] == own["outputs"] == ["Wrong!"]
            )  # the scripted model says "example"
            assert row["finished"] is True
    finally:
        proc.terminate()
        proc.wait(timeout=30)
