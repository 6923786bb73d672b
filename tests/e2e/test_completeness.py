"""Completeness that does not trust the broker (issue 37, item 2): stored results removed behind the runtime's
back come back as rows, exactly once, and a slot whose result keeps being lost ends as a ``lost`` row.

Real nats-server, real worker processes (the scripted policy is the only test double). Results are removed
after their tasks were acknowledged, which leaves nothing in the work queue: a purge of the results subject,
a server restarted on a store whose results file was cut in half, and a cluster node so damaged that then
leads the results stream (what the server holds is counted in slots, read message by message, not in stream
counts: nats-server keeps lost messages as deleted sequences). Each time ``collect`` finds the empty slots,
publishes their tasks again from the bodies the batch keeps, and writes every row once. Each test failed on
the code before (``lost`` rows, exit 1). ~3 min for the file on 2 shared cores under a load of 20.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from gym_runtime.client import Client
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.service import runner
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.codec import Codec
from gym_runtime.transport.discovery import register
from gym_runtime.transport.jetstream import ensure_consumer
from gym_runtime.transport.subjects import Subjects
from tests.cluster import LocalCluster, cut_last_block, start_worker, stop, stream_messages
from tests.cluster import write_config as cluster_config
from tests.helpers import ROWS, cli, read_jsonl, weather, write_jsonl
from tests.pools import N_TASKS, REPEATS, Pool, assert_exactly_once, publish, tasks_file, write_config

RESULTS = "GYM_RESULTS_agent"
SLOTS = N_TASKS * REPEATS


@pytest.fixture
def pool(nats_server: EmbeddedServer, tmp_path: Path) -> Iterator[Pool]:
    """The three roles' workers, one process each."""
    p = Pool(write_config(tmp_path, delay_s=0.0), nats_server.url)
    try:
        for only in ("agents.agent", "models.policy", "resources.env"):
            p.start(only, only)
        yield p
    finally:
        p.stop_all()


def _collect(url: str, batch: str, out: Path, *extra: str) -> Any:
    return cli("collect", "--batch", batch, "--nats", url, "-o", str(out), "--no-progress", *extra, timeout=150)


def _slots_stored(urls: list[str]) -> set[tuple[int, int]]:
    """The slots whose results the server still holds, from each stored message (not the stream's counts)."""
    codec = Codec()
    stored = stream_messages(urls, RESULTS) or {}
    return {(r.task_index, r.rollout_index) for r in (codec.decode(b, None) for b in stored.values())}


def _done_batch(pool: Pool, url: str, tmp_path: Path, batch: str) -> list[dict[str, Any]]:
    """Publish and collect a batch: every row, as collected before anything was removed."""
    publish(pool.config, url, tasks_file(tmp_path), batch)
    res = _collect(url, batch, tmp_path / "first.jsonl")
    assert res.returncode == 0, res.stderr
    return assert_exactly_once(tmp_path / "first.jsonl")


def _same_rows(rows: list[dict[str, Any]], before: list[dict[str, Any]]) -> None:
    assert [(r["task_id"], r["reward"]) for r in rows] == [(r["task_id"], r["reward"]) for r in before]


def test_collect_gets_back_every_row_whose_stored_result_was_purged(
    nats_server: EmbeddedServer, pool: Pool, tmp_path: Path
) -> None:
    """14 of 24 acknowledged results are purged (their tasks left the queue long before). Before: 14 ``lost``
    failure rows, exit 1."""
    before = _done_batch(pool, nats_server.url, tmp_path, "p1")

    async def purge() -> None:
        bus = await Bus.connect(nats_server.url, namespace="gym", telemetry=Telemetry(), name="test-admin")
        try:  # the oldest 14 results go
            await bus.js.purge_stream(RESULTS, subject="gym.result.agent.p1", keep=SLOTS - 14)
        finally:
            await bus.close()

    anyio.run(purge)
    assert len(_slots_stored([nats_server.url])) == SLOTS - 14
    out = tmp_path / "out.jsonl"
    res = _collect(nats_server.url, "p1", out)
    assert res.returncode == 0, res.stderr
    assert f"{SLOTS} rows, 0 failed" in res.stdout
    assert not (tmp_path / "out_failures.jsonl").exists()
    _same_rows(assert_exactly_once(out), before)
    assert _slots_stored([nats_server.url]) == {(t, r) for t in range(N_TASKS) for r in range(REPEATS)}


