"""The trainer's client API end to end: real nats-server, real workers, the scripted policy as the LLM."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from gym_runtime import Client, ClientError, SyncClient
from gym_runtime.messages import RolloutResult
from gym_runtime.service.batches import collect_batch
from gym_runtime.transport.discovery import discover
from gym_runtime.transport.jetstream import consumers, ensure_results_stream, subject_count
from gym_runtime.transport.subjects import LOST, Subjects
from tests.helpers import REPO, ROWS, WEATHER, read_jsonl, rows, weather, weather_config


def three(workers: list[dict[str, Any]]) -> bool:
    """Weather's three workers (a model, a resource, an agent) have answered a discovery."""
    return len(workers) >= 3


async def test_rows_stream_in_completion_order_and_equal_collects(nats_server, tmp_path: Path) -> None:
    """The first row arrives long before the batch ends; the rows are the ones `collect` writes."""
    async with Client(weather(delay_s=0.1, agent_concurrency=1), nats=nats_server.url) as client:
        t0 = time.perf_counter()
        batch = await client.submit(ROWS)
        arrivals, got = [], []
        async for row in batch:
            arrivals.append(time.perf_counter() - t0)
            got.append(row)
        assert len(got) == 5 and all(r["reward"] == 1.0 for r in got)
        assert arrivals[0] < 0.6 * arrivals[-1], arrivals  # streamed, not all at the end
        ordered = await batch.gather()
        assert [r["_ng_task_index"] for r in ordered] == [0, 1, 2, 3, 4]
        stats = await collect_batch(client.bus, batch.batch, tmp_path / "out.jsonl", wait_s=5)
        assert stats.rows == 5
    assert read_jsonl(tmp_path / "out.jsonl") == json.loads(json.dumps(ordered))


async def test_a_row_on_the_lost_subject_is_never_the_clients_row(nats_server) -> None:
    """A row on the lost subject (its writers are not the agent pools) is no reader's row, as for ``collect``:
    stored before the agent's real result, under the id results had before, it neither is the row the client
    gets nor keeps the real result out; a slot is lost only when the server says its task left the queue."""
    async with Client(weather(delay_s=1.0), nats=nats_server.url) as client:
        batch = await client.submit(ROWS[:1])
        forged = RolloutResult(batch=batch.batch, task_index=0, rollout_index=0, agent="simple", row={"reward": 7.0})
        await ensure_results_stream(client.bus, LOST)
        await client.bus.js_publish(client.bus.subjects.lost(batch.batch), forged, msg_id=f"{batch.batch}:0:0")
        (row,) = await batch.gather()
    assert row["reward"] == 1.0 and batch.refused == 0, row


async def test_groups_hold_every_repeat_of_a_task(nats_server) -> None:
    async with Client(weather(), nats=nats_server.url) as client:
        batch = await client.submit(ROWS, repeats=3)
        groups = [g async for g in batch.groups()]
    assert sorted(g[0]["_ng_task_index"] for g in groups) == [0, 1, 2, 3, 4]
    for g in groups:
        assert [r["_ng_rollout_index"] for r in g] == [0, 1, 2]
        assert len({r["_ng_task_index"] for r in g}) == 1
        src = ROWS[g[0]["_ng_task_index"]]
        assert all(r["responses_create_params"] == src["responses_create_params"] for r in g)


async def test_two_batches_in_flight_do_not_mix(nats_server) -> None:
    async with Client(weather(delay_s=0.02), nats=nats_server.url) as client:
        a = await client.submit(ROWS[:3], repeats=2)
        b = await client.submit(ROWS[3:], repeats=4)
        out: dict[str, list[dict[str, Any]]] = {}

        async def take(name: str, h: Any) -> None:
            out[name] = await h.gather()

        async with anyio.create_task_group() as tg:
            tg.start_soon(take, "a", a)
            tg.start_soon(take, "b", b)
    assert len(out["a"]) == 6 and len(out["b"]) == 8
    for r in out["a"]:
        assert r["responses_create_params"] == ROWS[r["_ng_task_index"]]["responses_create_params"]
    for r in out["b"]:
        assert r["responses_create_params"] == ROWS[3 + r["_ng_task_index"]]["responses_create_params"]


