"""A real SWE task end to end on the sandbox fleet: our ``swe`` environment and ``agents.swe``, a real
dockerd, a real nats-server, the task's image built here (``tests/swe_demo.py``). Only the LLM is a test
double: the ``replay`` adapter plays two scripted policies, one that fixes the bug and one that does not.

Every command of the policy runs in a sandbox of the pool holding the task's image; grading takes the
session's diff, applies it and the row's ``test_patch`` to a fresh sandbox of the same image and runs the
``FAIL_TO_PASS`` and ``PASS_TO_PASS`` tests: reward 1 iff all of them pass (SWE-bench's rule).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import anyio

from gym_runtime.agents.swe import SUBMIT
from gym_runtime.config import Config, resolve_config
from gym_runtime.data.collector import Collector
from gym_runtime.data.inputs import publish_rows
from gym_runtime.sandboxes.engine_api import POOL
from gym_runtime.sandboxes.engine_http import Engine
from gym_runtime.service.runner import make_workers, selected, start_workers
from gym_runtime.transport.bus import Bus
from gym_runtime.workers.sandbox_worker import SandboxWorker
from tests.helpers import put_batch, read_jsonl
from tests.swe_demo import fleet_config, scripted_policy, swe_row

FIX = ["pwd; ls /testbed", "sed -i 's/return a - b/return a + b/' calc.py", "python3 -m unittest -v test_calc", SUBMIT]
NO_FIX = ["python3 -m unittest -v test_calc", SUBMIT]


def outputs(row: dict[str, Any]) -> list[str]:
    return [i["output"] for i in row["response"]["output"] if i["type"] == "function_call_output"]


async def run_rows(bus: Bus, cfg: Config, rows: list[dict[str, Any]], out: Path, check: Any) -> None:
    """Run the rows through in-process workers; ``check(sandbox worker)`` while they still run."""
    workers = make_workers(bus, resolve_config(cfg), selected(cfg, None))
    async with anyio.create_task_group() as tg:
        await start_workers(tg, workers)
        await publish_rows(bus, rows, batch="swe", agents=["swe_agent"])
        with anyio.fail_after(120):
            await Collector(bus, await put_batch(bus, "swe", len(rows), agent="swe_agent"), out).run()
        [sandboxes] = [w for w in workers if isinstance(w, SandboxWorker)]
        await check(sandboxes)
        tg.cancel_scope.cancel()


async def test_a_swe_task_on_the_fleet_rewards_the_fix_and_not_its_absence(
    bus: Bus, engine: Engine, swe_demo_image: str, tmp_path: Path
) -> None:
    fixes = swe_row(swe_demo_image, problem_statement="calc.add(2, 3) returns -1 instead of 5 (policy: fixes it).")
    idles = swe_row(swe_demo_image, problem_statement="calc.add(2, 3) returns -1 instead of 5 (policy: does not).")
    recordings = tmp_path / "policy.jsonl"
    recordings.write_text(
        "".join(json.dumps(r) + "\n" for r in (scripted_policy(fixes, FIX), scripted_policy(idles, NO_FIX)))
    )
    pool = f"swe{uuid.uuid4().hex[:6]}"  # this test's own: others on the engine keep their containers
    cfg = fleet_config(tmp_path, engine.socket_path, pool, recordings, [swe_demo_image])

    async def none_left(sandboxes: SandboxWorker) -> None:
        # each rollout: its session's sandbox, then a fresh one to grade in; every one closed by its owner
        assert sandboxes.created == 4
        with anyio.fail_after(30):
            while await engine.containers({POOL: f"gym.{pool}"}):
                await anyio.sleep(0.2)

    await run_rows(bus, cfg, [fixes, idles], tmp_path / "out.jsonl", none_left)
    assert not (tmp_path / "out_failures.jsonl").exists() or read_jsonl(tmp_path / "out_failures.jsonl") == []
    fixed, idle = sorted(read_jsonl(tmp_path / "out.jsonl"), key=lambda r: r["_ng_task_index"])

    assert (fixed["reward"], fixed["resolved"], fixed["exit_status"]) == (1.0, True, "submitted")
    assert fixed["tests_status"] == {
        "FAIL_TO_PASS": {"success": ["test_calc.TestCalc.test_add"], "failure": []},
        "PASS_TO_PASS": {"success": ["test_calc.TestCalc.test_mul"], "failure": []},
    }
    assert "-    return a - b\n+    return a + b" in fixed["model_patch"]  # the answer: the session's diff
    ran = outputs(fixed)
    assert (
        ran[0] == "<returncode>0</returncode>\n<output>\n/work/repo\ncalc.py\ntest_calc.py\n</output>"
    )  # in the image
    assert "Ran 1 test" in ran[2] and "OK" in ran[2]  # live, in the container (test_add comes with the test patch)

    assert (idle["reward"], idle["resolved"], idle["model_patch"]) == (0.0, False, "")
    assert idle["tests_status"] == {
        "FAIL_TO_PASS": {"success": [], "failure": ["test_calc.TestCalc.test_add"]},
        "PASS_TO_PASS": {"success": ["test_calc.TestCalc.test_mul"], "failure": []},
    }


async def test_a_task_whose_image_the_engine_lacks_fails_with_one_line_naming_it(
    bus: Bus, engine: Engine, base_image: str, tmp_path: Path
) -> None:
    row = swe_row("gym-runtime/swe-missing:0", problem_statement="calc.add is wrong (no image).")
    recordings = tmp_path / "policy.jsonl"
    recordings.write_text(json.dumps(scripted_policy(row, NO_FIX)) + "\n")
    pool = f"swe{uuid.uuid4().hex[:6]}"
    cfg = fleet_config(tmp_path, engine.socket_path, pool, recordings, [])

    async def nothing_made(sandboxes: SandboxWorker) -> None:
        assert sandboxes.created == 0 and await engine.containers({POOL: f"gym.{pool}"}) == []

    await run_rows(bus, cfg, [row], tmp_path / "out.jsonl", nothing_made)
    (failed,) = read_jsonl(tmp_path / "out_failures.jsonl")
    assert failed["error_class"] == "tool_error"
    assert "image 'gym-runtime/swe-missing:0' is not in the docker engine" in failed["error"], failed
