"""verifiers environments (0.3.x, the classic ``vf.load_environment`` API) as gym-runtime agents.

Real parts: `gym-runtime run` in a child process (embedded nats-server, real workers), the
environments of tests/envs/vf_suite.py written against verifiers' public API, verifiers'
own runner in another child process. The LLM double is the vLLM emulator
(tests/stub_openai.py) with a deterministic policy (tests/vf_stub_policy.py).

The child processes run outside the repository: its top-level ``agents`` folder would
shadow the ``agents`` package of openai-agents, which verifiers' ToolEnv imports (an
installed gym-runtime has no top-level ``agents``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.helpers import REPO, cli, read_jsonl, write_jsonl
from tests.stub_openai import StubOpenAI
from tests.vf_stub_policy import make_emulator

ROWS = [
    {"responses_create_params": {"input": [{"role": "user", "content": f"say {c}"}]}, "verifiers": {"answer": c}}
    for c in ("blue", "red", "green")
]

# verifiers' own runner: the same environment, the same rows, an AsyncOpenAI at the same model.
OWN_RUNNER = r"""
import asyncio, json, sys
import verifiers as vf
from openai import AsyncOpenAI
from verifiers.legacy.clients import OpenAIChatCompletionsClient

base_url, kind, rows_path, repeats = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
env = vf.load_environment("vf_suite", kind=kind)
client = OpenAIChatCompletionsClient(AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0))

async def main():
    out = []
    for i, line in enumerate(open(rows_path)):
        row = json.loads(line)
        inp = {"prompt": row["responses_create_params"]["input"], "example_id": i, **row["verifiers"]}
        if repeats == 1:
            res = [await env.run_rollout(inp, client, "tiny", env.sampling_args)]
        else:
            res = await env.run_group([dict(inp) for _ in range(repeats)], client, "tiny", env.sampling_args)
        out.append([[r["reward"], r["metrics"]] for r in res])
    print(json.dumps(out))

asyncio.run(main())
"""


def _workdir(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(REPO / "tests/envs/vf_suite.py", work / "vf_suite.py")
    return work


def _env(work: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(work), "TMPDIR": str(work)}


def _cli(work: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`gym-runtime ARGS` in ``work``, its environment module (vf_suite) importable from there."""
    return cli(*args, timeout=timeout, cwd=work, env=_env(work))


def _run_ours(
    work: Path, base_url: str, kind: str, rows: list[dict[str, Any]], *, repeats: int = 1, extra: str = "", args=()
) -> subprocess.CompletedProcess[str]:
    (work / "config.yaml").write_text(
        "nats: embedded\n"
        "models:\n"
        f"  policy: {{adapter: vllm, base_url: '{base_url}', model: tiny, return_token_ids: true,"
        " eos_token_id: 4, timeout_s: 20}\n"
        "agents:\n"
        f"  vf: {{agent: agents.verifiers_env, model: policy, timeout_s: 20, max_attempts: 1{extra},"
        f" options: {{env_id: vf_suite, env_args: {{kind: {kind}}}}}}}\n"
    )
    write_jsonl(work / "rows.jsonl", rows)
    run = ["run", "config.yaml", "-i", "rows.jsonl", "-o", "out.jsonl", "-q", "--repeats", str(repeats), *args]
    return _cli(work, *run, timeout=180)