async def test_ten_submits_reuse_the_same_warm_workers(nats_server) -> None:
    async with Client(weather(), nats=nats_server.url) as client:
        before = {w["worker"] for w in await discover(client.bus, wait_s=30, until=three)}
        for step in range(10):
            got = await (await client.submit(ROWS[:2])).gather()
            assert [r["reward"] for r in got] == [1.0, 1.0], step
        after = {w["worker"] for w in await discover(client.bus, wait_s=30, until=three)}
        served = sum(getattr(w, "served", 0) for w in client.workers)
    assert before == after and len(before) == 3  # one model, one resource, one agent worker: never restarted
    assert served == 10 * 2 * 2  # two model calls per weather rollout, all on those workers


async def test_cancel_drops_unstarted_tasks_and_drains_the_queue(nats_server) -> None:
    cfg = weather(delay_s=0.15, agent_concurrency=1)
    async with Client(cfg, nats=nats_server.url) as client:
        batch = await client.submit(rows(12))
        first = await batch.__anext__()
        assert first["reward"] == 1.0
        t0 = time.perf_counter()
        await batch.cancel()
        rest = [r async for r in batch]  # ends at once
        # the count proves the unstarted tasks were dropped (running them is 11 x 2 calls x 0.15 s, only ~3 s, so
        # no wall bound could tell that apart under load); the bound catches an iteration that hangs
        assert time.perf_counter() - t0 < 30.0
        assert len(rest) <= 2  # at most what had arrived before the cancel
        agent = next(w for w in client.workers if hasattr(w, "skipped"))
        with anyio.fail_after(30):  # every task is accounted for: run, or acked without running
            while agent.completed < 12:
                await anyio.sleep(0.05)
        lag = {c["consumer"]: c for c in await consumers(client.bus, Subjects("gym").tasks_stream)}
    assert agent.skipped >= 8, (agent.skipped, agent.completed)  # 12 tasks, one slot: most never ran
    assert lag["agent_weather_agent"]["pending"] == 0 and lag["agent_weather_agent"]["ack_pending"] == 0


async def test_stale_tasks_are_dropped_not_run(nats_server) -> None:
    async with Client(weather(delay_s=0.15, agent_concurrency=1), nats=nats_server.url) as client:
        await client.set_policy_version(1)
        batch = await client.submit(rows(8), max_staleness=0)
        first = await batch.__anext__()
        assert first["policy_versions"] == [1, 1]
        assert first["provenance"]["turns"] == ["policy@1", "policy@1"]  # each model call's entry and version
        await client.set_policy_version(2)
        rest = [r async for r in batch]
        with pytest.raises(ClientError, match="must not go down"):
            await client.set_policy_version(1)
    stale = [r for r in rest if r.get("error_class") == "stale"]
    ran = [first] + [r for r in rest if "reward" in r]
    assert len(stale) >= 4 and len(stale) + len(ran) == 8
    assert all("max_staleness=0" in r["error"] for r in stale)
    for r in ran:  # versions stamped by the model worker, on the row and on each token-id-less item: none
        lo, hi = r["policy_versions"]
        assert 1 <= lo <= hi <= 2


async def test_pause_waits_for_calls_in_flight_and_resume_loses_none(nats_server) -> None:
    async with Client(weather(delay_s=0.3, model_replicas=2, model_concurrency=2), nats=nats_server.url) as client:
        models = [w for w in client.workers if hasattr(w, "gate")]
        assert len(models) == 2
        batch = await client.submit(rows(8))
        with anyio.fail_after(10):
            while sum(m.gate.active for m in models) == 0:  # calls in flight
                await anyio.sleep(0.01)
        t0 = time.perf_counter()
        assert await client.pause() == 2  # every live replica acknowledged
        assert time.perf_counter() - t0 > 0.1
        assert all(m.gate.active == 0 for m in models)  # returned only once none was in flight
        served = sum(m.served for m in models)
        # a replica that starts during the pause holds its calls too (it reads the pause from KV)
        async with Client(weather(delay_s=0.3), nats=nats_server.url, workers=["models.policy"]) as late:
            await anyio.sleep(1.0)  # a span with nothing in it: load only stretches it, never fails a sound run
            assert sum(m.served for m in models) == served  # held, not served
            assert late.workers[0].served == 0 and late.workers[0].gate.active == 0
            assert sum(m.gate.held for m in [*models, late.workers[0]]) > 0
            await client.resume()
            got = await batch.gather()
    assert len(got) == 8 and all(r["reward"] == 1.0 for r in got)  # held calls continued, none failed


