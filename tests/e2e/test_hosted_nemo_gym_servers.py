"""Hosted NeMo Gym resources servers: their own code (nemo-gym 0.7.0) in gym-runtime resource workers.

Real parts only: the real `gym-runtime` CLI in subprocesses, a real nats-server, the
servers' environments built by ``gym-runtime env build`` on a Python >= 3.13 (cached
by content hash; CI builds them once before the tests, see .ci/run), the servers'
own recorded rollouts replayed by the replay model (the only test double).

Without a Python >= 3.13 on the machine these tests skip, unless GYM_REQUIRE_HOSTING=1
(CI) turns the skip into a failure.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gym_runtime.nemo_gym import parity as hosting_parity
from gym_runtime.nemo_gym.hosting import env as hosting_env
from tests.helpers import REPO, cli, read_jsonl, write_jsonl
from tests.hosting import LOOPBACK, assert_hosted_worker_opens_no_port, catalogue_root, listeners_while_running

CRASHY = REPO / "tests" / "data" / "nemo_servers" / "crashy"
SLEEPY = REPO / "tests" / "data" / "nemo_servers" / "sleepy"


@pytest.fixture(scope="module")
def catalogue() -> Path:
    """The installed catalogue (nemo-gym's resources_servers) in the shared base layer, built if missing."""
    return catalogue_root("--server", "example_session_state_mgmt")


def config(tmp_path: Path, resource: dict[str, Any], *, policy: dict[str, Any], agent: str = "agents.simple") -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(
        json.dumps(
            {
                "models": {"policy": policy},
                "resources": {"env": resource},
                "agents": {"env_agent": {"agent": agent, "model": "policy", "resource": "env", "max_steps": 10}},
            }
        )
    )
    return path


def prompt(row: dict[str, Any]) -> str:
    """A row's prompt by role and text (recordings add item types and ids)."""
    items = row["responses_create_params"]["input"]
    items = [{"role": "user", "content": items}] if isinstance(items, str) else items
    return json.dumps([(m.get("role"), m.get("content")) for m in items])


def outputs(row: dict[str, Any]) -> list[str]:
    return [o["output"] for o in row["response"]["output"] if o["type"] == "function_call_output"]


def test_session_state_server_hosted_reproduces_its_recordings(catalogue: Path, tmp_path: Path) -> None:
    """example_session_state_mgmt keeps a counter per session cookie: every rollout's tool outputs and reward
    equal the recorded ones (one cookie jar per rollout; concurrent rollouts do not share a counter)."""
    sdir = catalogue / "example_session_state_mgmt"
    recorded = read_jsonl(sdir / "data" / "example_rollouts.jsonl")
    cfg = config(
        tmp_path,
        {"nemo_gym": "example_session_state_mgmt"},
        policy={"adapter": "replay", "rollouts": str(sdir / "data" / "example_rollouts.jsonl")},
    )
    r = cli("run", str(cfg), "-i", str(sdir / "data" / "example.jsonl"), "-o", str(tmp_path / "out.jsonl"), timeout=300)
    assert r.returncode == 0, r.stderr
    assert "building" not in r.stderr  # the environment was built once, before; run found it
    got = read_jsonl(tmp_path / "out.jsonl")
    assert len(got) == len(recorded) == 5
    by_prompt = {prompt(row): row for row in got}
    for rec in recorded:
        row = by_prompt[prompt(rec)]
        assert row["reward"] == rec["reward"] == 1.0
        assert [json.loads(o) for o in outputs(row)] == [json.loads(o) for o in outputs(rec)]


def test_mcqa_hosted_is_stateless_and_keeps_the_servers_fields(catalogue: Path, tmp_path: Path) -> None:
    """mcqa (its layer adds tiktoken): rewards and extracted answers from NeMo Gym's own grader."""
    sdir = catalogue / "mcqa"
    cfg = config(
        tmp_path,
        {"nemo_gym": "mcqa"},
        policy={"adapter": "replay", "rollouts": str(sdir / "data" / "example_rollouts.jsonl")},
    )
    r = cli("run", str(cfg), "-i", str(sdir / "data" / "example.jsonl"), "-o", str(tmp_path / "out.jsonl"), timeout=600)
    assert r.returncode == 0, r.stderr
    got = {prompt(row): row for row in read_jsonl(tmp_path / "out.jsonl")}
    recorded = {prompt(row): row["reward"] for row in read_jsonl(sdir / "data" / "example_rollouts.jsonl")}
    # recorded 0,1,0,1,1; NeMo Gym's grader accepts `\\boxed{C: text}` since the recording (one 0 became 1)
    assert sorted(recorded.values()) == [0.0, 0.0, 1.0, 1.0, 1.0]
    assert all(got[p]["reward"] == 1.0 for p, reward in recorded.items() if reward == 1.0)
    assert sum(row["reward"] for row in got.values()) == 4.0
    got = list(got.values())
    assert all("extracted_answer" in row and "expected_answer" in row for row in got)


def test_gymnasium_server_hosted_on_our_gym_resource(catalogue: Path, tmp_path: Path) -> None:
    """example_multi_turn_gymnasium (/reset + /step) under our multi-turn agent: its recordings replayed."""
    sdir = catalogue / "example_multi_turn_gymnasium"
    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        json.dumps(
            {
                "models": {"policy": {"adapter": "replay", "rollouts": str(sdir / "data" / "example_rollouts.jsonl")}},
                "resources": {"env": {"nemo_gym": "example_multi_turn_gymnasium"}},
                "agents": {
                    "env_agent": {
                        "agent": "agents.multi_turn",
                        "model": "policy",
                        "resource": "env",
                        "max_steps": 8,
                        "options": {"user": "env", "max_turns": 5},
                    }
                },
            }
        )
    )
    rows = [{k: v for k, v in row.items() if k != "agent_ref"} for row in read_jsonl(sdir / "data" / "example.jsonl")]
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    r = cli("env", "build", str(cfg), timeout=600)
    assert r.returncode == 0, r.stderr
    r = cli("run", str(cfg), "-i", str(data), "-o", str(tmp_path / "out.jsonl"), timeout=300)
    assert r.returncode == 0, r.stderr
    recorded = {prompt(row): row["reward"] for row in read_jsonl(sdir / "data" / "example_rollouts.jsonl")}
    got = read_jsonl(tmp_path / "out.jsonl")
    assert len(got) == len(rows)
    for row in got:
        assert row["reward"] == recorded[prompt(row)]


def test_crashing_tool_lifespan_and_failure_class(catalogue: Path, tmp_path: Path) -> None:
    """A server of a checkout (a directory): a crashing tool's repr(e) is the model's tool output (NeMo Gym's
    500 body), its lifespan hook ran, its options reached its config, its _ng_failure_class stays in the row."""
    cfg = config(
        tmp_path,
        {"nemo_gym": str(CRASHY), "options": {"label": "from-config"}},
        policy={"adapter": "scripted"},
    )
    tools = [
        {
            "type": "function",
            "name": "boom",
            "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
            "strict": True,
        },
        {"type": "function", "name": "started", "parameters": {"type": "object", "properties": {}}, "strict": True},
    ]
    data = write_jsonl(tmp_path / "in.jsonl", [{"responses_create_params": {"input": "go", "tools": tools}}])
    r = cli("run", str(cfg), "-i", str(data), "-o", str(tmp_path / "out.jsonl"), timeout=600)
    assert r.returncode == 0, r.stderr
    (row,) = read_jsonl(tmp_path / "out.jsonl")
    calls = [o["name"] for o in row["response"]["output"] if o["type"] == "function_call"]
    boom, started = (dict(zip(calls, outputs(row), strict=True))[n] for n in ("boom", "started"))
    assert json.loads(boom).startswith("ValueError('boom ")
    assert json.loads(started) == {"lifespan_ran": True, "label": "from-config"}
    assert row["reward"] == 0.25 and row["_ng_failure_class"] == "crashy_verdict"
    # the app's exception is logged as its worker logs: a JSON line, the traceback a field (the guest's structlog
    # left unconfigured rendered each as a rich console traceback, ~1 s of CPU apiece, a core under malformed rows)
    raised = [json.loads(x) for x in r.stderr.splitlines() if "hosted request raised" in x]
    assert raised and all(e["level"] == "warning" and "ValueError: boom" in e["exception"] for e in raised), r.stderr


