"""A rollout's checkpoint and its environment session are its own agent pool's (issue 73, items 1 and 2).

The red team's round 6, replayed: a second agent pool, with its own valid credential on a ``server --secure``
bus and an environment it shares with the first pool, read the first pool's checkpoint (the bucket's stream
info lists every key; a message get by sequence or by subject reads any), took the session id and address out
of it, called a tool in that session and closed it. What must hold: the second pool can neither list nor read
another pool's checkpoint keys, and the resource worker answers a session's operations only from the caller
that seeded it (on a secured bus the server itself refuses the others, as it refuses their seeds).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from gym_runtime.agent import Session
from gym_runtime.config import AgentConfig, ResourceConfig
from gym_runtime.messages import (
    Checkpoint,
    CloseSession,
    Response,
    SessionHandle,
    ToolCall,
    ToolReply,
    VerifyReply,
    VerifyRequest,
)
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.ops.permissions import Reach
from gym_runtime.rollout.checkpoint import Checkpointer, checkpoints_kv
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.subjects import Subjects
from gym_runtime.workers.resource_worker import ResourceWorker
from tests.helpers import ROWS, pool_bus, resolved, secured_server

POOLS = [("resource", "weather"), ("agent", "weather_agent"), ("agent", "other_agent")]
PARIS = json.dumps({"city": "Paris"})


@pytest.fixture
def pooled(tmp_path: Path) -> Iterator[tuple[EmbeddedServer, Path]]:
    """A secured server whose two agent pools both run rollouts on one environment (the attack's best case)."""
    reach = Reach(agents={"weather_agent": ("weather",), "other_agent": ("weather",)})
    with secured_server(tmp_path, POOLS, reach) as server:
        yield server


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


async def test_another_agent_pool_can_neither_list_nor_read_a_rollouts_checkpoint(pooled) -> None:
    """Every way JetStream offers to list or read a KV bucket's keys, tried with the other pool's credential on
    the weather agent's checkpoint: none answers its key or its content; the owner still reads it back (a
    last-by-subject direct get on its own keys)."""
    srv, auth = pooled
    mine = await pool_bus(srv.url, auth, "agent", "weather_agent")
    thief = await pool_bus(srv.url, auth, "agent", "other_agent")
    secret = "5e55a1d0f0ca1c0ffee0000000000042"  # the session id a reader of the checkpoint would take
    key = Subjects.checkpoint_key("weather_agent", "b1", 3, 0)
    bucket = Subjects("gym").checkpoints_bucket
    stream, subject = f"KV_{bucket}", f"$KV.{bucket}.{Subjects.checkpoint_part(key, 1)}"  # where its turn is kept
    handle = SessionHandle(resource="weather", session=secret, address="gym.res.weather.w1")
    cp = Checkpoint(turn=7, phase="answered", response=Response(id="r", created_at=0.0, output=[]), sessions=[handle])
    try:
        await checkpoints_kv(mine, 3600.0)
        box = Checkpointer(mine, key, "every_turn")
        box.write(cp, [], [])
        assert await box.settled()
        assert await box.read() == cp  # the owner's read
        api = "$JS.API"
        own = f"$KV.{bucket}.other_agent.b1.3.0"  # a key the thief may write: a direct get there is its own
        attacks = [
            (f"{api}.STREAM.INFO.{stream}", b'{"subjects_filter": ">"}'),  # lists every key
            (f"{api}.STREAM.INFO.{stream}", b'{"subjects_filter": "$KV.%s.weather_agent.>"}' % bucket.encode()),
            (f"{api}.STREAM.MSG.GET.{stream}", b'{"seq": 1}'),
            (f"{api}.STREAM.MSG.GET.{stream}", b'{"last_by_subj": "%s"}' % subject.encode()),
            (f"{api}.DIRECT.GET.{stream}", b'{"seq": 1}'),
            (f"{api}.DIRECT.GET.{stream}", b'{"last_by_subj": "%s"}' % subject.encode()),
            (f"{api}.DIRECT.GET.{stream}", b'{"multi_last": [">"], "batch": 100}'),
            (f"{api}.DIRECT.GET.{stream}.{subject}", b""),  # the owner's own read, asked by another pool
            (f"{api}.DIRECT.GET.{stream}.{own}", b'{"seq": 1}'),  # its own key's get, with a body that names more
            (f"{api}.DIRECT.GET.{stream}.{own}", b'{"next_by_subj": ">", "seq": 1}'),
            (f"{api}.CONSUMER.CREATE.{stream}", b'{"stream_name": "%s", "config": {}}' % stream.encode()),
            (f"{api}.CONSUMER.CREATE.{stream}.x.{subject}", b'{"stream_name": "%s", "config": {}}' % stream.encode()),
        ]
        leaks = []
        for api_subject, body in attacks:
            for r in await _replies(thief, api_subject, body):
                if secret.encode() in r or key.encode() in r:
                    leaks.append(api_subject)
        assert leaks == []
        assert await box.read() == cp  # still the owner's to read
    finally:
        for b in (mine, thief):
            await b.close()


@asynccontextmanager
async def weather_pool(server: tuple[EmbeddedServer, Path]) -> AsyncIterator[tuple[ResourceWorker, Bus, Bus]]:
    """A weather worker on the weather pool's credential; buses of the weather_agent pool (the honest one) and
    of the other_agent pool (the thief), whose agents both run on weather."""
    srv, auth = server
    buses = [await pool_bus(srv.url, auth, role, pool) for role, pool in POOLS]
    agents = {a: AgentConfig(agent="agents.simple", model="policy") for a in ("weather_agent", "other_agent")}
    config = resolved(resources={"weather": ResourceConfig(server="resources.weather")}, agents=agents)
    worker = ResourceWorker(buses[0], "weather", config)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(worker.run)
            yield worker, buses[1], buses[2]
            tg.cancel_scope.cancel()
    finally:
        for b in buses:
            await b.close()


async def _drive(thief: Bus, handle: SessionHandle) -> list[str]:
    """Every operation on the session ``handle`` names, sent by ``thief`` on every subject a caller could name
    (the bare operation, as the callee's own subject once was; as the thief; as the session's owner): what was
    answered as if the session were the thief's."""
    row = ROWS[0]
    ops: list[tuple[str, Any]] = [
        ("tool", ToolCall(session=handle.session, name="get_weather", arguments=PARIS)),
        (
            "verify",
            VerifyRequest(session=handle.session, row=row, response=Response(id="r", created_at=0.0, output=[])),
        ),
        ("close", CloseSession(session=handle.session)),
    ]
    answered = []
    for op, msg in ops:
        for caller in ("", f".{thief.caller}", ".agent.weather_agent"):
            subject = f"{handle.address}.{op}{caller}"
            try:
                reply = await thief.request(subject, msg, timeout=2.0, op=op)
            except Exception:  # noqa: BLE001 - refused: by the server (no answer), or by the worker (a failure)
                continue
            if op == "close" or isinstance(reply, (ToolReply, VerifyReply)):
                answered.append(subject)
    return answered


async def test_another_agent_pool_cannot_drive_verify_or_close_a_session_it_did_not_seed(pooled) -> None:
    """The thief knows the session's id and address (what a checkpoint carries): resuming it as a redelivered
    attempt would is not a reattach, and no tool call, verify or close it sends is answered. The owner's session
    is untouched: it still answers its tool calls, and its verify."""
    async with weather_pool(pooled) as (worker, honest, thief):
        mine = Session(honest, "weather", ROWS[0])
        assert "Paris" in (await mine.call("get_weather", PARIS)).output
        handle = mine.handle()
        assert handle is not None and handle.session in worker.sessions

        theirs = Session(thief, "weather", ROWS[0])
        assert await theirs.resume(handle) == "restarted"  # before: "reattached", and its calls ran in it
        assert theirs.id != handle.session
        await theirs.close()
        assert await _drive(thief, handle) == []  # before: every bare operation answered

        assert handle.session in worker.sessions
        assert "Paris" in (await mine.call("get_weather", PARIS)).output
        assert isinstance(await mine.verify(ROWS[0], Response(id="r", created_at=0.0, output=[])), VerifyReply)
        assert handle.session not in worker.sessions  # closed by its own verify


async def test_on_an_unsecured_bus_the_worker_still_refuses_a_caller_that_did_not_seed(nats_server) -> None:
    """Defence in depth: on a bus with no credentials the caller a session operation names is not proven (any
    client may name any), but the worker still records who seeded each session and refuses an operation naming
    another caller."""
    buses = [
        await Bus.connect(nats_server.url, namespace="gym", telemetry=Telemetry(), name=n, role=r, pool=p)
        for n, (r, p) in zip(("w", "honest", "thief"), POOLS, strict=True)
    ]
    config = resolved(
        resources={"weather": ResourceConfig(server="resources.weather")},
        agents={a: AgentConfig(agent="agents.simple", model="policy") for a in ("weather_agent", "other_agent")},
    )
    worker = ResourceWorker(buses[0], "weather", config)
    honest, thief = buses[1], buses[2]
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(worker.run)
            mine = Session(honest, "weather", ROWS[0])
            assert "Paris" in (await mine.call("get_weather", PARIS)).output
            handle = mine.handle()
            assert handle is not None
            theirs = Session(thief, "weather", ROWS[0])
            assert await theirs.resume(handle) == "restarted"
            await theirs.close()
            own = f".{thief.caller}"
            for op, msg in [
                ("tool", ToolCall(session=handle.session, name="get_weather", arguments=PARIS)),
                ("close", CloseSession(session=handle.session)),
            ]:
                with pytest.raises(Exception):  # noqa: B017 - a failure from the worker, or nobody serves it
                    await thief.request(f"{handle.address}.{op}{own}", msg, timeout=5.0, op=op)
            assert handle.session in worker.sessions
            assert "Paris" in (await mine.call("get_weather", PARIS)).output
            tg.cancel_scope.cancel()
    finally:
        for b in buses:
            await b.close()


async def test_a_checkpoints_bucket_made_by_an_earlier_version_is_given_direct_gets(nats_server) -> None:
    """A bucket an earlier version made (no direct gets: every read went to its leader by a message get) is
    given them by the first agent worker that makes sure of it, and a checkpoint stored before is read back."""
    bus = await Bus.connect(nats_server.url, namespace="gym", telemetry=Telemetry(), name="t")
    bucket = bus.subjects.checkpoints_bucket
    key = Subjects.checkpoint_key("weather_agent", "b1", 0, 0)
    cp = Checkpoint(turn=4, phase="answered", response=Response(id="r", created_at=0.0, output=[]))
    try:
        old = await bus.js.create_key_value(bucket=bucket, history=1)  # as an earlier version made it
        await old.put(key, msgspec.msgpack.encode(cp))
        assert not (await bus.js.stream_info(f"KV_{bucket}")).config.allow_direct
        await checkpoints_kv(bus, 3600.0)
        assert (await bus.js.stream_info(f"KV_{bucket}")).config.allow_direct
        assert await Checkpointer(bus, key, "every_turn").read() == cp
    finally:
        await bus.close()
