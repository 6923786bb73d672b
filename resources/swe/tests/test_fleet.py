"""swe on the fleet without an engine: a ``process`` pool (the project's code sandbox) serves the session and
the grading of rows that carry their repository (``repo_files``). Real nats-server, in-process workers; the
LLM is a test double (a replayed scripted recording). The same path on a real dockerd, with the task's image,
is tests/e2e/test_swe_fleet.py."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import anyio

from gym_runtime.agents.swe import SUBMIT
from gym_runtime.config import resolve_config
from gym_runtime.data.collector import Collector
from gym_runtime.data.inputs import publish_rows
from gym_runtime.service.runner import make_workers, selected, start_workers
from gym_runtime.transport.bus import Bus
from gym_runtime.workers.sandbox_worker import SandboxWorker
from tests.helpers import put_batch, read_jsonl
from tests.swe_demo import FILES, fleet_config, scripted_policy, swe_row


async def test_a_process_pool_runs_and_grades_rows_that_carry_their_repository(bus: Bus, tmp_path: Path) -> None:
    fix = ["sed -i 's/return a - b/return a + b/' calc.py", SUBMIT]
    row = swe_row("", repo_files=FILES, problem_statement="calc.add is wrong (process pool).")
    del row["image_name"]
    idle = {**row, "problem_statement": "calc.add is wrong (process pool, no fix)."}
    recordings = tmp_path / "policy.jsonl"
    recordings.write_text("".join(json.dumps(scripted_policy(r, c)) + "\n" for r, c in ((row, fix), (idle, [SUBMIT]))))
    pool = f"swe{uuid.uuid4().hex[:6]}"
    cfg = fleet_config(tmp_path, "", pool, recordings, [], backend="process")
    workers = make_workers(bus, resolve_config(cfg), selected(cfg, None))
    async with anyio.create_task_group() as tg:
        await start_workers(tg, workers)
        await publish_rows(bus, [row, idle], batch="swe", agents=["swe_agent"])
        with anyio.fail_after(120):
            await Collector(bus, await put_batch(bus, "swe", 2, agent="swe_agent"), tmp_path / "out.jsonl").run()
        [sandboxes] = [w for w in workers if isinstance(w, SandboxWorker)]
        assert sandboxes.created == 4 and sandboxes.stats()["sandboxes"] == 0  # two per rollout, all closed
        tg.cancel_scope.cancel()
    fixed, unfixed = sorted(read_jsonl(tmp_path / "out.jsonl"), key=lambda r: r["_ng_task_index"])
    assert (fixed["reward"], fixed["resolved"]) == (1.0, True)
    assert fixed["model_patch"].startswith(
        "diff --git a/calc.py b/calc.py\n"
    )  # the Python diff, against the row's files
    assert (unfixed["reward"], unfixed["model_patch"]) == (0.0, "")
    assert unfixed["tests_status"]["FAIL_TO_PASS"] == {"success": [], "failure": ["test_calc.TestCalc.test_add"]}
