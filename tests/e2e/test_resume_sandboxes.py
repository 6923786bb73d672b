"""A resumed rollout reattaches to the agent's own sandbox (issue 69 item 2): real nats-server, real Docker, real
worker processes SIGKILLed mid-rollout (only the LLM is a test double: ``scripted``).

The agent (``tests/envs/agent_boxed.py``) runs each of 50 tool calls in its own container (``ctx.sandbox``),
bumping a counter of the call's own there. Its worker killed at turn k, the pool keeps the container under the
rollout's lease for ``lease_grace_s``; the redelivered attempt takes it up by that lease: the same container, its
files intact, each call's side effect once. With no attempt coming, the container is gone once the grace has
passed: a dead agent leaks nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gym_runtime.ops.nats_server import EmbeddedServer
from tests.docker import docker_socket
from tests.envs.long_boxed import STEPS, task
from tests.long_rollout import (
    Run,
    containers,
    new_pool,
    remove_containers,
    stored_checkpoint,
    tool_outputs,
    write_config,
)
from tests.pools import wait_until

KILL_AT = 12
STEPS_HERE = 8  # the restored session's task: fewer, slower turns


@pytest.fixture
def box_pool() -> Iterator[str]:
    pool = new_pool(docker_socket())
    yield pool
    remove_containers(pool)  # what a failed test left: this pool's only


def test_a_resumed_rollout_reattaches_to_the_agents_own_container(
    nats_server: EmbeddedServer, box_pool: str, tmp_path: Path
) -> None:
    run = Run(tmp_path, nats_server.url, write_config(tmp_path, box_pool, agent_boxed=True))
    try:
        run.start(box_pool)
        cp = run.kill_agent_after(lambda cp: cp.turn >= KILL_AT)
        assert cp.turn < STEPS
        (held,) = cp.sandboxes  # the agent's own container, by its lease
        assert len(bytes.fromhex(cp.sandbox_lease)) == 16  # a random secret, not the rollout's key (issue 73)
        assert containers(box_pool) == [held.sandbox]
        run.pool.start("agents.agent#2", "agents.agent")
        row = run.row()
        assert (row["resumed_how"], row["resumed_from_turn"]) == ("reattached", cp.turn)
        assert row["provenance"]["attempt"] == 2
        counts = row["counts"]
        assert sorted(counts) == [f"step_{i:02d}" for i in range(STEPS)], counts
        assert set(counts.values()) == {1}, {k: v for k, v in counts.items() if v != 1}  # each call once
        outputs = tool_outputs(row)
        assert {o["sandbox"] for o in outputs} == {held.sandbox}  # one container, before and after the kill
        assert {o["container"] for o in outputs} == {row["container"]} == {held.sandbox[:12]}
        assert stored_checkpoint(nats_server.url) is None
        wait_until(lambda: containers(box_pool) == [], timeout=30)  # closed with the rollout's end
    finally:
        run.close()


def test_a_dead_agents_container_is_gone_after_the_pools_lease_grace(
    nats_server: EmbeddedServer, box_pool: str, tmp_path: Path
) -> None:
    grace = 6.0
    run = Run(tmp_path, nats_server.url, write_config(tmp_path, box_pool, agent_boxed=True, lease_grace_s=grace))
    try:
        run.start(box_pool)
        (held,) = run.kill_agent_after(lambda cp: cp.turn >= 3).sandboxes  # no attempt comes to take it up
        assert containers(box_pool) == [held.sandbox]
        # kept meanwhile (idle_ttl_s is 120: only the grace ends it), then removed by its worker
        wait_until(lambda: containers(box_pool) == [], timeout=grace + 30)
    finally:
        run.close()


def test_an_attempt_given_back_for_a_retryable_failure_leaves_its_container_to_the_next(
    nats_server: EmbeddedServer, box_pool: str, tmp_path: Path
) -> None:
    """A retryable failure (the model's 5xx) at turn k gives the rollout back with its checkpoint: its container is
    left under its lease (not closed), and the next attempt, on the same live worker, reattaches to it."""
    cfg = write_config(tmp_path, box_pool, agent_boxed=True, agent_options={"fail_at": KILL_AT})
    run = Run(tmp_path, nats_server.url, cfg)
    try:
        run.start(box_pool)
        row = run.row()
        assert (row["resumed_how"], row["resumed_from_turn"]) == ("reattached", KILL_AT)
        assert row["provenance"]["attempt"] == 2
        assert set(row["counts"].values()) == {1} and len(row["counts"]) == STEPS
        assert len({o["sandbox"] for o in tool_outputs(row)}) == 1  # one container, before and after the failure
        wait_until(lambda: containers(box_pool) == [], timeout=30)
    finally:
        run.close()


def test_a_session_restored_after_its_resource_worker_died_reattaches_to_its_container(
    nats_server: EmbeddedServer, box_pool: str, tmp_path: Path
) -> None:
    """An environment session's sandboxes (``tests/envs/long_boxed.py``, restorable): its agent and its resource
    worker SIGKILLed, the pool keeps the session's container for its grace; the session restored from the snapshot
    on a fresh resource worker takes it up by the dead session's lease: the same container, each step once. Killed
    between two turns (an answered turn's checkpoint: the container is as its snapshot left it; the policy takes
    1 s a turn), on a task of ``STEPS_HERE`` steps."""
    cfg = write_config(tmp_path, box_pool, restorable=True, delay_s=1.0)
    run = Run(tmp_path, nats_server.url, cfg)
    run.tasks = [task(STEPS_HERE)]
    try:
        run.start(box_pool)
        cp = run.kill_agent_after(lambda cp: cp.turn >= 3 and cp.phase == "answered")
        assert cp.phase == "answered" and cp.sessions[0].held is not None
        run.pool.kill("resources.env")  # the session's holder: its container is left to the grace
        held = cp.sessions[0].held
        assert held is not None
        (box,) = held.sandboxes
        assert containers(box_pool) == [box.sandbox]
        run.pool.start("resources.env#2", "resources.env")
        run.pool.start("agents.agent#2", "agents.agent")
        row = run.row()
        assert (row["resumed_how"], row["resumed_from_turn"]) == ("restored", cp.turn)
        assert set(row["counts"].values()) == {1} and len(row["counts"]) == STEPS_HERE
        assert {o["sandbox"] for o in tool_outputs(row)} == {row["sandbox"]} == {box.sandbox}
        wait_until(lambda: containers(box_pool) == [], timeout=30)
    finally:
        run.close()
