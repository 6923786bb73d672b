"""Admission against a pool-wide quota, end to end: real dockerd, real nats-server, real worker processes.

200 tiny rollouts (CI size of the issue's 2,000 against 20) each take a sandbox of a pool whose
``max_live`` is 5, split over two sandbox workers, with 64 rollouts in flight and a ``timeout_s`` far
shorter than the batch's wait for leases. The engine, polled all along, never holds more than 5 of the
pool's containers (warm ones included); every row is scored, none fails (a create past the quota waits for
a lease, and the wait is not counted against ``timeout_s``: each row says how long it waited).

The issue's full size, by hand (not CI): ``GYM_QUOTA_TASKS=1000 GYM_QUOTA=20 python -m pytest -s`` this file.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import anyio
import yaml

from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.sandboxes.engine_api import POOL
from gym_runtime.sandboxes.engine_http import Engine
from tests.docker import docker_socket
from tests.e2e.test_sandboxes import box_pool, containers, server  # noqa: F401 (fixtures)
from tests.pools import REPEATS, Pool, assert_exactly_once, publish, start_collect, tasks_file, wait_until

N_TASKS = int(os.environ.get("GYM_QUOTA_TASKS", "100"))  # x REPEATS = 200 rollouts
QUOTA = int(os.environ.get("GYM_QUOTA", "5"))


def write_config(tmp: Path, pool: str) -> Path:
    cfg = {
        "namespace": "gym",
        "models": {"policy": {"adapter": "scripted"}},  # named by the agent, never called
        "sandboxes": {
            pool: {
                "backend": "docker",
                "capacity": 64,
                "max_live": QUOTA,
                "replicas": 2,  # the pool's workers (each `start --replicas 1`): the most its quota counts
                "warm": 1,
                "limits": {"memory_mb": 64, "pids": 32, "disk_mb": 8, "timeout_s": 30},
            }
        },
        "agents": {
            "agent": {
                "agent": "tests.envs.boxed_tiny",
                "model": "policy",
                "sandbox": pool,
                "timeout_s": 6,  # the batch waits far longer for leases than this: the wait must not count
                "concurrency": 64,
                "ack_wait_s": 5.0,
                "max_attempts": 1,  # a refused create would be a failure row at once
            }
        },
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


class Watch:
    """Polls the engine for the pool's containers (every state) until stopped; the most seen at once."""

    def __init__(self, label: str) -> None:
        self.label, self.most, self.polls = label, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: anyio.run(self._run), daemon=True)
        self._thread.start()

    async def _run(self) -> None:
        async with Engine(docker_socket()) as e:
            while not self._stop.is_set():
                self.most = max(self.most, len(await e.containers({POOL: self.label})))
                self.polls += 1
                await anyio.sleep(0.02)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(30)
        return self.most


def test_200_rollouts_against_a_quota_of_5_never_pass_it_and_all_are_scored(
    server: EmbeddedServer,  # noqa: F811
    box_pool: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    config = write_config(tmp_path, box_pool)
    label = f"gym.{box_pool}"
    pool = Pool(config, server.url)
    watch = Watch(label)
    try:
        pool.start("sbx1", f"sandboxes.{box_pool}")
        pool.start("sbx2", f"sandboxes.{box_pool}")
        pool.start("agent", "agents.agent")
        out = tmp_path / "out.jsonl"
        started = time.monotonic()
        publish(config, server.url, tasks_file(tmp_path, N_TASKS), "q1")
        collector = start_collect(server.url, "q1", out)
        stdout, stderr = collector.communicate(timeout=240 + N_TASKS)
        took = time.monotonic() - started
        assert collector.returncode == 0, stderr
        assert f"{N_TASKS * REPEATS} rows, 0 failed" in stdout, stdout
        rows = assert_exactly_once(out, N_TASKS)
        assert all(r["reward"] == 1.0 for r in rows)
        waits = [r["sandbox_wait_s"] for r in rows]
        assert max(waits) > 6  # some waited longer than timeout_s for a lease, and were scored all the same
        most = watch.stop()
        assert watch.polls > 50 and 0 < most <= QUOTA, (most, watch.polls)
        n = N_TASKS * REPEATS
        print(f"{n} rollouts at quota {QUOTA}: {took:.1f} s, most live {most}, max wait {max(waits):.1f} s")
    finally:
        watch.stop()
        pool.stop_all()
    wait_until(lambda: containers(label) == [], timeout=30)
