"""swe on the local backend (the project's sandbox): a tiny repository task made by the tests, end to end."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gym_runtime.agent import Session
from gym_runtime.config import load_config, resolve_config
from gym_runtime.messages import Response
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.resources.swe import SWE
from gym_runtime.service.runner import run_batch
from gym_runtime.transport.bus import Bus
from tests.helpers import REPO, cli, read_jsonl, with_late_reads

from .tiny_repo import rows_and_recordings, task

ENV_DIR = Path(__file__).resolve().parents[1]
EMPTY = Response(id="r", created_at=0.0, output=[])


@pytest.fixture(autouse=True)
async def options() -> Any:
    await SWE.setup({"command_timeout_s": 5, "eval_timeout_s": 120})
    yield
    await SWE.setup({})


async def graded(patch: str, row: dict[str, Any] | None = None) -> tuple[float, dict[str, Any]]:
    row = {**(row or task()), "model_patch": patch}
    inst = SWE()
    await inst.seed(row)
    v = await inst.verify(row, EMPTY)
    return v.reward, v.fields


@pytest.mark.parametrize(
    ("which", "reward", "f2p_ok", "p2p_ok"),
    [("patch", 1.0, True, True), ("empty", 0.0, False, True), ("breaking_patch", 0.0, True, False)],
)
async def test_gold_empty_and_breaking_patches(which: str, reward: float, f2p_ok: bool, p2p_ok: bool) -> None:
    row = task()
    r, fields = await graded("" if which == "empty" else row[which], row)
    assert r == reward and fields["resolved"] is (reward == 1.0) and fields["patch_applied"]
    assert (not fields["tests_status"]["FAIL_TO_PASS"]["failure"]) is f2p_ok
    assert (not fields["tests_status"]["PASS_TO_PASS"]["failure"]) is p2p_ok


async def test_a_patch_that_does_not_apply_scores_zero() -> None:
    r, fields = await graded("diff --git a/nope.py b/nope.py\n--- a/nope.py\n+++ b/nope.py\n@@ -1 +1 @@\n-x\n+y\n")
    assert (r, fields["patch_applied"]) == (0.0, False) and "does not apply" in fields["eval_error"]


async def test_the_sessions_diff_is_the_answer() -> None:
    row = task()
    inst = SWE()
    await inst.seed(row)
    out = await inst.call_tool("bash", json.dumps({"command": "sed -i 's/a - b/a + b/' calc.py && echo done"}))
    assert out == "<returncode>0</returncode>\n<output>\ndone\n</output>"
    v = await inst.verify(row, EMPTY)
    assert v.reward == 1.0 and "+    return a + b" in v.fields["model_patch"]
    assert inst.env is None and SWE.backend().runner.running == 0  # every sandbox is gone


async def test_each_session_has_its_own_repository() -> None:
    a, b = SWE(), SWE()
    await a.seed(task())
    await b.seed(task())
    try:
        await a.call_tool("bash", '{"command": "echo changed > calc.py"}')
        assert "def add" in await b.call_tool("bash", '{"command": "cat calc.py"}')
    finally:
        await a.close()
        await b.close()


async def test_runaway_command_is_killed_at_the_command_timeout() -> None:
    inst = SWE()
    await inst.seed(task())
    try:
        start = time.monotonic()
        out = await inst.call_tool("bash", '{"command": "echo started; while true; do :; done"}')
        assert time.monotonic() - start < 30
        assert out.startswith("<returncode>-9</returncode>\n<warning>The command was killed after 5 s")
        assert "started" in out
        # background children do not keep a command alive, and the shell still works afterwards
        out = await inst.call_tool("bash", '{"command": "sleep 600 & echo back"}')
        assert out == "<returncode>0</returncode>\n<output>\nback\n</output>"  # not killed at the timeout
    finally:
        await inst.close()


def test_output_written_just_before_a_command_ends_is_kept(tmp_path: Path) -> None:
    got = with_late_reads(
        tmp_path,
        """
        import os
        from gym_runtime.resources.swe import shell_payload as p
        print(p._run(os.getcwd(), dict(os.environ), "echo hi; exit 3", 10, 1000))
        """,
    )
    assert got == str({"returncode": 3, "output": b"hi\n", "timed_out": False, "truncated": False})


async def test_huge_output_keeps_head_and_tail() -> None:
    inst = SWE()
    await inst.seed(task())
    try:
        out = await inst.call_tool("bash", '{"command": "seq 1 100000"}')
        assert "<output_head>\n1\n2\n" in out and "left out" in out and len(out) < 11_000
    finally:
        await inst.close()


async def test_bad_rows_and_empty_commands() -> None:
    inst = SWE()
    await inst.seed({"instance_id": "x"})  # no repo_files: the local backend cannot build it
    out = await inst.call_tool("bash", '{"command": "ls"}')
    assert out.startswith("<returncode>-1</returncode>\n<error>the local backend needs the row's repo_files")
    with pytest.raises(Exception, match="the command is empty"):
        await inst.call_tool("bash", '{"command": "  "}')


async def test_sandbox_dies_with_a_killed_resource_worker(nats_server, tmp_path: Path) -> None:
    """SIGKILL the resource worker holding a session mid-command: its sandbox and the command go too."""
    import anyio
    import psutil

    worker = subprocess.Popen(  # noqa: ASYNC220 - a real worker process, killed below
        [
            sys.executable,
            "-m",
            "gym_runtime.cli",
            "start",
            "resources/swe/config.yaml",
            "--nats",
            nats_server.url,
            "--only",
            "resources.swe",
            "--replicas",
            "1",
            "--in-process",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    bus = await Bus.connect(nats_server.url, namespace="gym", telemetry=Telemetry(), name="test")
    try:
        assert worker.stdout is not None and "ready" in worker.stdout.readline()
        session = Session(bus, "swe", task())
        assert "ok" in (await session.call("bash", '{"command": "echo ok"}')).output
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: session.call("bash", '{"command": "sleep 1000"}', timeout=60))
            kids: list[Any] = []
            with anyio.fail_after(30):
                while not any(k.name() == "sleep" for k in kids):
                    await anyio.sleep(0.1)
                    kids = [k for k in psutil.Process(worker.pid).children(recursive=True) if k.is_running()]
            worker.send_signal(signal.SIGKILL)
            worker.wait(10)
            _gone, alive = await anyio.to_thread.run_sync(lambda: psutil.wait_procs(kids, timeout=15))
            assert not alive, [p.cmdline() for p in alive]
            tg.cancel_scope.cancel()
    finally:
        await bus.close()
        if worker.poll() is None:
            worker.kill()


# ------------------------------------------------------------------ end to end through the runtime


async def test_replayed_agent_runs_end_to_end(nats_server, tmp_path: Path) -> None:
    rows, rec = rows_and_recordings(tmp_path)
    cfg = load_config(
        ENV_DIR / "config.yaml",
        [
            "models.policy.adapter=replay",
            f"models.policy.rollouts={rec}",
            "resources.swe.options.command_timeout_s=15",  # generous: pytest runs inside it on a loaded machine
        ],
    )
    out = tmp_path / "out.jsonl"
    result = await run_batch(resolve_config(cfg), nats_server.url, input_path=rows, out=out, telemetry=Telemetry())
    assert result.stats.failures == 0
    fixed, looped = read_jsonl(out)
    assert (fixed["reward"], fixed["exit_status"], fixed["steps"]) == (1.0, "submitted", 3)
    outputs = [i["output"] for i in fixed["response"]["output"] if i["type"] == "function_call_output"]
    assert "1 passed" in outputs[1]  # the live pytest run (the recording says "recorded")
    assert outputs[2] == "<returncode>0</returncode>\n<output>\nCOMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n</output>"
    assert (looped["reward"], looped["exit_status"]) == (0.0, "submitted")
    assert "killed after 15 s" in looped["response"]["output"][1]["output"]


@pytest.mark.parametrize(
    ("settings", "status"),
    [(["agents.swe_agent.max_steps=1"], "step_limit"), (["agents.swe_agent.options.time_limit_s=0.001"], "time_limit")],
)
async def test_step_and_time_limits_end_the_loop_and_grade_the_diff(
    settings: list[str], status: str, nats_server, tmp_path: Path
) -> None:
    rows, rec = rows_and_recordings(tmp_path)
    cfg = load_config(
        ENV_DIR / "config.yaml", ["models.policy.adapter=replay", f"models.policy.rollouts={rec}", *settings]
    )
    out = tmp_path / "out.jsonl"
    result = await run_batch(
        resolve_config(cfg), nats_server.url, input_path=rows, out=out, telemetry=Telemetry(), limit=1
    )
    assert result.stats.failures == 0
    (row,) = read_jsonl(out)
    assert (row["exit_status"], row["steps"], row["reward"]) == (status, 1, 1.0)  # the first command fixed it


def test_run_cli_offline_on_the_bundled_example(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    res = cli("run", "resources/swe/config.yaml", "-i", "resources/swe/data/example.jsonl", "-o", str(out), timeout=300)
    assert res.returncode == 0, res.stderr
    (row,) = read_jsonl(out)
    assert row["reward"] == 0.0 and row["instance_id"] == "tiny__calc-1" and row["exit_status"] == "answered"


def test_grade_cli_grades_gold_patches(tmp_path: Path) -> None:
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "gym_runtime.resources.swe.grade",
            str(ENV_DIR / "data" / "example.jsonl"),
            "--backend",
            "local",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert "tiny__calc-1" in res.stdout and "resolved" in res.stdout and "1/1 resolved" in res.stdout


def test_grade_cli_user_mistakes_are_one_line(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "gym_runtime.resources.swe.grade", str(tmp_path / "missing.jsonl")],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_reverify_regrades_the_rows_model_patch(tmp_path: Path) -> None:
    """`gym-runtime reverify` on rollout rows: each row's model_patch is graded again in a fresh sandbox."""
    rows = []
    for patch, recorded in (("patch", 0.0), ("breaking_patch", 0.0), ("empty", 1.0)):
        row = task()
        row["model_patch"] = "" if patch == "empty" else row[patch]
        rows.append({**row, "response": {"id": f"r-{patch}", "output": []}, "reward": recorded})
    src = tmp_path / "rollouts.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    res = cli("reverify", "resources/swe/config.yaml", "-i", str(src), "-o", str(out), timeout=300)
    assert res.returncode == 0, res.stderr
    assert "3 rows re-verified, 0 failed, 2 rewards changed" in res.stdout
    assert [r["reward"] for r in read_jsonl(out)] == [1.0, 0.0, 0.0]


async def test_commands_are_confined(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The policy's commands are hostile: no network, no worker secrets, no writes outside the sandbox."""
    import socket

    monkeypatch.setenv("GYM_SWE_TEST_SECRET", "s3cr3t-value")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    escape = tmp_path / "escaped.txt"
    inst = SWE()
    await inst.seed(task())
    try:
        out = await inst.call_tool(
            "bash",
            json.dumps(
                {
                    "command": (
                        f"python -c \"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)\""
                    )
                }
            ),
        )
        assert not out.startswith("<returncode>0<") and ("Permission" in out or "unreachable" in out), out
        out = await inst.call_tool(
            "bash", '{"command": "env; cat /proc/*/environ 2>/dev/null | tr \\"\\\\0\\" \\"\\\\n\\""}'
        )
        assert "s3cr3t-value" not in out
        out = await inst.call_tool("bash", json.dumps({"command": f"echo x > {escape}; echo rc=$?"}))
        assert "rc=0" not in out and not escape.exists()
    finally:
        await inst.close()
        listener.close()
