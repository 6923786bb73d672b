"""The ``podman`` backend against a real Podman engine (its Docker-compatible API, ``tests/podman.py``): the
engine backend's core cases (round trips, limits, isolation) as ``tests/test_sandbox_engine.py`` runs them
on Docker, and a pool of ``backend: podman`` over the bus (a warm container, a cold one, files, removal). Forks:
``tests/test_sandbox_podman_fork.py``."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import pytest

from gym_runtime.config import SandboxLimits
from gym_runtime.sandboxes.client import Sandboxes
from gym_runtime.sandboxes.engine_api import POOL, EngineBackend
from gym_runtime.sandboxes.engine_http import Engine
from gym_runtime.transport.bus import Bus
from tests.envs.cpu_burn import BURN_S, program
from tests.podman import backend_name, base_image, engine, pool  # noqa: F401  (the Docker cases' fixtures, on Podman)
from tests.test_sandbox_engine import (  # noqa: F401  (the same cases, on this module's engine)
    test_exec_round_trip_and_files,
    test_limits_memory_pids_wall_clock_output_disk,
    test_no_network_no_engine_socket_no_host_mounts,
    test_the_cgroup_file_system_is_read_only,
)
from tests.test_sandbox_processes import (  # noqa: F401  (background processes and streamed output, here)
    test_a_command_printing_forever_sends_its_capped_output_and_the_worker_serves_others,
    test_a_restart_ends_every_process_however_started_and_keeps_the_files,
    test_a_server_in_the_background_a_client_against_it_and_its_kill,
    test_exec_output_reaches_the_caller_as_the_command_produces_it,
)
from tests.test_sandbox_worker import fleet, wait_for


@pytest.fixture
async def backend(podman_engine: Engine) -> AsyncIterator[EngineBackend]:
    b = EngineBackend(podman_engine, name="podman", pool=f"test{uuid.uuid4().hex[:8]}")
    try:
        yield b
    finally:
        for c in await b.list_owned():
            await b.close(c.id)


async def test_a_podman_pool_over_the_bus(
    bus: Bus,
    podman_engine: Engine,
    podman_base: str,
    pool: str,  # noqa: F811  (the fixture)
) -> None:
    async with fleet(bus, podman_engine, pool) as worker:
        w = await worker(backend="podman", warm=1, limits=SandboxLimits(memory_mb=128, timeout_s=30))

        async def warmed() -> bool:
            return len(w.warm) == 1 and w.warming == 0

        await wait_for(warmed, timeout=90)
        boxes = Sandboxes(bus, pool, lease="p:0:0", deadline=time.time() + 60)
        warm = await boxes.sandbox()
        cold = await boxes.sandbox(memory_mb=64)
        assert w.stats()["warm_hits"] == 1 and cold.id != warm.id
        await cold.write("x/y.txt", "podman")
        r = await cold.exec("cat x/y.txt; echo err >&2; exit 3")
        assert (r.exit_code, r.stdout, r.stderr) == (3, b"podman", b"err\n")
        assert await cold.read("x/y.txt") == b"podman"
        assert (await warm.exec(["sh", "-c", "ls /sys/class/net"])).stdout == b"lo\n"  # no network
        burn = await cold.exec(["python3", "-c", program(BURN_S)])
        await cold.close()
        # the box's CPU, from Podman's stats as its worker removed it: the program's own count, plus the
        # engine's work for the box's four execs (runc, ~0.2 s here: more than Docker's)
        measured = float(burn.stdout)
        assert 0.9 * measured <= boxes.cpu_s <= 1.25 * measured, (boxes.cpu_s, measured)
        await boxes.close_all()

        async def removed() -> bool:
            live = {c["Id"] for c in await podman_engine.containers({POOL: f"gym.{pool}"})}
            return not live & {warm.id, cold.id}

        await wait_for(removed, timeout=60)
