"""A long rollout resumes at its last turn (issue 69): real nats-server, real Docker sandboxes, real worker
processes SIGKILLed mid-rollout (only the LLM is a test double: ``scripted``, with token ids).

The environment (``tests/envs/long_boxed.py``) is 50 turns of one tool call each, every call bumping a counter of
its own in the session's one container. An agent worker killed at turn k is redelivered (``ack_wait_s`` lowered)
and its next attempt takes up the checkpoint: the row says ``resumed_from_turn`` = k, every tool's side effect
happened once, in the same container, and the token ids run on across the kill. With its resource worker killed
too, the session is restored from the environment's snapshot (or, for one without, the rollout restarts), as the
row says; so it is when the node of both is lost (the two in one process, killed at once). A kill while a tool
call runs: that call runs once. The checkpoint never outlives its row.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from gym_runtime.ops.nats_server import EmbeddedServer
from tests.docker import docker_socket
from tests.envs.long_boxed import STEPS
from tests.helpers import cli
from tests.long_rollout import (
    BATCH,
    Run,
    checkpoint_gone,
    new_pool,
    stored_checkpoint,
    tool_outputs,
    turn_stored,
    write_config,
)
from tests.pools import wait_until

KILL_AT = 12  # the agent worker is killed once a checkpoint at this turn or later is stored


@pytest.fixture
def box_pool() -> str:
    return new_pool(docker_socket())


@pytest.fixture
def server(nats_server: EmbeddedServer) -> EmbeddedServer:
    return nats_server  # a store of its own, killed and started again by one test


def assert_once_each(row: dict[str, Any]) -> None:
    """Every step ran, and each one's side effect happened once (its counter in the container is 1)."""
    counts = row["counts"]
    assert sorted(counts) == [f"step_{i:02d}" for i in range(STEPS)], counts
    assert set(counts.values()) == {1}, {k: v for k, v in counts.items() if v != 1}


def assert_contiguous(row: dict[str, Any]) -> None:
    """Each turn's prompt token ids start with the turn before it: its prompt, then its generation."""
    gens = [i for i in row["response"]["output"] if i.get("generation_token_ids")]
    assert len(gens) == STEPS + 1, len(gens)
    for before, after in zip(gens, gens[1:], strict=False):
        seen = before["prompt_token_ids"] + before["generation_token_ids"]
        assert after["prompt_token_ids"][: len(seen)] == seen


def test_an_agent_worker_killed_at_turn_k_resumes_there_in_the_same_container(
    server: EmbeddedServer, box_pool: str, tmp_path: Path
) -> None:
    run = Run(tmp_path, server.url, write_config(tmp_path, box_pool))
    try:
        run.start(box_pool)
        wait_until(lambda: turn_stored(server.url) >= KILL_AT, timeout=120)
        run.pool.kill("agents.agent")
        cp = stored_checkpoint(server.url)  # what the next attempt finds: nothing writes it now
        assert cp is not None and cp.turn < STEPS
        run.pool.start("agents.agent#2", "agents.agent")
        row = run.row()
        assert row["resumed_from_turn"] == cp.turn
        assert row["resumed_how"] == "reattached"
        assert row["provenance"]["attempt"] == 2
        assert_once_each(row)
        containers = {o["container"] for o in tool_outputs(row)}
        assert containers == {row["container"]}, containers  # one container, before and after the kill
        assert_contiguous(row)
        checkpoint_gone(server.url)  # the checkpoint went with its row
        # explain: the resumed attempt's calls numbered as the rollout's turns, its first tool the replayed one
        res = cli("explain", BATCH, "0", "0", "--nats", server.url)
        assert res.returncode == 0, res.stderr
        second = res.stdout.split("attempt 2", 1)[1]
        assert f"resumed at turn {cp.turn} (reattached)" in second
        tools = re.findall(r"tool  (step_\d+)", second)
        expect = cp.turn - 1 if cp.phase == "generated" else cp.turn  # a generated turn's calls are replayed
        assert tools == [f"step_{i:02d}" for i in range(expect, STEPS)], tools
    finally:
        run.close()


@pytest.mark.parametrize("restorable", [True, False])
def test_a_resource_worker_killed_too_is_restored_from_its_snapshot_or_restarts(
    server: EmbeddedServer, box_pool: str, tmp_path: Path, restorable: bool
) -> None:
    run = Run(tmp_path, server.url, write_config(tmp_path, box_pool, restorable=restorable))
    try:
        run.start(box_pool)
        wait_until(lambda: turn_stored(server.url) >= KILL_AT, timeout=120)
        run.pool.kill("agents.agent")
        run.pool.kill("resources.env")  # its session, and the container it held, are gone with it
        cp = stored_checkpoint(server.url)
        assert cp is not None
        run.pool.start("resources.env#2", "resources.env")
        run.pool.start("agents.agent#2", "agents.agent")
        row = run.row()
        if restorable:
            assert (row["resumed_how"], row["resumed_from_turn"]) == ("restored", cp.turn)
        else:
            assert (row["resumed_how"], row["resumed_from_turn"]) == ("restarted", 0)
        assert_once_each(row)  # in the container the rollout ended in: each step once
        assert_contiguous(row)
        checkpoint_gone(server.url)
    finally:
        run.close()


