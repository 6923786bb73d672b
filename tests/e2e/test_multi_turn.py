"""Multi-turn rollouts end to end: real nats-server, real workers; only the LLM is faked.

User turns come from scripted follow-ups, a gymnasium-style resource, or an LLM
user simulator (a model of the config with its own workers), here played by the
``scripted`` and ``replay`` test doubles.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import yaml

from gym_runtime.config import Config, config_from_dict, resolve_config
from gym_runtime.errors import ConfigError
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.service.runner import RunHooks, RunResult, make_workers, run_batch, selected, start_workers
from gym_runtime.transport.bus import Bus
from tests.helpers import COMPAT, REPO, prompt_key, read_jsonl, write_jsonl

MTG = COMPAT / "example_multi_turn_gymnasium"
CAL = COMPAT / "calendar"
MTG_DATA = REPO / "resources/multi_turn_gymnasium/data/example.jsonl"
AGENT = "example_multi_turn_gymnasium_agent"


def config(
    *,
    options: dict[str, Any],
    resource: str = "resources.multi_turn_gymnasium",
    policy: dict[str, Any] | None = None,
    user_sim: dict[str, Any] | None = None,
    agent: dict[str, Any] | None = None,
) -> dict[str, Any]:
    models: dict[str, Any] = {"policy": policy or {"adapter": "scripted"}}
    if user_sim is not None:
        models["user_sim"] = user_sim
    return {
        "namespace": "gym",
        "models": models,
        "resources": {"env": {"server": resource}},
        "agents": {
            AGENT: {
                "agent": "agents.multi_turn",
                "model": "policy",
                "resource": "env",
                "max_steps": 8,
                "timeout_s": 60,
                "options": options,
                **(agent or {}),
            }
        },
    }


async def run(raw: dict[str, Any], url: str, data: Path, out: Path, repeats: int = 1, **kw: Any) -> RunResult:
    cfg = config_from_dict(copy.deepcopy(raw))
    return await run_batch(
        resolve_config(cfg), url, input_path=data, out=out, telemetry=Telemetry(), repeats=repeats, **kw
    )


def roles(row: dict[str, Any]) -> list[str]:
    return [i.get("role", i["type"]) for i in row["response"]["output"]]


def texts(row: dict[str, Any], role: str) -> list[str]:
    out = []
    for i in row["response"]["output"]:
        if i["type"] == "message" and i["role"] == role:
            c = i["content"]
            out.append(c if isinstance(c, str) else "".join(p.get("text", "") for p in c))
    return out


def needs(path: Path) -> None:
    if not path.is_dir():
        raise FileNotFoundError(f"NeMo Gym compat data not found at {path} (it ships in tests/compat)")


# ================================================================ user simulator


async def test_four_turn_conversation_with_scripted_user_simulator(nats_server, tmp_path: Path) -> None:
    """The scripted user says "OK" until it is offered the stop tool (after turn 4), then calls it.

    The user simulator runs as its own model worker: it serves exactly the user
    turns (3 per rollout) plus the call that ends each conversation.
    """
    raw = config(
        options={
            "user": "model",
            "user_model": "user_sim",
            "stop_tool": "end_conversation",
            "min_turns": 4,
            "max_turns": 10,
        },
        user_sim={"adapter": "scripted", "replicas": 0},
    )
    cfg = config_from_dict(copy.deepcopy(raw))
    bus = await Bus.connect(nats_server.url, namespace="gym", telemetry=Telemetry(), name="user-sim")
    out = tmp_path / "out.jsonl"
    async with anyio.create_task_group() as tg:
        cfg.models["user_sim"].replicas = 1
        sims = make_workers(bus, resolve_config(cfg), selected(cfg, ["models.user_sim"]))
        await start_workers(tg, sims)
        result = await run(raw, nats_server.url, MTG_DATA, out, repeats=2)
        served = sum(w.served for w in sims)
        tg.cancel_scope.cancel()
    await bus.close()
    rows = read_jsonl(out)
    assert result.stats.failures == 0 and len(rows) == 10
    assert served == 10 * 4
    for row in rows:
        assert roles(row) == ["assistant", "user"] * 3 + ["assistant"]
        assert texts(row, "user") == ["OK"] * 3
        assert row["truncated"] is False
        # user turns are NeMo Gym's easy input messages: no id/status keys
        users = [i for i in row["response"]["output"] if i.get("role") == "user"]
        assert all(set(u) == {"type", "role", "content"} for u in users)
        assert row["reward"] == 0.0 and row["follow_ups"]  # task fields ride along


async def test_user_simulator_that_never_stops_is_cut_at_max_turns(nats_server, tmp_path: Path) -> None:
    raw = config(
        options={"user": "model", "user_model": "user_sim", "max_turns": 3},
        user_sim={"adapter": "scripted"},
    )
    out = tmp_path / "out.jsonl"
    result = await run(raw, nats_server.url, MTG_DATA, out)
    rows = read_jsonl(out)
    assert result.stats.failures == 0 and len(rows) == 5
    assert not (tmp_path / "out_failures.jsonl").exists()
    for row in rows:
        assert roles(row) == ["assistant", "user", "assistant", "user", "assistant"]
        assert row["truncated"] is True
        assert isinstance(row["reward"], float)
    metrics = json.loads((tmp_path / "out_aggregate_metrics.json").read_text())
    assert metrics, "metrics sidecar is empty"


async def test_conversation_stops_before_the_deadline(nats_server, tmp_path: Path) -> None:
    """A conversation that would outlive timeout_s ends early, verified and marked, not failed."""
    raw = config(
        options={"user": "model", "user_model": "user_sim", "max_turns": 1000, "deadline_reserve_s": 0.4},
        policy={"adapter": "scripted", "delay_s": 0.15},
        user_sim={"adapter": "scripted"},
        agent={"timeout_s": 1.5},
    )
    data = write_jsonl(tmp_path / "in.jsonl", read_jsonl(MTG_DATA)[:2])
    out = tmp_path / "out.jsonl"
    t0 = time.monotonic()
    result = await run(raw, nats_server.url, data, out)
    # 1,000 turns at 0.15 s a call would take minutes; timeout_s (1.5 s) ends them: 60 s tells the two apart
    # with room for a loaded machine's start-up (the rows below say the deadline, not max_turns, ended them)
    assert time.monotonic() - t0 < 60
    rows = read_jsonl(out)
    assert result.stats.failures == 0 and len(rows) == 2
    for row in rows:
        assert row["truncated"] is True
        assert 2 <= roles(row).count("assistant") < 1000


# ===================================================================== gymnasium


async def test_gym_resource_that_terminates_early(nats_server, tmp_path: Path) -> None:
    """Countdown ends at turn ``stop_at`` of a possible 10: terminated, not truncated; rewards summed."""
    tick = {
        "type": "function",
        "name": "tick",
        "description": "Count one tick.",
        "parameters": {"type": "object", "properties": {}, "required": [], "additionalProperties": False},
    }
    tasks = [
        {
            "responses_create_params": {"input": [{"role": "user", "content": "Let's play."}], "tools": [tick]},
            "stop_at": n,
        }
        for n in (1, 2, 3)
    ]
    data = write_jsonl(tmp_path / "in.jsonl", tasks)
    raw = config(options={"user": "env", "max_turns": 10}, resource="tests.envs.countdown")
    out = tmp_path / "out.jsonl"
    result = await run(raw, nats_server.url, data, out)
    rows = read_jsonl(out)
    assert result.stats.failures == 0 and len(rows) == 3
    for row in rows:
        n = row["stop_at"]
        assert row["terminated"] is True and row["truncated"] is False
        assert row["reward"] == pytest.approx(0.25 * (n - 1) + 1.0)
        assert roles(row).count("user") == n - 1  # policy turns = n, each but the last answered by a user turn
        # the reset observation opened the conversation: it is part of the prompt, as in NeMo Gym
        assert row["responses_create_params"]["input"][-1] == {"role": "user", "content": f"You have {n} turns."}
        assert texts(row, "user") == [f"Turn {t} done; {n - t} to go." for t in range(1, n)]
        # the tool call of turn 1 changed the session state that step() reports
        assert row["info"]["ticks"] == 1
        types = [i["type"] for i in row["response"]["output"]]
        assert types[:3] == ["function_call", "function_call_output", "message"]


async def test_policy_cannot_call_reserved_env_operations(nats_server, tmp_path: Path) -> None:
    task = {"responses_create_params": {"input": [{"role": "user", "content": "Let's play."}]}, "stop_at": 1}
    recording = {
        "responses_create_params": {
            "input": [{"role": "user", "content": "Let's play."}, {"role": "user", "content": "You have 1 turns."}]
        },
        "response": {
            "id": "r",
            "created_at": 0,
            "output": [
                {"type": "function_call", "call_id": "c1", "name": "gym.step", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "recorded"},
                {"type": "message", "role": "assistant", "content": "done"},
            ],
        },
    }
    rec = write_jsonl(tmp_path / "rec.jsonl", [recording])
    raw = config(
        options={"user": "env"}, resource="tests.envs.countdown", policy={"adapter": "replay", "rollouts": str(rec)}
    )
    out = tmp_path / "out.jsonl"
    result = await run(raw, nats_server.url, write_jsonl(tmp_path / "in.jsonl", [task]), out)
    assert result.stats.failures == 0
    (row,) = read_jsonl(out)
    assert "unknown tool 'gym.step'" in row["response"]["output"][1]["output"]
    assert row["reward"] == 1.0  # one real step, not two


# ===================================================================== parity


def same_items(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> bool:
    """Item for item, ignoring keys that are null (our reasoning items write ``content``/``status``
    as null where NeMo Gym's recordings leave them out)."""

    def norm(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in i.items() if v is not None} for i in items]

    return norm(ours) == norm(theirs)


