"""Attacks by nodes holding one role's valid credentials on a ``server --secure`` bus (issue 26, items 4-8).

Each attack runs for real: a secured nats-server, the attacker connected with
another role's (or another pool's) genuine seed, replaying genuine headers it
observed. What must hold: no role lists or reads bodies it was not sent, nothing
stored can be overwritten, a swapped body is a failure row, never a reward; no
node answers or reads another entry's calls; a deleted reader or an unreadable
task never hangs ``collect``; junk and replays cost a counter, not the pool.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import nats.errors
import pytest

from gym_runtime.config import ResourceConfig, load_config, resolve_config
from gym_runtime.data.batches import Manifest
from gym_runtime.data.collector import Collector
from gym_runtime.errors import Failure
from gym_runtime.messages import (
    Checkpoint,
    Response,
    RolloutResult,
    RolloutTask,
    SeedReply,
    SeedRequest,
    ToolCall,
    ToolReply,
    VerifyReply,
)
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.ops.credentials import ClientAuth
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.ops.permissions import Reach
from gym_runtime.rollout.checkpoint import Checkpointer, checkpoints_kv
from gym_runtime.service.runner import make_workers, publish_batch, run_batch, selected, start_workers
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.discovery import discover
from gym_runtime.transport.headers import BLOB_HEADER
from gym_runtime.transport.jetstream import ensure_consumer, ensure_streams, result_msg_id
from gym_runtime.transport.subjects import Subjects
from gym_runtime.workers.control import ControlView, control_kv, send_pause, send_resume
from gym_runtime.workers.resource_worker import ResourceWorker
from tests.helpers import REPO, connect_as, put_batch, read_jsonl, resolved, secured_server, write_jsonl

MARKER = "confidential-trajectory-7f3a"


async def _replies(bus: Bus, subject: str, body: bytes) -> list[bytes]:
    """Everything that comes back within 0.3 s of a raw request (headers and body), refused or not."""
    inbox = bus.nc.new_inbox()
    sub = await bus.nc.subscribe(inbox)
    await bus.nc.publish(subject, body, reply=inbox)
    got: list[bytes] = []
    with anyio.move_on_after(0.3):
        while True:
            m = await sub.next_msg(timeout=0.3)
            got.append(json.dumps(m.headers or {}).encode() + m.data)
    await sub.unsubscribe()
    return got


async def test_stored_bodies_cannot_be_listed_overwritten_or_swapped(buses: dict[str, Bus], tmp_path: Path) -> None:
    agent, admin, model = buses["agent"], buses["admin"], buses["model"]
    big = {"reward": 0.0, "notes": MARKER + "x" * (agent.blob_threshold + 1000)}
    genuine = RolloutResult(batch="b1", task_index=0, rollout_index=0, agent="a", row=big)
    await agent.js_publish("gym.result.a.b1", genuine, msg_id="b1:0:0")
    stored = await admin.js.get_last_msg(Subjects("gym").shared_results_stream, "gym.result.a.b1")
    ref = (stored.headers or {})[BLOB_HEADER]  # the genuine header: every attacker below knows it
    space, key = ref.rsplit(".", 3)[0], ref.split(".")[2]  # the agent's key space: agent._ (role-wide)

    # listing or reading by sequence: refused for every role but the admin, whatever the stream is called
    leaks: list[bytes] = []
    for attacker in (model, buses["resource"], buses["publisher"], agent):
        for stream in ("GYM_BLOBS", "OBJ_GYM_BLOBS", "GYM_BLOBS_AGENT", "GYM_BLOBS_PUBLISHER"):
            api = "$JS.API"
            for subject, body in [
                (f"{api}.STREAM.INFO.{stream}", b'{"subjects_filter": ">"}'),
                (f"{api}.DIRECT.GET.{stream}", b'{"seq": 1}'),
                (f"{api}.DIRECT.GET.{stream}", b'{"multi_last": [">"], "batch": 100}'),
                (f"{api}.DIRECT.GET.{stream}.gym.blob.x", b'{"seq": 1}'),
                (f"{api}.DIRECT.GET.{stream}.gym.blob.x", b'{"next_by_subj": ">", "seq": 1}'),
                (f"{api}.STREAM.MSG.GET.{stream}", b'{"seq": 1}'),
                (f"{api}.CONSUMER.CREATE.{stream}", b'{"stream_name": "%s", "config": {}}' % stream.encode()),
            ]:
                leaks += [
                    r for r in await _replies(attacker, subject, body) if MARKER.encode() in r or key.encode() in r
                ]
    assert leaks == []

    # overwriting a chunk under the genuine key: refused by the server, even for the admin
    forged = RolloutResult(batch="b1", task_index=0, rollout_index=0, agent="a", row={"reward": 1337.0})
    for attacker in (model, agent, admin):
        with pytest.raises((nats.js.errors.APIError, nats.errors.TimeoutError)):
            await attacker.js.publish(f"gym.blob.{space}.{key}.0", attacker.codec.encode(forged), timeout=1.0)

    # the admin purges the chunks and stores a forged body under the key: the digest refuses it
    n = int(ref.split(".")[3])
    blobs = "GYM_BLOBS_AGENT"
    for i in range(n):
        await admin.js.purge_stream(blobs, subject=f"gym.blob.{space}.{key}.{i}")
        chunk = admin.codec.encode(forged) if i == 0 else b""
        await admin.js.publish(f"gym.blob.{space}.{key}.{i}", chunk, timeout=5.0)
    out = tmp_path / "out.jsonl"
    pub = buses["publisher"]
    with anyio.fail_after(20):
        stats = await Collector(pub, await put_batch(pub, "b1", 1), out).run()
    assert stats.rows == 0 and stats.failures == 1
    (failure,) = read_jsonl(tmp_path / "out_failures.jsonl")
    assert failure["error_class"] == "integrity" and failure["_ng_task_index"] == 0
    assert read_jsonl(out) == []


# ------------------------------------------------------------------------- least privilege per pool

WEATHER_POOLS = [("agent", "weather_agent"), ("resource", "weather"), ("model", "policy")]
ATTACKER_POOLS = [("agent", "other_agent"), ("resource", "other_env"), ("model", "other_model")]


@pytest.fixture
def pooled(tmp_path: Path) -> Iterator[tuple[EmbeddedServer, Path]]:
    """A secured server whose directory also holds per-entry credentials (``server --secure DIR --pool ...``)."""
    reach = Reach(agents={"weather_agent": ("weather",), "other_agent": ("other_env",)})  # each agent's environment
    with secured_server(tmp_path, [*WEATHER_POOLS, *ATTACKER_POOLS], reach) as (srv, auth):
        yield srv, auth


async def test_another_pools_credentials_can_neither_read_nor_answer_nor_forge(pooled, tmp_path: Path) -> None:
    """Nodes of other entries (valid pool credentials) attack a weather batch run with the weather pools' files."""

    srv, auth = pooled
    node = tmp_path / "node"  # the honest node: publisher + the weather entries' pool files, no role-wide file
    node.mkdir()
    for name in ["ca.pem", "publisher.creds", *(f"{r}.{p}.creds" for r, p in WEATHER_POOLS)]:
        shutil.copy(auth / name, node / name)
    admin = await connect_as(srv, auth, "admin", None)
    res_thief = await connect_as(srv, auth, "resource", "other_env")
    model_thief = await connect_as(srv, auth, "model", "other_model")
    agent_thief = await connect_as(srv, auth, "agent", "other_agent")
    sniffed: list[str] = []
    forged_seen: list[str] = []
    replies: list[tuple[str, dict[str, str]]] = []

    async def sniff(msg) -> None:  # type: ignore[no-untyped-def]
        sniffed.append(msg.subject)

    async def spy(msg) -> None:  # type: ignore[no-untyped-def]  # the admin sees every genuine reply subject
        if (msg.headers or {}).get("Forged"):
            forged_seen.append(msg.subject)
        else:
            replies.append((msg.subject, dict(msg.headers or {})))

    for subject in ("gym.res.weather.>", "gym.res.>", "gym.call.model.policy", "_INBOX.agent.>", "_INBOX.>"):
        await res_thief.nc.subscribe(subject, cb=sniff)
        await model_thief.nc.subscribe(subject, cb=sniff)
    await admin.nc.subscribe("_INBOX.>", cb=spy)
    forged_verdict = VerifyReply(reward=1337.0)
    sent = 0

    async def spray() -> None:
        """Replay every genuine reply subject with a forged verdict from the other pools' credentials."""
        nonlocal sent
        done = 0
        while True:
            for subject, headers in replies[done:]:
                for thief in (model_thief, res_thief):
                    h = {**headers, "Forged": "1"}
                    h.pop("Gym-Progress", None)
                    await thief.nc.publish(subject, thief.codec.encode(forged_verdict), headers=h)
                    # the next calls' subjects: the same lane, the next numbers
                    base, _, n = subject.rpartition(".")
                    if n.isdigit():
                        for k in range(1, 4):
                            await thief.nc.publish(
                                f"{base}.{int(n) + k}", thief.codec.encode(forged_verdict), headers=h
                            )
                    sent += 1
            done = len(replies)
            await anyio.sleep(0.01)

    cfg = load_config(REPO / "resources/weather/config.yaml")
    data = REPO / "resources/weather/data/example.jsonl"
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(spray)
            result = await run_batch(
                resolve_config(cfg),
                srv.url,
                input_path=data,
                out=tmp_path / "out.jsonl",
                telemetry=Telemetry(),
                auth=ClientAuth(node),
                repeats=4,
                batch="b1",
            )
            tg.cancel_scope.cancel()
        assert result.stats.failures == 0 and result.stats.rows == 4 * len(read_jsonl(data))
        assert {r["reward"] for r in read_jsonl(tmp_path / "out.jsonl")} == {1.0}
        assert sent > 0 and forged_seen == [] and sniffed == []  # every forged reply and subscription refused

        # another agent pool: no result under the weather agent's name, no pull or +TERM on its durable
        forged = RolloutResult(batch="b2", task_index=0, rollout_index=0, agent="weather_agent", row={"reward": 1.0})
        with pytest.raises((nats.js.errors.APIError, nats.errors.TimeoutError)):
            await agent_thief.js.publish("gym.result.weather_agent.b2", agent_thief.codec.encode(forged), timeout=1.0)
        await agent_thief.js.publish("gym.result.other_agent.b2", agent_thief.codec.encode(forged), timeout=5.0)
        stream = Subjects("gym").tasks_stream
        await admin.js.publish(Subjects("gym").task("weather_agent", "b2"), b"t", timeout=5.0)
        pulled = await _replies(
            agent_thief,
            f"$JS.API.CONSUMER.MSG.NEXT.{stream}.agent_weather_agent",
            b'{"batch": 1, "expires": 500000000}',
        )
        assert pulled == []  # refused: not even a "no messages" status comes back
        with pytest.raises(nats.errors.TimeoutError):  # nor a consumer of its own on the weather agent's tasks
            await agent_thief.js.add_consumer(
                stream,
                durable_name="agent_other_agent",
                filter_subject=Subjects("gym").agent_tasks("weather_agent"),
                timeout=1.0,
            )
    finally:
        for b in (admin, res_thief, model_thief, agent_thief):
            await b.close()


