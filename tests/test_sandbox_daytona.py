"""The ``daytona`` backend (a hosted provider) through a sandbox worker on a real nats-server, against a TEST
DOUBLE of Daytona's REST API (``tests/daytona_double.py``): the author's calls, what is asked of the provider
(blocked network, labels the reaper reads), the reaper, and a wrong key as one line."""

from __future__ import annotations

import time

import anyio
import pytest

from gym_runtime.config import SandboxConfig, SandboxLimits
from gym_runtime.errors import ConfigError, Failure
from gym_runtime.sandboxes.client import Sandboxes
from gym_runtime.sandboxes.leases import lease_tag
from gym_runtime.sandboxes.reaper import DEAD_AFTER_S
from gym_runtime.transport.bus import Bus
from gym_runtime.workers.sandbox_worker import SandboxWorker
from tests.daytona_double import DaytonaDouble


async def test_a_daytona_pool_serves_the_api_and_reaps_through_the_providers_labels(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    double = DaytonaDouble(key="test-key-1")
    url = await double.start()
    monkeypatch.setenv("DAYTONA_API_KEY", "test-key-1")
    try:
        # a sandbox of a worker never heard here whose lease has ended: the reaper removes it; one whose lease
        # has not ended may be another cluster's live worker's (the same provider account): it stays
        labels = {"gym-runtime.pool": "gym.hosted", "gym-runtime.owner": "dead"}
        double.sandboxes["orphan"] = {"labels": {**labels, "gym-runtime.expires": str(time.time() - 1)},
                                      "dir": "/nonexistent", "body": {}}  # fmt: skip
        double.sandboxes["other"] = {"labels": {**labels, "gym-runtime.expires": str(time.time() + 3600)},
                                     "dir": "/nonexistent", "body": {}}  # fmt: skip
        cfg = SandboxConfig(backend="daytona", engine=url, reap_interval_s=0.3, limits=SandboxLimits(memory_mb=4096))
        worker = SandboxWorker(bus, "hosted", cfg)
        async with anyio.create_task_group() as tg:
            await tg.start(worker.run)
            boxes = Sandboxes(bus, "hosted", lease="b:1:0", deadline=time.time() + 600)
            async with boxes.sandbox(image="python-3.12", memory_mb=2048) as box:
                await box.write("pkg/answer.txt", b"42")
                r = await box.exec("cat pkg/answer.txt; exit 3")
                assert (r.exit_code, r.stdout) == (3, b"42")
                assert await box.read("pkg/answer.txt") == b"42"
                r = await box.exec("yes | head -c 5000000")
                assert r.truncated and len(r.stdout) == SandboxConfig().limits.max_output
                [(sid, made)] = [(k, v) for k, v in double.sandboxes.items() if k not in ("orphan", "other")]
                asked = made["body"]
                assert asked["networkBlockAll"] is True and asked["snapshot"] == "python-3.12"
                assert asked["memory"] == 2 and made["labels"]["gym-runtime.lease"] == lease_tag("b:1:0")
                assert made["labels"]["gym-runtime.owner"] == worker.worker_id
            assert sid not in double.sandboxes  # closed with the block
            deadline = time.monotonic() + DEAD_AFTER_S + 10
            while "orphan" in double.sandboxes:
                assert time.monotonic() < deadline, "the orphan was not reaped"
                await anyio.sleep(0.1)
            assert "other" in double.sandboxes  # never heard, lease running: not this cluster's to remove
            tg.cancel_scope.cancel()
        monkeypatch.setenv("DAYTONA_API_KEY", "wrong")
        bad = SandboxWorker(bus, "hosted", SandboxConfig(backend="daytona", engine=url))
        async with anyio.create_task_group() as tg:
            await tg.start(bad.run)
            with pytest.raises(Failure, match="daytona: POST /sandbox: 401"):
                await Sandboxes(bus, "hosted", lease="x").sandbox()
            tg.cancel_scope.cancel()
        monkeypatch.delenv("DAYTONA_API_KEY")
        with pytest.raises(
            ConfigError,
            match="sandboxes.hosted: the daytona backend needs engine: its API URL, and DAYTONA_API_KEY set",
        ):
            await SandboxWorker(bus, "hosted", SandboxConfig(backend="daytona", engine=url)).run()
    finally:
        await double.stop()
