"""The runner's workers (``service.runner``) on the in-memory transport: no nats-server.

``make_workers`` builds each config entry's replicas, ``start_workers`` returns once each is serving, a task
published then is run to its stored row, and ``drain`` ends once every worker has drained, with nothing left
in the queue. The same on a real server: ``tests/e2e/test_run.py``, ``tests/e2e/test_crash.py``.
"""

from __future__ import annotations

import anyio

from gym_runtime.config import config_from_dict, resolve_config
from gym_runtime.messages import RolloutResult, RolloutTask
from gym_runtime.service.runner import drain, make_workers, start_workers
from gym_runtime.testing import MemoryTransport
from gym_runtime.transport.jetstream import task_msg_id
from gym_runtime.workers.agent_worker import AgentWorker
from gym_runtime.workers.model_worker import ModelWorker
from gym_runtime.workers.resource_worker import ResourceWorker
from tests.helpers import FLAKY, ROWS

PAIRS = [("models", "policy"), ("resources", "env"), ("agents", "agent")]


async def test_the_runners_workers_serve_a_task_to_its_row_and_drain_to_a_stop() -> None:
    cfg = resolve_config(config_from_dict(FLAKY))
    async with MemoryTransport() as bus:
        workers = make_workers(bus, cfg, PAIRS, replicas=2)
        assert [type(w) for w in workers] == [ModelWorker] * 2 + [ResourceWorker] * 2 + [AgentWorker] * 2
        subject = bus.subjects.task("agent", "b")
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                await start_workers(tg, workers)
                task = RolloutTask(batch="b", task_index=0, rollout_index=0, agent="agent", row=ROWS[0])
                await bus.js_publish(subject, task, msg_id=task_msg_id("b", 0, 0))
                while not (stored := bus.broker.messages(bus.subjects.result("agent", "b"))):
                    await bus.broker.changed.wait()
                await drain(workers, timeout=60)  # each worker's drain ends (well before the 60 s given it)
                tg.cancel_scope.cancel()  # as ``serve`` ends its workers once drained
        (row,) = [await bus.decode(m) for m in stored]
        assert isinstance(row, RolloutResult) and row.error is None and row.row is not None
        assert row.row["reward"] == 1.0
        assert not bus.broker.messages(subject)  # acked before the drain ended
