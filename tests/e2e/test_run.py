"""`gym-runtime run` end to end: real nats-server, real workers, real files.

The only test double is the LLM: the `scripted` policy or `replay` of NeMo Gym's
recorded model outputs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gym_runtime.config import load_config, resolve_config
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.service.runner import make_workers, run_batch, selected, start_workers
from gym_runtime.transport.bus import Bus
from tests.helpers import COMPAT, REPO, as_from_a_terminal, cli, nats_server_pids, prompt_key, read_jsonl, write_jsonl
from tests.stub_openai import StubOpenAI, StubReply, responses_reply

ENVS = {
    "weather": "example_single_tool_call",
    "counter": "example_session_state_mgmt",
    "multi_step": "example_multi_step",
}


def test_cli_run_weather_writes_nemo_gym_rows(tmp_path: Path) -> None:
    """The README's main command: 5 rows, reward 1.0, NeMo Gym's row shape, no server left."""
    out = tmp_path / "out.jsonl"
    res = cli(
        "run",
        "resources/weather/config.yaml",
        "-i",
        "resources/weather/data/example.jsonl",
        "-o",
        str(out),
        env={"TMPDIR": str(tmp_path)},
    )
    assert res.returncode == 0, res.stderr
    rows = read_jsonl(out)
    inputs = read_jsonl(REPO / "resources/weather/data/example.jsonl")
    assert len(rows) == 5
    for i, (row, src) in enumerate(zip(rows, inputs, strict=True)):
        assert row["reward"] == 1.0
        assert row["_ng_task_index"] == i and row["_ng_rollout_index"] == 0
        assert row["agent_ref"] == {"type": "responses_api_agents", "name": "weather_agent"}
        assert row["responses_create_params"] == src["responses_create_params"]
        resp = row["response"]
        assert resp["object"] == "response" and resp["status"] == "completed"
        types = [item["type"] for item in resp["output"]]
        assert types == ["function_call", "function_call_output", "message"]
        call, result = resp["output"][0], resp["output"][1]
        assert call["name"] == "get_weather" and result["call_id"] == call["call_id"]
        assert json.loads(result["output"])["city"] == json.loads(call["arguments"])["city"]
        assert resp["usage"]["total_tokens"] > 0
    assert "mean reward: 1.0000" in res.stdout
    metrics = json.loads((tmp_path / "out_aggregate_metrics.json").read_text())
    assert metrics, "aggregate metrics sidecar is empty"
    assert not (tmp_path / "out_failures.jsonl").exists()
    assert not nats_server_pids(tmp_path), "an embedded nats-server outlived the command"


@pytest.mark.parametrize("env", ["counter", "multi_step"])
async def test_run_scripted_on_each_environment(env: str, nats_server, tmp_path: Path) -> None:
    cfg = load_config(REPO / f"resources/{env}/config.yaml")
    data = REPO / f"resources/{env}/data/example.jsonl"
    out = tmp_path / "out.jsonl"
    result = await run_batch(
        resolve_config(cfg), nats_server.url, input_path=data, out=out, telemetry=Telemetry(), repeats=2
    )
    rows = read_jsonl(out)
    n = len(read_jsonl(data))
    assert result.stats.failures == 0 and len(rows) == 2 * n
    assert [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in rows] == [(t, k) for t in range(n) for k in range(2)]
    for r in rows:
        assert isinstance(r["reward"], float)
        assert any(i["type"] == "function_call_output" for i in r["response"]["output"])


@pytest.mark.parametrize("env", list(ENVS))
async def test_replay_reproduces_recorded_rewards(env: str, nats_server, tmp_path: Path) -> None:
    """NeMo Gym's recorded model outputs, replayed through our agent and resources, give its rewards."""
    compat = COMPAT / ENVS[env]
    if not compat.is_dir():
        raise FileNotFoundError(f"compat data not found at {compat} (it ships in tests/compat)")
    cfg = load_config(
        REPO / f"resources/{env}/config.yaml",
        ["models.policy.adapter=replay", f"models.policy.rollouts={compat / 'example_rollouts.jsonl'}"],
    )
    out = tmp_path / "out.jsonl"
    result = await run_batch(
        resolve_config(cfg), nats_server.url, input_path=compat / "example.jsonl", out=out, telemetry=Telemetry()
    )
    assert result.stats.failures == 0
    recorded = {
        prompt_key(r["responses_create_params"]["input"]): r for r in read_jsonl(compat / "example_rollouts.jsonl")
    }
    tasks = {prompt_key(r["responses_create_params"]["input"]): r for r in read_jsonl(compat / "example.jsonl")}
    rows = read_jsonl(out)
    assert len(rows) == len(recorded)
    for row in rows:
        rec = recorded[prompt_key(row["responses_create_params"]["input"])]
        assert row["reward"] == rec["reward"]
        # NeMo Gym's keys, plus its collector's (the indices and agent_ref, absent from these recordings) and
        # gym-runtime's two documented additions, ``cost`` and ``provenance`` (docs/rows.md)
        # (and the task row's fields, which older recordings lack)
        added = {"_ng_task_index", "_ng_rollout_index", "agent_ref", "cost", "provenance"}
        task = tasks[prompt_key(row["responses_create_params"]["input"])]
        assert set(rec) <= set(row) and set(row) - set(rec) - set(task) == added, set(row) ^ set(rec)
        for k, v in rec.items():
            if k not in ("response", "responses_create_params"):
                assert row[k] == v, k
        # the trajectory is the recorded one, item for item (tool outputs come from our resource)
        ours = [(i["type"], i.get("name"), i.get("arguments")) for i in row["response"]["output"]]
        theirs = [(i["type"], i.get("name"), i.get("arguments")) for i in rec["response"]["output"]]
        assert ours == theirs


