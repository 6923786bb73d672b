"""Results only from their owner, and a ``collect`` that always ends (issue 33, items 2 and 3).

Attacks by a node holding one agent pool's genuine credentials on a ``server --secure`` bus, against
real workers: the pool knows a batch's slots (indices from 0; it may no longer read the manifests, and is
handed them here) and, using only the result subject its
credentials allow, stores rows for every slot of another agent's batch first, under every message id the
runtime could use. What must hold: collect, the client's batch and its ``run`` take only the owner's
results, every genuine row is kept, the forged ones are counted and dropped; a batch whose stored
results were purged or flooded away still ends, its empty slots ``lost`` failure rows (exit 1).
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from gym_runtime.client import Client
from gym_runtime.config import Config, JetStreamConfig, config_from_dict, load_config, resolve_config
from gym_runtime.data.batches import get_manifest
from gym_runtime.errors import StorageFull
from gym_runtime.messages import RolloutResult
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.ops.credentials import ClientAuth
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.ops.permissions import Reach
from gym_runtime.ops.security import ensure_auth_dir
from gym_runtime.service.runner import (
    RunResult,
    close_buses,
    make_workers,
    open_buses,
    pool_key,
    publish_batch,
    run_batch,
    selected,
    start_workers,
)
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.subjects import Subjects
from tests.helpers import REPO, ROWS, WEATHER, cli, pool_bus, read_jsonl, write_jsonl

DATA = REPO / "resources/weather/data/example.jsonl"
S = Subjects("gym")
POOLS = [("agent", "weather_agent"), ("agent", "other_agent"), ("resource", "weather"), ("model", "policy")]
FORGED_REWARD = 1337.0
# two agents of one config sharing the weather environment: the thief is the other agent's pool
TWO_AGENTS = {
    "namespace": "gym",
    "models": {"policy": {"adapter": "scripted"}},
    "resources": {"weather": {"server": "resources.weather"}},
    "agents": {
        "weather_agent": {"agent": "agents.simple", "model": "policy", "resource": "weather", "max_steps": 8},
        "other_agent": {"agent": "agents.simple", "model": "policy", "resource": "weather", "max_steps": 8},
    },
}


def _start(tmp_path: Path, jetstream: JetStreamConfig | None = None) -> tuple[EmbeddedServer, Path, Path]:
    """A secured server with per-entry credentials, and an honest node's directory (publisher + the pools)."""
    auth = tmp_path / "auth"
    ensure_auth_dir(auth, pools=POOLS)
    node = tmp_path / "node"
    node.mkdir()
    for name in ["ca.pem", "publisher.creds", *(f"{r}.{p}.creds" for r, p in POOLS)]:
        shutil.copy(auth / name, node / name)
    reach = Reach.of(config_from_dict(TWO_AGENTS))  # each agent pool may call its own environment
    srv = EmbeddedServer(store_dir=str(tmp_path / "js"), secure_dir=str(auth), jetstream=jetstream, reach=reach)
    srv.start()
    return srv, auth, node


@pytest.fixture
def owned(tmp_path: Path) -> Iterator[tuple[EmbeddedServer, Path, Path]]:
    srv, auth, node = _start(tmp_path)
    try:
        yield srv, auth, node
    finally:
        srv.stop()


async def _run(srv: EmbeddedServer, node: Path, cfg: Config, data: Path, batch: str, out: Path) -> RunResult:
    """``run`` of ``data`` × 2 as batch ``batch`` on the honest node's credentials (its publish finds a batch
    already published and only collects it)."""
    return await run_batch(
        resolve_config(cfg),
        srv.url,
        input_path=data,
        out=out,
        telemetry=Telemetry(),
        auth=ClientAuth(node),
        repeats=2,
        batch=batch,
    )


def _forged(batch: str, task: int, rollout: int, agent: str) -> RolloutResult:
    row = {
        "reward": FORGED_REWARD,
        "_ng_task_index": task,
        "_ng_rollout_index": rollout,
        "agent_ref": {"type": "responses_api_agents", "name": agent},
    }
    return RolloutResult(batch=batch, task_index=task, rollout_index=rollout, agent=agent, row=row)


def _guessed_ids(batch: str, task: int, rollout: int) -> list[str]:
    """Every id of a slot's result a forger can predict: the runtime's before this change, and its slot+attempt
    prefix now (the rest of a genuine id is drawn by the storing worker)."""
    return [f"{batch}:{task}:{rollout}", f"{batch}:{task}:{rollout}:1", f"{batch}:{task}:{rollout}:1:0"]


async def _forge(
    thief: Bus, batch: str, slots: list[tuple[int, int]], claim: str, changes: dict[str, Any] | None = None
) -> int:
    """Store forged rows of ``slots`` on the thief's own result subject, claiming agent ``claim``, under every
    guessable id; returns how many the server stored (an id it has seen is dropped)."""
    subject = S.result("other_agent", batch)
    stored = 0
    for task, rollout in slots:
        for msg_id in _guessed_ids(batch, task, rollout):
            res = msgspec.structs.replace(_forged(batch, task, rollout, claim), **(changes or {}))
            ack = await thief.js.publish(subject, thief.codec.encode(res), headers={"Nats-Msg-Id": msg_id})
            stored += not ack.duplicate
    return stored


