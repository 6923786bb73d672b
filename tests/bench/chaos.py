"""The gray-failure matrix, once: each component frozen mid-batch (SIGSTOP of its real process), and how long until
it was found and worked around (issue 77).

Each row is the e2e test that freezes that component (real nats-server, real worker processes, the scripted
policy as the LLM), run on its own with ``pytest -s``; the test asserts its own bounds (found within 30 s,
worked around within 60 s, every row once) and prints what it measured, which this script reads back into one
table. A row whose test is not in this tree (another branch's) is skipped; one that fails says so.

    python tests/bench/chaos.py [--only NAME[,NAME...]]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Row:
    name: str
    test: str  # file::name
    found: str  # a regex whose group 1 is the seconds until found (named), or "" when the test measures none
    recovered: str  # ... until worked around (calls moved, the batch going again or done)
    what: str  # what "recovered" measures


E2E = "tests/e2e/"
MATRIX = [
    Row("model worker", E2E + "test_why.py::test_why_names_a_frozen_model_worker_within_30_s",
        r"frozen model worker named after ([\d.]+)s", "", "-"),
    Row("model replica (2)",
        E2E + "test_why.py::test_a_frozen_model_replicas_calls_move_to_the_other_and_every_row_arrives_once",
        "", r"done ([\d.]+)s after the freeze", "batch of 12 done"),
    Row("resource worker",
        E2E + "test_frozen_components.py::test_a_frozen_resource_workers_sessions_resume_on_the_other",
        r"named ([\d.]+)s", r"calls moved ([\d.]+)s", "no call waits on it"),
    Row("agent worker",
        E2E + "test_frozen_components.py::test_a_frozen_agent_worker_is_named_and_its_tasks_redelivered",
        r"named ([\d.]+)s", r"batch done ([\d.]+)s", "batch of 8 done"),
    Row("guest",
        E2E + "test_isolation.py::test_a_frozen_guest_is_restarted_within_seconds_not_after_call_timeout_s",
        "", r"batch done ([\d.]+)s after the freeze", "batch of 36 done"),
    Row("collector",
        E2E + "test_frozen_components.py::test_a_frozen_collector_named_and_both_collects_write_every_row_once",
        r"named ([\d.]+)s", r"written by the second ([\d.]+)s", "a second collect's file whole"),
    Row("collector frozen 35 s, resumed",
        E2E + "test_frozen_resumed.py::test_a_collector_frozen_35s_then_resumed_reconnects_and_writes_every_row_once",
        "", r"finished ([\d.]+)s after it was resumed", "the resumed collect's file whole (s after SIGCONT)"),
    Row("NATS node (of 3)",
        E2E + "test_cluster.py::test_a_frozen_node_its_clients_move_to_a_live_one_and_nothing_is_lost_or_doubled",
        "", r"completing again after ([\d.]+) s", "rollouts completing again"),
    Row("sandbox worker (needs Docker)",
        E2E + "test_sandboxes.py::test_a_frozen_sandbox_worker_its_calls_fail_over_and_every_row_arrives_once",
        "", r"batch done ([\d.]+)s after the freeze", "batch done"),
    Row("Docker engine (dockerd SIGSTOP, needs root)",
        "tests/test_engine_liveness.py::test_a_frozen_dockerd_fails_a_create_sandbox_unavailable_within_seconds",
        r"failed sandbox_unavailable ([\d.]+)s", r"failed sandbox_unavailable ([\d.]+)s",
        "the waiting create failed typed (retryable)"),
    Row("model endpoint hangs (1 of 2)",
        E2E + "test_endpoint_outages.py::test_a_hung_endpoint_is_found_its_calls_moved_and_probed_back_in",
        r"found ([\d.]+) s", r"rows again by ([\d.]+) s", "rows arriving again"),
    Row("model endpoint answers 500s (1 of 2)",
        E2E + "test_endpoint_outages.py::test_an_endpoint_answering_only_500s_is_taken_out_and_back_in",
        r"found ([\d.]+) s after the fault", "", "-"),
    Row("every endpoint answers 500s",
        E2E + "test_endpoint_outages.py::test_with_every_endpoint_answering_500s_the_run_stops_with_one_line",
        "", r"stopped after ([\d.]+) s", "the run stopped, one line"),
    Row("single worker SIGKILLed (start --only)",
        E2E + "test_single_worker_restart.py::test_a_single_worker_killed_is_restarted",
        "", r"restarted ([\d.]+)s after the kill", "the worker restarted"),
]  # fmt: skip


FOUND_S, WORKED_AROUND_S = 30.0, 60.0  # the bounds


def _over(seconds: str, bound: float) -> bool:
    return seconds != "-" and float(seconds) > bound


def run(row: Row) -> tuple[str, str, str, float]:
    """(found, recovered, outcome, wall s) of one row's test."""
    path = row.test.split("::", 1)[0]
    test = row.test.split("::", 1)[1]
    if not (REPO / path).exists() or test not in (REPO / path).read_text():
        return "-", "-", "not in this tree", 0.0
    t0 = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:randomly", row.test],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    wall = time.monotonic() - t0
    out = res.stdout + res.stderr

    def pick(pattern: str) -> str:
        m = re.search(pattern, out) if pattern else None
        return f"{float(m.group(1)):.1f}" if m else "-"

    if res.returncode != 0:  # what failed, on stderr (the table stays on stdout)
        print(f"--- {row.name} failed; its test's last lines:\n" + "\n".join(out.splitlines()[-40:]), file=sys.stderr)
    return pick(row.found), pick(row.recovered), "pass" if res.returncode == 0 else "FAIL", wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated row names (default: every row)")
    args = ap.parse_args()
    wanted = {n.strip() for n in args.only.split(",") if n.strip()}
    rows = [r for r in MATRIX if not wanted or r.name in wanted]
    load = os.getloadavg()[0]
    print(f"load average at start: {load:.1f} on {os.cpu_count()} cores")
    print("| component (SIGSTOP, or the fault named) | found s | worked around s | measured as | test | wall s |")
    print("| --- | ---: | ---: | --- | --- | ---: |")
    for row in rows:
        found, recovered, outcome, wall = run(row)
        if outcome == "pass" and (_over(found, FOUND_S) or _over(recovered, WORKED_AROUND_S)):
            outcome = f"pass, OVER the bounds ({FOUND_S:g} s found, {WORKED_AROUND_S:g} s worked around)"
        print(f"| {row.name} | {found} | {recovered} | {row.what} | {outcome} | {wall:.0f} |", flush=True)
    print(f"load average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