async def test_no_pool_lists_the_queued_batches_of_any_agent(pooled) -> None:
    """The tasks stream's info with a subjects filter lists every queued task's subject with its count: every
    batch id of every agent (round 4 of the red team). Refused to every pool and role-wide credential but the
    publisher's (which counts a batch's tasks); a pool still starts (it checks the streams are there by name)."""
    srv, auth = pooled
    admin = await connect_as(srv, auth, "admin", None)
    names = Subjects("gym")
    secret = "batch-4c1d-queued"
    who = [*WEATHER_POOLS, *ATTACKER_POOLS, *((r, None) for r in ("agent", "model", "resource", "sandbox"))]
    attackers = [await connect_as(srv, auth, r, p) for r, p in who]
    try:
        await ensure_streams(admin)
        await admin.js.publish(names.task("weather_agent", secret), b"t", timeout=5.0)
        info = f"$JS.API.STREAM.INFO.{names.tasks_stream}"
        for body in (b'{"subjects_filter": ">"}', b'{"subjects_filter": "gym.task.weather_agent.>"}'):
            assert any(secret.encode() in r for r in await _replies(admin, info, body))  # the attack's reach
            for (role, pool), bus in zip(who, attackers, strict=True):
                leaks = [r for r in await _replies(bus, info, body) if secret.encode() in r]
                assert leaks == [], (role, pool)
        for bus in attackers:  # what a pool's worker asks before it starts: the streams are there
            await ensure_streams(bus)
    finally:
        for b in (admin, *attackers):
            await b.close()