def _check_against_recording(row: dict[str, Any], rec: dict[str, Any]) -> None:
    assert row["reward"] == rec["reward"]
    for k in ("terminated", "truncated", "info"):
        if k in rec:
            assert row[k] == rec[k], k
    # item for item, user turns included, in NeMo Gym's exact shape
    assert row["response"]["output"] == rec["response"]["output"]
    if rec["response"].get("usage"):
        assert row["response"]["usage"] == rec["response"]["usage"]


@pytest.mark.parametrize("user", ["env", "follow_ups", "model"])
async def test_multi_turn_gymnasium_replay_reproduces_recorded_rewards(user: str, nats_server, tmp_path: Path) -> None:
    """NeMo Gym's recorded policy turns, replayed; user turns from the env, the task, or a replayed user simulator."""
    needs(MTG)
    rollouts = str(MTG / "example_rollouts.jsonl")
    options: dict[str, Any] = {"user": user, "max_turns": 5}
    user_sim = None
    if user == "model":
        options["user_model"] = "user_sim"
        user_sim = {"adapter": "replay", "rollouts": rollouts}
    raw = config(options=options, policy={"adapter": "replay", "rollouts": rollouts}, user_sim=user_sim)
    out = tmp_path / "out.jsonl"
    result = await run(raw, nats_server.url, MTG / "example.jsonl", out)
    assert result.stats.failures == 0
    recorded = {prompt_key(r["responses_create_params"]["input"]): r for r in read_jsonl(rollouts)}
    rows = read_jsonl(out)
    assert len(rows) == len(recorded) == 5
    for row in rows:
        _check_against_recording(row, recorded[prompt_key(row["responses_create_params"]["input"])])