def _run_theirs(work: Path, base_url: str, kind: str, *, repeats: int = 1) -> list[list[Any]]:
    res = subprocess.run(
        [sys.executable, "-c", OWN_RUNNER, base_url, kind, str(work / "rows.jsonl"), str(repeats)],
        cwd=work,
        env=_env(work),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("kind", "isolation"),
    [("single", "process"), ("tool", "process"), ("multi", "process"), ("reasoning_gym", "process"), ("tool", "none")],
)
def test_rewards_equal_verifiers_own_runner(kind: str, isolation: str, tmp_path: Path) -> None:
    """Each environment's rows: the rubric's reward and metrics are what verifiers' own runner gives, with the
    environment in the agent worker's guest process (the default) and in the worker itself (``isolation: none``)."""
    work = _workdir(tmp_path)
    rows = ROWS
    if kind == "reasoning_gym":
        rows = [json.loads(line) for line in (REPO / "tests/data/vf_reasoning_gym.jsonl").read_text().splitlines()]
    with StubOpenAI(emulator=make_emulator()) as stub:
        res = _run_ours(work, stub.base_url, kind, rows, extra="" if isolation == "process" else ", isolation: none")
        assert res.returncode == 0, res.stderr[-3000:]
        theirs = _run_theirs(work, stub.base_url, kind)
    ours = sorted(read_jsonl(work / "out.jsonl"), key=lambda r: r["_ng_task_index"])
    assert len(ours) == len(rows)
    for row, [[reward, metrics]] in zip(ours, theirs, strict=True):
        assert row["reward"] == pytest.approx(reward)
        for name, value in metrics.items():
            assert row[name] == pytest.approx(value), name
        turns = [i for i in row["response"]["output"] if "generation_token_ids" in i]
        assert turns, "no model turn carries token ids"
        for item in turns:
            assert len(item["generation_token_ids"]) == len(item["generation_log_probs"]) > 0
    if kind != "reasoning_gym":
        assert len({r["reward"] for r in ours}) >= 2, "the rows should not all score the same"
    if kind == "tool":
        types = [i["type"] for i in ours[0]["response"]["output"]]
        assert types == ["function_call", "function_call_output", "message"]
    if kind == "multi":
        assert all(r["num_turns"] == 3 for r in ours)


@pytest.mark.parametrize(
    ("kind", "error_class", "says"),
    [
        ("raises", "verify_error", "reward blew up"),
        ("not_number", "verify_error", "not a number"),
        ("setup_raises", "tool_error", "setup broke"),
        ("hangs", "timeout", "timeout_s"),
    ],
)
def test_foreign_failures_are_failure_rows(kind: str, error_class: str, says: str, tmp_path: Path) -> None:
    """verifiers scores a raising or non-number reward function as 0; here it is a failure row with its
    class, and the worker goes on serving the other rows (the hang hits only the row it hangs on)."""
    work = _workdir(tmp_path)
    with StubOpenAI(emulator=make_emulator()) as stub:
        res = _run_ours(work, stub.base_url, kind, ROWS, extra=", timeout_s: 3" if kind == "hangs" else "")
    failures = read_jsonl(work / "out_failures.jsonl")
    rows = read_jsonl(work / "out.jsonl") if (work / "out.jsonl").exists() else []
    if kind == "hangs":
        assert len(failures) == 1 and len(rows) == 2, res.stderr[-2000:]  # only "blue" hangs
        assert all(r["reward"] == 1.0 for r in rows)
    else:
        assert len(failures) == 3 and not rows, res.stderr[-2000:]
    for f in failures:
        assert f["error_class"] == error_class and says in f["error"], f


@pytest.mark.parametrize("isolation", ["process", "none"])
def test_a_failed_groups_every_row_keeps_its_own_repeats_turns_and_cost(isolation: str, tmp_path: Path) -> None:
    """Issue 66: a group task (group_repeats, verifiers' run_group) whose rubric raises after each repeat's three
    turns: every repeat's failure row carries its own trajectory so far (its three turns with their token ids and
    logprobs, ``partial``), its attribution and its own cost (three calls), not the group's nine on its first row
    and nothing on the others; in the agent's guest process (the model calls cross to the worker) and in the
    worker itself."""
    work = _workdir(tmp_path)
    k = 3
    extra = ", group_repeats: true" + ("" if isolation == "process" else ", isolation: none")
    with StubOpenAI(emulator=make_emulator()) as stub:
        res = _run_ours(work, stub.base_url, "multi_raises", ROWS[:2], repeats=k, extra=extra)
    failures = read_jsonl(work / "out_failures.jsonl")
    assert len(failures) == 2 * k, res.stderr[-3000:]
    by_slot = sorted(failures, key=lambda f: (f["_ng_task_index"], f["_ng_rollout_index"]))
    assert [(f["_ng_task_index"], f["_ng_rollout_index"]) for f in by_slot] == [
        (t, i) for t in range(2) for i in range(k)
    ]
    for f in by_slot:
        assert f["error_class"] == "verify_error" and f["failure_attribution"] == "environment", f
        assert f["partial"] is True and f["response"]["status"] == "incomplete"
        turns = [i for i in f["response"]["output"] if "generation_token_ids" in i]
        assert len(turns) == 3, f["response"]["output"]  # its own three turns, not the group's nine
        for item in turns:
            assert len(item["generation_token_ids"]) == len(item["generation_log_probs"]) > 0
        assert f["cost"]["models"]["policy"]["calls"] == 3, f.get("cost")
        assert f["response"]["usage"]["output_tokens"] == sum(len(i["generation_token_ids"]) for i in turns)