async def test_two_counter_replicas_keep_each_session_state(nats_server, tmp_path: Path) -> None:
    cfg = load_config(REPO / "resources/counter/config.yaml", ["resources.counter.replicas=2"])
    telemetry = Telemetry()
    bus = await Bus.connect(nats_server.url, namespace=cfg.namespace, telemetry=telemetry, name="test")
    import anyio

    data = REPO / "resources/counter/data/example.jsonl"
    out = tmp_path / "out.jsonl"
    async with anyio.create_task_group() as tg:
        workers = make_workers(bus, resolve_config(cfg), selected(cfg, ["resources"]))
        assert len(workers) == 2
        await start_workers(tg, workers)
        cfg_no_res = load_config(REPO / "resources/counter/config.yaml")
        cfg_no_res.resources["counter"].replicas = 0
        result = await run_batch(
            resolve_config(cfg_no_res), nats_server.url, input_path=data, out=out, telemetry=telemetry, repeats=8
        )
        seeded = [w.seeded for w in workers]
        tg.cancel_scope.cancel()
    await bus.close()
    assert result.stats.failures == 0
    assert all(s > 0 for s in seeded) and sum(seeded) == 8 * len(read_jsonl(data)), seeded
    for row in read_jsonl(out):
        outputs = {i["call_id"]: i["output"] for i in row["response"]["output"] if i["type"] == "function_call_output"}
        calls = [i for i in row["response"]["output"] if i["type"] == "function_call"]
        increments = sum(json.loads(c["arguments"])["count"] for c in calls if c["name"] == "increment_counter")
        got = [json.loads(outputs[c["call_id"]])["count"] for c in calls if c["name"] == "get_counter_value"]
        assert got == [row["initial_count"] + increments]


def test_malformed_input_names_file_and_line_and_publishes_nothing(tmp_path: Path) -> None:
    good = read_jsonl(REPO / "resources/weather/data/example.jsonl")
    bad = write_jsonl(
        tmp_path / "bad.jsonl", [good[0], good[1], '{"responses_create_params": {', good[2], {"expected": 1}]
    )
    out = tmp_path / "out.jsonl"
    res = cli("run", "resources/weather/config.yaml", "-i", str(bad), "-o", str(out))
    assert res.returncode == 2
    assert f"{bad}:3: not valid JSON" in res.stderr
    assert f"{bad}:5: missing required field 'responses_create_params'" in res.stderr
    assert not out.exists() and not Path(str(out) + ".partial").exists()