async def test_an_agent_pool_can_neither_forge_nor_preempt_another_agents_results(owned, tmp_path: Path) -> None:
    """Before: 10 of 10 collected rows carried the forged reward; the genuine ones were dropped as duplicates."""
    srv, auth, node = owned
    cfg = load_config(WEATHER)
    publisher = await pool_bus(srv.url, node, "publisher")
    thief = await pool_bus(srv.url, auth, "agent", "other_agent")
    try:
        await publish_batch(publisher, resolve_config(cfg), DATA, batch="b1", repeats=2)
        # only the publisher's credential reads the manifests now (tests/test_subjects.py); the slots are
        # indices from 0, so the thief is handed them as a guess would find them
        seen = await get_manifest(publisher, "b1")
        assert seen is not None and seen.expected == 10
        slots = [(t, r) for t in range(seen.tasks) for r in range(seen.repeats)]
        forged = await _forge(thief, "b1", slots, "weather_agent")  # as the owner, pre-empting its ids
        forged += await _forge(thief, "b1", slots, "other_agent")  # as itself
        with anyio.fail_after(120):  # the weather pools now run the batch (already published) and collect it
            result = await _run(srv, node, cfg, DATA, "b1", tmp_path / "out.jsonl")
    finally:
        await publisher.close()
        await thief.close()
    rows = read_jsonl(tmp_path / "out.jsonl")
    assert [r["reward"] for r in rows] == [1.0] * 10
    assert [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in rows] == slots
    # stored in the thief's own results stream, which a reader of a batch of weather_agent's never opens
    assert forged == 30 and (result.stats.rows, result.stats.failures, result.stats.refused) == (10, 0, 0)


async def test_a_result_from_another_agent_batch_or_slot_is_refused(owned, tmp_path: Path) -> None:
    """A batch two agents share: the other agent's pool forges results for the weather agent's tasks, and for
    its own tasks with ``res.agent`` or ``res.batch`` disagreeing with their subject, or with a task or rollout
    index the batch does not have. Only genuine rows are collected, each under the agent that owns its task."""
    srv, auth, node = owned
    cfg = config_from_dict({**TWO_AGENTS, "base_dir": str(tmp_path)})
    owners = ["weather_agent" if i % 2 == 0 else "other_agent" for i in range(len(ROWS))]
    data = write_jsonl(
        tmp_path / "in.jsonl",
        [
            {**row, "agent_ref": {"type": "responses_api_agents", "name": a}}
            for row, a in zip(ROWS, owners, strict=True)
        ],
    )
    publisher = await pool_bus(srv.url, node, "publisher")
    thief = await pool_bus(srv.url, auth, "agent", "other_agent")
    try:
        manifest = await publish_batch(publisher, resolve_config(cfg), data, batch="b2", repeats=2)
        theirs = [(t, r) for t in range(5) for r in range(2) if owners[t] == "weather_agent"]
        mine = [(t, r) for t in range(5) for r in range(2) if owners[t] == "other_agent"]
        forged = await _forge(thief, "b2", theirs, "weather_agent")  # another agent's tasks, as their owner
        forged += await _forge(thief, "b2", theirs, "other_agent")  # ... and as itself
        forged += await _forge(thief, "b2", mine, "weather_agent")  # res.agent is not its subject's agent
        forged += await _forge(thief, "b2", mine, "other_agent", {"batch": "zz"})  # res.batch is not its subject's
        outside = [(5, 0), (-1, 0), (1, 2), (3, -1), (10**6, 0)]  # slots the batch does not have
        forged += await _forge(thief, "b2", outside, "other_agent")
        with anyio.fail_after(120):
            result = await _run(srv, node, cfg, data, "b2", tmp_path / "out.jsonl")
    finally:
        await publisher.close()
        await thief.close()
    rows = read_jsonl(tmp_path / "out.jsonl")
    assert [r["reward"] for r in rows] == [1.0] * manifest.expected
    assert [r["agent_ref"]["name"] for r in rows] == [a for a in owners for _ in range(2)]
    assert (result.stats.rows, result.stats.failures, result.stats.refused) == (10, 0, forged)