def test_collect_gets_back_the_rows_a_truncated_store_lost(
    nats_server: EmbeddedServer, pool: Pool, tmp_path: Path
) -> None:
    """The server is stopped, the last file of its results stream cut in half, and started again on it: the
    results in the lost half are gone (nats-server 2.15.1 keeps them as deleted sequences). Before: a ``lost``
    failure row for each, exit 1."""
    before = _done_batch(pool, nats_server.url, tmp_path, "t1")
    nats_server.stop()
    cut_last_block(nats_server, RESULTS)
    nats_server.start()
    left = _slots_stored([nats_server.url])
    assert 0 < len(left) < SLOTS, len(left)  # acknowledged results were lost
    out = tmp_path / "out.jsonl"
    res = _collect(nats_server.url, "t1", out)
    assert res.returncode == 0, res.stderr
    assert f"{SLOTS} rows, 0 failed" in res.stdout
    _same_rows(assert_exactly_once(out), before)


async def _ack_without_results(url: str, agent: str, *, count: int | None, seen: list[str]) -> None:
    """A buggy or hostile agent pool: it announces itself as ``agent``'s worker and acks the tasks it pulls
    without storing any result (``count`` of them, or all until cancelled), recording each task's id."""
    bus = await Bus.connect(url, namespace="gym", telemetry=Telemetry(), name="test-rogue")
    s = Subjects("gym")
    stream, durable = s.tasks_stream, s.durable("task", agent)
    svc = await register(bus, "agent", agent, "rogue", dict)
    try:
        await ensure_consumer(bus, stream, durable, s.agent_tasks(agent), ack_wait=30.0)
        sub = await bus.js.pull_subscribe_bind(durable=durable, stream=stream)
        while count is None or len(seen) < count:
            try:
                msgs = await sub.fetch(1 if count else 16, timeout=1.0)
            except Exception:  # nothing to take this second
                continue
            for m in msgs:
                seen.append((m.headers or {}).get("Nats-Msg-Id", ""))
                await m.ack()
    finally:
        with anyio.CancelScope(shield=True):
            await svc.stop()
            await bus.close()


async def test_a_clients_batch_gets_back_the_rows_of_tasks_acked_without_a_result(nats_server) -> None:
    """A pool acks three of a client's tasks without storing their results; the honest workers start after:
    ``gather()`` returns every slot's row, once. Before: three ``lost`` rows."""
    cfg = weather()
    pairs = runner.selected(cfg, None)
    async with Client(cfg, nats=nats_server.url, workers=False) as client:
        batch = await client.submit(ROWS, repeats=2, batch="c1")
        seen: list[str] = []
        with anyio.fail_after(30):
            await _ack_without_results(nats_server.url, "weather_agent", count=3, seen=seen)
        honest = await runner.open_buses(
            nats_server.url, [runner.pool_key(*p) for p in pairs], namespace="gym", telemetry=Telemetry(), name="honest"
        )
        try:
            async with anyio.create_task_group() as tg:
                await runner.start_workers(tg, runner.make_workers(honest, cfg, pairs))
                with anyio.fail_after(90):
                    rows = await batch.gather()
                tg.cancel_scope.cancel()
        finally:
            await runner.close_buses(honest)
    assert [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in rows] == [(t, k) for t in range(5) for k in range(2)]
    assert [r["reward"] for r in rows] == [1.0] * 10
    assert len(seen) == 3 and all("/" not in s for s in seen)  # the first publish's tasks


async def test_run_gets_back_the_rows_of_tasks_acked_without_a_result(nats_server, tmp_path: Path) -> None:
    """``run`` of a batch already published (its publish finds it and only collects), three of whose tasks a pool
    acked without storing their results: every row, once. Before: three ``lost`` rows."""
    cfg = weather()
    data = write_jsonl(tmp_path / "in.jsonl", ROWS)
    bus = await Bus.connect(nats_server.url, namespace="gym", telemetry=Telemetry(), name="test-publisher")
    try:
        await runner.publish_batch(bus, cfg, data, batch="u1", repeats=2)
    finally:
        await bus.close()
    seen: list[str] = []
    with anyio.fail_after(30):
        await _ack_without_results(nats_server.url, "weather_agent", count=3, seen=seen)
    with anyio.fail_after(90):
        result = await runner.run_batch(
            cfg,
            nats_server.url,
            input_path=data,
            out=tmp_path / "out.jsonl",
            telemetry=Telemetry(),
            repeats=2,
            batch="u1",
        )
    assert (result.stats.rows, result.stats.failures) == (10, 0)
    rows = read_jsonl(tmp_path / "out.jsonl")
    assert [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in rows] == [(t, k) for t in range(5) for k in range(2)]


