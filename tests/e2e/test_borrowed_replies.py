"""The borrowed reply (issue 33, item 1): a credential that may both publish and subscribe one subject sends
itself a message there whose reply names another subject, receives it, and answers. With the server's
``allow_responses``, that answer is one publish to any subject at all.

Every role and a pool of each tries it, for real, on a ``server --secure`` bus: through each subject it may
both publish and subscribe (its pool's liveness lane, its own reply lane), with a reply naming another
agent's result subject, the tasks stream's purge, another environment's seed subject and a batch's cancel.
What must hold: the loop itself works (the message comes back), and the answer never arrives anywhere.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from gym_runtime.messages import CancelBatch, PolicyVersion, RolloutResult
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.ops.permissions import Reach
from gym_runtime.transport.jetstream import stream_config
from gym_runtime.workers.control import ControlView, cancel_batch, publish_version
from tests.helpers import cli, connect_as, secured_server

POOLS = [("agent", "a"), ("agent", "b"), ("resource", "env_a"), ("resource", "env_b"), ("model", "m")]
REACH = Reach(agents={"a": ("env_a",), "b": ("env_b",)}, resources={})

# where a borrowed answer would go: another agent's results, the tasks stream's purge, another environment's
# sessions, a batch's cancel
TARGETS = [
    "gym.result.b.victim",
    "$JS.API.STREAM.PURGE.GYM_TASKS",
    "gym.res.env_b.seed.agent.b",
    "gym.ctl.batch.victim.cancel",
]

# the subjects each credential may both publish and subscribe (or that it would try): its pool's liveness
# lane (as spelled now, and before this round) and its own reply lane, as a pool and as the role-wide credential
LOOPS = {
    ("agent", "a"): ["gym.live.agent.a", "gym.live.agent_a", "_INBOX.agent.a.x.agent.a.0"],
    ("agent", None): ["gym.live.agent.a", "gym.live.agent_a", "_INBOX.agent._.x.agent.a.0"],
    ("resource", "env_a"): ["_INBOX.resource.env_a.x.res.env_a.0"],
    ("resource", None): ["_INBOX.resource._.x.res.env_a.0"],
    ("model", "m"): ["gym.live.model.m", "gym.live.model_m", "_INBOX.model.m.x.model.m.0"],
    ("model", None): ["gym.live.model.m", "gym.live.model_m", "_INBOX.model._.x.model.m.0"],
    ("publisher", None): ["_INBOX.publisher._.x.res.env_a.0", "gym.status"],
}


# what a credential may publish to itself, so nothing to borrow: the role-wide agent credential stores any
# agent's results and calls every agent's environment
# where a credential may both publish and subscribe on the loop subject: the loop itself works (only the
# borrowed answer must fail)
LOOPS_THAT_WORK = {
    ("agent", "a", "gym.live.agent.a"),
    ("agent", None, "gym.live.agent.a"),
    ("model", "m", "gym.live.model.m"),
    ("model", None, "gym.live.model.m"),
    ("agent", "a", "_INBOX.agent.a.x.agent.a.0"),
    ("resource", "env_a", "_INBOX.resource.env_a.x.res.env_a.0"),
    ("model", "m", "_INBOX.model.m.x.model.m.0"),
}
OWN = {"agent.None": {"gym.result.b.victim", "gym.res.env_b.seed.agent.b"}}


@pytest.fixture
def pooled(tmp_path: Path) -> Iterator[tuple[EmbeddedServer, Path]]:
    with secured_server(tmp_path, POOLS, REACH) as (srv, auth):
        yield srv, auth


async def test_no_credential_can_borrow_a_reply_to_publish_elsewhere(pooled) -> None:
    srv, auth = pooled
    admin = await connect_as(srv, auth, "admin", None)
    arrived: list[tuple[str, str]] = []  # (target, which credential's answer)

    async def spy(msg) -> None:  # type: ignore[no-untyped-def]
        arrived.append((msg.subject, msg.data.decode()))

    for target in TARGETS:
        if not target.startswith("$JS"):
            await admin.nc.subscribe(target, cb=spy)
    await admin.flush()
    for i in range(3):  # queued tasks a borrowed purge would remove
        await admin.js.publish("gym.task.a.victim", b"%d" % i, timeout=5.0)
    looped: dict[tuple[str, str | None, str], int] = {}
    try:
        for (role, pool), loops in LOOPS.items():
            attacker = await connect_as(srv, auth, role, pool)
            who = f"{role}.{pool}".encode()  # what its borrowed answer says
            try:
                for loop in loops:
                    got = 0

                    async def answer(msg, attacker=attacker, who=who) -> None:  # type: ignore[no-untyped-def]
                        nonlocal got
                        got += 1
                        if msg.reply:  # the borrowed publish
                            await attacker.nc.publish(msg.reply, who)

                    sub = await attacker.nc.subscribe(loop, cb=answer)
                    await attacker.flush()
                    for target in TARGETS:
                        await attacker.nc.publish(loop, b"loop", reply=target)
                    if (role, pool, loop) in LOOPS_THAT_WORK:
                        with anyio.fail_after(30):  # every loop message comes round: an event, not a span
                            while got < len(TARGETS):
                                await anyio.sleep(0.02)
                    else:  # a span with nothing in it: load only stretches it, so it can't fail falsely
                        with anyio.move_on_after(2.0):
                            while got < len(TARGETS):
                                await anyio.sleep(0.02)
                    await attacker.flush()
                    looped[(role, pool, loop)] = got
                    await sub.unsubscribe()
            finally:
                await attacker.close()
        await admin.flush()
        # a span with nothing in it (a borrowed publish that got through would reach the spy): load only stretches
        # it, which can hide a leak on a loaded run but never fails a sound one
        await anyio.sleep(0.3)
        borrowed = [(t, who) for t, who in arrived if t not in OWN.get(who, set())]
        assert borrowed == []
        assert (await admin.js.stream_info("GYM_TASKS")).state.messages == 3
        # the loops themselves worked where a credential may both publish and subscribe: only the answer failed
        for key in LOOPS_THAT_WORK:
            assert looped[key] == len(TARGETS), key
    finally:
        await admin.close()


# ----------------------------------------------------------------------- the server's own answers, borrowed
#
# JetStream answers a request (a stored message's ack, a direct get, a pull's status) by publishing to the
# reply subject the requester named, as the server itself, past every permission (NATS permissions never
# look at a reply subject). A direct get's answer carries headers, so the JetStream API would take it as a
# request of its own; with ``no_hdr`` it carries the stored body alone, which a stream would store as it is.
# On one account both worked (a stream deleted; a result stored as another agent). The secured server keeps
# JetStream in an account of its own (``ops.permissions.accounts``): its answers come back to the users'
# account as service responses, delivered to subscribers only, never through an import into JetStream.


async def _answered(bus, subject: str, body: bytes = b"") -> None:  # type: ignore[no-untyped-def]
    """A direct get answered into ``bus``'s own inbox: the server has handled what this connection sent before
    (it handles one connection's messages in order), and the attack path itself works."""
    msg = await bus.nc.request(subject, body, timeout=10)
    assert msg.headers or msg.data  # a direct get's answer (found, 404 or no_hdr): what the attack borrows


async def test_a_direct_get_answer_cannot_delete_a_stream(pooled) -> None:
    srv, auth = pooled
    admin, model = await connect_as(srv, auth, "admin", None), await connect_as(srv, auth, "model", "m")
    try:
        # a blob that does not exist: the answer is a header-only 404, which the API reads as an empty request
        for victim in ("GYM_RESULTS_b", "GYM_TASKS"):
            await model.nc.publish(
                "$JS.API.DIRECT.GET.GYM_BLOBS_MODEL.gym.blob.model.m.nokey.0",
                b"",
                reply=f"$JS.API.STREAM.DELETE.{victim}",
            )
        await _answered(model, "$JS.API.DIRECT.GET.GYM_BLOBS_MODEL.gym.blob.model.m.nokey.0")
        for victim in ("GYM_RESULTS_b", "GYM_TASKS"):
            assert await stream_config(admin, victim) is not None  # before: None, deleted
    finally:
        await model.close()
        await admin.close()


async def test_a_pull_status_answer_cannot_delete_a_stream(pooled) -> None:
    """A pull with ``no_wait`` on an empty queue is answered with a 404 status: the same borrowed request."""
    srv, auth = pooled
    admin, agent = await connect_as(srv, auth, "admin", None), await connect_as(srv, auth, "agent", "a")
    try:
        await agent.js.pull_subscribe("gym.task.a.>", durable="agent_a", stream="GYM_TASKS")  # its own durable
        pull = "$JS.API.CONSUMER.MSG.NEXT.GYM_TASKS.agent_a"
        await agent.nc.publish(pull, b'{"batch":1,"no_wait":true}', reply="$JS.API.STREAM.DELETE.GYM_RESULTS_b")
        status = await agent.nc.request(pull, b'{"batch":1,"no_wait":true}', timeout=10)  # the same, answered here
        assert status.headers is not None and status.headers.get("Status") == "404"
        await _answered(agent, "$JS.API.DIRECT.GET.GYM_BLOBS_AGENT.gym.blob.agent.a.nokey.0")
        assert await stream_config(admin, "GYM_RESULTS_b") is not None
    finally:
        await agent.close()
        await admin.close()


async def test_a_direct_get_answer_cannot_store_a_result_as_another_agent(pooled) -> None:
    srv, auth = pooled
    admin, thief = await connect_as(srv, auth, "admin", None), await connect_as(srv, auth, "agent", "a")
    try:
        forged = RolloutResult(batch="victim", task_index=0, rollout_index=0, agent="b", row={"reward": 1337.0})
        await thief.js.publish("gym.blob.agent.a.forged.0", thief.codec.encode(forged), timeout=5.0)  # its own chunk
        # read back headerless (no_hdr) into agent b's result subject, which only b's pool may publish to; and
        # with its headers into the control bucket and a batch manifest
        get = "$JS.API.DIRECT.GET.GYM_BLOBS_AGENT.gym.blob.agent.a.forged.0"
        for reply in ("gym.result.b.victim", "$KV.GYM_BATCHES.victim", "$KV.GYM_CONTROL.batch.victim.cancelled"):
            await thief.nc.publish(get, b'{"no_hdr": true}', reply=reply)
            await thief.nc.publish(get, b"", reply=reply)
        await _answered(thief, get, b'{"no_hdr": true}')
        for stream in ("GYM_RESULTS_b", "KV_GYM_BATCHES", "KV_GYM_CONTROL"):
            assert (await admin.js.stream_info(stream)).state.messages == 0, stream  # before: the forged row
    finally:
        await thief.close()
        await admin.close()


async def test_a_borrowed_answer_cannot_ack_another_pools_task(pooled) -> None:
    """A delivered task's ack subject as the reply of a direct get: the server refuses a client's publish whose
    reply is an ack subject, and an answer could not reach the JS account's ack handling anyway."""
    srv, auth = pooled
    admin = await connect_as(srv, auth, "admin", None)
    owner, thief = await connect_as(srv, auth, "agent", "b"), await connect_as(srv, auth, "agent", "a")
    try:
        await admin.js.publish("gym.task.b.victim", b"t", timeout=5.0)
        sub = await owner.js.pull_subscribe("gym.task.b.>", durable="agent_b", stream="GYM_TASKS")
        (task,) = await sub.fetch(1, timeout=10)
        await thief.nc.publish("$JS.API.DIRECT.GET.GYM_BLOBS_AGENT.gym.blob.agent.a.nokey.0", b"", reply=task.reply)
        with pytest.raises(Exception):  # noqa: B017 - the server closes nothing: it says "permissions violation"
            await _answered(thief, "$JS.API.DIRECT.GET.GYM_BLOBS_AGENT.gym.blob.agent.a.nokey.0")
            await thief.nc.flush()
            raise AssertionError("no violation")
        info = await admin.js.consumer_info("GYM_TASKS", "agent_b")
        assert info.num_ack_pending == 1  # still the owner's, unacked
    finally:
        for b in (thief, owner, admin):
            await b.close()


async def test_a_direct_get_answer_cannot_cancel_a_batch_or_set_a_policy_version(pooled) -> None:
    """Inside the users' account a server's answer still reaches the subscribers of the subject it is sent to: a
    cancel or a version announcement with the requester's own body. Workers take an announcement as a hint and
    read what it says from the control bucket, which no answer can write."""
    srv, auth = pooled
    admin, thief = await connect_as(srv, auth, "admin", None), await connect_as(srv, auth, "agent", "a")
    worker = await connect_as(srv, auth, "agent", "b")
    try:
        async with anyio.create_task_group() as tg:
            view = ControlView(worker)
            await view.start(tg)
            heard: list[str] = []

            async def spy(msg) -> None:  # type: ignore[no-untyped-def]
                heard.append(msg.subject)

            await admin.nc.subscribe(admin.subjects.cancel("*"), cb=spy)
            await admin.nc.subscribe(admin.subjects.policy_version("*"), cb=spy)
            await admin.flush()
            for i, (subject, body) in enumerate(
                [
                    (thief.subjects.cancel("victim"), CancelBatch(batch="victim")),
                    (thief.subjects.policy_version("m"), PolicyVersion(model="m", version=99)),
                ]
            ):
                await thief.js.publish(f"gym.blob.agent.a.forged{i}.0", thief.codec.encode(body), timeout=5.0)
                await thief.nc.publish(
                    f"$JS.API.DIRECT.GET.GYM_BLOBS_AGENT.gym.blob.agent.a.forged{i}.0",
                    b'{"no_hdr": true}',
                    reply=subject,
                )
            with anyio.fail_after(10):  # both delivered: the attack reaches the workers' subjects
                while len(heard) < 2:
                    await anyio.sleep(0.01)
            # and genuine ones after them: once their handlers have run (seen in the view's own state, which only
            # the handlers set for names never asked about), the forged ones' have too
            await cancel_batch(admin, "genuine")
            await publish_version(admin, "n", 3)
            with anyio.fail_after(10):
                while "genuine" not in view._cancelled or view._versions.get("n") != 3:
                    await anyio.sleep(0.01)
            assert not await view.is_cancelled("victim")  # before: cancelled on every worker
            assert await view.version("m") is None  # before: 99
            tg.cancel_scope.cancel()
    finally:
        for b in (worker, thief, admin):
            await b.close()


def test_an_agent_pool_without_the_config_is_one_line_exit_2(tmp_path: Path) -> None:
    """An agent pool may call only its own environment, which only the run's config names."""
    auth = str(tmp_path / "auth")
    for extra, said in [
        ([], "give the server the config (--config CONFIG)"),
        (["--config", "resources/counter/config.yaml"], "the config has no agents.weather_agent"),
    ]:
        r = cli("server", "--secure", auth, "--port", "0", "--pool", "agents.weather_agent", *extra, timeout=60)
        assert r.returncode == 2 and said in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
