"""A rollout does not wait for a lease without limit (issue 52, item 2): ``lease_wait_s``.

Waiting for a saturated pool is normal (and off the rollout's clock), but a pool that releases no lease at all
(stuck workers, or a quota that believed peers which are not there: the forged beacons of issue 52) held its
rollouts for ever. Now a rollout that sees no lease released in the pool for its ``lease_wait_s`` ends as a
``sandbox_unavailable`` failure row, stored as failure rows are (a later attempt of the slot may replace it).

Real nats-server, a real sandbox worker (the ``process`` backend), real agent workers.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import yaml

from gym_runtime import Client
from tests.helpers import rows

HOLD_S = 12.0  # far past lease_wait_s: the second rollout sees no lease released while it waits
WAIT_S = 2.0


def write_config(tmp: Path) -> Path:
    cfg = {
        "namespace": "gym",
        "models": {"policy": {"adapter": "scripted"}},  # named by the agent, never called
        "sandboxes": {"box": {"backend": "process", "capacity": 1, "lease_wait_s": WAIT_S}},
        "agents": {
            "agent": {
                "agent": "tests.envs.boxed_hold",
                "model": "policy",
                "sandbox": "box",
                "timeout_s": 60,
                "concurrency": 2,
                "max_attempts": 1,
            }
        },
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


async def test_a_rollout_that_sees_no_lease_released_for_lease_wait_s_is_a_sandbox_unavailable_row(
    nats_server, tmp_path: Path
) -> None:
    config = write_config(tmp_path)
    workers = ["agents.agent", "sandboxes.box"]
    async with Client(config, nats=nats_server.url, workers=workers) as client:
        batch = await client.submit([{**row, "hold_s": HOLD_S} for row in rows(2)])
        with anyio.fail_after(120):
            got = await batch.gather()
    classes = sorted(str(r.get("error_class", r.get("reward"))) for r in got)
    assert classes == ["1.0", "sandbox_unavailable"], got  # before: both 1.0, the second after the first's 12 s
    (failed,) = [r for r in got if "error_class" in r]
    assert "sandbox pool 'box' released no lease for lease_wait_s=2" in failed["error"], failed