def test_group_rubric_scores_all_repeats_together_across_two_processes(tmp_path: Path) -> None:
    """A rubric with a group reward function: each task's K repeats reach one agent as one group task
    (group_repeats), so the group function sees all K completions (its value carries the group size),
    even with two worker processes serving the batch; one row per repeat, rewards as verifiers' run_group."""
    work = _workdir(tmp_path)
    k = 3
    with StubOpenAI(emulator=make_emulator()) as stub:
        res = _run_ours(
            work, stub.base_url, "group", ROWS, repeats=k, extra=", group_repeats: true", args=("--processes", "2")
        )
        assert res.returncode == 0, res.stderr[-3000:]
        theirs = _run_theirs(work, stub.base_url, "group", repeats=k)
    ours = read_jsonl(work / "out.jsonl")
    assert [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in ours] == [
        (t, i) for t in range(len(ROWS)) for i in range(k)
    ]
    for t, group in enumerate(theirs):
        rows = [r for r in ours if r["_ng_task_index"] == t]
        assert sorted(r["reward"] for r in rows) == pytest.approx(sorted(g[0] for g in group))
        for r in rows:
            assert round(r["rank_in_group"] % 1, 6) == k / 100  # the group function saw K completions
            assert "vf_advantage" in r


def test_prepare_writes_the_environments_dataset_as_rows(tmp_path: Path) -> None:
    """`prepare -i AGENT=env` writes the verifiers environment's own dataset as rows that run as they are."""
    work = _workdir(tmp_path)
    with StubOpenAI(emulator=make_emulator()) as stub:
        res = _run_ours(work, stub.base_url, "single", ROWS[:1])  # writes the config
        assert res.returncode == 0, res.stderr[-3000:]
        rows = _prepare(work, "train")
        assert sorted(r["responses_create_params"]["input"][-1]["content"] for r in rows) == [
            "say blue",
            "say green",
            "say red",
        ]
        assert all(r["verifiers"]["answer"] in r["responses_create_params"]["input"][-1]["content"] for r in rows)
        shutil.copy(work / "prepared" / "train.jsonl", work / "rows.jsonl")
        run = _cli(work, "run", "config.yaml", "-i", "rows.jsonl", "-o", "out2.jsonl", "-q")
        assert run.returncode == 0, run.stderr[-3000:]
    by_color = {r["verifiers"]["answer"]: r["exact"] for r in read_jsonl(work / "out2.jsonl")}
    assert by_color == {"blue": 1.0, "red": 1.0, "green": 0.0}


def _prepare(work: Path, *splits: str) -> list[dict[str, Any]]:
    """`gym-runtime prepare config.yaml -i vf=env`: the environment's own ``splits`` (train, validation) as rows."""
    prep = _cli(work, "prepare", "config.yaml", "-i", "vf=env", "-o", "prepared")
    assert prep.returncode == 0, prep.stderr[-3000:]
    return [
        row for split in splits or ("train", "validation") for row in read_jsonl(work / "prepared" / f"{split}.jsonl")
    ]