async def test_an_agent_pool_counts_failed_attempts_of_its_own_agents_rollouts_only(pooled) -> None:
    """The count that tells a rollout's failed attempts from its lost workers: the weather agent's pool
    writes its own (a redelivery reads it back), another agent pool's credentials cannot change it."""
    srv, auth = pooled
    mine = await connect_as(srv, auth, "agent", "weather_agent")
    thief = await connect_as(srv, auth, "agent", "other_agent")
    try:
        view = ControlView(mine)
        view._kv = await control_kv(mine)
        key = Subjects.failed_key("weather_agent", "b1", 3, 0)
        await view.count_failed(key, 2)
        assert await view.failed_attempts(key) == 2
        with pytest.raises(nats.errors.TimeoutError):  # refused by the server: no ack comes back
            await thief.js.publish(f"$KV.GYM_CONTROL.{key}", b"0", timeout=1.0)
        assert await view.failed_attempts(key) == 2
        await view.count_failed(key, 0)  # the rollout finished: the record goes
        assert await view.failed_attempts(key) == 0
    finally:
        for b in (mine, thief):
            await b.close()


async def test_a_rollouts_checkpoint_is_its_agent_pools_alone_to_write_and_read(pooled) -> None:
    """A forged checkpoint would steer a rollout (issue 69): the weather agent's pool writes and reads back its
    own; another agent pool cannot write it, and no other role (an environment, a model) can read it."""
    srv, auth = pooled
    mine = await connect_as(srv, auth, "agent", "weather_agent")
    thieves = {
        "agent": await connect_as(srv, auth, "agent", "other_agent"),
        "resource": await connect_as(srv, auth, "resource", "other_env"),
        "model": await connect_as(srv, auth, "model", "other_model"),
    }
    key = Subjects.checkpoint_key("weather_agent", "b1", 3, 0)
    bucket = Subjects("gym").checkpoints_bucket
    cp = Checkpoint(turn=7, phase="answered", response=Response(id="r", created_at=0.0, output=[]))
    try:
        await checkpoints_kv(mine, 3600.0)  # provisioned: looked up
        box = Checkpointer(mine, key, "every_turn")
        box.write(cp, [], [])
        assert await box.settled()
        assert await box.read() == cp
        part = Subjects.checkpoint_part(key, 1)  # where its turn is kept
        for thief in thieves.values():
            with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):  # refused: no answer
                await thief.nc.request(f"$JS.API.DIRECT.GET.KV_{bucket}.$KV.{bucket}.{part}", b"", timeout=1.0)
            with pytest.raises(nats.errors.TimeoutError):  # refused by the server: no ack comes back
                await thief.js.publish(f"$KV.{bucket}.{part}", msgspec.msgpack.encode(cp), timeout=1.0)
        assert await box.read() == cp  # unchanged
        await box.remove()  # its row is stored: the checkpoint goes (its delete sent as the task's ack is: unacked)
        with anyio.fail_after(10):
            while await Checkpointer(mine, key, "every_turn").read() is not None:
                await anyio.sleep(0.02)
    finally:
        for b in (mine, *thieves.values()):
            await b.close()