async def test_two_configs_with_one_model_name_do_not_mix(nats_server) -> None:
    """A second experiment in the same namespace with another `policy` entry: a clear error, not mixing."""
    async with Client(weather(), nats=nats_server.url):
        other = weather(delay_s=0.01)  # another config entry named `policy`
        with pytest.raises(ClientError, match="another config.*model 'policy'"):
            async with Client(other, nats=nats_server.url, workers=False):
                pass
        async with Client(other, nats=nats_server.url, workers=False, check_fingerprints=False) as c2:
            got = await (await c2.submit(ROWS[:2])).gather()
    assert [r["error_class"] for r in got] == ["config_mismatch", "config_mismatch"]
    assert "namespace" in got[0]["error"]


async def test_bad_rows_are_refused_before_anything_is_published(nats_server) -> None:
    async with Client(weather(), nats=nats_server.url) as client:
        with pytest.raises(ClientError, match="row 1: missing required field 'responses_create_params'"):
            await client.submit([ROWS[0], {"input": "hi"}])
        with pytest.raises(ClientError, match="set_policy_version"):
            await client.submit(ROWS, max_staleness=1)


def test_sync_client_and_silence(tmp_path: Path, nats_server) -> None:
    """A sync trainer script: rows come back, and nothing is printed on stdout or stderr."""
    script = tmp_path / "trainer.py"
    script.write_text(
        "import json, sys\n"
        "from gym_runtime import SyncClient\n"
        f"rows = [json.loads(l) for l in open({str(REPO / 'resources/weather/data/example.jsonl')!r})]\n"
        f"with SyncClient({str(WEATHER)!r}, nats={nats_server.url!r}) as c:\n"
        "    c.set_policy_version(7)\n"
        "    got = [r['reward'] for r in c.submit(rows, repeats=2)]\n"
        "    groups = list(c.submit(rows[:2], repeats=2).groups())\n"
        "    one = c.run(rows[0])\n"
        "open(sys.argv[1], 'w').write(json.dumps([got, [len(g) for g in groups], one['policy_versions']]))\n"
    )
    res = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "out.json")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout == "" and res.stderr == ""
    got, groups, versions = json.loads((tmp_path / "out.json").read_text())
    assert got == [1.0] * 10 and groups == [2, 2] and versions == [7, 7]


def test_sync_client_with_an_embedded_server() -> None:
    with SyncClient(WEATHER, nats="embedded") as c:
        assert [r["reward"] for r in c.submit(ROWS[:2]).gather()] == [1.0, 1.0]


async def test_workers_as_child_processes_stay_warm_and_stop_with_the_client(nats_server) -> None:
    async with Client(WEATHER, nats=nats_server.url, workers="processes") as client:
        assert client._children is not None
        child = client._children.proc
        first = {w["worker"] for w in await discover(client.bus, wait_s=30, until=three)}
        for _ in range(3):
            got = await (await client.submit(ROWS)).gather()
            assert [r["reward"] for r in got] == [1.0] * 5
        assert {w["worker"] for w in await discover(client.bus, wait_s=30, until=three)} == first and len(first) == 3
    assert child.poll() is not None  # stopped (drained) with the client


async def test_a_worker_started_later_reads_the_current_version(nats_server) -> None:
    async with Client(weather(), nats=nats_server.url, workers=False) as trainer:
        await trainer.set_policy_version(9)
    async with Client(weather(), nats=nats_server.url) as client:  # its model worker starts now
        assert client.policy_version == 9
        got = await (await client.submit(ROWS[:2])).gather()
    assert [r["policy_versions"] for r in got] == [[9, 9], [9, 9]]