def test_nemo_gyms_function_middlewares_as_plain_asgi_answer_as_nemo_gyms_own(catalogue: Path) -> None:
    """The crashy server's app as we host it (NeMo Gym's ``add_session_id`` and exception middleware as plain
    ASGI layers) and as NeMo Gym's run_webserver builds it: the same status, body and cookie for a crashing
    tool, a malformed argument, an inner server's error, an unknown path, a plain call, and one session id
    kept across a client's calls; a cancellation inside the server's code is the one answer that differs,
    on purpose (ours says what NeMo Gym's middleware means to; Starlette's BaseHTTPMiddleware turns it into
    "No response returned.")."""
    python = hosting_env.ensure(str(CRASHY)).python
    r = subprocess.run(
        [python, str(CRASHY.parent / "middleware_parity.py"), str(CRASHY)],
        capture_output=True,
        text=True,
        cwd=CRASHY,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.splitlines()[-1])  # NeMo Gym's middleware prints its errors before it
    ours, theirs = got["ours"], got["nemo_gym"]
    assert got["layers"] == ["ErrorsAsReplies", "RolloutContextMiddleware", "SessionMiddleware", "SessionId"]
    assert ours.pop("/cancelled {}") == [500, '"Request was cancelled"', False]
    assert theirs.pop("/cancelled {}") == [500, "\"RuntimeError('No response returned.')\"", False]
    assert ours == theirs
    assert ours['/boom {"n": 3}'] == [500, "\"ValueError('boom 3')\"", False]
    assert (
        ours["/inner {}"][1]
        == "\"Hit an exception in CrashyServer___env calling an inner server: b'the judge is down'\""
    )
    assert ours["session cookie sent"] == [True, True, True] and ours["session ids"] == [1, True]


def test_a_server_that_blocks_its_loop_past_the_liveness_window_loses_no_rollout(
    catalogue: Path, tmp_path: Path
) -> None:
    """A hosted server's verify that blocks its own event loop (time.sleep 12 s, past the bus's 10 s liveness
    window, as toolsandbox's /close scores on its loop) while five other rollouts are in flight: the worker
    keeps answering on the bus (keepalives), so every row is scored, none is worker_lost (one attempt each).
    And the app keeps the main thread, as under uvicorn: a signal.alarm timeout in its verify (math-verify's
    kind) fires there (off the main thread, signal.signal raises ValueError: an HTTP 500)."""
    cfg = config(tmp_path, {"nemo_gym": str(SLEEPY)}, policy={"adapter": "scripted"})
    entry = json.loads(cfg.read_text())
    entry["agents"]["env_agent"]["max_attempts"] = 1  # a lost call is a failure row, not a retry
    cfg.write_text(json.dumps(entry))
    rows_in = [{"responses_create_params": {"input": f"go {i}"}, "block_s": 12.0 if i == 0 else 0.0} for i in range(6)]
    rows_in[1].update(block_s=30.0, alarm_s=1)  # cut short after 1 s by its alarm
    data = write_jsonl(tmp_path / "in.jsonl", rows_in)
    r = cli("run", str(cfg), "-i", str(data), "-o", str(tmp_path / "out.jsonl"), timeout=600)
    failures = tmp_path / "out_failures.jsonl"
    lost = [(f["_ng_task_index"], f["error_class"]) for f in read_jsonl(failures)] if failures.exists() else []
    assert r.returncode == 0 and not lost, (lost, r.stderr[-2000:])
    rows = sorted(read_jsonl(tmp_path / "out.jsonl"), key=lambda row: row["_ng_task_index"])
    assert [(row["_ng_task_index"], row["reward"], row["blocked_s"], row["alarm_fired"]) for row in rows] == [
        (i, 1.0, {0: 12.0, 1: 30.0}.get(i, 0.0), i == 1) for i in range(6)
    ]


