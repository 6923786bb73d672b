"""The test suite's CPU, per test and per file: what a CPU-bound suite on a small machine spends its time on.

Under ``-n 4`` on 2 cores a test's wall time mostly measures the others beside it; its CPU does not. This runs
pytest with a plugin that records, for each test, the CPU of the pytest process and of the processes it reaped
(``getrusage``: a child's CPU is counted once it is waited for, a grandchild's through its parent), then prints
the files and tests that spent the most. Containers' CPU (their own daemons' children) is not counted.

    python tests/bench/suite_cpu.py [--top 25] [--jsonl PATH] [-- PYTEST ARGS...]   # default: the README's test command
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
OUT_ENV = "GYM_SUITE_CPU_OUT"


def _cpu() -> tuple[float, float]:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: Any, nextitem: Any) -> Any:
    """The plugin (``-p suite_cpu``, in each xdist worker): one JSON line per test, appended."""
    me0, kids0 = _cpu()
    t0 = time.monotonic()
    yield
    me1, kids1 = _cpu()
    line = {
        "id": item.nodeid,
        "cpu": round(me1 - me0 + kids1 - kids0, 3),
        "wall": round(time.monotonic() - t0, 3),
        "end": round(time.time(), 3),
        "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
    }
    with open(os.environ[OUT_ENV], "a") as f:
        f.write(json.dumps(line) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top", type=int, default=25, help="rows of each table (default 25)")
    ap.add_argument("--jsonl", type=Path, help="also keep the per-test lines (id, cpu, wall, end, worker) here")
    readme = ["-q", "-n", "4", "--dist", "worksteal"]  # the README's test command
    ap.add_argument("pytest_args", nargs="*", help=f"after --: pytest's arguments (default: {' '.join(readme)})")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cpu.jsonl"
        env = {**os.environ, OUT_ENV: str(out), "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(REPO)])}
        started, before = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
        cmd = [sys.executable, "-m", "pytest", "-p", "suite_cpu", *(args.pytest_args or readme)]
        rc = subprocess.run(cmd, cwd=REPO, env=env).returncode
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
        if args.jsonl and out.exists():
            args.jsonl.write_text(out.read_text())
    wall = time.monotonic() - started
    total = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    counted = sum(r["cpu"] for r in rows) or 1.0
    print(f"\n{len(rows)} tests, pytest exit {rc}: {wall:.0f} s wall, {total:.0f} CPU-s ({counted:.0f} in tests)")
    if rows:  # the tail: when each xdist worker ran out of tests, from the first test's end
        first = min(r["end"] - r["wall"] for r in rows)
        last: dict[str, float] = {}
        for r in rows:
            last[r["worker"]] = max(last.get(r["worker"], 0.0), r["end"] - first)
        print("workers done at: " + ", ".join(f"{w} {t:.0f} s" for w, t in sorted(last.items())))
    by_file: collections.Counter[str] = collections.Counter()
    for r in rows:
        by_file[r["id"].split("::")[0]] += r["cpu"]
    print("\n| file | CPU-s | share | running share |\n| --- | ---: | ---: | ---: |")
    running = 0.0
    for name, cpu in by_file.most_common(args.top):
        running += cpu
        print(f"| {name} | {cpu:.1f} | {cpu / counted:.1%} | {running / counted:.1%} |")
    print("\n| test | CPU-s | wall s |\n| --- | ---: | ---: |")
    for r in sorted(rows, key=lambda r: -r["cpu"])[: args.top]:
        print(f"| {r['id']} | {r['cpu']:.1f} | {r['wall']:.1f} |")
    return rc


if __name__ == "__main__":
    sys.exit(main())