async def test_calendar_replay_reproduces_recorded_rewards(nats_server, tmp_path: Path) -> None:
    needs(CAL)
    rollouts = CAL / "example_rollouts.jsonl"
    raw = config(
        options={"user": "env", "max_turns": 32},
        resource="resources.calendar",
        policy={"adapter": "replay", "rollouts": str(rollouts)},
    )
    out = tmp_path / "out.jsonl"
    result = await run(raw, nats_server.url, CAL / "example.jsonl", out)
    assert result.stats.failures == 0
    recorded = {prompt_key(r["responses_create_params"]["input"]): r for r in read_jsonl(rollouts)}
    rows = read_jsonl(out)
    assert len(rows) == 5
    assert sorted(r["reward"] for r in rows) == [0.0, 0.0, 0.0, 1.0, 1.0]
    for row in rows:
        rec = recorded[prompt_key(row["responses_create_params"]["input"])]
        assert row["reward"] == rec["reward"]
        assert same_items(row["response"]["output"], rec["response"]["output"])
        assert row["terminated"] is True and row["truncated"] is False


async def test_interactive_calendar_reproduces_recorded_rewards(nats_server, tmp_path: Path) -> None:
    """The same conversations played turn by turn: the environment sends each user turn, the
    policy (a replay of the recorded assistant turns, then the recorded final answer) keeps
    the calendar itself; the final grade equals NeMo Gym's recorded reward."""
    needs(CAL)
    tasks = {prompt_key(t["responses_create_params"]["input"]): t for t in read_jsonl(CAL / "example.jsonl")}
    recordings, expected = [], {}
    for r in read_jsonl(CAL / "example_rollouts.jsonl"):
        msgs = tasks[prompt_key(r["responses_create_params"]["input"])]["responses_create_params"]["input"]
        system = [m for m in msgs if m["role"] == "system"]
        turns = [{"type": "message", **m} for m in msgs if m["role"] != "system"]
        recordings.append(
            {
                "responses_create_params": {"input": system},
                "response": {**r["response"], "output": turns + r["response"]["output"]},
            }
        )
        expected[json.dumps([m["content"] for m in msgs if m["role"] == "user"])] = r["reward"]
    rec = write_jsonl(tmp_path / "rec.jsonl", recordings)
    raw = config(
        options={"user": "env", "max_turns": 32},
        resource="resources.calendar",
        policy={"adapter": "replay", "rollouts": str(rec)},
    )
    out = tmp_path / "out.jsonl"
    result = await run(raw, nats_server.url, REPO / "resources/calendar/data/example_interactive.jsonl", out)
    assert result.stats.failures == 0
    rows = read_jsonl(out)
    assert len(rows) == 5
    for row in rows:
        assert row["reward"] == expected[json.dumps(row["user_turns"])]
        assert texts(row, "user") == row["user_turns"][1:]  # the first opened the conversation
        assert row["terminated"] is True and row["truncated"] is False


