"""Hosted NeMo Gym agent servers (nemo-gym 0.7.0's ``simple_agent`` ...) as gym-runtime agent workers.

Real parts only: the real `gym-runtime` CLI in subprocesses, a real nats-server, the agent's own
code in a worker child on its built environment (Python >= 3.13, the shared base layer), native
and hosted resource workers; the replay and scripted models are the only doubles. The reference
for every row is our own ``agents.simple`` run on the same config, the same input and the same
replayed model outputs.

Without a Python >= 3.13 on the machine these tests skip, unless GYM_REQUIRE_HOSTING=1 (CI).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from gym_runtime.nemo_gym.hosting import env as hosting_env
from tests.helpers import REPO, cli, read_jsonl, without_run_identity, write_jsonl
from tests.hosting import assert_hosted_worker_opens_no_port, catalogue_root
from tests.pools import start_collect, wait_until

CRASHY = REPO / "tests" / "data" / "nemo_servers" / "crashy"
EPISODES = REPO / "tests" / "data" / "nemo_servers" / "episodes"
SLEEPY_AGENT = REPO / "tests" / "data" / "nemo_agents" / "sleepy_agent"


@pytest.fixture(scope="module")
def catalogue() -> Path:
    """The installed catalogue (nemo-gym's resources_servers) in the shared base layer, built if missing
    (with simple_agent's environment: `env build --agent`)."""
    return catalogue_root(
        "--server", "example_single_tool_call", "--agent", "simple_agent", "--server", "toolsandbox",
        "--agent", "toolsandbox_agent",
    )  # fmt: skip


def with_token_ids(src: Path, dst: Path) -> Path:
    """The recording with token ids on the last item of every model turn (contiguous, as a trainer's
    model returns them), so the rows show whether ids survive NeMo Gym's own agent."""
    rows = []
    for row in read_jsonl(src):
        items, ids, nxt = row["response"]["output"], [1, 2, 3], 10
        for i, item in enumerate(items):
            if item["type"] == "function_call_output":
                ids, nxt = [*ids, nxt], nxt + 1
                continue
            if i + 1 == len(items) or items[i + 1]["type"] == "function_call_output":
                gen, nxt = [nxt, nxt + 1], nxt + 2
                item.update(prompt_token_ids=list(ids), generation_token_ids=gen, generation_log_probs=[-0.5, -0.25])
                ids = [*ids, *gen]
        rows.append(row)
    return write_jsonl(dst, rows)


def run_agents(
    tmp_path: Path,
    resource: dict[str, Any],
    policy: dict[str, Any],
    data: Path,
    agents: dict[str, dict[str, Any]],
) -> dict[str, list[dict[str, Any]]]:
    """Each agent of one config over ``data``, in one `run` (the rows once per agent, each naming its agent):
    every agent's rows, in task order. The config has one more hosted agent that no row names, which `run`
    must not start: the hosted agents ready (each a worker child) are exactly those the rows go to."""
    cfg = tmp_path / "config.yaml"
    entries = {
        n: {"model": "policy", "resource": "env", "max_steps": 10, "max_attempts": 1, **a} for n, a in agents.items()
    }
    idle = {"idle": {"model": "policy", "resource": "env", "nemo_gym": "simple_agent"}}
    cfg.write_text(json.dumps({"models": {"policy": policy}, "resources": {"env": resource}, "agents": entries | idle}))
    rows_in = read_jsonl(data)
    tagged = write_jsonl(tmp_path / "tagged.jsonl", [{**r, "agent_ref": {"name": n}} for n in agents for r in rows_in])
    path = tmp_path / "out.jsonl"
    r = cli("run", str(cfg), "-i", str(tagged), "-o", str(path), "--log-level", "info", timeout=600)
    assert r.returncode in (0, 1), r.stderr  # 1: some rows are failure rows (checked by the caller)
    ready = [json.loads(line) for line in r.stderr.splitlines() if '"worker.ready"' in line]
    hosted = {e["worker"] for e in ready if e["worker"].startswith("agents.")}
    assert hosted == {f"agents.{n}" for n, a in agents.items() if "nemo_gym" in a}, hosted  # not agents.idle
    out: dict[str, list[dict[str, Any]]] = {n: [] for n in agents}
    for row in read_jsonl(path):
        out[row["agent_ref"]["name"]].append(row)
    for k, name in enumerate(agents):  # agent k's rows are lines k*n... of the tagged file: its own task order
        for row in out[name]:
            row["_ng_task_index"] -= k * len(rows_in)
        out[name].sort(key=lambda row: row["_ng_task_index"])
    return out


def write_config(path: Path, agents: dict[str, Any], *, server: str, model: dict[str, Any] | None = None) -> Path:
    """A config of one scripted model ``policy``, one native resource ``env`` and ``agents``."""
    cfg = {"models": {"policy": model or {"adapter": "scripted"}}, "resources": {"env": {"server": server}}}
    path.write_text(json.dumps({**cfg, "agents": agents}))
    return path


def start_workers(cfg: Path, url: str, *only: str) -> subprocess.Popen[str]:
    """`gym-runtime start` (of ``only``, or every entry) on the bus at ``url``, once its workers are ready."""
    args = [a for o in only for a in ("--only", o)]
    p = subprocess.Popen(
        [sys.executable, "-m", "gym_runtime.cli", "start", str(cfg), "--nats", url, *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert p.stdout is not None and "ready" in p.stdout.readline()
    return p


def comparable(row: dict[str, Any]) -> dict[str, Any]:
    """A row less what differs by design: the agent's name, the response's creation time, the ids the
    scripted model gives (``resp_scripted_N``, ``msg_scripted_N``: it numbers its answers in the order it gives
    them, across the agents of one run), the null optional fields (``defer_loading``, ``description``) NeMo
    Gym's Responses schema adds to each tool it echoes, the provenance (each agent has its own fingerprint and
    workers) and the cost's timings (the calls and tokens stay: both agents made the same model calls)."""
    row = {k: v for k, v in without_run_identity(row).items() if k != "agent_ref"}
    response = {k: v for k, v in row["response"].items() if k != "created_at" and not _scripted_id(k, v)}
    response["tools"] = [{k: v for k, v in t.items() if v is not None} for t in response["tools"]]
    response["output"] = [{k: v for k, v in o.items() if not _scripted_id(k, v)} for o in response["output"]]
    return {**row, "response": response}


def _scripted_id(key: str, value: Any) -> bool:
    return key == "id" and isinstance(value, str) and value.startswith(("resp_scripted_", "msg_scripted_"))


def token_ids(row: dict[str, Any]) -> list[Any]:
    return [
        (o["type"], o.get("prompt_token_ids"), o.get("generation_token_ids"), o.get("generation_log_probs"))
        for o in row["response"]["output"]
    ]


def test_simple_agent_on_a_native_resource_rows_equal_agents_simple(catalogue: Path, tmp_path: Path) -> None:
    """NeMo Gym's simple_agent, unchanged, against our native weather port: its tool calls reach our resource
    workers over the bus, its model calls our model workers (token ids kept per turn); every row equals
    agents.simple's for the same replayed outputs."""
    sdir = catalogue / "example_single_tool_call" / "data"
    rollouts = with_token_ids(sdir / "example_rollouts.jsonl", tmp_path / "rollouts.jsonl")
    rows = run_agents(
        tmp_path,
        {"server": "resources.weather"},
        {"adapter": "replay", "rollouts": str(rollouts)},
        sdir / "example.jsonl",
        {"ng": {"nemo_gym": "simple_agent"}, "ours": {"agent": "agents.simple"}},
    )
    assert len(rows["ng"]) == len(rows["ours"]) == 5
    assert [r["agent_ref"]["name"] for r in rows["ng"]] == ["ng"] * 5
    assert [comparable(r) for r in rows["ng"]] == [comparable(r) for r in rows["ours"]]
    assert [r["reward"] for r in rows["ng"]] == [1.0] * 5
    calls = [o for r in rows["ng"] for o in r["response"]["output"] if o["type"] == "function_call_output"]
    assert calls and all("weather_description" in json.loads(o["output"]) for o in calls)  # our tool answered
    first = token_ids(rows["ng"][0])
    assert first[0] == ("function_call", [1, 2, 3], [10, 11], [-0.5, -0.25])
    assert first == token_ids(rows["ours"][0])


def test_simple_agent_on_a_hosted_resource_rows_equal_agents_simple(catalogue: Path, tmp_path: Path) -> None:
    """The same against NeMo Gym's own example_single_tool_call, hosted: two hosted children (agent and
    resource) talking over our bus; rewards are the recording's (3 of 5), rows equal agents.simple's."""
    sdir = catalogue / "example_single_tool_call" / "data"
    rows = run_agents(
        tmp_path,
        {"nemo_gym": "example_single_tool_call"},
        {"adapter": "replay", "rollouts": str(sdir / "example_rollouts.jsonl")},
        sdir / "example.jsonl",
        {"ng": {"nemo_gym": "simple_agent"}, "ours": {"agent": "agents.simple"}},
    )
    assert [comparable(r) for r in rows["ng"]] == [comparable(r) for r in rows["ours"]]
    assert sorted(r["reward"] for r in rows["ng"]) == sorted(
        r["reward"] for r in read_jsonl(sdir / "example_rollouts.jsonl")
    )
    assert all("failure_kind" in r for r in rows["ng"])  # the hosted server's verify fields stay in the row


def test_single_turn_agents_on_hosted_mcqa_rows_equal_agents_simple(catalogue: Path, tmp_path: Path) -> None:
    """simple_agent, non_executing_simple_agent and tool_simulation_agent (one model call, then /verify; the
    last with no /seed_session: our session is seeded with the verify) on NeMo Gym's mcqa, hosted."""
    sdir = catalogue / "mcqa" / "data"
    rows = run_agents(
        tmp_path,
        {"nemo_gym": "mcqa"},
        {"adapter": "replay", "rollouts": str(sdir / "example_rollouts.jsonl")},
        sdir / "example.jsonl",
        {
            "ours": {"agent": "agents.simple"},
            "simple": {"nemo_gym": "simple_agent"},
            "non_executing": {"nemo_gym": "non_executing_simple_agent"},
            "tool_simulation": {"nemo_gym": "tool_simulation_agent"},
        },
    )
    want = [comparable(r) for r in rows["ours"]]
    assert len(want) == 5 and sum(r["reward"] for r in want) == 4.0
    for name in ("simple", "non_executing", "tool_simulation"):
        assert [comparable(r) for r in rows[name]] == want, name


def test_a_crashing_tool_is_answered_as_nemo_gyms_runner_answers(catalogue: Path, tmp_path: Path) -> None:
    """A hosted server's crashing tool: the model reads its repr(e) under simple_agent as under agents.simple;
    the server's own failure marker (_ng_failure_class) stays in the row."""
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
    rows = run_agents(
        tmp_path,
        {"nemo_gym": str(CRASHY), "options": {"label": "from-config"}},
        {"adapter": "scripted"},
        data,
        {"ng": {"nemo_gym": "simple_agent"}, "ours": {"agent": "agents.simple"}},
    )
    (ng,), (ours,) = rows["ng"], rows["ours"]
    outs = [o["output"] for o in ng["response"]["output"] if o["type"] == "function_call_output"]
    assert any(json.loads(o).startswith("ValueError('boom ") for o in outs)
    assert ng["reward"] == 0.25 and ng["_ng_failure_class"] == "crashy_verdict"
    assert comparable(ng) == comparable(ours)


def test_a_verifier_that_raises_is_a_verify_error_row_and_the_worker_keeps_serving(
    catalogue: Path, tmp_path: Path
) -> None:
    """A native resource whose verify raises: the hosted agent's row is our verify_error failure row (not
    NeMo Gym's HTTP 500, not a reward 0), and the same worker goes on to score the other rows."""
    rows_in = [
        {"responses_create_params": {"input": f"weather in city {i}?"}, **({"explode": True} if i == 1 else {})}
        for i in range(3)
    ]
    data = write_jsonl(tmp_path / "in.jsonl", rows_in)
    rows = run_agents(
        tmp_path,
        {"server": "tests.envs.flaky"},
        {"adapter": "scripted"},
        data,
        {"ng": {"nemo_gym": "simple_agent"}},
    )
    assert [(r["_ng_task_index"], r["reward"]) for r in rows["ng"]] == [(0, 1.0), (2, 1.0)]
    (failure,) = read_jsonl(tmp_path / "out_failures.jsonl")
    assert failure["_ng_task_index"] == 1 and failure["error_class"] == "verify_error"
    assert "this verifier always fails" in failure["error"]


def test_an_agent_that_blocks_its_loop_past_the_liveness_window_loses_no_rollout(
    catalogue: Path, tmp_path: Path
) -> None:
    """A hosted agent whose /run blocks its own event loop (time.sleep 11 s, past the bus's 10 s liveness
    window) while another rollout's /verify is out: the worker's bus loop is not the agent's, so it reads
    the verify's reply and sends its keepalives meanwhile; every row is scored, none is worker_lost (one
    attempt each)."""
    rows_in = [{"responses_create_params": {"input": f"weather in city {i}?"}} for i in range(4)]
    rows_in[0]["block_s"] = 11.0
    rows = run_agents(
        tmp_path,
        {"server": "resources.weather"},
        {"adapter": "scripted"},
        write_jsonl(tmp_path / "in.jsonl", rows_in),
        {"ng": {"nemo_gym": str(SLEEPY_AGENT)}},
    )["ng"]
    failures = tmp_path / "out_failures.jsonl"
    lost = [(f["_ng_task_index"], f["error_class"]) for f in read_jsonl(failures)] if failures.exists() else []
    assert not lost
    assert [(r["_ng_task_index"], r["reward"], r.get("block_s")) for r in rows] == [
        (0, 1.0, 11.0),
        *((i, 1.0, None) for i in range(1, 4)),
    ]


def test_agent_and_nemo_gym_together_is_one_line_exit_2(tmp_path: Path) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        json.dumps(
            {
                "models": {"policy": {"adapter": "scripted"}},
                "resources": {"env": {"server": "resources.weather"}},
                "agents": {
                    "a": {"agent": "agents.simple", "nemo_gym": "simple_agent", "model": "policy", "resource": "env"}
                },
            }
        )
    )
    data = write_jsonl(tmp_path / "in.jsonl", [{"responses_create_params": {"input": "hi"}}])
    r = cli("run", str(cfg), "-i", str(data), "-o", str(tmp_path / "out.jsonl"))
    assert r.returncode == 2, r.stderr
    assert "exactly one of agent" in r.stderr and "Traceback" not in r.stderr


def test_an_unknown_nemo_gym_agent_is_one_line_exit_2(catalogue: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        json.dumps(
            {
                "models": {"policy": {"adapter": "scripted"}},
                "resources": {"env": {"server": "resources.weather"}},
                "agents": {"a": {"nemo_gym": "no_such_agent", "model": "policy", "resource": "env"}},
            }
        )
    )
    data = write_jsonl(tmp_path / "in.jsonl", [{"responses_create_params": {"input": "hi"}}])
    r = cli("run", str(cfg), "-i", str(data), "-o", str(tmp_path / "out.jsonl"))
    assert r.returncode == 2, r.stderr
    assert "no_such_agent: no such agent server" in r.stderr and "Traceback" not in r.stderr


def test_start_runs_a_hosted_agent_on_its_environment_with_no_port_of_its_own(
    catalogue: Path, nats_server: Any, tmp_path: Path
) -> None:
    """`start --only agents.NAME` puts the hosted agent's worker in a child on the built layer's interpreter;
    that process listens on no socket (the agent's app is called with one ASGI request a rollout) and talks
    only to the bus."""

    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        json.dumps(
            {
                "models": {"policy": {"adapter": "scripted"}},
                "resources": {"env": {"server": "resources.weather"}},
                "agents": {"ng": {"nemo_gym": "simple_agent", "model": "policy", "resource": "env"}},
            }
        )
    )
    assert_hosted_worker_opens_no_port(cfg, nats_server.url, "agents.ng")


def turns(row: dict[str, Any]) -> list[Any]:
    """A trajectory's items by type, role and text (NeMo Gym writes ``id``/``status`` nulls on user turns)."""
    out = []
    for o in row["response"]["output"]:
        content = o.get("content")
        text = content if isinstance(content, str) else [p.get("text") for p in content or []]
        out.append((o["type"], o.get("role"), text, o.get("call_id"), o.get("output")))
    return out


def test_gymnasium_agent_on_a_hosted_gym_server_equals_agents_multi_turn(catalogue: Path, tmp_path: Path) -> None:
    """NeMo Gym's gymnasium_agent, unchanged: its /reset and /step reach our GymResource protocol (here NeMo
    Gym's example_multi_turn_gymnasium, hosted), its reward is the sum of step rewards; the trajectory,
    reward and episode fields equal our agents.multi_turn's on the same replayed recording."""
    sdir = catalogue / "example_multi_turn_gymnasium" / "data"
    rows_in = [{k: v for k, v in row.items() if k != "agent_ref"} for row in read_jsonl(sdir / "example.jsonl")]
    rows = run_agents(
        tmp_path,
        {"nemo_gym": "example_multi_turn_gymnasium"},
        {"adapter": "replay", "rollouts": str(sdir / "example_rollouts.jsonl")},
        write_jsonl(tmp_path / "in.jsonl", rows_in),
        {
            "ng": {"nemo_gym": "gymnasium_agent", "max_steps": 8},
            "ours": {"agent": "agents.multi_turn", "max_steps": 8, "options": {"user": "env", "max_turns": 5}},
        },
    )
    assert len(rows["ng"]) == len(rows["ours"]) == 5
    for ng, ours in zip(rows["ng"], rows["ours"], strict=True):
        assert turns(ng) == turns(ours)
        assert len(turns(ng)) > 2  # several turns: the server's observations became user turns
        for key in ("reward", "terminated", "truncated", "info", "expected_answer"):
            assert ng[key] == ours[key], key
    recorded = sorted(r["reward"] for r in read_jsonl(sdir / "example_rollouts.jsonl"))
    assert sorted(r["reward"] for r in rows["ng"]) == recorded


def test_group_repeats_reach_a_cohort_scoring_server_together(catalogue: Path, tmp_path: Path) -> None:
    """`group_repeats` for a hosted agent: a task's K repeats are one group task, run as K concurrent `/run`
    calls of simple_agent (rows carrying `_ng_task_index`/`_ng_rollout_index`, as NeMo Gym's runner sends
    them), so a server that holds each verify until its task's K repeats arrived (genrm_compare's cohort)
    scores them together, even with one slot per agent; one row per repeat, exactly once."""
    k = 3
    rows_in = [{"responses_create_params": {"input": f"weather in city {i}?"}, "cohort_size": k} for i in range(2)]
    data = write_jsonl(tmp_path / "in.jsonl", rows_in)
    agent = {"nemo_gym": "simple_agent", "model": "policy", "resource": "env", "max_steps": 4, "max_attempts": 1}
    cfg = write_config(
        tmp_path / "config.yaml", {"ng": {**agent, "group_repeats": True, "concurrency": 1}}, server="tests.envs.cohort"
    )
    out = tmp_path / "out.jsonl"
    r = cli("run", str(cfg), "-i", str(data), "-o", str(out), "--repeats", str(k), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = sorted(read_jsonl(out), key=lambda row: (row["_ng_task_index"], row["_ng_rollout_index"]))
    assert [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in rows] == [(t, i) for t in range(2) for i in range(k)]
    assert [r["cohort"] for r in rows] == [[0, 1, 2]] * (2 * k)  # each verify saw its task's K repeats
    assert [r["reward"] for r in rows] == [1.0] * (2 * k)


def test_a_failed_group_gives_every_repeat_its_own_turns_and_cost(catalogue: Path, tmp_path: Path) -> None:
    """Issue 66: a hosted agent's group task (K concurrent `/run` calls of simple_agent) one of whose repeats'
    verify raises fails as a whole; each repeat's failure row keeps its own turns so far (the tool call and the
    answer its `/run` made, `partial`), its attribution and its own cost (two model calls, one tool call), where
    the group's calls all sat on its first row with no trajectory on any."""
    k = 3
    weather = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tools = [{"type": "function", "name": "get_weather", "parameters": weather, "strict": True}]
    params = {"input": "weather in city 0?", "tools": tools}
    data = write_jsonl(tmp_path / "in.jsonl", [{"responses_create_params": params, "fail_index": 1}])
    agent = {"nemo_gym": "simple_agent", "model": "policy", "resource": "env", "max_steps": 4, "max_attempts": 1}
    cfg = write_config(tmp_path / "config.yaml", {"ng": {**agent, "group_repeats": True}}, server="tests.envs.cohort")
    out = tmp_path / "out.jsonl"
    r = cli("run", str(cfg), "-i", str(data), "-o", str(out), "--repeats", str(k), timeout=600)
    failures = sorted(read_jsonl(tmp_path / "out_failures.jsonl"), key=lambda f: f["_ng_rollout_index"])
    assert [f["_ng_rollout_index"] for f in failures] == list(range(k)), r.stderr[-3000:]
    for f in failures:
        assert f["error_class"] == "verify_error" and f["failure_attribution"] == "environment", f
        assert f["partial"] is True and f["response"]["status"] == "incomplete"
        types = [i["type"] for i in f["response"]["output"]]
        assert types == ["function_call", "message"], types  # its own two turns, not the group's six
        cost = f["cost"]
        assert cost["models"]["policy"]["calls"] == 2 and cost["tool_ms"] >= 0, cost
    assert sum(f["cost"]["models"]["policy"]["calls"] for f in failures) == 2 * k


def test_a_group_whose_worker_is_killed_mid_group_ends_with_k_rows_from_one_run(
    catalogue: Path, nats_server: Any, tmp_path: Path
) -> None:
    """A hosted agent's group task whose worker is SIGKILLed while the group is in flight (two repeats
    scored, the last one held by the environment): the group is redelivered whole to a new worker and ends
    with exactly K rows, none duplicated, all from the redelivered run (the killed run stored none: rows
    are stored after the whole group ran; a worker killed within the stores themselves leaves a mixed
    group, tests/test_group_store.py)."""
    k = 3
    hold = tmp_path / "hold"
    hold.touch()
    data = write_jsonl(
        tmp_path / "in.jsonl",
        [{"responses_create_params": {"input": "weather in city 0?"}, "hold_file": str(hold), "hold_index": k - 1}],
    )
    agent = {"nemo_gym": "simple_agent", "model": "policy", "resource": "env", "max_steps": 4}
    cfg = write_config(
        tmp_path / "config.yaml",
        {"ng": {**agent, "group_repeats": True, "ack_wait_s": 2.0, "max_attempts": 4}},
        server="tests.envs.cohort",
    )

    def start(*only: str) -> subprocess.Popen[str]:
        return start_workers(cfg, nats_server.url, *only)

    procs = [start("models.policy", "resources.env"), start("agents.ng")]
    collect = None
    try:
        r = cli("publish", str(cfg), "-i", str(data), "--nats", nats_server.url, "--batch", "g", "--repeats", str(k))
        assert r.returncode == 0, r.stderr
        collect = start_collect(nats_server.url, "g", tmp_path / "out.jsonl")
        wait_until(lambda: Path(str(hold) + ".held").exists(), timeout=60)
        killed = procs.pop()
        workers = psutil.Process(killed.pid).children(recursive=True)
        for p in [killed, *workers]:
            os.kill(p.pid, signal.SIGKILL)
        killed.wait(10)
        hold.unlink()
        procs.append(start("agents.ng"))
        _, err = collect.communicate(timeout=120)
        assert collect.returncode == 0, err
    finally:
        for p in [*procs, *([collect] if collect else [])]:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(60)
    rows = read_jsonl(tmp_path / "out.jsonl")
    assert [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in rows] == [(0, i) for i in range(k)]
    assert [r["first_run"] for r in rows] == [False] * k  # every row from the redelivered run


def test_start_with_a_hosted_agent_at_replicas_2_serves_one_batch_from_both_exactly_once(
    catalogue: Path, nats_server: Any, tmp_path: Path
) -> None:
    """`replicas: 2` on a hosted agent: `start` runs two worker children on the built environment, both pull
    from the agent's one work queue, and a batch of 40 ends with 40 rows, each once, served by both."""
    n = 40
    data = write_jsonl(
        tmp_path / "in.jsonl", [{"responses_create_params": {"input": f"weather in city {i}?"}} for i in range(n)]
    )
    agent = {"nemo_gym": "simple_agent", "model": "policy", "resource": "env", "max_steps": 4}
    cfg = write_config(
        tmp_path / "config.yaml",
        {"ng": {**agent, "replicas": 2, "concurrency": 2}},
        server="resources.weather",
        model={"adapter": "scripted", "delay_s": 0.05},
    )
    proc = start_workers(cfg, nats_server.url)
    try:
        hosted = [
            c for c in psutil.Process(proc.pid).children() if c.cmdline()[0].startswith(str(hosting_env.cache_dir()))
        ]
        assert len(hosted) == 2  # one child per replica, on the built layer's interpreter
        r = cli("publish", str(cfg), "-i", str(data), "--nats", nats_server.url, "--batch", "r2")
        assert r.returncode == 0, r.stderr
        r = cli("collect", "--batch", "r2", "--nats", nats_server.url, "-o", str(tmp_path / "out.jsonl"), timeout=300)
        assert r.returncode == 0, r.stderr
        status = json.loads(cli("status", "--nats", nats_server.url, "--json").stdout)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    rows = read_jsonl(tmp_path / "out.jsonl")
    assert sorted(r["_ng_task_index"] for r in rows) == list(range(n))
    assert [r["reward"] for r in rows] == [1.0] * n
    served = sorted(w["completed"] for w in status["workers"] if w.get("role") == "agent" and w.get("name") == "ng")
    assert len(served) == 2 and sum(served) == n and served[0] > 0, served  # both replicas served the batch


def test_toolsandbox_agent_on_its_hosted_server_scores_every_row(catalogue: Path, tmp_path: Path) -> None:
    """NeMo Gym's toolsandbox_agent and toolsandbox server, both unchanged and hosted: the agent's own protocol
    (/seed_session's env_id, observations and tools; /step and /close by env_id; /verify reading
    response.env_id) reaches the server as it sent it, and the server's user simulator calls our model workers
    at /v1/chat/completions. Every row of the server's example.jsonl ends with the milestone score the server's
    own evaluation computed at /close (scripted answers for policy and user simulator alike); a row the
    server's seed refuses is a tool_error failure row with the server's message, not a reward 0."""
    refused = {"task_idx": 99999, "responses_create_params": {"input": []}}
    rows_in = [*read_jsonl(catalogue / "toolsandbox" / "data" / "example.jsonl"), refused]
    cfg = tmp_path / "config.yaml"
    user = {"type": "responses_api_models", "name": "policy"}
    cfg.write_text(
        json.dumps(
            {
                "models": {"policy": {"adapter": "scripted"}},
                "resources": {"env": {"nemo_gym": "toolsandbox", "options": {"user_model_server": user}}},
                "agents": {"ng": {"nemo_gym": "toolsandbox_agent", "model": "policy", "resource": "env"}},
            }
        )
    )
    out, trace = tmp_path / "out.jsonl", tmp_path / "trace.jsonl"
    data = write_jsonl(tmp_path / "in.jsonl", rows_in)
    r = cli("run", str(cfg), "-i", str(data), "-o", str(out), "--agent", "ng", "--trace-file", str(trace), timeout=600)
    assert r.returncode == 1, r.stderr  # one failure row, below
    rows = sorted(read_jsonl(out), key=lambda row: row["_ng_task_index"])
    assert [r["task_idx"] for r in rows] == [0, 1, 2, 3, 4]
    assert rows[0]["scenario"] == "add_contact_with_name_and_phone_number"
    for row in rows:
        assert row["exception_type"] is None, row  # scored by the server's own Evaluation at /close
        assert row["reward"] == row["similarity"] == row["milestone_similarity"] and 0.0 < row["reward"] < 1.0
        kinds = [o["type"] for o in row["response"]["output"]]
        assert kinds[0] == "function_call" and "function_call_output" in kinds  # the sandbox ran its tools
        assert kinds[-1] == "message"  # the agent's text went to the user simulator, which ended the episode
    assert len({r["reward"] for r in rows}) >= 2  # the scenarios score differently
    (failure,) = read_jsonl(tmp_path / "out_failures.jsonl")
    assert failure["error_class"] == "tool_error" and "task_idx=99999 out of range" in failure["error"]
    spans = {s["span_id"]: s for s in read_jsonl(trace)}
    user_calls = [
        s
        for s in spans.values()
        if s["name"] == "generate policy gym.call.model.policy"
        and spans.get(s["parent_span_id"], {}).get("name", "").startswith("process gym.res.env.")
    ]
    assert len(user_calls) >= 5  # the user simulator's calls, made from the resource worker: one per rollout at least


def test_an_agents_own_protocol_passes_through_and_a_step_that_raises_is_a_tool_error_row(
    catalogue: Path, tmp_path: Path
) -> None:
    """toolsandbox_agent against a small server of the same protocol (tests/data/nemo_servers/episodes): the
    env_id of its seed reply addresses /step and /close, its /verify finds the score by response.env_id (no
    env_id there: reward 0); a /step that raises (HTTP 500) makes a tool_error failure row, and the same
    workers go on to score the next row."""
    rows_in = [{"task_idx": i, "responses_create_params": {"input": []}} for i in range(3)]
    rows = run_agents(
        tmp_path,
        {"nemo_gym": str(EPISODES)},
        {"adapter": "scripted"},
        write_jsonl(tmp_path / "in.jsonl", rows_in),
        {"ng": {"nemo_gym": "toolsandbox_agent"}},
    )["ng"]
    assert [(r["task_idx"], r["reward"], r["steps"]) for r in rows] == [(0, 0.1, 2), (2, 0.1, 2)]
    outputs = [o.get("output") for o in rows[0]["response"]["output"] if o["type"] == "function_call_output"]
    assert outputs == ["added 1"]
    (failure,) = read_jsonl(tmp_path / "out_failures.jsonl")
    assert failure["_ng_task_index"] == 1 and failure["error_class"] == "tool_error"
    assert "/step: HTTP 500" in failure["error"] and "the episode exploded" in failure["error"]


def test_each_rollout_reaches_the_server_with_its_task_and_rollout_index(catalogue: Path, tmp_path: Path) -> None:
    """Without group_repeats too, simple_agent's /run body carries `_ng_task_index`/`_ng_rollout_index` as NeMo
    Gym's runner sends them, so its /seed_session and /verify do (genrm_compare answers 422 without them):
    tests.envs.cohort's verify reports the rollout indices its task's cohort read (-1: none)."""
    row = {"responses_create_params": {"input": "weather in city 0?"}, "cohort_size": 2, "cohort_wait_s": 60.0}
    data = write_jsonl(tmp_path / "in.jsonl", [row])
    agent = {"nemo_gym": "simple_agent", "model": "policy", "resource": "env", "max_steps": 4, "max_attempts": 1}
    cfg = write_config(tmp_path / "config.yaml", {"ng": agent}, server="tests.envs.cohort")
    out = tmp_path / "out.jsonl"
    r = cli("run", str(cfg), "-i", str(data), "-o", str(out), "--repeats", "2", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [r["cohort"] for r in read_jsonl(out)] == [[0, 1], [0, 1]]


def test_a_verify_field_cannot_replace_a_row_key_under_a_hosted_agent(catalogue: Path, tmp_path: Path) -> None:
    """Issue 52, item 4: the hosted agent's ``/verify`` answer put the environment's fields after ``reward``
    (``{**body, "reward": ..., **verdict.fields}``), and NeMo Gym's agent returns that answer's ``response`` as
    its own. A field naming a runtime key that is not an echo of the request now makes the row a
    ``verify_error`` naming the key; the echoes of the others are no forgery."""
    sdir = catalogue / "example_single_tool_call" / "data"
    tasks = write_jsonl(
        tmp_path / "tasks.jsonl", [{**r, "forge": i % 2 == 0} for i, r in enumerate(read_jsonl(sdir / "example.jsonl"))]
    )
    cfg = write_config(
        tmp_path / "config.yaml",
        {"ng": {"model": "policy", "resource": "env", "nemo_gym": "simple_agent", "max_steps": 10, "max_attempts": 1}},
        server="tests.envs.row_forger",
        model={"adapter": "replay", "rollouts": str(sdir / "example_rollouts.jsonl")},
    )
    out = tmp_path / "out.jsonl"
    r = cli("run", str(cfg), "-i", str(tasks), "-o", str(out), timeout=600)
    assert r.returncode == 1, r.stderr
    rows, failures = read_jsonl(out), read_jsonl(tmp_path / "out_failures.jsonl")
    assert sorted(f["_ng_task_index"] for f in failures) == [0, 2, 4], failures  # before: rows that say "forged"
    assert all(f["error_class"] == "verify_error" and "'response'" in f["error"] for f in failures), failures
    assert sorted(r["_ng_task_index"] for r in rows) == [1, 3]
    assert all(r["note"] == "echo" and r["reward"] == 1.0 and "forged" not in r["response"] for r in rows)
