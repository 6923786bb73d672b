"""Recovery that keeps its speed: real nats-server restarts and real worker processes.

* A long-lived collector must return to full speed after a server restart, even
  while a trickle of results keeps arriving (pull credits lost in the restart
  are restored, not leaked).
* A resource pool down for 5 s mid-batch must give zero failure rows: seeds
  wait out the absence; only failures of the work count as attempts.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import anyio

from gym_runtime.ops.nats_server import EmbeddedServer
from tests.helpers import REPO, cli, read_jsonl
from tests.pools import (
    N_RESULTS,
    Pool,
    publish,
    publish_results,
    results_stored,
    tasks_file,
    wait_until,
    write_config,
)


def test_long_lived_collector_returns_to_full_speed_after_a_server_restart(tmp_path: Path) -> None:
    srv = EmbeddedServer(store_dir=str(tmp_path / "js"))
    srv.start()
    out = tmp_path / "out.jsonl"
    collector = None
    try:
        anyio.run(lambda: publish_results(srv.url, range(100), manifest=True))
        collector = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gym_runtime.cli",
                "collect",
                "--batch",
                "long",
                "--nats",
                srv.url,
                "-o",
                str(out),
                "--no-progress",
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(3.0)  # the collector has read what is there and holds pull requests on the server
        srv.kill()
        time.sleep(0.5)
        srv.start()  # same port, same store; the collector reconnects
        # a trickle keeps answers arriving (this used to pin the lost credits for good) ...
        anyio.run(lambda: publish_results(srv.url, range(100, 130), every_s=0.2))
        # ... then the bulk of the batch lands at once
        t0 = time.monotonic()
        anyio.run(lambda: publish_results(srv.url, range(130, N_RESULTS)))
        stdout, stderr = collector.communicate(timeout=180)
        took = time.monotonic() - t0
        assert collector.returncode == 0, stderr[-2000:]
        assert f"{N_RESULTS} rows, 0 failed" in stdout
        assert [r["task_id"] for r in read_jsonl(out)] == list(range(N_RESULTS))
        # before the fix: ~5 rows/s, i.e. ~10 minutes for these rows; a fresh collect takes ~1 s. The bound is a
        # fifth of the broken time, so it still catches the bug and leaves a loaded machine 100x a quiet one's time
        assert took < 120.0, f"{N_RESULTS - 130} results took {took:.1f}s to collect after the restart"
        # the loss was said at warning level, and so is the connection's return: one line, not one per message
        # (before: an info line, so a command at warning level said it lost its server and never that it came back)
        back = [line for line in stderr.splitlines() if "nats.reconnected" in line]
        assert len(back) == 1 and "warning" in back[0].lower(), stderr[-3000:]
    finally:
        if collector is not None and collector.poll() is None:
            collector.kill()
        srv.stop()


def test_resource_pool_down_for_five_seconds_gives_zero_failure_rows(tmp_path: Path) -> None:
    srv = EmbeddedServer(store_dir=str(tmp_path / "js"))
    srv.start()
    config = write_config(tmp_path, delay_s=0.2, agent_concurrency=8, max_attempts=3)
    pool = Pool(config, srv.url)
    try:
        for only in ("agents.agent", "models.policy", "resources.env"):
            pool.start(only, only)
        n = 40
        publish(config, srv.url, tasks_file(tmp_path, n), "outage")  # ×2 repeats
        wait_until(lambda: results_stored(srv.url) >= 4)
        pool.kill("resources.env")  # sessions in flight on it are lost: those attempts fail (once)
        time.sleep(5.0)
        pool.start("resources.env", "resources.env")
        out = tmp_path / "out.jsonl"
        res = cli("collect", "--batch", "outage", "--nats", srv.url, "-o", str(out), "--no-progress", timeout=120)
        assert res.returncode == 0, res.stderr[-2000:]
        assert f"{n * 2} rows, 0 failed" in res.stdout
        assert not (tmp_path / "out_failures.jsonl").exists()
        rows = read_jsonl(out)
        assert [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in rows] == [
            (t, k) for t in range(n) for k in range(2)
        ]
    finally:
        pool.stop_all()
        srv.stop()