async def test_training_fields_survive_every_turn(nats_server, tmp_path: Path) -> None:
    """Token ids and log-probs on policy items pass through untouched, turn after turn."""
    a = {
        "type": "message",
        "role": "assistant",
        "id": "m1",
        "status": "completed",
        "content": [{"type": "output_text", "text": "A", "annotations": []}],
        "prompt_token_ids": [1, 2],
        "generation_token_ids": [3, 4],
        "generation_log_probs": [-0.1, -0.2],
    }
    b = {
        "type": "message",
        "role": "assistant",
        "id": "m2",
        "status": "completed",
        "content": [{"type": "output_text", "text": "B", "annotations": []}],
        "prompt_token_ids": [1, 2, 3, 4, 5, 6],
        "generation_token_ids": [7],
        "generation_log_probs": [-0.3],
    }
    user = {"type": "message", "role": "user", "content": "more"}
    task = {
        "responses_create_params": {"input": [{"role": "user", "content": "hi"}]},
        "follow_ups": ["more"],
        "expected_answer": "b",
    }
    rec = write_jsonl(
        tmp_path / "rec.jsonl", [{**task, "response": {"id": "r", "created_at": 0, "output": [a, user, b]}}]
    )
    raw = config(options={"user": "follow_ups"}, policy={"adapter": "replay", "rollouts": str(rec)})
    out = tmp_path / "out.jsonl"
    result = await run(raw, nats_server.url, write_jsonl(tmp_path / "in.jsonl", [task]), out)
    assert result.stats.failures == 0
    (row,) = read_jsonl(out)
    assert row["response"]["output"] == [a, user, b]
    first, second = row["response"]["output"][0], row["response"]["output"][2]
    assert second["prompt_token_ids"][:4] == first["prompt_token_ids"] + first["generation_token_ids"]
    assert row["reward"] == 1.0 and row["truncated"] is False


# ===================================================================== faults


def _start_user_sim(config_path: Path, url: str, log: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gym_runtime.cli",
            "start",
            str(config_path),
            "--nats",
            url,
            "--only",
            "models.user_sim",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=open(log, "a"),
        text=True,
    )
    ready = threading.Event()

    def watch() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "workers ready" in line:
                ready.set()

    threading.Thread(target=watch, daemon=True).start()
    if not ready.wait(30):
        proc.kill()
        raise AssertionError(f"user-sim worker did not start: {log.read_text()[-2000:]}")
    return proc


