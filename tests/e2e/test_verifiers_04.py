"""verifiers 0.4 tasksets (its Taskset x Harness API) in gym-runtime workers, on verifiers' own built environment.

Real parts: `gym-runtime env build --verifiers` (the layer: verifiers 0.4.0, uv and the chat harness's script
wheels, cached by content hash under the usual cache dir; built here when missing), `gym-runtime run` in a child
process (embedded nats-server, real workers, the agent's guest on the layer's interpreter), verifiers' harness
program in its subprocess runtime (its `uv sync --script` offline, from the layer's wheelhouse), verifiers' own
runner (`env.run_slot` inside `env.serving()`, as its eval CLI runs in process) in another child process on the
layer. The LLM double is the vLLM emulator (tests/stub_openai.py) with a deterministic policy.

The tasksets: tests/envs/vf04_suite (ours, in 0.4's style: single-turn, an MCP tool, a scripted multi-turn
user; verifiers' own best_of_n env for grouped scoring), and verifiers' shipped reverse_text example when
the layer holds it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gym_runtime.nemo_gym.hosting import env as hosting_env
from tests.helpers import REPO, cli, read_jsonl, write_jsonl
from tests.stub_openai import Gen, StubOpenAI, VLLMEmulator
from tests.vf_stub_policy import make_emulator

NULL = {"harness": {"id": "null"}}  # verifiers' tool-less/MCP chat loop (its default, bash, adds a shell tool)


def _env(kind: str) -> dict[str, Any]:
    return {"taskset": {"id": "vf04_suite", "task": {"kind": kind}}, "agent": NULL}


ENVS = {
    "single": _env("single"),
    "tool": _env("tool"),
    "multi": _env("multi"),
    "best_of_n": {"id": "best_of_n", "n": 3, "taskset": {"id": "vf04_suite"}, "agent": NULL},
}

# verifiers' own runner, in process as its eval CLI runs rollouts: each task's slots through env.run_slot
# inside env.serving(), the model an EvalClientConfig at the stub.
OWN_RUNNER = r"""
import asyncio, json, os, sys
from verifiers.v1.clients import EvalClientConfig, ModelContext
from verifiers.v1.utils.loaders import load_environment, resolve_env_config

cfg, base_url, tasks, repeats = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
cfg.setdefault("agent", {}).setdefault("runtime", {"type": "subprocess"})
os.environ["STUB_KEY"] = "x"
env = load_environment(resolve_env_config(cfg))
ctx = ModelContext(model="tiny", client=EvalClientConfig(base_url=base_url, api_key_var="STUB_KEY"))

async def main():
    out = []
    async with env.serving():
        for task in list(env.taskset)[:tasks]:
            episodes = await asyncio.gather(*(env.run_slot(s, ctx) for s in env.slots(task, repeats)))
            traces = [t for ep in episodes for t in ep.traces]
            out.append([[t.reward, dict(t.metrics), {k: r and r.score for k, r in t.rewards.items()}] for t in traces])
    print(json.dumps(out))

asyncio.run(main())
"""


def tool_policy_emulator() -> VLLMEmulator:
    """The 0.3 tests' policy, with the tool offered under the name MCP gives it (``*get_color``)."""
    em = make_emulator()
    base = em.policy

    def policy(path: str, body: dict[str, Any]) -> Gen:
        names = [t["function"]["name"] for t in body.get("tools") or [] if "function" in t]
        tool = next((n for n in names if n.endswith("get_color")), None)
        s = json.dumps(body.get("messages"))
        if tool and "the colour is" not in s:
            color = re.findall(r"say (\w+)", s)[0]
            return Gen(text=VLLMEmulator.tool_call_text(tool, {"name": color}))
        return base(path, body)

    em.policy = policy
    return em