def test_a_lost_node_its_agent_and_resource_workers_at_once_resumes_from_the_snapshot(
    server: EmbeddedServer, box_pool: str, tmp_path: Path
) -> None:
    """A node lost: the agent worker and the resource worker it ran beside (one process, as one node's ``start``)
    SIGKILLed together, the bus and the sandbox pool elsewhere. The checkpoint is on the bus, not on the node:
    a peer node takes the rollout up from it, its session restored from the environment's snapshot."""
    run = Run(tmp_path, server.url, write_config(tmp_path, box_pool, restorable=True))
    node = ["agents.agent", "resources.env"]
    try:
        for only in (f"sandboxes.{box_pool}", "models.policy"):
            run.pool.start(only, only)
        run.pool.start("node", node)
        run.publish()
        wait_until(lambda: turn_stored(server.url) >= KILL_AT, timeout=120)
        run.pool.kill("node")
        cp = stored_checkpoint(server.url)
        assert cp is not None and cp.turn < STEPS
        run.pool.start("node#2", node)
        row = run.row()
        assert (row["resumed_how"], row["resumed_from_turn"]) == ("restored", cp.turn)
        assert row["provenance"]["attempt"] == 2
        assert_once_each(row)  # each step once, the steps before the loss carried by the snapshot
        assert_contiguous(row)
        checkpoint_gone(server.url)
    finally:
        run.close()


def test_a_tool_call_in_flight_when_its_agent_dies_runs_once(
    server: EmbeddedServer, box_pool: str, tmp_path: Path
) -> None:
    marker = tmp_path / "slow-call-running"
    run = Run(tmp_path, server.url, write_config(tmp_path, box_pool, slow_step=KILL_AT, slow_s=4, marker=str(marker)))
    try:
        run.start(box_pool)
        wait_until(marker.exists, timeout=120)  # the slow step's call is running on the resource worker
        run.pool.kill("agents.agent")
        run.pool.start("agents.agent#2", "agents.agent")
        row = run.row()
        assert (row["resumed_how"], row["resumed_from_turn"]) == ("reattached", KILL_AT + 1)
        assert_once_each(row)  # the slow step too: answered from its first run, never run again
        checkpoint_gone(server.url)
    finally:
        run.close()


def test_a_server_killed_and_restarted_mid_batch_keeps_its_checkpoints_and_the_rollouts_resume(
    server: EmbeddedServer, box_pool: str, tmp_path: Path
) -> None:
    """The checkpoints are on the server's disk: SIGKILL nats-server mid-batch (two long rollouts running), and
    the agent worker while it is down, start both again: each rollout resumes where its stored checkpoint says,
    every row complete. A tool call whose sandbox exec was in flight as the bus went down may run again: the
    exec's answer was lost, not recorded."""
    run = Run(tmp_path, server.url, write_config(tmp_path, box_pool))
    try:
        run.start_workers(box_pool)
        run.publish(collect=False, repeats=2)
        wait_until(lambda: min(turn_stored(server.url, r) for r in (0, 1)) >= KILL_AT, timeout=120)
        server.kill()  # SIGKILL: the store dir stays
        run.pool.kill("agents.agent")
        server.start()  # same port, same store
        cps = [stored_checkpoint(server.url, r) for r in (0, 1)]
        assert all(cp is not None and cp.turn >= KILL_AT for cp in cps), cps
        run.pool.start("agents.agent#2", "agents.agent")
        run.collect()
        for row, cp in zip(run.rows(2), cps, strict=True):
            assert cp is not None
            assert row["resumed_from_turn"] == cp.turn  # the one stored before the kill
            assert row["resumed_how"] == "reattached"  # the resource worker reconnected, holding the session
            counts = row["counts"]
            assert sorted(counts) == [f"step_{i:02d}" for i in range(STEPS)], counts
            # at most the call in flight as the server died ran again: its sandbox exec ran, its answer was lost
            # with the bus, so its tool raised (worker_lost) and recorded no reply
            # (docs/operations.md#resume-at-the-last-turn)
            assert sum(counts.values()) <= STEPS + 1, counts
        for r in (0, 1):
            checkpoint_gone(server.url, r)
    finally:
        run.close()
