"""A connection closed after a good run says nothing on stderr, whatever was still under way on it: a PING whose
flush stopped waiting (its PONG comes later), a drain that outlasts the close's timeout (a handler still
running). Each is made to happen on a real nats-server, in a process of its own whose stderr is read."""

from __future__ import annotations

import subprocess
import sys

from gym_runtime.ops.nats_server import EmbeddedServer
from tests.helpers import REPO

SCRIPT = r"""
import gc, logging, sys

import anyio
import nats.errors

from gym_runtime.observability.tracing import Telemetry
from gym_runtime.service.loop import run_async
from gym_runtime.transport.bus import Bus

logging.basicConfig(level=logging.WARNING)  # as a command's log: nats-py's errors reach stderr


async def main() -> None:
    bus = await Bus.connect(sys.argv[1], namespace="gym", telemetry=Telemetry(), name="quiet")
    # a flush that stops waiting for its PONG (the PING stays outstanding)
    for _ in range(1000):
        try:
            await bus.nc.flush(timeout=1e-9)
        except nats.errors.TimeoutError:
            print("ping outstanding", flush=True)
            break
    await bus.nc.flush(timeout=30)  # the connection still reads: a later PONG answers
    print("flushed", flush=True)
    # a handler still running when the close's drain times out
    started = anyio.Event()

    async def busy(msg) -> None:
        started.set()
        await anyio.sleep(60)

    await bus.nc.subscribe("quiet.busy", cb=busy)
    await bus.nc.publish("quiet.busy", b"x")
    with anyio.fail_after(30):
        await started.wait()
    await bus.close(timeout=0.5)
    gc.collect()  # what nobody retrieved is reported when it is collected
    await anyio.sleep(0.2)
    print("closed", flush=True)


run_async(main)
gc.collect()
"""


def test_closing_with_a_ping_outstanding_and_a_busy_handler_prints_no_traceback(nats_server: EmbeddedServer) -> None:
    res = subprocess.run(
        [sys.executable, "-c", SCRIPT, nats_server.url], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    for said in ("ping outstanding", "flushed", "closed"):  # each trigger happened, and the close returned
        assert said in res.stdout, (res.stdout, res.stderr)
    assert res.returncode == 0, res.stderr
    for noise in ("Traceback", "encountered error", "InvalidStateError", "never retrieved", "CancelledError"):
        assert noise not in res.stderr, res.stderr
