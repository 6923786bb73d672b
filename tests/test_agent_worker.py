"""workers.agent_worker: a task pulled, run, its result stored before the ack; failures retried, then a row.

Real workers in this process on a real server (the scripted policy is the only double): rows come
back in NeMo Gym's shape; a verifier that keeps raising costs the task ``max_attempts`` attempts and
then becomes a ``verify_error`` failure row, while the other tasks of the batch complete.
"""

from __future__ import annotations

import json
from pathlib import Path

import anyio

from gym_runtime.config import config_from_dict, resolve_config
from gym_runtime.data.collector import Collector
from gym_runtime.data.inputs import publish_rows
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.service.runner import drain, make_workers, selected, start_workers
from gym_runtime.transport.bus import Bus
from tests.helpers import FLAKY, ROWS, put_batch, read_jsonl


async def test_rows_come_back_in_nemo_gym_shape_and_a_failing_verifier_becomes_a_failure_row(
    bus: Bus, tmp_path: Path
) -> None:
    cfg = config_from_dict({**FLAKY, "base_dir": str(tmp_path)})
    rows = [ROWS[0], {**ROWS[1], "explode": True}, ROWS[2]]
    workers = make_workers(bus, resolve_config(cfg), selected(cfg, None))
    async with anyio.create_task_group() as tg:
        await start_workers(tg, workers)
        await publish_rows(bus, rows, batch="b", agents=["agent"])
        with anyio.fail_after(60):
            stats = await Collector(bus, await put_batch(bus, "b", 3, agent="agent"), tmp_path / "out.jsonl").run()
        await drain(workers, timeout=5)
        tg.cancel_scope.cancel()
    got = read_jsonl(tmp_path / "out.jsonl")
    assert [r["_ng_task_index"] for r in got] == [0, 2] and all(r["reward"] == 1.0 for r in got)
    for row, sent in zip(got, (ROWS[0], ROWS[2]), strict=True):
        assert row["agent_ref"] == {"type": "responses_api_agents", "name": "agent"}
        assert row["responses_create_params"]["input"] == sent["responses_create_params"]["input"]
        kinds = [item["type"] for item in row["response"]["output"]]
        assert "function_call" in kinds and "function_call_output" in kinds and kinds[-1] == "message"
    (failed,) = read_jsonl(tmp_path / "out_failures.jsonl")
    assert failed["_ng_task_index"] == 1 and failed["error_class"] == "verify_error"
    assert failed["attempts"] == 2 and "always fails" in failed["error"]
    assert stats.rows == 2 and stats.failures == 1
    assert json.loads((tmp_path / "out_aggregate_metrics.json").read_text())


async def test_a_resource_sees_each_rollouts_task_and_rollout_index_at_seed_and_verify(
    bus: Bus, tmp_path: Path
) -> None:
    """NeMo Gym's runner puts `_ng_task_index` and `_ng_rollout_index` on every row its agents forward to
    /seed_session and /verify; genrm_compare refuses a verify without them (HTTP 422) and gathers a task's
    repeats by them. tests.envs.cohort holds each verify until its task's 3 repeats arrived, by those keys:
    without them the two tasks' six rollouts fell into one cohort of rollout index -1."""
    cfg = config_from_dict(
        {
            **FLAKY,
            "resources": {"env": {"server": "tests.envs.cohort"}},
            "agents": {"agent": {"agent": "agents.simple", "model": "policy", "resource": "env", "max_steps": 4}},
            "base_dir": str(tmp_path),
        }
    )
    rows = [{**ROWS[i], "cohort_size": 3, "cohort_wait_s": 20.0, "batch_key": str(tmp_path)} for i in (0, 1)]
    workers = make_workers(bus, resolve_config(cfg), selected(cfg, None))
    async with anyio.create_task_group() as tg:
        await start_workers(tg, workers)
        await publish_rows(bus, rows, batch="b", agents=["agent"], repeats=3)
        with anyio.fail_after(60):
            await Collector(bus, await put_batch(bus, "b", 2, repeats=3, agent="agent"), tmp_path / "out.jsonl").run()
        await drain(workers, timeout=5)
        tg.cancel_scope.cancel()
    got = read_jsonl(tmp_path / "out.jsonl")
    assert sorted((r["_ng_task_index"], r["_ng_rollout_index"], r["cohort"]) for r in got) == [
        (t, i, [0, 1, 2]) for t in (0, 1) for i in range(3)
    ]
    assert all(r["reward"] == 1.0 for r in got)


async def test_an_attempts_start_record_is_stored_before_its_first_model_call(
    bus: Bus, nats_server: EmbeddedServer, tmp_path: Path
) -> None:
    """The start record is the only trace of an attempt whose worker is SIGKILLed: the agent (tests.envs.
    attempt_witness) finds it on the server before its first model call. (Records sent every 0.5 s without an
    ack, the round before, were not there yet: the attempt failed.)"""
    agent = {"agent": "tests.envs.attempt_witness", "model": "policy", "resource": "env", "max_steps": 4}
    cfg = config_from_dict({**FLAKY, "agents": {"agent": agent}, "base_dir": str(tmp_path)})
    workers = make_workers(bus, resolve_config(cfg), selected(cfg, None))
    async with anyio.create_task_group() as tg:
        await start_workers(tg, workers)
        await publish_rows(bus, [{**ROWS[0], "nats_url": nats_server.url}], batch="b", agents=["agent"])
        with anyio.fail_after(60):
            await Collector(bus, await put_batch(bus, "b", 1, agent="agent"), tmp_path / "out.jsonl").run()
        await drain(workers, timeout=5)
        tg.cancel_scope.cancel()
    assert not (tmp_path / "out_failures.jsonl").exists(), (tmp_path / "out_failures.jsonl").read_text()
    (row,) = read_jsonl(tmp_path / "out.jsonl")
    assert row["reward"] == 1.0
