"""service.supervisor: the child processes `start`, `run` and `Client` keep (real processes, real server)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gym_runtime.errors import ClientError
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.service.supervisor import StartProcess
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.discovery import discover
from tests.helpers import REPO

WEATHER = str(REPO / "resources" / "weather" / "config.yaml")


async def test_a_start_child_is_ready_serves_and_drains_on_close(nats_server: EmbeddedServer, bus: Bus) -> None:
    child = await StartProcess.open(WEATHER, nats_server.url, auth_dir=None, replicas=None)
    try:
        assert child.proc.poll() is None
        every_role = {"model", "resource", "agent"}
        roles = {
            w["role"] for w in await discover(bus, wait_s=30, until=lambda ws: {w["role"] for w in ws} >= every_role)
        }
        assert roles == every_role
    finally:
        t0 = time.monotonic()
        await child.close()
    assert child.proc.returncode == 0 and time.monotonic() - t0 < 30  # SIGTERM drains, then exits 0


async def test_a_child_that_cannot_start_is_one_clear_error(nats_server: EmbeddedServer, tmp_path: Path) -> None:
    bad = tmp_path / "config.yaml"
    bad.write_text(Path(WEATHER).read_text().replace("server: resources.weather", "server: resources.wether"))
    t0 = time.monotonic()
    with pytest.raises(ClientError, match=r"the worker processes did not start \(exit code 2\)"):
        await StartProcess.open(str(bad), nats_server.url, auth_dir=None, replicas=None)
    assert time.monotonic() - t0 < 60