def replayed_weather_rollout(tmp_path: Path, output: list[dict[str, Any]]) -> dict[str, Any]:
    """weather's first example row run with the replay model answering ``output`` (one recorded response)."""
    task = read_jsonl(REPO / "resources/weather/data/example.jsonl")[0]
    recording = {
        "responses_create_params": task["responses_create_params"],
        "response": {"id": "resp_1", "created_at": 0.0, "model": "recorded", "object": "response", "output": output},
    }
    rec = write_jsonl(tmp_path / "recorded.jsonl", [recording])
    inp = write_jsonl(tmp_path / "in.jsonl", [task])
    out = tmp_path / "out.jsonl"
    res = cli(
        "run",
        "resources/weather/config.yaml",
        "-i",
        str(inp),
        "-o",
        str(out),
        "--set",
        "models.policy.adapter=replay",
        "--set",
        f"models.policy.rollouts={rec}",
    )
    assert res.returncode == 0, res.stderr
    rows = read_jsonl(out)
    assert len(rows) == 1
    return rows[0]


def test_invalid_tool_arguments_are_fed_back_to_the_model(tmp_path: Path) -> None:
    """A model that emits broken tool-call JSON sees the error and answers; the rollout completes."""
    row = replayed_weather_rollout(
        tmp_path,
        [
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": '},
            {"type": "function_call_output", "call_id": "c1", "output": "recorded"},
            {"type": "function_call", "call_id": "c2", "name": "get_wether", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c2", "output": "recorded"},
            {"type": "function_call", "call_id": "c3", "name": "get_weather", "arguments": '{"town": "sf"}'},
            {"type": "function_call_output", "call_id": "c3", "output": "recorded"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "sorry"}]},
        ],
    )
    outputs = [i["output"] for i in row["response"]["output"] if i["type"] == "function_call_output"]
    assert "not valid JSON" in outputs[0]
    assert "unknown tool 'get_wether'" in outputs[1] and "get_weather" in outputs[1]
    # weather follows NeMo Gym's (pydantic) argument semantics: the unknown key is ignored, the missing one named
    assert "city" in outputs[2] and "Field required" in outputs[2]


def test_a_reasoning_only_answer_ends_the_rollout_as_in_nemo_gyms_simple_agent(tmp_path: Path) -> None:
    """NeMo Gym's simple_agent stops at a model output without tool calls, even one with no message (a turn
    cut to its reasoning: equivalence_rule's recorded rollout 2): the rollout is verified as it stands. Asking
    the model again ran past the recording (replay: 'the conversation diverged', a failure row)."""
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Which city?"}]}
    row = replayed_weather_rollout(tmp_path, [reasoning])
    assert [i["type"] for i in row["response"]["output"]] == ["reasoning"]
    assert isinstance(row["reward"], float)  # verified as it stands
    assert not (tmp_path / "out_failures.jsonl").exists()