@pytest.fixture(scope="module")
def layer() -> hosting_env.VerifiersEnv:
    """verifiers 0.4's own environment, built by `env build --verifiers` when the cache lacks it."""
    try:
        hosting_env.find_python(minimum=hosting_env.VERIFIERS_MIN_PYTHON, var=hosting_env.VERIFIERS_PYTHON_ENV)
    except hosting_env.EnvError as e:
        if os.environ.get("GYM_REQUIRE_HOSTING") == "1":
            raise
        pytest.skip(f"verifiers 0.4 needs a Python >= 3.12: {e}")
    r = cli("env", "build", "--verifiers", timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "verifiers==0.4.0" in r.stdout
    return hosting_env.ensure_verifiers(log=lambda _line: None)


def _workdir(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    shutil.copytree(REPO / "tests/envs/vf04_suite", work / "vf04_suite")
    shutil.copy(REPO / "tests/envs/vf_suite.py", work / "vf_suite.py")
    return work


def _environ(work: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(work), "TMPDIR": str(work)}


def _config(base_url: str, agents: dict[str, str]) -> str:
    lines = "".join(f"  {name}: {body}\n" for name, body in agents.items())
    return (
        "nats: embedded\n"
        "models:\n"
        f"  policy: {{adapter: vllm, base_url: '{base_url}', model: tiny, return_token_ids: true,"
        " eos_token_id: 4, timeout_s: 60}\n"
        f"agents:\n{lines}"
    )


def _vf04(env_cfg: dict[str, Any], extra: str = "") -> str:
    return (
        f"{{agent: agents.verifiers_v1, model: policy, timeout_s: 120, max_attempts: 1{extra},"
        f" options: {{env: {json.dumps(env_cfg)}}}}}"
    )


# Every proxy a dead port, loopback exempt: a rollout that reached for the network (an index, a download) fails.
NO_NETWORK = {
    **{v: "http://127.0.0.1:9" for v in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy")},
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
}


def _run_ours(
    work: Path, config: str, rows: list[dict[str, Any]], *, repeats: int = 1, offline: bool = False
) -> subprocess.CompletedProcess[str]:
    (work / "config.yaml").write_text(config)
    write_jsonl(work / "rows.jsonl", rows)
    cmd = [sys.executable, "-m", "gym_runtime.cli", "run", "config.yaml", "-i", "rows.jsonl", "-o", "out.jsonl", "-q"]
    cmd += ["--repeats", str(repeats)]
    env = {**_environ(work), **(NO_NETWORK if offline else {})}
    return subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=600, check=False)


def _run_theirs(layer: Any, work: Path, env_cfg: dict[str, Any], base_url: str, *, repeats: int = 1) -> list[Any]:
    res = subprocess.run(
        [layer.python, "-c", OWN_RUNNER, json.dumps(env_cfg), base_url, "3", str(repeats)],
        cwd=work,
        env={**_environ(work), **layer.environ},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _compare(ours: list[dict[str, Any]], theirs: list[Any]) -> None:
    for t, traces in enumerate(theirs):
        rows = [r for r in ours if r["_ng_task_index"] == t]
        assert len(rows) == len(traces)
        assert sorted(r["reward"] for r in rows) == pytest.approx(sorted(tr[0] for tr in traces))
        for row, (_reward, metrics, rewards) in zip(
            sorted(rows, key=lambda r: r["reward"]), sorted(traces, key=lambda tr: tr[0]), strict=True
        ):
            for name, value in {**rewards, **metrics}.items():
                assert row[name] == pytest.approx(value), name


@pytest.mark.parametrize("kind", ["single", "tool", "multi"])
def test_rewards_equal_verifiers_own_runner(kind: str, layer: Any, tmp_path: Path) -> None:
    """Each task's reward, its named rewards and metrics are what verifiers 0.4's own runner gives on the same
    scripted model, with the taskset run unchanged in our agent worker's guest on verifiers' built environment."""
    work = _workdir(tmp_path)
    env_cfg = ENVS[kind]
    rows = [{"responses_create_params": {"input": []}, "verifiers": {"index": i}} for i in range(3)]
    with StubOpenAI(emulator=tool_policy_emulator()) as stub:
        res = _run_ours(work, _config(stub.base_url, {"vf": _vf04(env_cfg)}), rows)
        assert res.returncode == 0, res.stderr[-3000:]
        theirs = _run_theirs(layer, work, env_cfg, stub.base_url)
    ours = sorted(read_jsonl(work / "out.jsonl"), key=lambda r: r["_ng_task_index"])
    assert len(ours) == 3
    _compare(ours, theirs)
    assert len({r["reward"] for r in ours}) >= 2, "the tasks should not all score the same"
    for row in ours:
        turns = [i for i in row["response"]["output"] if "generation_token_ids" in i]
        assert turns, "no model turn carries token ids"
    if kind == "tool":
        types = [i["type"] for i in ours[0]["response"]["output"]]
        assert types == ["function_call", "function_call_output", "message"], types
    if kind == "multi":
        assert all(r["replies"] == 3 for r in ours)


def test_grouped_scoring_best_of_n_equals_verifiers_own_runner(layer: Any, tmp_path: Path) -> None:
    """verifiers' best_of_n env (its episode: n attempts judged together in finalize, the 0.4 form of a group
    rubric): with group_repeats and --repeats n, one episode per task, one row per attempt, each with the
    group's `best` and `pass_at_n` as verifiers' own runner gives them."""
    work = _workdir(tmp_path)
    env_cfg = ENVS["best_of_n"]
    rows = [{"responses_create_params": {"input": []}, "verifiers": {"index": i}} for i in range(3)]
    with StubOpenAI(emulator=tool_policy_emulator()) as stub:
        res = _run_ours(work, _config(stub.base_url, {"vf": _vf04(env_cfg, ", group_repeats: true")}), rows, repeats=3)
        assert res.returncode == 0, res.stderr[-3000:]
        theirs = _run_theirs(layer, work, env_cfg, stub.base_url)
    ours = read_jsonl(work / "out.jsonl")
    assert len(ours) == 9
    _compare(ours, theirs)
    assert all("best" in r and "pass_at_n" in r for r in ours)


def test_a_raising_reward_is_a_verify_error_row(layer: Any, tmp_path: Path) -> None:
    """A reward function that raises: verifiers marks the trace failed (scored nothing); here each task is a
    `verify_error` failure row naming it, and the run goes on to the other tasks."""
    work = _workdir(tmp_path)
    env_cfg = _env("raises")
    rows = [{"responses_create_params": {"input": []}, "verifiers": {"index": i}} for i in range(3)]
    with StubOpenAI(emulator=tool_policy_emulator()) as stub:
        res = _run_ours(work, _config(stub.base_url, {"vf": _vf04(env_cfg)}), rows)
        theirs = _run_theirs(layer, work, env_cfg, stub.base_url)
    assert res.returncode == 1, res.stderr[-3000:]
    failures = read_jsonl(work / "out_failures.jsonl")
    assert len(failures) == 3
    for f in failures:
        assert f["error_class"] == "verify_error" and "reward blew up" in f["error"], f
    assert all(tr[0] == 0 for traces in theirs for tr in traces)  # verifiers' own: not scored


def test_a_failed_groups_every_row_keeps_its_own_episodes_turns_and_cost(layer: Any, tmp_path: Path) -> None:
    """Issue 66: a group task (group_repeats) of independent episodes whose reward raises: each repeat's
    `verify_error` row keeps its own episode's turns so far (`partial`, token ids) and its own cost, its model calls
    made in the guest and crossing to the worker as that repeat's (before: no partial, all calls on the first)."""
    work = _workdir(tmp_path)
    env_cfg = _env("raises")
    rows = [{"responses_create_params": {"input": []}, "verifiers": {"index": 0}}]
    with StubOpenAI(emulator=tool_policy_emulator()) as stub:
        res = _run_ours(work, _config(stub.base_url, {"vf": _vf04(env_cfg, ", group_repeats: true")}), rows, repeats=3)
    failures = sorted(read_jsonl(work / "out_failures.jsonl"), key=lambda f: f["_ng_rollout_index"])
    assert [f["_ng_rollout_index"] for f in failures] == [0, 1, 2], res.stderr[-3000:]
    calls = []
    for f in failures:
        assert f["error_class"] == "verify_error" and f["partial"] is True, f
        turns = [i for i in f["response"]["output"] if "generation_token_ids" in i]
        assert turns, f["response"]
        calls.append(f["cost"]["models"]["policy"]["calls"])
        assert calls[-1] == len(turns)  # its own episode's calls only
    assert len(set(calls)) == 1  # alike episodes: each row its own share, not the group's all on the first


def test_verifiers_04_beside_03_in_one_config(layer: Any, tmp_path: Path) -> None:
    """One config, one run: a 0.3.x environment (agents.verifiers_env, in our own environment) and a 0.4 taskset
    (agents.verifiers_v1, its guest on verifiers 0.4's built interpreter); each row scored by its own. The run
    has no network (every proxy a dead port): the 0.4 rollouts' `uv sync --script` resolves from the layer."""
    work = _workdir(tmp_path)
    v03 = "{agent: agents.verifiers_env, model: policy, timeout_s: 60, max_attempts: 1, options: {env_id: vf_suite}}"
    rows = [
        {
            "responses_create_params": {"input": [{"role": "user", "content": f"say {c}"}]},
            "verifiers": {"answer": c},
            "agent_ref": {"name": "v03"},
        }
        for c in ("blue", "red", "green")
    ] + [
        {"responses_create_params": {"input": []}, "verifiers": {"index": i}, "agent_ref": {"name": "v04"}}
        for i in range(3)
    ]
    with StubOpenAI(emulator=tool_policy_emulator()) as stub:
        res = _run_ours(work, _config(stub.base_url, {"v03": v03, "v04": _vf04(ENVS["single"])}), rows, offline=True)
    assert res.returncode == 0, res.stderr[-3000:]
    ours = read_jsonl(work / "out.jsonl")
    by_agent = {
        a: sorted((r for r in ours if r["agent_ref"]["name"] == a), key=lambda r: r["_ng_task_index"])
        for a in ("v03", "v04")
    }
    assert [r["exact"] for r in by_agent["v03"]] == [1.0, 1.0, 0.0]  # vf_suite's rubric: green -> purple
    assert [r["reward"] for r in by_agent["v04"]] == [1.5, 1.5, 0.0]  # exact_match + 0.5 x mentions_answer


def test_layer_is_offline_and_cached(layer: Any) -> None:
    """The layer is built once (a second `env build` finds it by hash) and its rollouts resolve their scripts
    from its own wheelhouse: uv's index is the layer's, and the build checked that a script syncs so with no
    network (the rollouts' own check: the beside test runs with every proxy a dead port)."""
    r = cli("env", "build", "--verifiers")
    assert r.returncode == 0, r.stderr
    assert "cached" in r.stdout
    index = Path(layer.prefix, "wheelhouse", "simple")
    assert layer.environ["UV_DEFAULT_INDEX"] == index.as_uri()
    assert (index / "openai" / "index.html").is_file() and (index / "mcp" / "index.html").is_file()
    assert Path(layer.prefix, ".step-wheelhouse").is_file()