async def test_killed_user_simulator_worker_loses_no_rollout(nats_server, tmp_path: Path) -> None:
    """SIGKILL the only user-simulator worker mid-batch, start another: JetStream redelivers its
    unacked requests (after the model's ack_wait) and every task x repeat gets exactly one row."""
    raw = config(
        options={"user": "model", "user_model": "user_sim", "max_turns": 4},
        user_sim={"adapter": "scripted", "delay_s": 0.3, "ack_wait_s": 2.0, "replicas": 1},
    )
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(raw))
    local = copy.deepcopy(raw)
    local["models"]["user_sim"]["replicas"] = 0  # the user simulator lives only in the subprocess
    log = tmp_path / "user_sim.log"
    procs = [await anyio.to_thread.run_sync(_start_user_sim, config_path, nats_server.url, log)]
    repeats = 4
    out = tmp_path / "out.jsonl"
    progress: list[int] = []
    try:
        async with anyio.create_task_group() as tg:
            box: dict[str, RunResult] = {}

            async def batch() -> None:
                box["r"] = await run(
                    local,
                    nats_server.url,
                    MTG_DATA,
                    out,
                    repeats=repeats,
                    hooks=RunHooks(on_progress=lambda done, total: progress.append(done)),
                )

            tg.start_soon(batch)
            # every rollout is mid-conversation, waiting on the user simulator; the check below (not all done at
            # the kill) is one that load only makes easier, so the span cannot fail a sound run
            await anyio.sleep(0.8)
            done_at_kill = max(progress, default=0)
            procs[0].kill()
            procs[0].wait(10)
            procs.append(await anyio.to_thread.run_sync(_start_user_sim, config_path, nats_server.url, log))
        result = box["r"]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    assert done_at_kill < 5 * repeats
    rows = read_jsonl(out)
    assert result.stats.failures == 0
    keys = sorted((r["_ng_task_index"], r["_ng_rollout_index"]) for r in rows)
    assert keys == [(t, k) for t in range(5) for k in range(repeats)]
    for row in rows:
        assert roles(row) == ["assistant", "user"] * 3 + ["assistant"] and row["truncated"] is True


def test_configs_in_repo_are_valid() -> None:
    from gym_runtime.agents.multi_turn import check_options
    from gym_runtime.config import load_config

    for env in ("calendar", "multi_turn_gymnasium"):
        cfg: Config = load_config(REPO / f"resources/{env}/config.yaml")
        for a in cfg.agents.values():
            check_options(a.options)


# ===================================================================== pieces (no NATS)


def test_user_simulator_sees_the_conversation_from_the_users_side() -> None:
    from gym_runtime.messages import FunctionCall, FunctionCallOutput, Message, assistant_message
    from gym_runtime.user_sim import KICKOFF, user_message, user_sim_params

    conv = [
        Message(role="system", content="policy secrets"),
        Message(role="user", content="hi"),
        FunctionCall(name="f", arguments="{}", call_id="c"),
        FunctionCallOutput(call_id="c", output="tool says"),
        assistant_message("hello, how can I help?"),
    ]
    row = {"persona": "a retired sailor", "goal": "book a boat"}
    params = user_sim_params(row, conv, stop_tool="bye", may_stop=True, extra={"temperature": 0.5, "seed": 1})
    system, *rest = params.input
    assert system.role == "system" and "a retired sailor" in system.content and "book a boat" in system.content
    assert "###STOP###" in system.content and "bye" in system.content
    assert [(m.role, m.content) for m in rest] == [("assistant", "hi"), ("user", "hello, how can I help?")]
    assert params.tools and params.tools[0]["name"] == "bye"
    assert params.temperature == 0.5 and params.extra == {"seed": 1}
    early = user_sim_params(row, conv, stop_tool="bye", may_stop=False)
    assert early.tools is None and "###STOP###" not in early.input[0].content
    opening = user_sim_params({}, [Message(role="system", content="s")])
    assert [(m.role, m.content) for m in opening.input[1:]] == [("user", KICKOFF)]
    custom = user_sim_params(row, conv, instructions="You are {persona}. {goal}! Say {stop_token} when done.")
    assert custom.input[0].content.startswith("You are a retired sailor. book a boat! Say ###STOP### when done.")
    assert msgspec_json(user_message("x")) == {"type": "message", "role": "user", "content": "x"}


def msgspec_json(obj: Any) -> Any:
    import msgspec

    return json.loads(msgspec.json.encode(obj))


def test_reading_the_user_turn() -> None:
    from gym_runtime.messages import FunctionCall, assistant_message
    from gym_runtime.user_sim import read_user_turn

    assert read_user_turn([assistant_message(" next ")], stop_token="###STOP###", stop_tool=None).text == "next"
    t = read_user_turn([assistant_message("thanks! ###STOP###")], stop_token="###STOP###", stop_tool=None)
    assert t.stop and t.reason == "stop_token" and t.text == "thanks!"
    t = read_user_turn([FunctionCall(name="bye", arguments="{}", call_id="c")], stop_token=None, stop_tool="bye")
    assert t.stop and t.reason == "stop_tool"
    assert read_user_turn([], stop_token=None, stop_tool=None).reason == "empty"