async def test_a_clients_batch_and_runs_take_only_their_owners_results(owned, tmp_path: Path) -> None:
    """The trainer's client reads results itself: a forger's rows never reach ``gather()`` nor ``run()``."""
    srv, auth, node = owned
    cfg = load_config(WEATHER)
    thief = await pool_bus(srv.url, auth, "agent", "other_agent")
    pairs = selected(cfg, None)
    honest = await open_buses(
        srv.url,
        [pool_key(*p) for p in pairs],
        namespace="gym",
        telemetry=Telemetry(),
        name="honest",
        auth=ClientAuth(node),
    )
    try:
        async with Client(resolve_config(cfg), nats=srv.url, auth_dir=node, workers=False) as client:
            batch = await client.submit(ROWS, repeats=2, batch="c1")
            await _forge(thief, "c1", [(t, r) for t in range(5) for r in range(2)], "weather_agent")
            async with anyio.create_task_group() as tg:
                await start_workers(tg, make_workers(honest, resolve_config(cfg), pairs))
                with anyio.fail_after(60):
                    rows = await batch.gather()
                assert [r["reward"] for r in rows] == [1.0] * 10
                # run(): the thief is handed the client's open batch (it can no longer list another agent's
                # results stream to find it) and forges what comes next
                first = await client.run(ROWS[0])
                await _forge(thief, client._run_batch, [(i, 0) for i in range(1, 6)], "weather_agent")
                with anyio.fail_after(60):
                    later = [await client.run(ROWS[i % 5]) for i in range(1, 6)]
                tg.cancel_scope.cancel()
    finally:
        await thief.close()
        await close_buses(honest)
    assert [r["reward"] for r in [first, *later]] == [1.0] * 6


def _collect(srv: EmbeddedServer, node: Path, batch: str, out: Path) -> Any:
    return cli(
        "collect",
        "--batch",
        batch,
        "--nats",
        srv.url,
        "-o",
        str(out),
        "--auth-dir",
        str(node),
        "--no-progress",
        timeout=90,
    )


async def test_collect_ends_when_stored_results_were_purged(owned, tmp_path: Path) -> None:
    """Results removed from the stream after their tasks were acked (an admin's purge, or a full stream's
    eviction): ``collect`` writes a ``lost`` failure row for each empty slot and exits 1. Before: its lost rows
    reused the removed results' message ids, the duplicate window dropped them, and it never finished."""
    srv, _, node = owned
    cfg = load_config(WEATHER)
    with anyio.fail_after(120):
        await _run(srv, node, cfg, DATA, "b3", tmp_path / "first.jsonl")
    admin = await pool_bus(srv.url, tmp_path / "auth", "admin")
    try:  # the oldest six results go
        await admin.js.purge_stream(S.results_stream("weather_agent"), subject="gym.result.weather_agent.b3", keep=4)
    finally:
        await admin.close()
    out = tmp_path / "out.jsonl"
    res = await anyio.to_thread.run_sync(lambda: _collect(srv, node, "b3", out))
    assert res.returncode == 1, res.stderr
    rows, lost = read_jsonl(out), read_jsonl(tmp_path / "out_failures.jsonl")
    assert len(rows) == 4 and {r["reward"] for r in rows} == {1.0}
    assert len(lost) == 6 and {f["error_class"] for f in lost} == {"lost"}
    slots = sorted((r["_ng_task_index"], r["_ng_rollout_index"]) for r in rows + lost)
    assert slots == [(t, r) for t in range(5) for r in range(2)]


async def test_a_pool_flooding_its_results_evicts_nothing_of_another_agent_and_collect_finishes(
    tmp_path: Path,
) -> None:
    """Another agent pool writes its own results as fast as it can into 2 MB results streams once a batch is
    done (the red team wrote 80 MB in 0.4 s): it is refused once its own stream is full (its flood counts
    ``storage_full`` for it alone), every stored result of the weather agent survives, ``collect`` ends with
    all 10 rows and exit 0, and a batch run after the flood is stored and collected whole. Before: one shared
    discard-old stream, the flood evicted the batch's results, and they became ``lost`` rows (exit 1)."""
    srv, auth, node = _start(tmp_path, JetStreamConfig(results_max_bytes="2MB"))
    try:
        cfg = load_config(WEATHER)
        thief = await pool_bus(srv.url, auth, "agent", "other_agent")
        try:
            with anyio.fail_after(120):
                await _run(srv, node, cfg, DATA, "b4", tmp_path / "first.jsonl")
            pad = "x" * 8000
            flood, refused = 0, None
            for i in range(2000):  # 16 MB: eight times the stream
                res = _forged("zz", i, 0, "other_agent")
                res = msgspec.structs.replace(res, row={**(res.row or {}), "pad": pad})
                try:
                    await thief.js_publish(S.result("other_agent", "zz"), res, msg_id=uuid.uuid4().hex)
                except StorageFull as e:  # its own stream is full: refused, nothing dropped to make room
                    refused = e
                    break
                flood += 1
        finally:
            await thief.close()
        assert flood > 100 and refused is not None
        assert S.results_stream("other_agent") in str(refused) and "jetstream.results_max_bytes" in str(refused)
        out = tmp_path / "out.jsonl"
        res = await anyio.to_thread.run_sync(lambda: _collect(srv, node, "b4", out))
        assert res.returncode == 0, res.stderr
        rows = read_jsonl(out)
        assert [r["reward"] for r in rows] == [1.0] * 10
        assert not (tmp_path / "out_failures.jsonl").exists() or read_jsonl(tmp_path / "out_failures.jsonl") == []
        with anyio.fail_after(120):  # the weather agent still stores and collects a batch after the flood
            after = await _run(srv, node, cfg, DATA, "b5", tmp_path / "after.jsonl")
        assert (after.stats.rows, after.stats.failures) == (10, 0)
    finally:
        srv.stop()
