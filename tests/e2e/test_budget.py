"""Budgets (issue 39): ``run --budget`` stops a batch where its budget says, and a run of it again with a
larger budget finishes it. Real nats-server, the real ``gym-runtime run`` in a subprocess, real workers; the
only double is the policy LLM (``tests/stub_openai.py``), whose token counts per call are fixed, so the row
that must be the last to start is computed by hand."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
import yaml

from gym_runtime import Client, ClientError
from gym_runtime.config import load_config, resolve_config
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.service.batches import collect_batch
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.subjects import Subjects
from tests.helpers import ROWS, cli, read_jsonl, write_jsonl
from tests.stub_openai import RecordedRequest, StubOpenAI, StubReply, responses_reply

N_TASKS = 10
INPUT, OUTPUT = 20, 7  # each rollout: one policy call of 20 + 7 = 27 tokens (the stub's fixed counts)


class FixedModel:
    """The policy's double: one text answer of fixed token counts per call, and its own count of calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, req: RecordedRequest) -> StubReply:
        with self.lock:
            self.calls += 1
        return StubReply(body=responses_reply(input_tokens=INPUT, output_tokens=OUTPUT))


def write_config(tmp_path: Path, base_url: str, *, pricing: bool = True) -> Path:
    raw: dict[str, Any] = {
        "namespace": "gym",
        "nats": "embedded",
        "models": {"policy": {"adapter": "openai", "base_url": base_url, "api_key": "test", "model": "p"}},
        "resources": {"weather": {"server": "resources.weather"}},
        "agents": {"weather_agent": {"agent": "agents.simple", "model": "policy", "resource": "weather"}},
    }
    if pricing:  # 27 tokens a rollout at 10,000 per 1M input and output tokens: 0.27 a rollout
        raw["pricing"] = {"currency": "EUR", "models": {"policy": {"input_per_1m": 1e4, "output_per_1m": 1e4}}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


async def stored_results(url: str) -> int:
    bus = await Bus.connect(url, namespace="gym", telemetry=Telemetry(), name="test")
    try:
        return int((await bus.js.stream_info(Subjects("gym").results_stream("weather_agent"))).state.messages)
    finally:
        await bus.close()


def run(config: Path, tasks: Path, out: Path, url: str, budget: str) -> Any:
    args = ("run", str(config), "-i", str(tasks), "-o", str(out), "--nats", url, "--batch", "b1")
    return cli(*args, "--processes", "one", "--quiet", "--budget", budget, timeout=300)


def test_a_budget_stops_the_batch_at_the_right_row_and_a_larger_one_finishes_it(nats_server, tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    write_jsonl(tasks, [ROWS[i % len(ROWS)] for i in range(N_TASKS)])
    policy = FixedModel()
    with StubOpenAI(handler=policy) as stub:
        config = write_config(tmp_path, stub.base_url)
        # 1.00 EUR at 0.27 a rollout: the first runs alone (no mean yet), then rollouts start while
        # spent + in flight x 0.27 <= 1.00: three in all (0.81; a fourth would make 1.08). Row 2 is the last.
        first = run(config, tasks, tmp_path / "out.jsonl", nats_server.url, "1.00")
        assert first.returncode == 1, first.stderr
        said = [line for line in first.stderr.splitlines() if "budget" in line]
        assert len(said) == 1 and "budget reached: 0.8100 EUR of the budget's 1.0000 EUR spent;" in said[0]
        assert "7 of 10 rollouts not started" in said[0] and "--batch b1" in said[0], first.stderr
        rows = read_jsonl(tmp_path / "out.jsonl")
        assert [r["_ng_task_index"] for r in rows] == [0, 1, 2]
        assert all(r["cost"]["models"]["policy"]["input_tokens"] == INPUT for r in rows)
        failures = read_jsonl(tmp_path / "out_failures.jsonl")
        assert [f["_ng_task_index"] for f in failures] == list(range(3, N_TASKS))
        assert {f["error_class"] for f in failures} == {"budget"} and all(f["attempts"] == 0 for f in failures)
        assert policy.calls == 3  # no held-back task ever started
        assert anyio.run(stored_results, nats_server.url) == 3  # nor was anything stored for them

        # the same batch again: its budget counts what the first run spent (81 tokens of 100: nothing starts)
        again = run(config, tasks, tmp_path / "again.jsonl", nats_server.url, "100tokens")
        assert again.returncode == 1 and "budget reached: 81 tokens of the budget's 100 tokens" in again.stderr
        assert policy.calls == 3 and len(read_jsonl(tmp_path / "again_failures.jsonl")) == 7

        # and with room for it all (270 tokens): the 7 held back run, the 3 stored are not run again
        second = run(config, tasks, tmp_path / "all.jsonl", nats_server.url, "1000tokens")
        assert "10 rows, 0 failed" in second.stdout, second.stdout + second.stderr
        assert second.returncode == 0, second.stderr
    rows = read_jsonl(tmp_path / "all.jsonl")
    assert [r["_ng_task_index"] for r in rows] == list(range(N_TASKS))
    assert policy.calls == N_TASKS and anyio.run(stored_results, nats_server.url) == N_TASKS  # each task once
    assert not (tmp_path / "all_failures.jsonl").exists()
    (metrics,) = json.loads((tmp_path / "all_aggregate_metrics.json").read_text())
    assert metrics["cost"]["rollouts"]["models"]["policy"]["input_tokens"] == N_TASKS * INPUT, metrics["cost"]


def embedded_run(config: Path, tasks: Path, out: Path, budget: str, *flags: str) -> Any:
    args = ("run", str(config), "-i", str(tasks), "-o", str(out), "--batch", "b1", "--budget", budget)
    return cli(*args, "--processes", "one", "--quiet", *flags, timeout=300)


def test_run_with_a_store_dir_resumes_its_budgeted_batch_and_without_one_promises_no_resume(tmp_path: Path) -> None:
    """``run``'s own (embedded) server: with ``--store-dir`` it keeps the batch, so the line's resume works and
    runs only the 7 held back; without one, the line does not promise it."""
    tasks = tmp_path / "tasks.jsonl"
    write_jsonl(tasks, [ROWS[i % len(ROWS)] for i in range(N_TASKS)])
    store = tmp_path / "store"
    policy = FixedModel()
    with StubOpenAI(handler=policy) as stub:
        config = write_config(tmp_path, stub.base_url)
        # 0.10 EUR, less than one rollout (0.27): the first runs alone all the same, and the line says so
        forgetful = embedded_run(config, tasks, tmp_path / "gone.jsonl", "0.10")
        assert forgetful.returncode == 1, forgetful.stderr
        [said] = [line for line in forgetful.stderr.splitlines() if "budget" in line]
        assert "a rollout costs 0.2700 EUR, more than the whole budget" in said, said
        assert "run again with --batch b1" not in said and "--store-dir DIR" in said, said
        assert policy.calls == 1
        first = embedded_run(config, tasks, tmp_path / "out.jsonl", "1.00", "--store-dir", str(store))
        assert first.returncode == 1 and "run again with --batch b1 and a larger --budget" in first.stderr
        assert "more than the whole budget" not in first.stderr
        assert policy.calls == 1 + 3
        second = embedded_run(config, tasks, tmp_path / "all.jsonl", "1000tokens", "--store-dir", str(store))
        assert second.returncode == 0, second.stderr
        assert "10 rows, 0 failed" in second.stdout, second.stdout + second.stderr
    assert policy.calls == 1 + N_TASKS  # the resume ran only the 7 held back
    assert [r["_ng_task_index"] for r in read_jsonl(tmp_path / "all.jsonl")] == list(range(N_TASKS))


def test_a_store_dir_with_another_server_is_one_line_and_exit_2(nats_server, tmp_path: Path) -> None:
    tasks = write_jsonl(tmp_path / "tasks.jsonl", ROWS[:1])
    config = write_config(tmp_path, "http://127.0.0.1:9/v1")
    r = cli("run", str(config), "-i", str(tasks), "-o", str(tmp_path / "o.jsonl"), "--nats", nats_server.url,
            "--store-dir", str(tmp_path / "s"))  # fmt: skip
    assert r.returncode == 2 and "--store-dir is the embedded server's store" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_budget_mistake_is_one_line_and_exit_2(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    write_jsonl(tasks, ROWS[:1])
    config = write_config(tmp_path, "http://127.0.0.1:9/v1", pricing=False)
    for budget, says in (
        ("2.50", "has no `pricing` section"),
        ("-1", "a budget must be more than 0"),
        ("0tokens", "a budget must be more than 0"),
        ("lots", "a budget is an amount of money"),
    ):
        r = cli("run", str(config), "-i", str(tasks), "-o", str(tmp_path / "o.jsonl"), "--budget", budget)
        assert r.returncode == 2 and says in r.stderr, (budget, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr


async def test_client_submit_with_a_budget_holds_back_what_would_pass_it(nats_server, tmp_path: Path) -> None:
    """``Client.submit(budget=...)``: the same rule through the client's admission; the rows held back are
    ``budget`` failure rows yielded like any other, and never started."""
    policy = FixedModel()
    with StubOpenAI(handler=policy) as stub:
        config = resolve_config(load_config(write_config(tmp_path, stub.base_url)))
        (tmp_path / "unpriced").mkdir()
        unpriced = resolve_config(load_config(write_config(tmp_path / "unpriced", stub.base_url, pricing=False)))
        async with Client(config, nats=nats_server.url) as client:
            batch = await client.submit([ROWS[i % len(ROWS)] for i in range(N_TASKS)], budget="100tokens")
            rows = await batch.gather()
            with pytest.raises(ClientError, match="-1"):
                await client.submit(ROWS[:1], budget=-1)
        async with Client(unpriced, nats=nats_server.url) as client:
            with pytest.raises(ClientError, match="no `pricing` section"):
                await client.submit(ROWS[:1], budget=2.5)
    ok = [r["_ng_task_index"] for r in rows if "error_class" not in r]
    held = [r for r in rows if r.get("error_class") == "budget"]
    assert ok == [0, 1, 2] and [r["_ng_task_index"] for r in held] == list(range(3, N_TASKS))  # 81 of 100 tokens
    assert batch.budget_stopped == 7 and policy.calls == 3


async def test_publish_with_a_budget_then_collect_writes_the_budget_rows_and_a_resume_finishes(
    nats_server, tmp_path: Path
) -> None:
    """``publish --budget`` stays until each task is started or held back (it reads the results to count what
    is spent), then says so in one line; ``collect`` writes the held-back slots' ``budget`` rows to the
    failures file (nothing stored for them), and a publish again with a larger budget finishes the batch."""
    tasks = tmp_path / "tasks.jsonl"
    write_jsonl(tasks, [ROWS[i % len(ROWS)] for i in range(N_TASKS)])
    policy = FixedModel()
    url = nats_server.url

    def cmd(*args: str) -> Any:
        return anyio.to_thread.run_sync(lambda: cli(*args, timeout=300))

    with StubOpenAI(handler=policy) as stub:
        path = write_config(tmp_path, stub.base_url)
        async with Client(resolve_config(load_config(path)), nats=url):  # the workers, in this process
            publish = ("publish", str(path), "-i", str(tasks), "--nats", url, "--batch", "p1", "--quiet")
            first = await cmd(*publish, "--budget", "100tokens")
            said = [line for line in first.stderr.splitlines() if "budget" in line]
            assert first.returncode == 1 and len(said) == 1, first.stderr
            assert "budget reached: 81 tokens of the budget's 100 tokens spent; 7 of 10 rollouts" in said[0]
            collect = ("collect", "--batch", "p1", "--nats", url, "--quiet", "-o")
            got = await cmd(*collect, str(tmp_path / "out.jsonl"))
            assert got.returncode == 1 and "held back by the batch's budget" in got.stderr, got.stderr
            assert [r["_ng_task_index"] for r in read_jsonl(tmp_path / "out.jsonl")] == [0, 1, 2]
            failures = read_jsonl(tmp_path / "out_failures.jsonl")
            assert [(f["_ng_task_index"], f["error_class"]) for f in failures] == [(i, "budget") for i in range(3, 10)]
            assert policy.calls == 3 and await stored_results(url) == 3

            second = await cmd(*publish, "--budget", "1000tokens")
            assert second.returncode == 0, second.stderr
            got = await cmd(*collect, str(tmp_path / "all.jsonl"))
            assert got.returncode == 0, got.stderr
    assert [r["_ng_task_index"] for r in read_jsonl(tmp_path / "all.jsonl")] == list(range(N_TASKS))
    assert policy.calls == N_TASKS and await stored_results(url) == N_TASKS  # each task exactly once


async def test_a_cancelled_budgeted_batch_still_ends_for_collect(nats_server, tmp_path: Path) -> None:
    """Tasks held by a budget alone when their batch is cancelled are published marked cancelled, as the
    staleness window's are: each becomes its ``cancelled`` row unrun, and ``collect`` ends."""
    slow = FixedModel()
    with StubOpenAI(handler=lambda req: (slow(req), StubReply(body=responses_reply(), delay_s=0.5))[1]) as stub:
        config = resolve_config(load_config(write_config(tmp_path, stub.base_url)))
        async with Client(config, nats=nats_server.url) as client:
            batch = await client.submit([ROWS[i % len(ROWS)] for i in range(N_TASKS)], budget="1000tokens")
            assert batch.held == N_TASKS - 1  # no mean yet: one rollout at a time
            await batch.cancel()
            with anyio.fail_after(120):
                stats = await collect_batch(client.bus, batch.batch, tmp_path / "out.jsonl", wait_s=5)
    failures = read_jsonl(tmp_path / "out_failures.jsonl") if stats.failures else []
    assert stats.rows + stats.failures == N_TASKS and slow.calls <= 1
    assert {f["error_class"] for f in failures} <= {"cancelled"} and len(failures) >= N_TASKS - 1
