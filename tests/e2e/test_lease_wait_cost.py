"""A wait for a lease is not tool time (issue 57, item 7): an environment's ``self.sandbox()`` inside a tool call,
waiting for a full pool, was counted in the row's ``cost.tool_ms`` (15,013 ms for 530 ms of execs) and charged
by ``pricing.cpu_hour``. The wait is the row's ``sandbox_wait_s``; ``tool_ms`` is the call's time less it.

Real nats-server, a real sandbox worker (the ``process`` backend), real resource and agent workers: a pool of
``max_live: 1`` and two rollouts whose tool holds its sandbox for ``HOLD_S``, so one waits for the other's lease.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import yaml

from gym_runtime import Client

HOLD_S = 5.0


def write_config(tmp: Path) -> Path:
    cfg = {
        "namespace": "gym",
        "models": {"policy": {"adapter": "scripted"}},  # named by the agent, never called
        "sandboxes": {"box": {"backend": "process", "max_live": 1}},
        "resources": {"env": {"server": "tests.envs.tool_boxed", "sandbox": "box"}},
        "agents": {
            "agent": {
                "agent": "tests.envs.tool_boxed",
                "model": "policy",
                "resource": "env",
                "timeout_s": 120,
                "concurrency": 2,
                "max_attempts": 1,
            }
        },
        "pricing": {"cpu_hour": 3600.0},  # one unit a second charged: the estimate reads in seconds
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


async def test_a_tools_wait_for_a_lease_is_not_tool_time_nor_charged(nats_server, tmp_path: Path) -> None:
    config = write_config(tmp_path)
    workers = ["agents.agent", "resources.env", "sandboxes.box"]
    async with Client(config, nats=nats_server.url, workers=workers) as client:
        task = {"responses_create_params": {"input": [{"role": "user", "content": "hold"}]}, "hold_s": HOLD_S}
        batch = await client.submit([task, task])
        with anyio.fail_after(180):
            got = await batch.gather()
    assert all(r.get("reward") == 1.0 for r in got), got
    holder, waiter = sorted(got, key=lambda r: r["sandbox_wait_s"])
    wait = waiter["sandbox_wait_s"]
    assert wait > 1.0, (holder, waiter)  # it did wait for the holder's lease (the holder's tool ran HOLD_S)
    for row in (holder, waiter):
        cost = row["cost"]
        assert cost["sandbox_ms"] >= 1000 * HOLD_S * 0.9, cost  # its own exec was charged
        own = cost["tool_ms"] - cost["sandbox_ms"]  # the tool's time beside its exec: round trips, the close
        # before: the waiter's tool_ms held its whole wait too (own >= wait)
        assert own < 1000 * wait / 2, (row["sandbox_wait_s"], cost)
        charged = (cost.get("sandbox_cpu_ms") or cost["sandbox_ms"]) / 1000  # pricing's sandbox part
        # what cpu_hour charged: the tool's and its sandbox's time, not the wait (before: the wait and more)
        assert cost["estimated_cost"] < cost["sandbox_ms"] / 1000 + charged + wait / 2, (wait, cost)