async def test_answers_come_back_in_each_pools_own_lane_and_an_agent_reaches_only_its_environment(pooled) -> None:
    """What ``allow_responses`` carried before (discovery, status and pause answers) comes back with every
    worker on its pool's credential, each answering into its own lane, and an answer claiming another lane's
    worker is not believed; an agent pool's seed request to its own environment is answered, to another
    environment's refused by the server (issue 33, items 1 and 4)."""
    srv, auth = pooled
    cfg = load_config(REPO / "resources/weather/config.yaml")
    pools = {f"{r}.{p}": await connect_as(srv, auth, r, p) for r, p in WEATHER_POOLS}  # the honest nodes
    pub = await connect_as(srv, auth, "publisher", None)
    other_agent = await connect_as(srv, auth, "agent", "other_agent")
    other_env = await connect_as(srv, auth, "resource", "other_env")
    row = read_jsonl(REPO / "resources/weather/data/example.jsonl")[0]
    try:
        async with anyio.create_task_group() as tg:
            weather = make_workers(pools, resolve_config(cfg), selected(cfg, None))
            other_cfg = resolved(resources={"other_env": ResourceConfig(server="resources.weather")})
            other = ResourceWorker(other_env, "other_env", other_cfg)
            await start_workers(tg, [*weather, other])  # type: ignore[list-item]
            forged = {"namespace": "gym", "role": "model", "name": "policy", "worker": "ghost", "uptime_s": 1.0}

            async def pose(msg: Any) -> None:  # another pool passes itself off as a replica a pause would wait for
                for lane in ("agent.other_agent", "model.policy"):  # its own lane, and the model's (refused)
                    await other_agent.nc.publish(f"{msg.reply}.{lane}.0", json.dumps(forged).encode())

            await other_agent.nc.subscribe("gym.status", cb=pose)
            honest = {
                ("agent", "weather_agent"),
                ("model", "policy"),
                ("resource", "weather"),
                ("resource", "other_env"),
            }
            workers = await discover(pub, wait_s=30, until=lambda ws: {(w["role"], w["name"]) for w in ws} >= honest)
            assert {(w["role"], w["name"]) for w in workers} == honest
            assert all("uptime_s" in w for w in workers)  # each with its live counters
            assert "ghost" not in {w["worker"] for w in workers}
            replica = next(str(w["worker"]) for w in workers if w["role"] == "model")
            acks = await send_pause(pub, "policy", {replica}, timeout=10.0)  # every replica acknowledges
            assert [a.worker for a in acks] == [replica]
            await send_resume(pub, "policy")

            seeded = [w for w in weather if isinstance(w, ResourceWorker)][0]
            reply = await other_agent.request(
                other_env.subjects.seed("other_env", other_agent.caller), SeedRequest(row=row), timeout=10.0, op="seed"
            )
            assert isinstance(reply, SeedReply) and other.seeded == 1
            with pytest.raises(Failure, match="no reply"):  # the server drops it: nobody hears it, nothing answers
                await other_agent.request(
                    pub.subjects.seed("weather", other_agent.caller), SeedRequest(row=row), timeout=2.0, op="seed"
                )
            assert seeded.seeded == 0
            tg.cancel_scope.cancel()
    finally:
        for b in (*pools.values(), pub, other_agent, other_env):
            await b.close()


