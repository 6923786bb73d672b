"""A reader frozen past the server's ping window (SIGSTOP 35 s: the server drops it after 15-20 s, with the results
it had just sent it), then resumed (SIGCONT), finishes its batch within the readers' ack wait, every row once (issue
77): the same as a loop that user code blocks that long. Real ``collect`` process, real nats-server. Before, the
lost results came back after a 600 s ack wait: the resumed ``collect`` sat silent."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import anyio

from gym_runtime.data.batches import Manifest, put_manifest
from gym_runtime.messages import RolloutResult
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.jetstream import ensure_streams
from tests.helpers import eventually
from tests.pools import assert_exactly_once, start_collect

FROZEN_S = 35.0  # well past the server's 15-20 s: it has dropped the frozen client when it resumes
FINISH_S = 50.0  # resumed, it has the rest within the readers' 60 s ack wait (~25 s after); stalled, 10 min


async def test_a_collector_frozen_35s_then_resumed_reconnects_and_writes_every_row_once(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    n, batch = 16, "fr"
    await ensure_streams(bus, ["agent"])
    await put_manifest(bus, Manifest(batch=batch, expected=n, tasks=n, repeats=1, agents={"agent": n}, input="-"))

    async def store(indexes: range) -> None:  # results as a batch's agent workers store them
        for i in indexes:
            row = {"task_id": i, "reward": 1.0, "_ng_task_index": i, "_ng_rollout_index": 0}
            res = RolloutResult(batch=batch, task_index=i, rollout_index=0, agent="agent", row=row)
            await bus.js_publish(bus.subjects.result("agent", batch), res, msg_id=f"{batch}:{i}:0")

    out = tmp_path / "out.jsonl"
    await store(range(8))
    proc = start_collect(nats_server.url, batch, out)
    stopped = False
    try:
        stream = await bus.ensure_results_stream("agent")

        async def has_read_them() -> bool:  # its consumer was handed what is stored so far: mid-batch
            infos = await bus.js.consumers_info(stream)
            return any(i.name.startswith("collect_") and i.delivered.stream_seq >= 8 for i in infos)

        with anyio.fail_after(60):
            while not await has_read_them():
                await anyio.sleep(0.2)
        proc.send_signal(signal.SIGSTOP)
        stopped = True
        await store(range(8, n))  # the batch goes on while it is frozen
        t0 = time.monotonic()
        while time.monotonic() - t0 < FROZEN_S:  # a frozen span, not a wait on state: the freeze is the input
            await anyio.sleep(1.0)
        proc.send_signal(signal.SIGCONT)
        stopped, t1 = False, time.monotonic()
        await eventually(lambda: proc.poll() is not None, within=FINISH_S)
        assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""
        assert_exactly_once(out, n, 1)
        print(f"collector frozen {FROZEN_S:.0f}s: finished {time.monotonic() - t1:.1f}s after it was resumed")
    finally:
        if proc.poll() is None:
            if stopped:
                proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait()