def test_trace_file_links_one_rollout_across_workers(tmp_path: Path) -> None:
    out, traces = tmp_path / "out.jsonl", tmp_path / "spans.jsonl"
    res = cli(
        "run",
        "resources/weather/config.yaml",
        "-i",
        "resources/weather/data/example.jsonl",
        "-o",
        str(out),
        "--limit",
        "1",
        "--trace-file",
        str(traces),
    )
    assert res.returncode == 0, res.stderr
    spans = read_jsonl(traces)
    rollout = [s for s in spans if s["name"] == "rollout"]
    assert len(rollout) == 1
    trace_id = rollout[0]["trace_id"]
    in_trace = [s for s in spans if s["trace_id"] == trace_id]
    names = {s["name"] for s in in_trace}
    assert any(n.startswith("generate") or n.startswith("publish gym.model") for n in names), names
    # the model's side of the call: direct (a free slot) or pulled from the queue
    assert any(n.startswith(("process gym.call.model.policy", "process gym.model.policy")) for n in names), names
    assert any(n.startswith("tool get_weather") for n in names), names
    assert any(n.startswith("verify") for n in names), names
    assert any(n.startswith("process gym.res.weather") for n in names), names
    by_id = {s["span_id"]: s for s in in_trace}
    # every span but the publisher's root has its parent in the same trace
    roots = [s for s in in_trace if s["parent_span_id"] not in by_id]
    assert len(roots) == 1 and roots[0]["kind"] in ("PRODUCER", "INTERNAL"), roots
    reward_attr = rollout[0]["attributes"].get("gym.reward")
    assert reward_attr == 1.0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_no_nats_server_outlives_an_interrupted_run(sig: int, tmp_path: Path) -> None:
    import os

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gym_runtime.cli",
            "run",
            "resources/weather/config.yaml",
            "-i",
            "resources/weather/data/example.jsonl",
            "-o",
            str(tmp_path / "out.jsonl"),
            "--set",
            "models.policy.delay_s=30",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "TMPDIR": str(tmp_path)},
        preexec_fn=as_from_a_terminal,
    )
    deadline = time.monotonic() + 20
    while not nats_server_pids(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.05)
    started = nats_server_pids(tmp_path)
    assert started, "the run did not start an embedded nats-server"
    time.sleep(0.5)
    proc.send_signal(sig)
    proc.wait(timeout=20)
    deadline = time.monotonic() + 10
    while nats_server_pids(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not nats_server_pids(tmp_path)
    if sig == signal.SIGINT:
        assert proc.returncode == 130


async def test_twenty_megabyte_payloads_round_trip(nats_server, tmp_path: Path) -> None:
    """Tool output, model request/response and result row all exceed the 8 MB max payload."""
    cfg = load_config(REPO / "resources/weather/config.yaml", ["resources.weather.server=tests.envs.big"])
    out = tmp_path / "out.jsonl"
    result = await run_batch(
        resolve_config(cfg),
        nats_server.url,
        input_path=REPO / "resources/weather/data/example.jsonl",
        out=out,
        telemetry=Telemetry(),
        limit=1,
    )
    assert result.stats.failures == 0
    row = read_jsonl(out)[0]
    assert row["reward"] == 1.0
    tool_output = next(i["output"] for i in row["response"]["output"] if i["type"] == "function_call_output")
    assert len(tool_output) >= 20 * 1024 * 1024 - 64
    assert out.stat().st_size > 40 * 1024 * 1024


def test_logs_are_json_with_task_rollout_and_trace_ids(tmp_path: Path) -> None:
    rows = read_jsonl(REPO / "resources/weather/data/example.jsonl")[:2]
    rows[1]["explode"] = True  # tests.envs.flaky's verifier raises on this row
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    res = cli(
        "run",
        "resources/weather/config.yaml",
        "-i",
        str(inp),
        "-o",
        str(tmp_path / "out.jsonl"),
        "--set",
        "resources.weather.server=tests.envs.flaky",
        "--set",
        "agents.weather_agent.max_attempts=1",
        "--log-level",
        "info",
    )
    assert res.returncode == 1  # one failure row
    events = [json.loads(line) for line in res.stderr.splitlines() if line.startswith("{")]
    failed = [e for e in events if e.get("event") == "rollout.failed"]
    assert len(failed) == 1
    e = failed[0]
    assert e["task_index"] == 1 and e["rollout_index"] == 0 and e["error_class"] == "verify_error"
    assert len(e["trace_id"]) == 32 and int(e["trace_id"], 16) != 0
    assert e["level"] == "warning" and "timestamp" in e
    # ids are scoped to their message: the readiness lines carry none
    assert all("task_index" not in x for x in events if x.get("event", "").endswith(".ready"))


@pytest.mark.parametrize("command", [["status"], ["collect", "--batch", "b", "-o", "x.jsonl"]])
def test_unreachable_nats_url_fails_clearly(command: list[str], tmp_path: Path) -> None:
    from gym_runtime.ops.nats_server import free_port

    url = f"nats://127.0.0.1:{free_port()}"
    res = cli(*command, "--nats", url, env={"GYM_CONNECT_TIMEOUT_S": "1"}, timeout=30)
    assert res.returncode == 2
    assert f"cannot reach a NATS server at {url}" in res.stderr


def _processes_with(marker: str) -> list[str]:
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if marker in cmd and "pytest" not in cmd:
            found.append(cmd)
    return found


def test_auto_spreads_a_batch_of_2000_or_more_over_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--processes auto` on 2 cores: one process below 2,000 rollouts, one per core from 2,000, whether the
    policy is the in-process scripted model or called over HTTP (measured: docs/benchmarks.md, Process modes);
    one process on a single core."""
    from gym_runtime.cli.run import worker_groups

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    scripted = resolve_config(load_config([REPO / "resources/weather/config.yaml"]))
    http = resolve_config(
        load_config(
            [REPO / "resources/weather/config.yaml"],
            ["models.policy.adapter=openai", "models.policy.base_url=http://127.0.0.1:9/v1"],
        )
    )
    auto = argparse.Namespace(processes="auto")
    for cfg in (scripted, http):
        assert [worker_groups(auto, cfg, n) for n in (100, 1999)] == [None, None]
        assert worker_groups(auto, cfg, 2000) == [[], []] and worker_groups(auto, cfg, 100_000) == [[], []]
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    assert worker_groups(auto, scripted, 100_000) is None


def test_worker_processes_write_the_same_rows_and_leave_nothing_running(tmp_path: Path) -> None:
    """`run --processes per-role` (one child per role) and `--processes 2` (two
    processes that each serve every role): the same rows as one process, and no worker outlives the command."""
    config = tmp_path / "weather.yaml"
    config.write_text((REPO / "resources/weather/config.yaml").read_text())
    got = {}
    for mode in ("one", "per-role", "2"):
        out = tmp_path / f"{mode}.jsonl"
        res = cli(
            "run",
            str(config),
            "-i",
            "resources/weather/data/example.jsonl",
            "-o",
            str(out),
            "--processes",
            mode,
            "--repeats",
            "3",
            env={"TMPDIR": str(tmp_path)},
        )
        assert res.returncode == 0, res.stderr
        got[mode] = [
            (
                r["_ng_task_index"],
                r["_ng_rollout_index"],
                r["reward"],
                [item["type"] for item in r["response"]["output"]],
            )
            for r in read_jsonl(out)
        ]
    assert len(got["one"]) == 15 and got["per-role"] == got["one"] and got["2"] == got["one"]
    assert not _processes_with(str(config)), "a worker process outlived the command"
    assert not nats_server_pids(tmp_path)


def test_worker_processes_against_a_dead_server_are_one_line_and_exit_2(tmp_path: Path) -> None:
    """`run --processes 2 --nats URL` with nothing there: the one-line error of any one-shot command, not
    children left waiting for the server until a readiness timeout and an internal error."""
    from gym_runtime.ops.nats_server import free_port

    url = f"nats://127.0.0.1:{free_port()}"
    config = tmp_path / "weather.yaml"
    config.write_text((REPO / "resources/weather/config.yaml").read_text())
    t0 = time.monotonic()
    res = cli(
        "run",
        str(config),
        "-i",
        "resources/weather/data/example.jsonl",
        "-o",
        str(tmp_path / "out.jsonl"),
        "--processes",
        "2",
        "--nats",
        url,
        timeout=60,
    )
    assert res.returncode == 2, res.stderr[-2000:]
    port = url.rsplit(":", 1)[1]
    assert res.stderr.strip().splitlines() == [  # what is tried, at once; then the one error line
        f"gym-runtime: no NATS server answers at {url} yet (connection refused, no server listens on "
        f"127.0.0.1:{port}); trying again for up to 10s (GYM_CONNECT_TIMEOUT_S)",
        f"gym-runtime: error: cannot reach a NATS server at {url}: connection refused, no server listens on "
        f"127.0.0.1:{port} (waited 10s); start one (`gym-runtime server`), or give --nats the URL of a running one",
    ]
    assert time.monotonic() - t0 < 30
    assert not (tmp_path / "out.jsonl").exists() and not _processes_with(str(config))


def test_a_worker_process_that_cannot_start_is_one_line_and_exit_2(tmp_path: Path) -> None:
    res = cli(
        "run",
        "weather",
        "-o",
        str(tmp_path / "out.jsonl"),
        "--processes",
        "per-role",
        "--set",
        "models.policy.adapter=openai",
        env={"OPENAI_API_KEY": "", "TMPDIR": str(tmp_path)},
    )
    assert res.returncode == 2, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "no API key" in lines[0] and "Traceback" not in res.stderr, res.stderr
    assert not (tmp_path / "out.jsonl").exists()
    assert not nats_server_pids(tmp_path)


# CPU seconds a worker child spends from its start to "ready" (its own, so the machine's load does not move it as it
# moves wall time: 0.17-0.35 s wall at load 8-10 but 1.6 s at load 33). Forked children: 0.08-0.10 CPU-s; a fresh
# interpreter importing the stack again: 0.79-0.94 CPU-s for the imports alone, on this 2-core machine. The bound
# fails the latter.
FORKED_READY_BOUND_CPU_S = 0.5


def test_default_worker_children_are_forked_ready_fast_and_write_the_same_rows(tmp_path: Path) -> None:
    """`run`'s worker children are forks of the command (the stack already imported): each says it is ready
    having spent under FORKED_READY_BOUND_CPU_S of CPU, the rows are those of one process, and none outlives the
    command."""
    config = tmp_path / "weather.yaml"
    config.write_text((REPO / "resources/weather/config.yaml").read_text())
    got = {}
    for mode in ("one", "per-role"):
        out = tmp_path / f"{mode}.jsonl"
        res = cli(
            "run",
            str(config),
            "-i",
            "resources/weather/data/example.jsonl",
            "-o",
            str(out),
            "--processes",
            mode,
            "--repeats",
            "2",
            "--log-level",
            "info",
            env={"TMPDIR": str(tmp_path)},
        )
        assert res.returncode == 0, res.stderr[-2000:]
        got[mode] = sorted(
            (r["_ng_task_index"], r["_ng_rollout_index"], r["reward"], [i["type"] for i in r["response"]["output"]])
            for r in read_jsonl(out)
        )
        if mode == "per-role":
            ready = [e for e in map(_json_or_none, res.stderr.splitlines()) if e and e.get("event") == "worker.ready"]
            assert sorted(e["worker"] for e in ready) == ["agents", "models", "resources"], res.stderr[-2000:]
            assert all(e["forked"] for e in ready), ready
            assert max(e["cpu_s"] for e in ready) < FORKED_READY_BOUND_CPU_S, ready
    assert len(got["one"]) == 10 and got["per-role"] == got["one"]
    assert not _processes_with(str(config)), "a worker process outlived the command"
    assert not nats_server_pids(tmp_path)


def _json_or_none(line: str) -> dict | None:
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def test_a_forked_worker_child_killed_mid_batch_is_started_again_and_the_batch_completes(tmp_path: Path) -> None:
    """SIGKILL one of `run --processes 2`'s forked children while results arrive: it is started again (as a
    fresh interpreter: the command now runs an event loop, so it does not fork), its work is redelivered,
    and every rollout is in the file once."""
    import psutil

    out = tmp_path / "o.jsonl"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gym_runtime.cli",
            "run",
            "weather",
            "-o",
            str(out),
            "--repeats",
            "600",
            "--processes",
            "2",
            "--quiet",
            "--log-level",
            "info",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**__import__("os").environ, "TMPDIR": str(tmp_path)},
    )
    spool = Path(f"{out}.partial")
    deadline = time.monotonic() + 120
    while not (spool.exists() and spool.stat().st_size > 20_000):
        assert time.monotonic() < deadline and proc.poll() is None, "no results spooled"
        time.sleep(0.01)
    workers = [c for c in psutil.Process(proc.pid).children() if "nats-server" not in c.name()]
    assert len(workers) == 2, workers
    workers[0].kill()
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-2000:]
    rows = read_jsonl(out)
    assert len(rows) == 3000 and len({(r["_ng_task_index"], r["_ng_rollout_index"]) for r in rows}) == 3000
    events = [e for e in map(_json_or_none, err.splitlines()) if e]
    assert any(e.get("event") == "worker.died" for e in events), err[-2000:]
    assert [e["forked"] for e in events if e.get("event") == "worker.ready"] == [True, True]


def _weather_run_in_a_fresh_python(tmp_path: Path, out: Path, more_args: str, after: str) -> dict[str, Any]:
    """``main(['run', weather, ..., more_args])`` (``--processes one``) in a fresh interpreter, then the code
    ``after``, which sets ``report``: the exit code with ``report``, as the JSON the interpreter printed."""
    script = (
        "import gc, sys, json\n"
        "from gym_runtime.cli import main\n"
        "code = main(['run', 'resources/weather/config.yaml', '-i', 'resources/weather/data/example.jsonl',\n"
        f"             '-o', {str(out)!r}, '--processes', 'one', {more_args}])\n"
        f"{after}"
        "print(json.dumps({'code': code, **report}))\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert res.returncode == 0, res.stderr[-2000:]
    return dict(json.loads(res.stdout.strip().splitlines()[-1]))


def test_run_start_up_imports_only_what_the_run_uses_and_tunes_the_collector_first(tmp_path: Path) -> None:
    """A `run` of weather with the `openai` adapter on a self-hosted base URL and no metrics endpoint never
    imports the `openai` package (with pydantic's models of the whole OpenAI API, ~half of start-up's
    imports) nor the metrics or tracing SDKs (nothing records), and the cycle collector is tuned before the
    stack is imported (at CPython's default it made ~150 passes over start-up's growing heap)."""
    out = tmp_path / "out.jsonl"
    with StubOpenAI(handler=lambda req: StubReply(body=responses_reply())) as stub:
        got = _weather_run_in_a_fresh_python(
            tmp_path,
            out,
            f"'--set', 'models.policy.adapter=openai', '--set', 'models.policy.base_url={stub.base_url}', "
            "'--set', 'models.policy.model=m'",
            "heavy = ('openai', 'opentelemetry.sdk.metrics', 'opentelemetry.sdk.trace', 'psutil')\n"
            "loaded = [m for m in heavy if m in sys.modules]\n"
            "report = {'loaded': loaded, 'passes': sum(s['collections'] for s in gc.get_stats())}\n",
        )
        assert len([r for r in stub.requests if r.path.endswith("/responses")]) == 5  # every rollout called it
    assert got["code"] == 0 and len(read_jsonl(out)) == 5
    assert got["loaded"] == [], got
    bare = subprocess.run(  # the interpreter's own start-up (site, the editable install's finder)
        [sys.executable, "-c", "import gc; print(sum(s['collections'] for s in gc.get_stats()))"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    # the whole command on top of a bare interpreter: a handful of passes, not one per 700 allocations
    assert got["passes"] - int(bare.stdout) < 15, (got, bare.stdout)


def test_run_freezes_start_up_and_still_collects_the_cycles_made_after_it(tmp_path: Path) -> None:
    """`run` takes start-up's objects out of the cycle collector's passes (gc.freeze, once everything is
    imported): the rows are right, the frozen count is start-up's size, and a reference cycle made after
    start-up is still found and freed by the collector (a frozen heap must not turn cycles into leaks)."""
    out = tmp_path / "out.jsonl"
    got = _weather_run_in_a_fresh_python(
        tmp_path,
        out,
        "",
        "frozen = gc.get_freeze_count()\n"
        "class Node: pass\n"
        "a, b = Node(), Node(); a.other, b.other = b, a\n"
        "del a, b\n"
        "report = {'frozen': frozen, 'freed': gc.collect()}\n",
    )
    assert got["code"] == 0 and len(read_jsonl(out)) == 5
    assert got["frozen"] > 10_000, got  # the stack, the environment and the config: tens of thousands
    assert got["freed"] >= 2, got  # the two nodes (and their dicts) of the cycle made after start-up


def test_python_dash_m_cli_runs_an_environment_that_scores_in_worker_processes(tmp_path: Path) -> None:
    """`python -m gym_runtime.cli run` on reasoning_gym (scoring in anyio worker processes, which re-run the
    parent's main module): every row is verified, none is a verify_error (all were, BrokenWorkerProcess,
    while the CLI's __main__ ran unguarded)."""
    out = tmp_path / "out.jsonl"
    data = "resources/reasoning_gym/data/example.jsonl"
    res = cli("run", "resources/reasoning_gym/config.yaml", "-i", data, "-o", str(out), timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert len(read_jsonl(out)) == 5 and not (tmp_path / "out_failures.jsonl").exists()