# ------------------------------------------------------------------------------- nothing hangs


async def test_collector_outlives_a_deleted_reader(buses: dict[str, Bus], tmp_path: Path) -> None:
    """Another publisher deletes a running collector's reader: the collector recreates it and finishes."""
    agent, thief = buses["agent"], buses["publisher"]
    results = Subjects("gym").shared_results_stream

    def result(i: int) -> RolloutResult:
        return RolloutResult(batch="b1", task_index=i, rollout_index=0, agent="a", row={"reward": 1.0})

    await agent.js_publish("gym.result.a.b1", result(0), msg_id="b1:0:0")
    batch = await put_batch(buses["publisher"], "b1", 3, published=False)  # no slot settles as lost meanwhile
    collector = Collector(buses["publisher"], batch, tmp_path / "out.jsonl")
    async with anyio.create_task_group() as tg:
        tg.start_soon(collector.run)
        with anyio.fail_after(60):  # a generous deadline: only a broken run reaches it
            while collector.stats.rows < 1:
                await anyio.sleep(0.05)
        listed = await thief.nc.request(f"$JS.API.CONSUMER.LIST.{results}", b"{}", timeout=5.0)
        names = [c["name"] for c in json.loads(listed.data)["consumers"]]
        assert names
        for name in names:
            await thief.js.delete_consumer(results, name)
        await agent.js_publish("gym.result.a.b1", result(1), msg_id="b1:1:0")
        await agent.js_publish("gym.result.a.b1", result(2), msg_id="b1:2:0")
        with anyio.fail_after(60):  # before: it waited forever on a consumer that no longer exists
            while collector.stats.rows < 3:
                await anyio.sleep(0.05)
    assert collector.stats.rows == 3 and collector.stats.duplicates == 0


