"""``gym-runtime view`` at scale: the index built cold (MB/s), then the server started on it, its runs page, a
trajectory, a filtered table and a full-text search timed over HTTP, and its resident memory.

Rows of two sizes: NeMo Gym's recorded size (``--big-kb``, default 25 KB: its rows are 12-43 KB) and
weather's (~2 KB). "Cold": the file's pages are dropped from the page cache first (``posix_fadvise
DONTNEED`` on that file alone; nothing else's cache is touched). Keep it short on a shared machine; say the
load (``/proc/loadavg``) beside the figures.

    python tests/bench/view.py [--big-rows 8000] [--small-rows 100000] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from gym_runtime.view import index  # noqa: E402
from tests.view_rows import row  # noqa: E402


def write_rows(path: Path, n: int, kb: int) -> int:
    """``n`` rows of about ``kb`` KB each (a long tool output and answer), rewards and agents varied."""
    base = len(json.dumps(row(0, 0, 1.0)))
    pad = max(0, kb * 1024 - base)
    text = ("The weather is sunny with a light breeze from the west. " * (pad // 56 + 1))[: pad // 2]
    with path.open("w") as f:
        for i in range(n):
            r = row(i // 4, i % 4, float(i % 3 == 0), answer=text, tool_output=text, version=i % 7, ms=i % 997)
            f.write(json.dumps(r) + "\n")
    return path.stat().st_size


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def get(url: str) -> tuple[float, int]:
    t0 = time.perf_counter()
    with urllib.request.urlopen(url, timeout=120) as r:
        body = r.read()
    return time.perf_counter() - t0, len(body)


def rss_mb(pid: int) -> tuple[float, float]:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def measure(label: str, path: Path, reps: int) -> dict[str, object]:
    size = path.stat().st_size
    index.index_path(path).unlink(missing_ok=True)
    drop_cache(path)
    t0 = time.perf_counter()
    ix = index.load(path)
    build_s = time.perf_counter() - t0
    rows = len(ix)
    del ix
    proc = subprocess.Popen(
        [sys.executable, "-m", "gym_runtime.cli", "view", str(path), "--port", "0", "--no-token"],  # (timing pages)
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        t0 = time.perf_counter()
        assert proc.stdout is not None
        line = proc.stdout.readline()
        start_s = time.perf_counter() - t0
        base = line.split(": ", 1)[1].strip().rstrip("/")
        runs = [get(base + "/")[0] for _ in range(reps)]
        trajectories = [get(base + f"/rollout/0/0/{(i * 7919) % rows}")[0] for i in range(reps)]
        table = [get(base + "/rollouts?rmin=0.5&sort=busy&desc=true")[0] for _ in range(reps)]
        search = get(base + "/rollouts?q=task+" + str(rows // 8))[0]
        rss, peak = rss_mb(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    out = {
        "label": label,
        "rows": rows,
        "MB": round(size / 1e6, 1),
        "row_KB": round(size / rows / 1024, 1),
        "index_cold_s": round(build_s, 2),
        "index_MB_per_s": round(size / 1e6 / build_s, 1),
        "server_ready_s": round(start_s, 2),
        "runs_page_s": round(statistics.median(runs), 3),
        "trajectory_ms": round(1000 * statistics.median(trajectories), 1),
        "filtered_table_s": round(statistics.median(table), 3),
        "full_text_search_s": round(search, 2),
        "rss_MB": round(rss),
        "peak_rss_MB": round(peak),
    }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--big-rows", type=int, default=8000)
    p.add_argument("--big-kb", type=int, default=25)
    p.add_argument("--small-rows", type=int, default=100_000)
    p.add_argument("--small-kb", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dir", default=None, help="where the files are written (default: a temporary folder)")
    args = p.parse_args()
    print("load before:", Path("/proc/loadavg").read_text().strip(), flush=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for label, n, kb in (
            ("nemo-gym-size", args.big_rows, args.big_kb),
            ("weather-size", args.small_rows, args.small_kb),
        ):
            path = Path(tmp) / f"{label}.jsonl"
            write_rows(path, n, kb)
            print(json.dumps(measure(label, path, args.reps)), flush=True)
            path.unlink()
            index.index_path(path).unlink(missing_ok=True)
    print("load after:", Path("/proc/loadavg").read_text().strip())


if __name__ == "__main__":
    main()
