"""Worker pools and batches as real processes, for the fault, recovery and exit-code scenarios.

A ``Pool`` runs ``gym-runtime start`` children that a test can SIGKILL; ``publish`` and
``start_collect`` drive the CLI; ``publish_results`` stores results straight on the bus.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import msgspec
import nats
import yaml

from gym_runtime.data.batches import Manifest, put_manifest
from gym_runtime.messages import RolloutResult
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.jetstream import ensure_streams
from gym_runtime.transport.pull import Beacon
from tests.helpers import REPO, cli, read_jsonl, write_jsonl

N_TASKS = 12


REPEATS = 2


def write_config(
    tmp: Path,
    *,
    resource: str = "resources.weather",
    delay_s: float = 0.3,
    agent_concurrency: int = 4,
    max_attempts: int = 4,
) -> Path:
    cfg = {
        "namespace": "gym",
        "models": {"policy": {"adapter": "scripted", "delay_s": delay_s, "ack_wait_s": 2.0, "concurrency": 8}},
        "resources": {"env": {"server": resource}},
        "agents": {
            "agent": {
                "agent": "agents.simple",
                "model": "policy",
                "resource": "env",
                "max_steps": 4,
                "timeout_s": 60,
                "concurrency": agent_concurrency,
                "ack_wait_s": 2.0,
                "max_attempts": max_attempts,
            }
        },
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def tasks_file(tmp: Path, n: int = N_TASKS, explode: set[int] | None = None) -> Path:
    base = read_jsonl(REPO / "resources/weather/data/example.jsonl")
    rows = []
    for i in range(n):
        row = dict(base[i % len(base)])
        row["task_id"] = i
        if explode and i in explode:
            row["explode"] = True
        rows.append(row)
    return write_jsonl(tmp / "tasks.jsonl", rows)


class Pool:
    """Worker processes started with `gym-runtime start --in-process` (one worker each)."""

    def __init__(self, config: Path, url: str) -> None:
        self.config, self.url = config, url
        self.procs: dict[str, subprocess.Popen[str]] = {}

    def start(self, key: str, only: str | list[str], log: Path | None = None) -> subprocess.Popen[str]:
        """One process running ``only`` (several: a node's workers in one process, lost together); its log lines
        to the file ``log`` where given."""
        roles = [x for role in ([only] if isinstance(only, str) else only) for x in ("--only", role)]
        err = log or self.config.parent / f"pool-{key}.stderr"  # quoted when the worker never says ready
        p = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gym_runtime.cli",
                "start",
                str(self.config),
                "--nats",
                self.url,
                *roles,
                "--replicas",
                "1",
                "--in-process",
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=err.open("w"),
            text=True,
        )
        assert p.stdout is not None
        line = p.stdout.readline()
        assert "ready" in line, f"{only} did not start: {line!r}; its stderr ends:\n{err.read_text()[-2000:]}"
        self.procs[key] = p
        return p

    def kill(self, key: str) -> None:
        p = self.procs.pop(key)
        p.send_signal(signal.SIGKILL)
        p.wait(10)

    def stop_all(self) -> None:
        for p in self.procs.values():
            p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


def publish(config: Path, url: str, tasks: Path, batch: str) -> None:
    res = cli("publish", str(config), "-i", str(tasks), "--nats", url, "--batch", batch, "--repeats", str(REPEATS))
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == batch


def start_collect(url: str, batch: str, out: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "gym_runtime.cli", "collect", "--batch", batch, "--nats", url, "-o", str(out)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def results_stored(url: str) -> int:
    res = cli("status", "--nats", url, "--json")
    return int(json.loads(res.stdout)["results_stored"]) if res.returncode == 0 else 0


class BeaconWatch:
    """What a pool's workers say they hold, heard on their liveness subject as a peer hears it (a thread of
    its own): a fault test kills a worker once what it took is announced, so the kill never lands between a
    take and its beacon (that message would wait ``ack_wait``, by design)."""

    def __init__(self, url: str, subject: str) -> None:
        self.url, self.subject = url, subject
        self._held: dict[str, set[str]] = {}
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._listen()), daemon=True)

    def __enter__(self) -> BeaconWatch:
        self._thread.start()
        assert self._ready.wait(30), f"no subscription to {self.subject}"
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def held(self) -> int:
        with self._lock:
            return sum(len(h) for h in self._held.values())

    async def _listen(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        nc = await nats.connect(self.url)
        decode = msgspec.msgpack.Decoder(Beacon).decode

        async def heard(msg: Any) -> None:
            b = decode(msg.data)
            with self._lock:
                if b.bye:
                    self._held.pop(b.worker, None)
                    return
                held = set(b.add) if b.full else self._held.get(b.worker, set()) | set(b.add)
                self._held[b.worker] = held - set(b.done)

        await nc.subscribe(self.subject, cb=heard)
        await nc.flush()
        self._ready.set()
        await self._stop.wait()
        await nc.close()


def wait_until(pred: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.1)


def assert_exactly_once(out: Path, n: int = N_TASKS, repeats: int = REPEATS) -> list[dict[str, Any]]:
    rows = read_jsonl(out)
    keys = [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in rows]
    assert keys == [(t, k) for t in range(n) for k in range(repeats)], keys
    assert [r["task_id"] for r in rows] == [t for t in range(n) for _ in range(repeats)]
    return rows


N_RESULTS = 3000


def result(i: int) -> RolloutResult:
    return RolloutResult(
        batch="long",
        task_index=i,
        rollout_index=0,
        agent="agent",
        row={"task_id": i, "reward": 1.0, "_ng_task_index": i, "_ng_rollout_index": 0},
    )


async def publish_results(url: str, indexes: range, *, every_s: float = 0.0, manifest: bool = False) -> None:
    bus = await Bus.connect(url, namespace="gym", telemetry=Telemetry(), name="test-results")
    try:
        if manifest:
            await ensure_streams(bus, ["agent"])
            await put_manifest(
                bus,
                Manifest(
                    batch="long", expected=N_RESULTS, tasks=N_RESULTS, repeats=1, agents={"agent": N_RESULTS}, input="-"
                ),
            )
        async with anyio.create_task_group() as tg:
            for i in indexes:
                tg.start_soon(
                    lambda i=i: bus.js_publish(bus.subjects.result("agent", "long"), result(i), msg_id=f"long:{i}:0")
                )
                if every_s:
                    await anyio.sleep(every_s)
    finally:
        await bus.close()
