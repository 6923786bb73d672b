"""Cluster benchmark: a real 1-node vs 3-node NATS cluster on loopback, real worker processes.

    python tests/bench/cluster.py [--rollouts 2000] [--only throughput recovery newpool]

throughput  rollouts/s with 1 node (replicas 1) vs 3 nodes (replicas 3)
recovery    the results-stream leader SIGKILLed mid-batch: seconds until results land
            again, and the rate in the 5 s before the kill vs the 5 s after resuming
newpool     a batch waits with no model worker; seconds from starting a model pool
            (process spawn) until the first result lands

The machine is shared (2 cores): numbers are noisy; run twice before comparing.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.cluster import (
    LocalCluster,  # noqa: E402
    start_worker,
    stop,
    tasks_file,
    write_config,
)


def results(c: LocalCluster) -> int:
    """Results stored, as the most up-to-date live node reports it (a restarted node catches up)."""
    return c.stored("GYM_RESULTS_agent")


def publish(config: Path, url: str, tasks: Path, batch: str) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "gym_runtime.cli",
            "publish",
            str(config),
            "-i",
            str(tasks),
            "--nats",
            url,
            "--batch",
            batch,
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
    )


def pools(
    config: Path,
    c: LocalCluster,
    roles: tuple[str, ...] = ("agents.agent", "resources.env", "models.policy"),
) -> list[subprocess.Popen[str]]:
    return [start_worker(config, c.urls[i % len(c.urls)], r) for i, r in enumerate(roles)]


def wait_for(c: LocalCluster, n: int, timeout: float = 300) -> float:
    t0 = time.monotonic()
    while results(c) < n:
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{results(c)}/{n} results after {timeout}s")
        time.sleep(0.05)
    return time.monotonic() - t0


def throughput(tmp: Path, size: int, n: int) -> float:
    c = LocalCluster(tmp / f"t{size}", size=size).start()
    procs: list[subprocess.Popen[str]] = []
    try:
        config = write_config(tmp, replicas=size)
        procs = pools(config, c)
        t0 = time.monotonic()
        publish(config, c.url, tasks_file(tmp, n), "tp")
        wait_for(c, n)
        return n / (time.monotonic() - t0)
    finally:
        stop(procs)
        c.stop()


def recovery(tmp: Path, n: int) -> tuple[float, float, float, list[int]]:
    """(seconds until results land again, rate before, rate from resuming to the end, per-second series)."""
    c = LocalCluster(tmp / "rec", size=3).start()
    procs: list[subprocess.Popen[str]] = []
    try:
        config = write_config(tmp, replicas=3)
        procs = pools(config, c)
        publish(config, c.url, tasks_file(tmp, n), "rec")
        wait_for(c, n // 5)
        a = results(c)
        time.sleep(3)
        before = (results(c) - a) / 3
        victim = c.node(c.stream_leader("GYM_RESULTS_agent") or "n1")
        k = results(c)
        victim.kill()
        t_kill = time.monotonic()
        while results(c) <= k + 50:  # beyond what was already on its way when the node died
            time.sleep(0.02)
        resumed = time.monotonic() - t_kill
        victim.start()  # it rejoins and catches up while the batch goes on
        series, last = [], results(c)
        t_resume, at_resume = time.monotonic(), last
        while last < n and time.monotonic() - t_resume < 120:
            time.sleep(1.0)
            now = results(c)
            series.append(now - last)
            last = now
        after = (last - at_resume) / max(1e-9, time.monotonic() - t_resume)
        return resumed, before, after, series
    finally:
        stop(procs)
        c.stop()


def new_pool(tmp: Path, n: int) -> tuple[float, float]:
    c = LocalCluster(tmp / "np", size=3).start()
    procs: list[subprocess.Popen[str]] = []
    try:
        config = write_config(tmp, replicas=3)
        procs = pools(config, c, ("agents.agent", "resources.env"))
        publish(config, c.url, tasks_file(tmp, n), "np")
        time.sleep(1.0)
        t0 = time.monotonic()
        procs.append(start_worker(config, c.urls[2], "models.policy"))
        ready = time.monotonic() - t0
        wait_for(c, 1)
        return ready, time.monotonic() - t0
    finally:
        stop(procs)
        c.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rollouts", type=int, default=2000)
    ap.add_argument("--only", nargs="*", default=["throughput", "recovery", "newpool"])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if "throughput" in args.only:
            print("| nodes | replicas | rollouts | rollouts/s |\n|---|---|---|---|")
            for size in (1, 3):
                print(f"| {size} | {size} | {args.rollouts} | {throughput(tmp, size, args.rollouts):.0f} |", flush=True)
        if "recovery" in args.only:
            resumed, before, after, series = recovery(tmp, args.rollouts * 5)
            print(
                f"\nresults-stream leader SIGKILLed: results land again after {resumed:.2f} s; "
                f"rate {before:.0f}/s before the kill, {after:.0f}/s from resuming to the end of the batch "
                f"(per second after resuming: {series})",
                flush=True,
            )
        if "newpool" in args.only:
            ready, first = new_pool(tmp, 200)
            print(f"\nnew model pool: ready {ready:.2f} s after spawn, first result {first:.2f} s after spawn")


if __name__ == "__main__":
    main()