def test_nemo_gym_config_of_an_unported_server_runs_unchanged(catalogue: Path, tmp_path: Path) -> None:
    """xlam_fc's own NeMo Gym config file (config_paths), unchanged: the server is hosted, not refused."""
    sdir = catalogue / "xlam_fc"
    train = tmp_path / "train.yaml"
    train.write_text(f"config_paths:\n  - {sdir / 'configs' / 'xlam_fc.yaml'}\n")
    rollouts = sdir / "data" / "example_rollouts.jsonl"
    r = cli(
        "run",
        str(train),
        "-i",
        str(sdir / "data" / "example.jsonl"),
        "-o",
        str(tmp_path / "out.jsonl"),
        "--set",
        "+models.policy_model.adapter=replay",
        "--set",
        f"+models.policy_model.rollouts={rollouts}",
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    got = read_jsonl(tmp_path / "out.jsonl")
    recorded = {prompt(row): row["reward"] for row in read_jsonl(rollouts)}
    assert len(got) == 5
    assert [row["reward"] for row in got] == [recorded[prompt(row)] for row in got]


TOOLS_PROBE = r"""
import asyncio, json, os, sys
from gym_runtime.observability import logs
from gym_runtime.nemo_gym.hosting.host import ServerHost, hosted_class

async def main():
    cls = hosted_class(ServerHost(sys.argv[1], "env", {}, []))
    await cls.setup({})
    host = cls.host
    built = host.app.openapi_schema is not None
    out = {"names": sorted(host.tool_names), "catch_all": host.catch_all, "schema_built": built}
    out["defined"] = sorted(t["name"] for t in host.tool_definitions())
    print(json.dumps(out))
    os._exit(0)

logs.configure("error")
asyncio.run(main())
"""


@pytest.mark.parametrize(
    ("server", "names", "catch_all"),
    [
        ("example_session_state_mgmt", ["get_counter_value", "increment_counter"], False),
        ("workplace_assistant", [], True),  # POST /{tool_name}: its rows name its tools
    ],
)
def test_a_hosted_servers_tools_are_read_from_its_routes_not_its_openapi_schema(
    catalogue: Path, server: str, names: list[str], catch_all: bool
) -> None:
    """A hosted server's start reads its tool routes from the app's routes. Its OpenAPI schema (1.1-2.9 CPU-s for
    each of the catalogue's servers: their verify models hold the Responses API's) is built only where a caller
    asks for the tools' schemas, and names the same tools."""
    built = hosting_env.ensure(server)
    r = subprocess.run([built.python, "-c", TOOLS_PROBE, server], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.splitlines()[-1])
    assert (out["names"], out["catch_all"], out["schema_built"]) == (names, catch_all, False)
    assert out["defined"] == names


def test_environment_is_built_once_and_reused(catalogue: Path) -> None:
    """A second build of the same server's environment finds it (content hash) in well under a second of work."""
    started = time.monotonic()
    r = cli("env", "build", "--server", "example_session_state_mgmt", timeout=120)
    assert r.returncode == 0, r.stderr
    assert "(cached;" in r.stdout and "building" not in r.stderr
    assert time.monotonic() - started < 30


def test_a_server_that_cannot_be_installed_is_one_line_exit_2(catalogue: Path, tmp_path: Path) -> None:
    """code_fim needs a git-only package: run says so in one line, exit 2, before any task is taken."""
    cfg = config(tmp_path, {"nemo_gym": "code_fim"}, policy={"adapter": "scripted"})
    data = write_jsonl(tmp_path / "in.jsonl", [{"responses_create_params": {"input": "x"}}])
    r = cli("run", str(cfg), "-i", str(data), "-o", str(tmp_path / "out.jsonl"), timeout=120)
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert "code_fim" in line and "git" in line and "cannot be installed here" in line
    assert not (tmp_path / "out.jsonl").exists()


def test_judge_calls_of_a_hosted_server_are_served_by_our_model_workers(catalogue: Path, tmp_path: Path) -> None:
    """aalcr grades with an LLM judge through ``server_client.post(judge, /v1/responses)``: the config maps the
    judge's name to a model entry (the replay model answering with the recorded judge outputs), so each judge
    call is a model call on the bus, served by that model's worker (its spans say so), and the rewards are the
    recorded ones."""
    sdir = catalogue / "aalcr"
    recorded = read_jsonl(sdir / "data" / "example_rollouts.jsonl")
    judge = write_jsonl(
        tmp_path / "judge.jsonl",
        [
            {"responses_create_params": r["judge_responses_create_params"], "response": r["judge_response"]}
            for r in recorded
        ],
    )
    rows = [{k: v for k, v in r.items() if k not in ("response", "reward", "judge_response")} for r in recorded]
    data = write_jsonl(tmp_path / "in.jsonl", [{k: v for k, v in r.items() if k != "agent_ref"} for r in rows])
    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        json.dumps(
            {
                "models": {
                    "policy": {"adapter": "replay", "rollouts": str(sdir / "data" / "example_rollouts.jsonl")},
                    "judge": {"adapter": "replay", "rollouts": str(judge)},
                },
                "resources": {
                    "env": {
                        "nemo_gym": "aalcr",
                        "options": {"judge_model_server": {"type": "responses_api_models", "name": "judge"}},
                    }
                },
                "agents": {"env_agent": {"agent": "agents.simple", "model": "policy", "resource": "env"}},
            }
        )
    )
    r = cli("env", "build", str(cfg), timeout=600)
    assert r.returncode == 0, r.stderr
    trace = tmp_path / "trace.jsonl"
    r = cli(
        "run", str(cfg), "-i", str(data), "-o", str(tmp_path / "out.jsonl"), "--trace-file", str(trace), timeout=300
    )
    assert r.returncode == 0, r.stderr
    got = {row["question_id"]: row for row in read_jsonl(tmp_path / "out.jsonl")}
    assert {q: row["reward"] for q, row in got.items()} == {rec["question_id"]: rec["reward"] for rec in recorded}
    spans = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    judged = [s for s in spans if "gen_ai.request.model" in json.dumps(s) and '"judge"' in json.dumps(s)]
    assert len(judged) == len(recorded)


def test_start_runs_a_hosted_worker_on_its_environment_with_no_port_of_its_own(
    catalogue: Path, nats_server: Any, tmp_path: Path
) -> None:
    """`start` runs the hosted server's code in a guest process on the environment's interpreter (its worker on
    ours); no process listens on a socket, and they talk to nothing but the loopback bus (sockets listed while
    they run)."""

    cfg = config(tmp_path, {"nemo_gym": "example_session_state_mgmt"}, policy={"adapter": "scripted"})
    assert_hosted_worker_opens_no_port(cfg, nats_server.url, "resources")


def test_ray_started_by_a_hosted_server_stays_on_loopback(catalogue: Path, tmp_path: Path) -> None:
    """code_gen's verify runs the model's program as a Ray task, so its code starts Ray inside the hosted worker
    (GCS, raylet, agents, Ray workers: ports of their own, on every interface and the host's address by default).
    Listed every 0.2 s while `run` replays code_gen's recordings, every listening socket of the run's whole
    process tree, Ray's included, is bound to loopback; the rewards are the recorded ones."""
    env = hosting_env.ensure("code_gen", log=lambda _line: None)
    cfg, data, recorded = hosting_parity.parity_config(env, tmp_path)
    out = tmp_path / "out.jsonl"
    argv = [sys.executable, "-m", "gym_runtime.cli", "run", str(cfg), "-i", str(data), "-o", str(out), "--no-progress"]
    run, listening, names = listeners_while_running(argv, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert {"gcs_server", "raylet"} <= names, names  # Ray did start, under the hosted worker
    assert len({port for name, _, port in listening if name in ("gcs_server", "raylet")}) >= 2, listening
    assert [s for s in listening if s[1] not in LOOPBACK] == []
    assert hosting_parity.compare("code_gen", recorded, read_jsonl(out)).ok


def test_parity_on_placeholder_recordings_is_one_line(catalogue: Path, tmp_path: Path) -> None:
    """over_refusal_detection and jailbreak_detection ship `<PLACEHOLDER ROW>` lines as their recordings: parity
    says there is nothing to replay in one line, exit 2 (it was a JSONDecodeError traceback)."""
    server = tmp_path / "placeholder_server"
    shutil.copytree(CRASHY, server)
    (server / "data").mkdir()
    (server / "data" / "example_rollouts.jsonl").write_text("<PLACEHOLDER ROW>\n" * 5)
    r = cli("parity", str(server), timeout=300)
    assert r.returncode == 2, r.stderr
    assert "its recordings cannot be replayed: responses missing (0/5 rows have one; 5 placeholder rows)" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("server", "code", "summary"),
    [
        ("example_session_state_mgmt", 0, "parity 5/5 rewards; tool-output drift 0"),
        ("example_multi_turn_gymnasium", 0, "parity 5/5 rewards"),
        ("aalcr", 0, "parity 5/5 rewards"),  # its judge answered from the recorded judge outputs
        ("mcqa", 1, "parity 4/5 rewards"),  # the grader changed after the recording (catalogue note)
        # a judge and no judge call recorded: its grader decides all five rows alone (issue 57: refused whole before)
        ("polymath", 0, "polymath: 5 rows replayed, 0 refused"),
    ],
)
def test_parity_command(catalogue: Path, server: str, code: int, summary: str) -> None:
    r = cli("parity", server, timeout=600)
    assert r.returncode == code, r.stderr
    assert summary in r.stdout
    # a documented mismatch names its cause (the catalogue table's), an unexplained one does not exist here
    assert ("a known difference (docs/nemo-gym.md, the catalogue table): grader changed" in r.stdout) == (code == 1)
    assert len([line for line in r.stdout.splitlines() if line.strip()[:1].isdigit()]) == 5  # one line per rollout