def test_fingerprints_ignore_deployment_fields_but_not_what_is_served() -> None:
    from gym_runtime.config import resolve_config
    from gym_runtime.model import model_config

    served = {"adapter": "openai", "model": "policy-7b", "base_url": "http://gpu1:8000/v1", "api_key": "k"}
    first = weather_config()
    first.models["policy"] = model_config(served)
    node = weather_config(model_concurrency=8, model_replicas=4)
    node.models["policy"] = model_config(
        {
            **served,
            "base_url": "http://gpu7:8000/v1",
            "api_key": "other",
            "timeout_s": 5.0,
            "concurrency": 8,
            "replicas": 4,
        }
    )
    assert resolve_config(node).fingerprints == resolve_config(first).fingerprints  # another node, same experiment
    base = weather().fingerprints
    other = weather(delay_s=0.5).fingerprints
    assert other[("model", "policy")] != base[("model", "policy")]
    assert other[("agent", "weather_agent")] != base[("agent", "weather_agent")]  # covers its model
    assert other[("resource", "weather")] == base[("resource", "weather")]


async def test_cli_style_publish_is_fingerprinted_too(nats_server, tmp_path: Path) -> None:
    """`gym-runtime run/publish` of another config into a namespace with these workers: refused before
    anything is published, naming the key that differs; a publish that skips the check gets failure rows."""
    from gym_runtime.errors import ConfigError
    from gym_runtime.observability.tracing import Telemetry
    from gym_runtime.service.runner import run_batch

    async def run(check: bool) -> Any:
        return await run_batch(
            weather(delay_s=0.01),
            nats_server.url,
            input_path=WEATHER.parent / "data/example.jsonl",
            out=tmp_path / "out.jsonl",
            telemetry=Telemetry(),
            start_local_workers=False,
            check_workers=check,
        )

    async with Client(weather(), nats=nats_server.url) as client:
        with pytest.raises(ConfigError, match=r"agent 'weather_agent' .*differs in models\.policy\.delay_s"):
            await run(True)
        subjects = client.bus.subjects
        assert await subject_count(client.bus, subjects.tasks_stream, subjects.stream_subjects("task")) == 0
        stats = (await run(False)).stats
    assert stats.failures == 5
    assert {r["error_class"] for r in read_jsonl(tmp_path / "out_failures.jsonl")} == {"config_mismatch"}


async def test_a_worker_of_another_config_that_starts_later_is_refused_at_the_next_submit(nats_server) -> None:
    """A client checks the cluster at start and again every few seconds: the other experiment's workers
    that start after it are named (with the key that differs) at its next submit, before any row is sent."""
    async with Client(weather(), nats=nats_server.url, workers=False) as client:
        async with Client(weather(delay_s=0.01), nats=nats_server.url, check_fingerprints=False):
            with anyio.fail_after(60):
                while True:
                    with pytest.raises(ClientError) as got:
                        await client.submit([])  # no rows: refused either way, the cluster check first
                    if "differs in models.policy.delay_s" in str(got.value):
                        break
                    await anyio.sleep(0.2)
            with pytest.raises(ClientError, match="started with another config"):
                await client.submit(ROWS[:1])


async def test_a_publish_the_stream_refuses_fails_the_whole_publish_at_once(nats_server) -> None:
    """The task stream takes 5 messages and refuses the rest: publishing 40 raises StorageFull
    promptly (no hang waiting for acks that will not come), saying how many were stored, and nothing
    past it is sent."""
    import dataclasses

    from nats.js.api import DiscardPolicy

    from gym_runtime.data.inputs import publish_rows
    from gym_runtime.errors import StorageFull
    from gym_runtime.observability.tracing import Telemetry
    from gym_runtime.transport.bus import Bus
    from gym_runtime.transport.jetstream import ensure_streams

    bus = await Bus.connect(nats_server.url, namespace="fullq", telemetry=Telemetry(), name="publisher")
    try:
        await ensure_streams(bus)
        name = Subjects("fullq").tasks_stream
        info = await bus.js.stream_info(name)
        await bus.js.update_stream(dataclasses.replace(info.config, max_msgs=5, discard=DiscardPolicy.NEW))
        with (
            anyio.fail_after(20),
            pytest.raises(StorageFull, match=r"FULLQ_TASKS is full \(maximum messages.*; 5 tasks"),
        ):
            await publish_rows(bus, rows(40), batch="b", agents=["weather_agent"], in_flight=4)
        assert (await bus.js.stream_info(name)).state.messages == 5
    finally:
        await bus.close()