async def _terminate(bus: Bus, stream: str, durable: str, n: int) -> int:
    """Pull ``n`` tasks from a durable as a (buggy or hostile) worker would, and +TERM each without a result."""
    got: list[str] = []
    inbox = bus.nc.new_inbox()

    async def take(msg: Any) -> None:
        if msg.reply:
            got.append(msg.reply)

    sub = await bus.nc.subscribe(inbox, cb=take)
    await bus.nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}", b'{"batch": %d}' % n, reply=inbox)
    with anyio.fail_after(30):  # a generous deadline: only a broken run reaches it
        while len(got) < n:
            await anyio.sleep(0.02)
    for ack in got:
        await bus.nc.publish(ack, b"+TERM")
    await bus.nc.flush()
    await sub.unsubscribe()
    return len(got)


async def _terminated_batch(buses: dict[str, Bus], tmp_path: Path, max_republish: int) -> tuple[Manifest, Any]:
    """A worker with the agent role's credentials pulls two tasks of a batch and +TERMs them (no result); then
    the honest pools run the batch and ``collect`` reads it: the manifest and the collect's stats."""
    cfg = load_config(REPO / "resources/weather/config.yaml")
    cfg.jetstream.max_republish = max_republish
    publisher, thief = buses["publisher"], buses["agent"]
    data = tmp_path / "in.jsonl"
    write_jsonl(data, read_jsonl(REPO / "resources/weather/data/example.jsonl") * 2)
    stream = Subjects("gym").tasks_stream
    await ensure_streams(publisher)
    await ensure_consumer(
        thief, stream, "agent_weather_agent", Subjects("gym").agent_tasks("weather_agent"), ack_wait=30.0
    )
    manifest = await publish_batch(publisher, resolve_config(cfg), data, batch="t1")
    assert await _terminate(thief, stream, "agent_weather_agent", 2) == 2
    pools = {"agent.weather_agent": thief, "model.policy": buses["model"], "resource.weather": buses["resource"]}
    async with anyio.create_task_group() as tg:
        await start_workers(tg, make_workers(pools, resolve_config(cfg), selected(cfg, None)))
        with anyio.fail_after(30):
            stats = await Collector(publisher, manifest, tmp_path / "out.jsonl").run()
        tg.cancel_scope.cancel()
    return manifest, stats


async def test_tasks_terminated_without_a_result_are_run_again(buses: dict[str, Bus], tmp_path: Path) -> None:
    """The collector hears of the terminations (JetStream's advisory), publishes the two tasks again from the
    bodies the batch keeps (the publisher role's only new rights: store and read ``{ns}.kept``) and writes every
    row. Before: two ``lost`` rows, those rollouts never ran."""
    manifest, stats = await _terminated_batch(buses, tmp_path, max_republish=2)
    assert (stats.rows, stats.failures, stats.duplicates) == (manifest.expected, 0, 0)
    rows = read_jsonl(tmp_path / "out.jsonl")
    assert [r["_ng_task_index"] for r in rows] == list(range(manifest.expected))