def test_parity_on_recordings_it_cannot_replay_says_what_they_lack(catalogue: Path, tmp_path: Path) -> None:
    """A server whose recorded rollouts' tasks are not in its example rows cannot be replayed: parity says so, in
    the catalogue's words, before it runs anything (it said "the replay did not run" with a failure-file path)."""
    server = tmp_path / "unjoinable_server"
    shutil.copytree(CRASHY, server)
    (server / "data").mkdir(exist_ok=True)
    write_jsonl(server / "data" / "example.jsonl", [{"responses_create_params": {"input": "a"}, "wanted": 1}])
    recorded = {"responses_create_params": {"input": "b"}, "reward": 1.0, "response": {"output": [{"x": 1}]}}
    write_jsonl(server / "data" / "example_rollouts.jsonl", [recorded])
    r = cli("parity", str(server), timeout=300)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == (
        f"gym-runtime: error: parity {server}: its recordings cannot be replayed: task fields not joinable (0/1 rows)"
    )


def test_publisher_side_never_needs_the_hosted_environment(tmp_path: Path) -> None:
    """validate (like publish and the client) reads a hosted config without nemo-gym or a built environment;
    reverify runs the hosted server's code in its worker's guest on its built environment, and a server the catalogue
    does not have is one line naming it."""
    cfg = config(tmp_path, {"nemo_gym": "no_such_server_built_here"}, policy={"adapter": "scripted"})
    data = write_jsonl(tmp_path / "in.jsonl", [{"responses_create_params": {"input": "x"}, "anything": 1}])
    r = cli("validate", str(cfg), "-i", str(data), env={hosting_env.CACHE_ENV: str(tmp_path / "no-cache")})
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "no-cache").exists()
    rollouts = write_jsonl(tmp_path / "r.jsonl", [{"responses_create_params": {"input": "x"}, "response": {}}])
    r = cli("reverify", str(cfg), "-i", str(rollouts), "-o", str(tmp_path / "o.jsonl"))
    assert r.returncode == 2
    assert "no_such_server_built_here: no such resources server" in r.stderr.strip().splitlines()[-1], r.stderr
    assert "Traceback" not in r.stderr


# Lax and malformed final answers: what a policy may write in extract_synonym_values' arguments.
SYNONYM_VARIANTS = {
    "as_recorded": lambda values: {"synonym_values": values},
    "floats": lambda values: {"synonym_values": [float(v) for v in values]},
    "strings": lambda values: {"synonym_values": [str(v) for v in values]},
    "reordered": lambda values: {"synonym_values": list(reversed(values))},
    "extra_key": lambda values: {"synonym_values": values, "note": "x"},
    "missing_key": lambda values: {"values": values},
    "not_a_list": lambda values: {"synonym_values": values[0] if values else 0},
    "not_json": None,
}


def test_multi_step_reads_lax_and_malformed_answers_as_nemo_gyms_original_does(catalogue: Path, tmp_path: Path) -> None:
    """Issue 25, item 9: the same lax or malformed extract_synonym_values arguments sent to our multi_step
    and to NeMo Gym's example_multi_step (hosted, its own code) give the same reward, or the same error
    class where its verify raises."""
    from gym_runtime.nemo_gym.parity import inputs

    sdir = catalogue / "example_multi_step"
    recorded = read_jsonl(sdir / "data" / "example_rollouts.jsonl")
    variants = []
    for name, make in SYNONYM_VARIANTS.items():
        for n, (row, rec) in enumerate(zip(inputs(sdir, recorded), recorded, strict=True)):
            output = json.loads(json.dumps(rec["response"]["output"]))
            last = [o for o in output if o.get("name") == "extract_synonym_values"][-1]
            values = json.loads(last["arguments"])["synonym_values"]
            last["arguments"] = '{"synonym_values": [' if make is None else json.dumps(make(values))
            variants.append((f"{name}/{n}", row, output))
    assert_same_rewards(both_sides(tmp_path, variants, {"server": "multi_step"}, {"nemo_gym": "example_multi_step"}))


# ------------------------------------------------------------------ issue 25, item 9, every mirrored environment
# The same lax or malformed model outputs sent to our environment and to NeMo Gym's original, hosted (nemo-gym
# 0.7.0's own code): one `run` per side, every variant a row whose prompt carries the variant's name (the replay
# model answers by prompt). Where nemo-gym 0.7.0 changed a verify after the commit our differential cases come from
# (07d6b0d0), ours keeps that commit's behaviour: those variants are listed, and must differ exactly so.

DIFFERENTIAL = REPO / "tests" / "compat" / "differential"


def message(*texts: str) -> dict[str, Any]:
    """An assistant message whose output_text parts are ``texts``."""
    parts = [{"type": "output_text", "text": t, "annotations": []} for t in texts]
    return {"type": "message", "role": "assistant", "id": "msg_v", "status": "completed", "content": parts}