async def test_replay_splits_at_user_turns_and_replays_the_user_side() -> None:
    needs(MTG)
    from gym_runtime.messages import CreateParams, FunctionCall, Message, create_params, message_text
    from gym_runtime.models.replay import Options as ReplayOptions
    from gym_runtime.models.replay import ReplayModel
    from gym_runtime.user_sim import DEFAULT_STOP_TOKEN, user_message, user_sim_params

    model = ReplayModel(ReplayOptions(rollouts=str(MTG / "example_rollouts.jsonl")))
    rec = next(r for r in read_jsonl(MTG / "example_rollouts.jsonl") if len(r["response"]["output"]) == 5)
    recorded = rec["response"]["output"]
    prompt = create_params(rec["responses_create_params"]).input
    first = await model.generate(CreateParams(input=list(prompt)))
    assert [message_text(i) for i in first.output] == [recorded[0]["content"][0]["text"]]  # stops at the user turn
    with pytest.raises(Exception, match="expects a user turn"):
        await model.generate(CreateParams(input=[*prompt, *first.output]))
    # the user simulator's side: the recorded follow-ups, then the stop signal
    conv = [*prompt, *first.output]
    said = await model.generate(user_sim_params({}, conv))
    assert message_text(said.output[0]) == recorded[1]["content"]
    conv += [user_message(recorded[1]["content"])]
    conv += (await model.generate(CreateParams(input=list(conv)))).output
    conv += [user_message(recorded[3]["content"])]
    last = await model.generate(CreateParams(input=list(conv)))
    assert last.usage is not None and last.usage.total_tokens == rec["response"]["usage"]["total_tokens"]
    conv += last.output
    end = await model.generate(user_sim_params({}, conv))
    assert isinstance(end.output[0], Message) and message_text(end.output[0]) == DEFAULT_STOP_TOKEN
    end = await model.generate(user_sim_params({}, conv, stop_tool="bye"))
    assert isinstance(end.output[0], FunctionCall) and end.output[0].name == "bye"


async def test_env_mode_on_a_plain_resource_and_bad_options_fail_clearly(nats_server, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "in.jsonl", read_jsonl(REPO / "resources/weather/data/example.jsonl")[:1])
    raw = config(options={"user": "env"}, resource="resources.weather")
    out = tmp_path / "out.jsonl"
    result = await run(raw, nats_server.url, data, out)
    assert result.stats.failures == 1
    (fail,) = read_jsonl(tmp_path / "out_failures.jsonl")
    assert "not a GymResource" in json.dumps(fail)
    raw = config(options={"user": "model"})
    with pytest.raises(ConfigError, match=r"agents\.\w+\.options: .*user_model"):  # refused at load, before any work
        await run(raw, nats_server.url, data, tmp_path / "out2.jsonl")


def test_options_are_checked() -> None:
    from gym_runtime.agents.multi_turn import check_options

    assert check_options({}).user == "auto"
    for bad in (
        {"user": "robot"},
        {"max_turns": 0},
        {"user": "model"},
        {"user_model": "u", "user": "env"},
        {"max_turn": 3},
    ):
        with pytest.raises(ValueError):
            check_options(bad)


async def test_follow_ups_cut_at_max_turns_are_marked(nats_server, tmp_path: Path) -> None:
    raw = config(options={"user": "follow_ups", "max_turns": 2})
    out = tmp_path / "out.jsonl"
    result = await run(raw, nats_server.url, MTG_DATA, out)
    assert result.stats.failures == 0
    for row in read_jsonl(out):
        assert texts(row, "user") == row["follow_ups"][:1]
        assert row["truncated"] is (len(row["follow_ups"]) > 1)  # only the France task has two


async def test_user_simulator_opens_a_conversation_without_a_user_message(nats_server, tmp_path: Path) -> None:
    task = {
        "responses_create_params": {"input": [{"role": "system", "content": "You are a travel agent."}]},
        "persona": "a tourist",
        "expected_answer": "OK",
    }
    raw = config(options={"user": "model", "user_model": "user_sim", "max_turns": 2}, user_sim={"adapter": "scripted"})
    out = tmp_path / "out.jsonl"
    result = await run(raw, nats_server.url, write_jsonl(tmp_path / "in.jsonl", [task]), out)
    assert result.stats.failures == 0
    (row,) = read_jsonl(out)
    assert row["responses_create_params"]["input"] == [
        *task["responses_create_params"]["input"],
        {"role": "user", "content": "OK"},
    ]
    assert roles(row) == ["assistant", "user", "assistant"] and row["truncated"] is True
    assert row["reward"] == 1.0