async def test_tasks_terminated_without_a_result_become_failure_rows(buses: dict[str, Bus], tmp_path: Path) -> None:
    """With ``jetstream.max_republish: 0``: the collector writes one failure row for each terminated task, and
    finishes. Before: those rollouts never ran and ``collect`` waited for them forever."""
    manifest, stats = await _terminated_batch(buses, tmp_path, max_republish=0)
    publisher, thief = buses["publisher"], buses["agent"]
    assert stats.rows == manifest.expected - 2 and stats.failures == 2 and stats.duplicates == 0
    failures = read_jsonl(tmp_path / "out_failures.jsonl")
    assert [f["error_class"] for f in failures] == ["lost", "lost"]
    everything = read_jsonl(tmp_path / "out.jsonl") + failures
    assert sorted(r["_ng_task_index"] for r in everything) == list(range(manifest.expected))

    # one row a slot, by the rule for attempts: a real result that comes after the lost row (a worker still
    # running a terminated task) is stored (the lost row's record has an id of its own), and every later
    # collection takes it in place of the lost row; the other slot is lost again
    late = RolloutResult(batch="t1", task_index=failures[0]["_ng_task_index"], rollout_index=0, agent="weather_agent")
    late = msgspec.structs.replace(late, row={"reward": 1.0, "_ng_task_index": late.task_index})
    await thief.js_publish("gym.result.weather_agent.t1", late, msg_id=result_msg_id("t1", late.task_index, 0, 1))
    with anyio.fail_after(30):
        again = await Collector(publisher, manifest, tmp_path / "again.jsonl").run()
    assert (again.rows, again.failures, again.duplicates) == (stats.rows + 1, 1, 0)
    assert read_jsonl(tmp_path / "again_failures.jsonl") == failures[1:]


async def test_a_row_on_the_lost_subject_is_never_a_reward(buses: dict[str, Bus], tmp_path: Path) -> None:
    """The publisher role may store records of lost slots; no reader takes one as a row (a reward stored there,
    or a failure that would end the batch early): a slot is lost only when the server says so."""
    publisher = buses["publisher"]
    forged = RolloutResult(batch="f1", task_index=0, rollout_index=0, agent="a", row={"reward": 1.0})
    await publisher.js_publish(Subjects("gym").lost("f1"), forged, msg_id="f1:0:0")
    with anyio.fail_after(30):
        stats = await Collector(publisher, await put_batch(publisher, "f1", 1), tmp_path / "out.jsonl").run()
    assert (stats.rows, stats.failures, stats.refused) == (0, 1, 0)
    assert read_jsonl(tmp_path / "out_failures.jsonl")[0]["error_class"] == "lost"


async def test_a_task_whose_body_was_swapped_is_a_failure_row(nats_server, tmp_path: Path) -> None:
    """Before: the agent +TERMed an unreadable task and ``collect`` waited for it forever."""

    cfg = load_config(REPO / "resources/weather/config.yaml")
    bus = await Bus.connect(nats_server.url, namespace="gym", telemetry=Telemetry(), name="t")
    try:
        await ensure_streams(bus)
        row = {**read_jsonl(REPO / "resources/weather/data/example.jsonl")[0], "pad": "x" * (bus.blob_threshold + 10)}
        task = RolloutTask(batch="b9", task_index=0, rollout_index=0, agent="weather_agent", row=row)
        await bus.js_publish(Subjects("gym").task("weather_agent", "b9"), task, msg_id="b9:0:0")
        stored = await bus.js.get_last_msg(Subjects("gym").tasks_stream, Subjects("gym").task("weather_agent", "b9"))
        role, pool, key, n, _ = stored.headers[BLOB_HEADER].split(".")
        forged = bus.codec.encode(msgspec.structs.replace(task, row={**row, "pad": "y" * 10}))
        for i in range(int(n)):  # an attacker with the admin's powers swaps the body
            chunk = f"gym.blob.{role}.{pool}.{key}.{i}"
            await bus.js.purge_stream(bus.subjects.blob_stream(role), subject=chunk)
            await bus.js.publish(chunk, forged if i == 0 else b"", timeout=5.0)
        async with anyio.create_task_group() as tg:
            await start_workers(tg, make_workers(bus, resolve_config(cfg), [("agents", "weather_agent")]))
            with anyio.fail_after(20):
                manifest = await put_batch(bus, "b9", 1, agent="weather_agent")
                stats = await Collector(bus, manifest, tmp_path / "out.jsonl").run()
            tg.cancel_scope.cancel()
        assert stats.rows == 0 and stats.failures == 1
        (failure,) = read_jsonl(tmp_path / "out_failures.jsonl")
        assert failure["error_class"] == "integrity" and "digest" in failure["error"]
    finally:
        await bus.close()