async def test_a_slot_whose_result_keeps_being_lost_ends_as_a_lost_row(nats_server, tmp_path: Path) -> None:
    """The only pool of the agent acks every task without a result, its tasks published again included:
    ``collect --max-republish 2`` publishes each task again twice, then ends with a ``lost`` row per slot
    saying so (exit 1); it never waits for a result that will not come."""
    cfg = weather()
    bus = await Bus.connect(nats_server.url, namespace="gym", telemetry=Telemetry(), name="test-publisher")
    seen: list[str] = []
    try:
        async with anyio.create_task_group() as tg:
            data = tmp_path / "in.jsonl"
            data.write_bytes(b"".join(msgspec.json.encode(r) + b"\n" for r in ROWS[:2]))
            manifest = await runner.publish_batch(bus, cfg, data, batch="r1", repeats=2)
            assert manifest.max_republish == cfg.jetstream.max_republish == 2
            # after the publish: it makes the streams the rogue pulls from (and checks live workers first)
            tg.start_soon(lambda: _ack_without_results(nats_server.url, "weather_agent", count=None, seen=seen))
            out = tmp_path / "out.jsonl"
            t0 = time.monotonic()
            res = await anyio.to_thread.run_sync(lambda: _collect(nats_server.url, "r1", out, "--max-republish", "2"))
            took = time.monotonic() - t0
            tg.cancel_scope.cancel()
    finally:
        await bus.close()
    assert res.returncode == 1, res.stderr
    lost = read_jsonl(tmp_path / "out_failures.jsonl")
    assert [(f["_ng_task_index"], f["_ng_rollout_index"]) for f in lost] == [(t, k) for t in range(2) for k in range(2)]
    assert {f["error_class"] for f in lost} == {"lost"}
    assert all("published again 2 times (max_republish=2)" in f["error"] for f in lost), lost[0]["error"]
    # each slot's task went out three times: first, and again in rounds 1 and 2 (ids of their own)
    assert sorted(seen) == sorted(
        f"r1:{t}:{k}{again}" for t in range(2) for k in range(2) for again in ("", "/1", "/2")
    )
    assert took < 60, took


def test_collect_gets_back_the_rows_a_damaged_leader_lost(tmp_path: Path) -> None:
    """A 3-node cluster (every stream R3): a follower of the results stream has its last block cut in half while
    it is stopped, and then leads the stream (tests/e2e/test_corruption.py: nats-server keeps the lost half as
    deleted sequences and reports itself healthy). Before: a ``lost`` failure row for each of those results."""
    c = LocalCluster(tmp_path / "nats", size=3).start()
    procs = []
    try:
        config = cluster_config(tmp_path, replicas=3, agent_concurrency=8)
        procs = [start_worker(config, c.url, only) for only in ("agents.agent", "models.policy", "resources.env")]
        data = tasks_file(tmp_path)
        res = cli("publish", str(config), "-i", str(data), "--nats", c.url, "--batch", "d1", "--repeats", str(REPEATS))
        assert res.returncode == 0, res.stderr
        res = _collect(c.url, "d1", tmp_path / "first.jsonl")
        assert res.returncode == 0, res.stderr
        before = assert_exactly_once(tmp_path / "first.jsonl")
        victim = c.node(next(n.server_name or "" for n in c.nodes if n.server_name != c.stream_leader(RESULTS)))
        victim.stop()
        cut_last_block(victim, RESULTS)
        victim.start()
        c.wait_ready(60)
        c.move_leader(RESULTS, victim.server_name or "")
        assert len(_slots_stored(c.urls)) < SLOTS  # what readers see now: acknowledged results are gone
        out = tmp_path / "out.jsonl"
        res = _collect(c.url, "d1", out)
        assert res.returncode == 0, res.stderr
        assert f"{SLOTS} rows, 0 failed" in res.stdout
        _same_rows(assert_exactly_once(out), before)
    finally:
        stop(procs)
        c.stop()