def reasoning(text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": "rs_v", "summary": [{"type": "summary_text", "text": text}]}


def call(name: str, arguments: str, n: int = 0) -> dict[str, Any]:
    return {"type": "function_call", "name": name, "arguments": arguments, "call_id": f"call_{n}", "id": f"fc_{n}"}


def both_sides(
    tmp_path: Path,
    variants: list[tuple[str, dict[str, Any], list[dict[str, Any]]]],
    ours: dict[str, Any],
    nemo_gym: dict[str, Any],
) -> dict[str, tuple[Any, Any]]:
    """{variant: (our reward, NeMo Gym's reward)} for (name, task row, model output items) variants; a failure
    row counts as its error_class. One run: an agent per side (agents.simple on each side's resource), every
    variant once per side, one replay file."""
    rows, rollouts = [], []
    for name, row, output in variants:
        row = json.loads(json.dumps(row))
        items = row["responses_create_params"]["input"]
        items = [{"role": "user", "content": items}] if isinstance(items, str) else items
        items[-1]["content"] = f"{items[-1]['content']} ({name})"
        row["responses_create_params"]["input"] = items
        rows.append(row)
        response = {"id": "resp_v", "created_at": 0.0, "model": "m", "object": "response", "output": output}
        rollouts.append({"responses_create_params": row["responses_create_params"], "response": response})
    write_jsonl(tmp_path / "rollouts.jsonl", rollouts)
    sides = ("ours", "nemo_gym")
    write_jsonl(tmp_path / "rows.jsonl", [{**row, "agent_ref": {"name": side}} for side in sides for row in rows])
    cfg = tmp_path / "config.yaml"
    agent = {"agent": "agents.simple", "model": "policy", "max_steps": 10}
    cfg.write_text(
        json.dumps(
            {
                "models": {"policy": {"adapter": "replay", "rollouts": str(tmp_path / "rollouts.jsonl")}},
                "resources": {"ours": ours, "nemo_gym": nemo_gym},
                "agents": {side: {**agent, "resource": side} for side in sides},
            }
        )
    )
    r = cli("run", str(cfg), "-i", str(tmp_path / "rows.jsonl"), "-o", str(tmp_path / "out.jsonl"), timeout=600)
    assert r.returncode in (0, 1), r.stderr  # 1: some variants are failure rows
    got: dict[str, dict[int, Any]] = {side: {} for side in sides}
    failed = tmp_path / "out_failures.jsonl"
    scored = [(x, x["reward"]) for x in read_jsonl(tmp_path / "out.jsonl")]
    for x, outcome in scored + [(x, x["error_class"]) for x in (read_jsonl(failed) if failed.exists() else [])]:
        side = x["agent_ref"]["name"]  # its variant: the task index less the rows of the sides before it
        got[side][x["_ng_task_index"] - sides.index(side) * len(rows)] = outcome
    assert all(len(got[side]) == len(rows) for side in sides), got
    return {name: (got["ours"][i], got["nemo_gym"][i]) for i, (name, _, _) in enumerate(variants)}


def assert_same_rewards(got: dict[str, tuple[Any, Any]], newer_in_0_7_0: dict[str, tuple[Any, Any]] = {}) -> None:  # noqa: B006
    differ = {name: pair for name, pair in got.items() if pair[0] != pair[1]}
    assert differ == newer_in_0_7_0
    assert len({ours for ours, _ in got.values()}) > 1  # the variants really differ in outcome


def mcqa_variants() -> list[tuple[str, dict[str, Any], list[dict[str, Any]]]]:
    """Every answer form below, for one task of each grading mode (and one with a template regex)."""
    cases = read_jsonl(DIFFERENTIAL / "mcqa.jsonl")
    tasks: dict[str, dict[str, Any]] = {}
    for case in cases:
        mode = "template" if case.get("template_metadata") else case.get("grading_mode", "strict_single_letter_boxed")
        tasks.setdefault(
            mode, {k: v for k, v in case.items() if k not in ("response", "expected_reward", "expected_fields", "case")}
        )
    out = []
    for mode, task in tasks.items():
        gold = task["expected_answer"]
        text = next(v for o in task["options"] for k, v in o.items() if k == gold)
        other = next(k for o in task["options"] for k in o if k != gold)
        answers: dict[str, list[dict[str, Any]]] = {
            "boxed": [message(f"So \\boxed{{{gold}}}")],
            "boxed_lowercase": [message(f"\\boxed{{{gold.lower()}}}")],
            "boxed_label": [message(f"\\boxed{{{gold}: {text}}}")],
            "boxed_label_multiline": [message(f"\\boxed{{\n{gold}: {text}\n}}")],
            "boxed_dot_label": [message(f"\\boxed{{{gold}. {text}}}")],
            "boxed_parens": [message(f"\\boxed{{({gold})}}")],
            "boxed_text": [message(f"\\boxed{{\\text{{ {gold} }}}}")],
            "boxed_textbf": [message(f"\\boxed{{\\textbf{{{gold}}}}}")],
            "boxed_fullwidth": [message("\\boxed{" + chr(0xFF21 + ord(gold) - 65) + "}")],
            "boxed_option_text": [message(f"\\boxed{{{text}}}")],
            "boxed_option_text_upper": [message(f"\\boxed{{ {text.upper()} }}")],
            "two_boxes_last_wrong": [message(f"\\boxed{{{gold}}} or rather \\boxed{{{other}}}")],
            "two_letters": [message(f"\\boxed{{{gold}, {other}}}")],
            "unclosed_box": [message(f"\\boxed{{{gold}")],
            "box_split_over_parts": [message(f"\\boxed{{{gold}", "}")],
            "box_split_over_messages": [message("\\boxed{"), message(f"{gold}}}")],
            "box_in_reasoning_only": [reasoning(f"\\boxed{{{gold}}}"), message("done")],
            "reasoning_then_box": [reasoning(f"\\boxed{{{other}}}"), message(f"\\boxed{{{gold}}}")],
            "answer_colon": [message(f"Answer: {gold}")],
            "answer_colon_lower": [message(f"answer:  {gold.lower()}")],
            "answer_colon_text": [message(f"Answer: {text.lower()}")],
            "answer_colon_markdown": [message(f"**Answer:** {gold}")],
            "answer_is": [message(f"The answer is {gold}.")],
            "whitespace_only": [message("  \n ")],
        }
        out += [(f"{mode}/{name}", task, output) for name, output in answers.items()]
    return out


def test_mcqa_reads_lax_and_malformed_answers_as_nemo_gyms_original_does(catalogue: Path, tmp_path: Path) -> None:
    """mcqa: boxes (lowercase, labels on one line or several, \\text, full-width, option text, two, unclosed,
    split over parts or messages, only in reasoning), Answer: lines, blank text; four grading modes."""
    got = both_sides(tmp_path, mcqa_variants(), {"server": "mcqa"}, {"nemo_gym": "mcqa"})
    assert_same_rewards(got)


def reasoning_gym_variants() -> list[tuple[str, dict[str, Any], list[dict[str, Any]]]]:
    """Tags, boxes, think blocks, fences and splits around a basic_arithmetic answer (30) and a word_sorting one."""
    cases = read_jsonl(DIFFERENTIAL / "reasoning_gym.jsonl")
    out = []
    for source in ("basic_arithmetic", "word_sorting"):
        case = next(c for c in cases if c["metadata"]["source_dataset"] == source)
        task = {k: v for k, v in case.items() if k not in ("response", "expected_reward", "expected_fields", "case")}
        gold, wrong = task["answer"], "31" if source == "basic_arithmetic" else "zzz"
        answers: dict[str, list[dict[str, Any]]] = {
            "tag": [message(f"<answer>{gold}</answer>")],
            "tag_padded": [message(f"<answer>  {gold}  </answer>")],
            "tag_newlines": [message(f"<answer>\n{gold}\n</answer>")],
            "tags_last_wins": [message(f"<answer>{wrong}</answer> no: <answer>{gold}</answer>")],
            "tags_last_wrong": [message(f"<answer>{gold}</answer> no: <answer>{wrong}</answer>")],
            "tag_upper_case": [message(f"<ANSWER>{gold}</ANSWER>")],
            "tag_unclosed": [message(f"<answer>{gold}")],
            "tag_split_over_parts": [message("<answer>", f"{gold}</answer>")],
            "tag_split_over_messages": [message(f"<answer>{gold}"), message("</answer>")],
            "tag_in_reasoning_only": [reasoning(f"<answer>{gold}</answer>"), message(f"{wrong}")],
            "boxed": [message(f"so \\boxed{{{gold}}}")],
            "boxed_padded": [message(f"\\boxed{{  {gold} }}")],
            "boxed_first_wins": [message(f"\\boxed{{{gold}}} then \\boxed{{{wrong}}}")],
            "boxed_empty_then": [message(f"\\boxed{{}} then \\boxed{{{gold}}}")],
            "boxed_nested": [message(f"\\boxed{{\\text{{{gold}}}}}")],
            "boxed_frac": [message("\\boxed{\\frac{60}{2}}")],
            "think_box_then_box": [message(f"<think>\\boxed{{{wrong}}}</think>\\boxed{{{gold}}}")],
            "think_then_plain": [message(f"<think>hmm {wrong}</think>{gold}")],
            "fenced": [message(f"```\n{gold}\n```")],
            "blank_lines": [message(f"\n\n{gold}\n\n")],
            "plain_with_prose": [message(f"The answer is {gold}.")],
            "empty": [message("")],
        }
        out += [(f"{source}/{name}", task, output) for name, output in answers.items()]
    return out


def test_reasoning_gym_reads_lax_and_malformed_answers_as_nemo_gyms_original_does(
    catalogue: Path, tmp_path: Path
) -> None:
    """reasoning_gym: <answer> tags (padded, several, upper case, unclosed, split, only in reasoning), boxes (first,
    empty, nested, \\frac), <think> blocks, fences, blank lines, prose; two tasks."""
    got = both_sides(tmp_path, reasoning_gym_variants(), {"server": "reasoning_gym"}, {"nemo_gym": "reasoning_gym"})
    assert_same_rewards(got)


def calendar_variants(sdir: Path) -> list[tuple[str, dict[str, Any], list[dict[str, Any]]]]:
    """The recorded calendars (two right, three wrong), reshaped: nested lists, brackets in names, fences, prose,
    <think>, a text part before the list, reasoning last, cut off, types and spellings of the fields."""
    from gym_runtime.nemo_gym.parity import inputs

    recorded = read_jsonl(sdir / "data" / "example_rollouts.jsonl")
    out = []
    for i, (row, rec) in enumerate(zip(inputs(sdir, recorded), recorded, strict=True)):
        text = rec["response"]["output"][-1]["content"][0]["text"]
        start = text.index('[{"event_id"')
        events = json.loads(text[start : text.index("}]", start) + 2])
        first = events[0]
        listed = json.dumps(events)
        answers: dict[str, list[dict[str, Any]]] = {
            "as_recorded": [message(text)],
            "list_only": [message(listed)],
            "nested_list": [message(json.dumps([{**first, "tags": ["a"]}, *events[1:]]))],
            "nested_list_last": [message(json.dumps([*events[:-1], {**events[-1], "tags": ["a"]}]))],
            "bracket_in_name": [message(json.dumps([{**first, "event_name": "Review [v2]"}, *events[1:]]))],
            "nested_object": [message(json.dumps([{**first, "meta": {"room": 1}}, *events[1:]]))],
            "fenced": [message(f"```json\n{listed}\n```")],
            "prose_around": [message(f"Here is the calendar:\n{listed}\nLet me know!")],
            "think": [message(f"<think>ok</think>{listed}")],
            "prose_part_first": [message("Here is the calendar:", listed)],
            "reasoning_last": [message(listed), reasoning("done")],
            "two_messages": [message(listed), message("Anything else?")],
            "cut_off": [message(listed[:-1])],
            "invalid_list_first": [message("[{event_id: 0}] " + listed)],
            "note_with_a_list_first": [message('Notes: [{"todo": ["call Bob"]}]\n' + listed)],
            "note_with_a_bracket_first": [message('Notes: [{"todo": "see [1]"}]\n' + listed)],
            "empty_list": [message("[]")],
            "float_durations": [message(json.dumps([{**e, "duration": float(e["duration"])} for e in events]))],
            "string_ids": [message(json.dumps([{**e, "event_id": str(e["event_id"])} for e in events]))],
            "seconds_in_times": [message(json.dumps([{**e, "start_time": e["start_time"] + ":00"} for e in events]))],
            "twelve_hour_times": [
                message(json.dumps([{**e, "start_time": twelve_hour(e["start_time"])} for e in events]))
            ],
            "upper_case_am_pm": [
                message(json.dumps([{**e, "start_time": twelve_hour(e["start_time"]).upper()} for e in events]))
            ],
            "missing_duration": [
                message(json.dumps([{k: v for k, v in first.items() if k != "duration"}, *events[1:]]))
            ],
            "duplicate_event": [message(json.dumps([*events, first]))],
        }
        out += [(f"{i}/{name}", row, output) for name, output in answers.items()]
    return out


def twelve_hour(hhmm: str) -> str:
    hours, minutes = (int(x) for x in hhmm.split(":"))
    return f"{(hours - 1) % 12 + 1}:{minutes:02d}{'am' if hours < 12 else 'pm'}"


def test_calendar_reads_lax_and_malformed_answers_as_nemo_gyms_original_does(catalogue: Path, tmp_path: Path) -> None:
    """calendar: where the calendar list is found (nested lists and objects, brackets in strings, fences, prose,
    <think>, a prose part first, reasoning last, cut off, an invalid list or a note first) and how its fields are
    read."""
    variants = calendar_variants(catalogue / "calendar")
    got = both_sides(tmp_path, variants, {"server": "calendar"}, {"nemo_gym": "calendar"})
    assert_same_rewards(got)


def structured_outputs_variants() -> list[tuple[str, dict[str, Any], list[dict[str, Any]]]]:
    """A valid JSON answer and a valid XML one, reshaped: fences, prose, splits over parts and messages, reasoning,
    JSON5-isms, extra, missing and retyped fields, a list or two objects, blank text."""
    cases = read_jsonl(DIFFERENTIAL / "structured_outputs.jsonl")
    skip = ("response", "expected_reward", "expected_fields", "case")
    out = []
    for kind, case_name in (("json", "json text: valid pretty-printed"), ("xml", "xml: valid with type coercion")):
        case = next(c for c in cases if c["case"].startswith(case_name))
        task = {k: v for k, v in case.items() if k not in skip}
        text = "".join(p["text"] for o in case["response"]["output"] if o["type"] == "message" for p in o["content"])
        half = len(text) // 2
        answers: dict[str, list[dict[str, Any]]] = {
            "as_given": [message(text)],
            "padded": [message(f"\n\n  {text}  \n")],
            "fenced": [message(f"```{kind}\n{text}\n```")],
            "prose_before": [message(f"Here you go:\n{text}")],
            "split_over_parts": [message(text[:half], text[half:])],
            "split_over_messages": [message(text[:half]), message(text[half:])],
            "reasoning_then_answer": [reasoning("{}"), message(text)],
            "only_in_reasoning": [reasoning(text), message("done")],
            "doubled": [message(text + text)],
            "cut_off": [message(text[:-3])],
            "empty": [message("")],
        }
        if kind == "json":
            value = json.loads(text)
            answers |= {
                "compact": [message(json.dumps(value, separators=(",", ":")))],
                "trailing_comma": [message(json.dumps(value)[:-1] + ",}")],
                "single_quotes": [message(json.dumps(value).replace('"', "'"))],
                "extra_field": [message(json.dumps({**value, "note": "x"}))],
                "missing_field": [message(json.dumps({k: v for k, v in value.items() if k != "email"}))],
                "age_as_float": [message(json.dumps({**value, "age": 36.0}))],
                "age_as_string": [message(json.dumps({**value, "age": "36"}))],
                "age_as_bool": [message(json.dumps({**value, "age": True}))],
                "age_nan": [message(json.dumps({**value, "age": float("nan")}))],
                "email_null": [message(json.dumps({**value, "email": None}))],
                "in_a_list": [message(json.dumps([value]))],
                "yaml_instead": [message("\n".join(f"{k}: {json.dumps(v)}" for k, v in value.items()))],
            }
        else:
            answers |= {
                "xml_declaration": [message('<?xml version="1.0"?>' + text)],
                "age_not_a_number": [message(text.replace("<age>36</age>", "<age>thirty</age>"))],
                "age_as_float_text": [message(text.replace("<age>36</age>", "<age>36.0</age>"))],
                "one_skill": [message(text.replace("<skill>poetry</skill>", ""))],
                "no_root": [message(text.replace("<person>", "").replace("</person>", ""))],
            }
        out += [(f"{kind}/{name}", task, output) for name, output in answers.items()]
    return out


def test_structured_outputs_reads_lax_and_malformed_answers_as_nemo_gyms_original_does(
    catalogue: Path, tmp_path: Path
) -> None:
    """structured_outputs (text mode, JSON and XML): which text is parsed (parts and messages joined, reasoning
    skipped, no fence or prose stripping) and how strictly (JSON5-isms, types, extra and missing fields)."""
    ours, nemo_gym = {"server": "structured_outputs"}, {"nemo_gym": "structured_outputs"}
    assert_same_rewards(both_sides(tmp_path, structured_outputs_variants(), ours, nemo_gym))


def called(name: str, arguments: str, answer: str = "done", n: int = 0) -> list[dict[str, Any]]:
    """A function call, the output a replay records for it (the live one replaces it) and a final message."""
    output = {"type": "function_call_output", "call_id": f"call_{n}", "output": "{}"}
    return [call(name, arguments, n), output, message(answer)]


def test_weather_reads_lax_and_malformed_calls_as_nemo_gyms_original_does(catalogue: Path, tmp_path: Path) -> None:
    """weather: lax get_weather arguments score alike. Without a get_weather call nemo-gym 0.7.0 scores 0; at
    07d6b0d0 (our differential cases' commit, and NeMo Gym's recordings, where two rollouts ask a question and score
    1) every rollout scores 1: ours keeps that, so exactly those variants differ."""
    row = read_jsonl(catalogue / "example_single_tool_call" / "data" / "example.jsonl")[0]
    row = {k: v for k, v in row.items() if k != "agent_ref"}
    variants = {
        "as_asked": called("get_weather", '{"city": "Paris"}'),
        "extra_key": called("get_weather", '{"city": "Paris", "units": "C"}'),
        "city_a_number": called("get_weather", '{"city": 7}'),
        "no_city": called("get_weather", "{}"),
        "not_json": called("get_weather", '{"city": '),
        "two_calls": called("get_weather", '{"city": "Paris"}')[:2] + called("get_weather", '{"city": "Rome"}', n=1),
        "no_call": [message("Which city?")],
        "misspelt_tool": called("get_wether", '{"city": "Paris"}'),
        "call_only_in_reasoning": [reasoning('get_weather({"city": "Paris"})'), message("It is cold.")],
    }
    got = both_sides(
        tmp_path,
        [(name, row, output) for name, output in variants.items()],
        {"server": "weather"},
        {"nemo_gym": "example_single_tool_call"},
    )
    newer = {name: (1.0, 0.0) for name in ("no_call", "misspelt_tool", "call_only_in_reasoning")}
    differ = {name: pair for name, pair in got.items() if pair[0] != pair[1]}
    assert differ == newer


def workplace_variants() -> list[tuple[str, dict[str, Any], list[dict[str, Any]]]]:
    """Each right trajectory of the differential cases, its last call's arguments reshaped: extra, null, missing
    and retyped arguments, case and padding, not JSON, not an object, repeated; NeMo Gym's verify replays them."""
    out = []
    skip = ("response", "expected_reward", "expected_fields", "case")
    for n, case in enumerate(read_jsonl(DIFFERENTIAL / "workplace_assistant.jsonl")):
        calls = [i for i, o in enumerate(case["response"]["output"]) if o["type"] == "function_call"]
        if case["expected_reward"] != 1.0 or not calls:
            continue
        task = {k: v for k, v in case.items() if k not in skip}
        last = calls[-1]
        args = json.loads(case["response"]["output"][last]["arguments"])
        key = next(k for k, v in sorted(args.items(), key=lambda kv: str(kv[1]).isdigit()) if isinstance(v, str))
        id_key = next((k for k in args if k.endswith("_id")), key)
        arguments = {
            "as_given": json.dumps(args),
            "compact": json.dumps(args, separators=(",", ":")),
            "extra_argument": json.dumps({**args, "note": "x"}),
            "null_argument": json.dumps({**args, key: None}),
            "missing_argument": json.dumps({k: v for k, v in args.items() if k != key}),
            "upper_case_value": json.dumps({**args, key: args[key].upper()}),
            "padded_value": json.dumps({**args, key: f" {args[key]} "}),
            "number_for_id": json.dumps({**args, id_key: int(args[id_key]) if args[id_key].isdigit() else 7}),
            "list_value": json.dumps({**args, key: [args[key]]}),
            "not_json": json.dumps(args)[:-1],
            "not_an_object": json.dumps([args]),
            "ascii_escaped": json.dumps(args, ensure_ascii=True).replace("e", "\\u0065", 1),
        }
        for name, text in arguments.items():
            output = json.loads(json.dumps(case["response"]["output"]))
            output[last]["arguments"] = text
            out.append((f"{n}/{name}", task, output))
        repeated = json.loads(json.dumps(case["response"]["output"]))
        twice = [
            dict(repeated[last], call_id="call_again"),
            {"type": "function_call_output", "call_id": "call_again", "output": "{}"},
        ]
        out.append((f"{n}/repeated", task, repeated[: last + 2] + twice + repeated[last + 2 :]))
    return out


def test_workplace_assistant_reads_lax_and_malformed_calls_as_nemo_gyms_original_does(
    catalogue: Path, tmp_path: Path
) -> None:
    """workplace_assistant: our verify grades the session's state; NeMo Gym's replays the response's calls on a
    fresh copy. Lax and malformed arguments of the state-changing call must end in the same reward."""
    ours, nemo_gym = {"server": "workplace_assistant"}, {"nemo_gym": "workplace_assistant"}
    assert_same_rewards(both_sides(tmp_path, workplace_variants(), ours, nemo_gym))


def math_advanced_variants() -> list[tuple[str, dict[str, Any], list[dict[str, Any]]]]:
    """The full right trajectories, every call's numbers rewritten: strings, ints, exponents, booleans, nulls,
    extra and missing keys, not JSON. The tools answer (ours, or the original's) and verify reads their outputs."""
    rewrites = {
        "as_given": lambda a: a,
        "numbers_as_strings": lambda a: {k: str(v) for k, v in a.items()},
        "integral_as_int": lambda a: {k: int(v) if float(v).is_integer() else v for k, v in a.items()},
        "exponent_strings": lambda a: {k: f"{v:e}" for k, v in a.items()},
        "booleans": lambda a: {k: True for k in a},
        "nulls": lambda a: {k: None for k in a},
        "extra_key": lambda a: {**a, "note": 1},
        "missing_key": lambda a: dict(list(a.items())[1:]),
        "not_json": None,
    }
    out = []
    skip = ("response", "expected_reward", "expected_fields", "case")
    for n, case in enumerate(read_jsonl(DIFFERENTIAL / "math_advanced_calculations.jsonl")):
        if not case["case"].endswith("full correct tool trajectory"):
            continue
        task = {k: v for k, v in case.items() if k not in skip}
        for name, rewrite in rewrites.items():
            output = json.loads(json.dumps(case["response"]["output"]))
            for item in output:
                if item["type"] == "function_call":
                    args = json.loads(item["arguments"])
                    item["arguments"] = json.dumps(rewrite(args)) if rewrite else item["arguments"][:-1]
            out.append((f"{n}/{name}", task, output))
    return out


def test_math_advanced_calculations_reads_lax_calls_as_nemo_gyms_original_does(catalogue: Path, tmp_path: Path) -> None:
    """math_advanced_calculations: lax tool arguments (numbers as strings or exponents, booleans, nulls, extra or
    missing keys, not JSON) make the same tool outputs on both sides, and verify reads them alike."""
    ours, nemo_gym = {"server": "math_advanced_calculations"}, {"nemo_gym": "math_advanced_calculations"}
    assert_same_rewards(both_sides(tmp_path, math_advanced_variants(), ours, nemo_gym))


def math_variants() -> list[tuple[str, dict[str, Any], list[dict[str, Any]]]]:
    """Forms of 1/2 (and of 32): boxed or not, \\frac, \\dfrac, decimals, percent, $...$, several boxes, split
    over parts and messages, only in reasoning, \\boxed{} empty, unclosed, with units."""
    row = read_jsonl(DIFFERENTIAL / "math_with_judge.jsonl")[0]
    base = {k: v for k, v in row.items() if k in ("responses_create_params", "question")}
    half, whole = {**base, "expected_answer": "\\frac{1}{2}"}, {**base, "expected_answer": "32"}
    forms = {
        "boxed_frac": "So \\boxed{\\frac{1}{2}}.",
        "boxed_dfrac": "\\boxed{\\dfrac12}",
        "boxed_decimal": "\\boxed{0.5}",
        "boxed_slash": "\\boxed{1/2}",
        "boxed_percent": "\\boxed{50\\%}",
        "boxed_padded": "\\boxed{  \\frac{1}{2}  }",
        "boxed_in_dollars": "$\\boxed{\\frac{1}{2}}$",
        "boxed_text": "\\boxed{\\text{1/2}}",
        "boxed_wrong_then_right": "\\boxed{1} no: \\boxed{\\frac{1}{2}}",
        "boxed_right_then_wrong": "\\boxed{\\frac{1}{2}} no: \\boxed{1}",
        "boxed_empty": "\\boxed{}",
        "boxed_blank_then_plain": "\\boxed{ } so 1/2",
        "boxed_unclosed": "\\boxed{\\frac{1}{2}",
        "fbox": "\\fbox{\\frac{1}{2}}",
        "plain_decimal": "The answer is 0.5",
        "plain_latex": "$\\frac{1}{2}$",
        "approximate": "\\boxed{0.50001}",
        "empty": "",
    }
    out = [(f"half/{name}", half, [message(text)]) for name, text in forms.items()]
    out += [
        ("half/split_over_parts", half, [message("\\boxed{\\frac{1}", "{2}}")]),
        ("half/split_over_messages", half, [message("\\boxed{\\frac{1}"), message("{2}}")]),
        ("half/only_in_reasoning", half, [reasoning("\\boxed{\\frac{1}{2}}"), message("done")]),
        ("whole/boxed", whole, [message("\\boxed{32}")]),
        ("whole/plain", whole, [message("The answer is 32.")]),
        ("whole/boxed_float", whole, [message("\\boxed{32.0}")]),
        ("whole/boxed_with_unit", whole, [message("\\boxed{32\\text{ cm}}")]),
        ("whole/boxed_thousands", whole, [message("\\boxed{32,000}")]),
    ]
    return out


# nemo-gym 0.7.0 scores an answer without a closed, non-empty \boxed{} 0 before math-verify sees it; at 07d6b0d0 (our
# differential cases: "int: correct, no box (plain text)" is 1.0) math-verify reads the whole text, as ours does.
MATH_BOX_REQUIRED_IN_0_7_0 = (
    "half/plain_decimal",
    "half/plain_latex",
    "half/boxed_blank_then_plain",
    "half/boxed_unclosed",
    "half/fbox",
    "whole/plain",
)


def test_math_reads_lax_and_malformed_answers_as_nemo_gyms_original_does(catalogue: Path, tmp_path: Path) -> None:
    """math (math_with_judge, library only): which text math-verify reads and how; unboxed right answers are the
    one difference, nemo-gym 0.7.0's newer box requirement."""
    judge = {"type": "responses_api_models", "name": "policy"}
    nemo_gym = {
        "nemo_gym": "math_with_judge",
        "options": {
            "should_use_judge": False,
            "judge_model_server": judge,
            "judge_responses_create_params": {"input": []},
        },
    }
    got = both_sides(tmp_path, math_variants(), {"server": "math"}, nemo_gym)
    assert_same_rewards(got, {name: (1.0, 0.0) for name in MATH_BOX_REQUIRED_IN_0_7_0})


def code_gen_variants() -> list[tuple[str, dict[str, Any], list[dict[str, Any]]]]:
    """A right a+b program, fenced and placed every which way, plus <think> tags in the answer or the reasoning."""
    case = next(c for c in read_jsonl(DIFFERENTIAL / "code_gen.jsonl") if c["case"] == "stdio: correct")
    task = {k: v for k, v in case.items() if k not in ("response", "expected_reward", "expected_fields", "case")}
    code, wrong = "a, b = map(int, input().split())\nprint(a + b)", "print(0)"
    texts = {
        "python_fence": f"Here:\n```python\n{code}\n```\n",
        "bare_fence": f"```\n{code}\n```",
        "cpp_tag": f"```cpp\n{code}\n```",
        "no_fence": code,
        "one_fence": f"```python\n{code}",
        "two_blocks_last_right": f"```python\n{wrong}\n```\nbetter:\n```python\n{code}\n```",
        "two_blocks_last_wrong": f"```python\n{code}\n```\nor:\n```python\n{wrong}\n```",
        "fence_inline_with_code": f"```python {code.splitlines()[0]}\n{code.splitlines()[1]}\n```",
        "indented_fences": f"  ```python\n{code}\n  ```",
        "crlf": f"```python\r\n{code.replace(chr(10), chr(13) + chr(10))}\r\n```",
        "think_in_answer": f"<think>easy</think>\n```python\n{code}\n```",
        "blank": "  \n",
    }
    out = [(name, task, [message(text)]) for name, text in texts.items()]
    fenced = f"```python\n{code}\n```"
    out += [
        ("split_over_parts", task, [message("```python\n" + code[:10], code[10:] + "\n```")]),
        ("split_over_messages", task, [message("```python\n" + code[:10]), message(code[10:] + "\n```")]),
        ("only_in_reasoning", task, [reasoning(fenced), message("done")]),
        ("one_think_in_reasoning", task, [reasoning("<think>x</think>"), message(fenced)]),
        ("two_thinks_in_reasoning", task, [reasoning("<think>x</think><think>y</think>"), message(fenced)]),
    ]
    return out


def test_code_gen_reads_lax_and_malformed_answers_as_nemo_gyms_original_does(catalogue: Path, tmp_path: Path) -> None:
    """code_gen: which fenced block is the program (last two fence lines, tag ignored, none without two fences),
    split answers, reasoning, and the <think>-tag penalty."""
    got = both_sides(tmp_path, code_gen_variants(), {"server": "code_gen"}, {"nemo_gym": "code_gen"})
    assert_same_rewards(got)


def test_counter_reads_lax_and_malformed_calls_as_nemo_gyms_original_does(catalogue: Path, tmp_path: Path) -> None:
    """counter (example_session_state_mgmt): verify reads the session's count, so what counts is how the
    increment_counter arguments are read: strings, floats, booleans, extra or missing keys, not JSON."""
    row = read_jsonl(catalogue / "example_session_state_mgmt" / "data" / "example.jsonl")[0]  # 3 -> 6
    step = row["expected_count"] - row["initial_count"]
    forms = {
        "int": f'{{"count": {step}}}',
        "string": f'{{"count": "{step}"}}',
        "padded_string": f'{{"count": " {step} "}}',
        "float": f'{{"count": {step}.0}}',
        "fraction": f'{{"count": {step}.5}}',
        "exponent": f'{{"count": {step}e0}}',
        "bool": '{"count": true}',
        "null": '{"count": null}',
        "extra_key": f'{{"count": {step}, "note": 1}}',
        "other_key": f'{{"amount": {step}}}',
        "not_json": f'{{"count": {step}',
        "a_list": f"[{step}]",
    }
    variants = [
        (name, row, called("increment_counter", args, answer=str(row["expected_count"])))
        for name, args in forms.items()
    ]
    variants.append(("no_call", row, [message(str(row["expected_count"]))]))
    ours, nemo_gym = {"server": "counter"}, {"nemo_gym": "example_session_state_mgmt"}
    assert_same_rewards(both_sides(tmp_path, variants, ours, nemo_gym))