def test_prepared_rows_keep_the_columns_a_reward_function_takes_by_name(tmp_path: Path) -> None:
    """verifiers passes every dataset column to a reward function by name (``difficulty`` here):
    `prepare -i vf=env` keeps them, so the prepared rows score as verifiers' own runner scores them."""
    work = _workdir(tmp_path)
    with StubOpenAI(emulator=make_emulator()) as stub:
        (work / "rows.jsonl").write_text("")
        _run_ours(work, stub.base_url, "columns", [])  # writes the config
        rows = _prepare(work)
        assert sorted(r["verifiers"]["difficulty"] for r in rows) == [1, 2, 3]
        res = _run_ours(work, stub.base_url, "columns", rows)
        assert res.returncode == 0, res.stderr[-3000:]
        theirs = _run_theirs(work, stub.base_url, "columns")
    assert not (work / "out_failures.jsonl").exists() or not read_jsonl(work / "out_failures.jsonl")
    ours = sorted(read_jsonl(work / "out.jsonl"), key=lambda r: r["_ng_task_index"])
    assert [r["reward"] for r in ours] == [t[0][0] for t in theirs]
    assert {r["verifiers"]["answer"]: r["reward"] for r in ours} == {"blue": 1.0, "red": 2.0, "green": 0.0}


def test_env_group_rows_carry_their_own_childs_metrics_and_a_raising_reward_is_verify_error(tmp_path: Path) -> None:
    """An EnvGroup of three children: a row has its own child's metrics only (verifiers pads the others'
    with 0.0), and a reward function raising inside a child is a verify_error row, not a reward of 0."""
    work = _workdir(tmp_path)
    with StubOpenAI(emulator=make_emulator()) as stub:
        _run_ours(work, stub.base_url, "env_group", [])  # writes the config
        rows = _prepare(work)
        assert len(rows) == 9
        _run_ours(work, stub.base_url, "env_group", rows)
    child = {i: r["verifiers"]["info"]["env_id"] for i, r in enumerate(rows)}
    out = read_jsonl(work / "out.jsonl")
    failures = read_jsonl(work / "out_failures.jsonl")
    assert sorted(child[f["_ng_task_index"]] for f in failures) == ["broken_env"] * 3
    for f in failures:
        assert f["error_class"] == "verify_error" and "reward blew up" in f["error"], f
    assert sorted(child[r["_ng_task_index"]] for r in out) == ["exact_env"] * 3 + ["short_env"] * 3
    for r in out:
        exact_row = child[r["_ng_task_index"]] == "exact_env"
        mine, others = ("exact", "length_penalty") if exact_row else ("length_penalty", "exact")
        assert mine in r and others not in r and "broken" not in r, r
    assert {r["reward"] for r in out if "exact" in r} == {0.0, 1.0}
    assert all(r["reward"] < 0 for r in out if "length_penalty" in r)


def _hog_config(work: Path, answers: dict[str, str], *, delay_s: float = 0.3) -> None:
    config = {
        "nats": "embedded",
        # the LLM's test double: "OK" to every prompt but those in ``answers``
        "models": {"policy": {"adapter": "scripted", "delay_s": delay_s, "answers": answers}},
        "agents": {
            "vf": {
                "agent": "agents.verifiers_env",
                "model": "policy",
                "timeout_s": 120,
                "call_timeout_s": 3,
                "concurrency": 4,  # the guest holds some rollouts in flight, and more wait behind them
                "options": {"env_id": "vf_suite", "env_args": {"kind": "gil_hog"}},
            }
        },
    }
    (work / "config.yaml").write_text(json.dumps(config))  # JSON is YAML


def _say(words: list[str]) -> list[dict[str, Any]]:
    return [
        {"responses_create_params": {"input": [{"role": "user", "content": f"say {c}"}]}, "verifiers": {"answer": c}}
        for c in words
    ]


HOG_KB = 100  # minutes of one regex search on a loaded core (~20 s on an idle one): it must be stopped, not waited out


