"""An agent worker's attempt records on its way out: a worker stopped after its server went away exits within its
supervisor's grace (srun waits 32 s, Compose 10 s, then kills), instead of retrying each held record for the
bus's whole store budget (CI: ``tests/e2e/test_slurm.py``'s cancelled job, one worker ``Killed``)."""

from __future__ import annotations

import time
from pathlib import Path

import anyio

from gym_runtime.messages import AttemptStart
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.transport.bus import Bus
from gym_runtime.workers.attempts import LAST_SEND_S, AttemptRecords


def start(i: int) -> AttemptStart:
    return AttemptStart(task_index=i, rollout_index=0, attempt=1, worker="w", node="n", pid=1, at=time.time())


async def test_records_held_when_the_server_is_gone_end_within_a_bound_on_stop(tmp_path: Path) -> None:
    with EmbeddedServer(store_dir=str(tmp_path / "js")) as srv:
        bus = await Bus.connect(srv.url, namespace="gym", telemetry=Telemetry(), name="test-attempts")
        try:
            await bus.ensure_attempts_stream()
            records = AttemptRecords(bus, "agent")
            async with anyio.create_task_group() as tg:
                tg.start_soon(records.run)
                with anyio.fail_after(30):
                    await records.started("b1", start(0))  # stored: the server holds it
                srv.kill()  # the server is gone, and a record comes in after it
                with anyio.fail_after(30):
                    while bus.nc.is_connected:
                        await anyio.sleep(0.02)
                t0 = time.monotonic()
                tg.cancel_scope.cancel()  # the worker stops, with a record that came in after the server went
                records.add("b1", start(1))
            assert time.monotonic() - t0 < LAST_SEND_S + 2.0  # not the bus's 20 s store budget (a record or more)
        finally:
            with anyio.move_on_after(10):
                await bus.close()