# ----------------------------------------------------------------------------- bounded cost per message


FLOODER = """
import asyncio, sys
import msgspec, nats

async def main():
    nc = await nats.connect(sys.argv[1])
    junk = [b"\\xff\\x00junk", b'{"not": "a seed"}', msgspec.msgpack.encode({"session": 1}), b""]
    inbox, sent, count = nc.new_inbox(), 0, int(sys.argv[2])
    while sent < count:
        for _ in range(500):
            await nc.publish("gym.res.weather.seed._._", junk[sent % 4], reply=inbox)
            sent += 1
        await nc.flush()
    print(sent)
    await nc.close()

asyncio.run(main())
"""


async def test_a_junk_flood_costs_a_few_log_lines_and_no_rollout(nats_server, tmp_path: Path, capfd) -> None:  # type: ignore[no-untyped-def]
    """200,000 junk seed requests (another process) against a resource pool, then a batch: every rollout succeeds.
    A count, not a span of time: how much junk a span holds, and how long the pool takes to read it, both move
    with the machine's load; the deadline only guards against a hang."""

    cfg = load_config(REPO / "resources/weather/config.yaml")
    data = REPO / "resources/weather/data/example.jsonl"
    bus = await Bus.connect(nats_server.url, namespace="gym", telemetry=Telemetry(), name="pool")
    try:
        async with anyio.create_task_group() as tg:
            await start_workers(tg, make_workers(bus, resolve_config(cfg), selected(cfg, None)))
            flood = await anyio.run_process([sys.executable, "-c", FLOODER, nats_server.url, "200000"], check=True)
            sent = int(flood.stdout)
            with anyio.fail_after(300):
                result = await run_batch(
                    resolve_config(cfg),
                    nats_server.url,
                    input_path=data,
                    out=tmp_path / "out.jsonl",
                    telemetry=Telemetry(),
                    repeats=4,
                    start_local_workers=False,
                )
            tg.cancel_scope.cancel()
    finally:
        await bus.close()
    out = capfd.readouterr()
    lines = (out.out + out.err).count("\n")
    assert sent >= 200_000
    assert result.stats.failures == 0 and result.stats.rows == 4 * len(read_jsonl(data))
    assert lines < 200, f"{lines} log lines for {sent} junk requests"


async def test_replayed_seed_requests_cannot_pile_up_sessions(nats_server) -> None:
    """One genuine seed request replayed 60 times: the worker keeps at most max_sessions open (the least
    recently used closed first); before, every replay kept a session for session_ttl_s (an hour)."""

    bus = await Bus.connect(nats_server.url, namespace="gym", telemetry=Telemetry(), name="t")
    try:
        entry = ResourceConfig(server="resources.weather", max_sessions=8)
        worker = ResourceWorker(bus, "weather", resolved(resources={"weather": entry}))
        row = read_jsonl(REPO / "resources/weather/data/example.jsonl")[0]
        async with anyio.create_task_group() as tg:
            await start_workers(tg, [worker])  # type: ignore[list-item]
            honest = await bus.request(
                bus.subjects.seed("weather", bus.caller), SeedRequest(row=row), timeout=10.0, op="seed"
            )
            assert isinstance(honest, SeedReply)
            for i in range(60):
                await bus.request(
                    bus.subjects.seed("weather", bus.caller), SeedRequest(row=row), timeout=10.0, op="seed"
                )
                if i % 4 == 0:  # the honest rollout keeps using its session meanwhile
                    call = ToolCall(session=honest.session, name="get_weather", arguments='{"city": "Paris"}')
                    reply = await bus.request(
                        Subjects.session_call(honest.address, "tool", bus.caller), call, timeout=10.0, op="tool"
                    )
                    assert isinstance(reply, ToolReply)
            assert len(worker.sessions) <= 8 and worker.evicted >= 53
            assert honest.session in worker.sessions  # in use, so never the least recently used
            assert bus.junk  # counted (and logged once per interval), not a line per replay
            tg.cancel_scope.cancel()
    finally:
        await bus.close()