def test_a_rubric_that_holds_the_gil_times_out_alone(tmp_path: Path) -> None:
    """The attack of issue 33, item 5, on a verifiers environment: its rubric runs a grader's regex over the
    model's answer, quadratic on repeated ``\\(``, and one rollout's answer is 100 KB of them. Python's ``re``
    holds the GIL the whole time; in the agent worker's own process that stopped its bus's keepalives and its
    other rollouts were lost with it. Run in a guest process (``isolation: process``, the default for verifiers
    environments), the guest is killed at ``call_timeout_s``: that rollout is a ``timeout`` row, every other
    rollout is scored (those that lived in the killed guest ran again as new attempts)."""
    work = _workdir(tmp_path)
    n, hog = 12, 1
    _hog_config(work, {"say hog": "\\(" * (HOG_KB * 512)})  # one answer is the hostile text
    write_jsonl(work / "rows.jsonl", _say([f"c{i}" if i != hog else "hog" for i in range(n)]))
    res = _cli(work, "run", "config.yaml", "-i", "rows.jsonl", "-o", "out.jsonl", "-q", timeout=600)
    failures = read_jsonl(work / "out_failures.jsonl") if (work / "out_failures.jsonl").exists() else []
    scored = read_jsonl(work / "out.jsonl") if (work / "out.jsonl").exists() else []
    by_task = {r["_ng_task_index"]: r for r in [*scored, *failures]}
    assert sorted(by_task) == list(range(n)), res.stderr[-3000:]
    assert by_task[hog].get("error_class") == "timeout", by_task[hog]
    assert "call_timeout_s=3" in by_task[hog]["error"], by_task[hog]["error"]
    others = {i: r.get("error_class", r.get("reward")) for i, r in by_task.items() if i != hog}
    assert all(v == 1.0 for v in others.values()), others  # no worker_lost, no timeout: every one scored
    assert res.returncode == 1, res.stderr[-3000:]  # one failure row


def test_a_guest_killed_mid_batch_loses_no_rollout(tmp_path: Path) -> None:
    """SIGKILL of the agent worker's guest (out of memory, a crash in native code) while rollouts run in it:
    every rollout is scored, the ones it held ran again as new attempts; the worker started another guest."""
    work = _workdir(tmp_path)
    n = 24
    _hog_config(work, {}, delay_s=1.0)
    write_jsonl(work / "rows.jsonl", _say([f"c{i}" for i in range(n)]))
    cmd = [sys.executable, "-m", "gym_runtime.cli", "run", "config.yaml", "-i", "rows.jsonl", "-o", "out.jsonl"]
    proc = subprocess.Popen(cmd, cwd=work, env=_env(work), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    lines: list[str] = []  # its progress lines ("run: 4/24 ...") as they come
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()

    def done() -> int:
        counts = [int(m.group(1)) for line in list(lines) if (m := re.match(r"run: (\d+)/", line))]
        return max(counts, default=0)

    try:

        def guests() -> list[psutil.Process]:
            found = []
            for p in psutil.Process(proc.pid).children(recursive=True):
                try:
                    if "gym_runtime.workers.guest_main" in p.cmdline():
                        found.append(p)
                except psutil.NoSuchProcess:
                    pass
            return found

        def wait_for(what: Any, timeout: float = 240) -> Any:
            end = time.monotonic() + timeout
            while time.monotonic() < end and proc.poll() is None:
                got = what()
                if got:
                    return got
                time.sleep(0.1)
            raise AssertionError(f"not seen in {timeout} s (exit {proc.poll()})")

        (first,) = wait_for(guests)
        wait_for(lambda: done() >= 2)  # the guest has served rollouts; others are in it now
        done_before = done()
        first.send_signal(signal.SIGKILL)
        (second,) = wait_for(lambda: [g for g in guests() if g.pid != first.pid])
        proc.wait(timeout=300)
        reader.join(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert done_before < n, "the batch ended before the guest was killed"
    assert proc.returncode == 0, "".join(lines)[-3000:]
    assert second.pid != first.pid
    rows = read_jsonl(work / "out.jsonl")
    assert sorted(r["_ng_task_index"] for r in rows) == list(range(n))
    assert all(r["reward"] == 1.0 for r in rows)
