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

from gym_runtime.data.collector import Collector
from gym_runtime.messages import RolloutResult
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.ops.permissions import Reach
from gym_runtime.transport.jetstream import stream_config
from tests.helpers import cli, connect_as, put_batch, read_jsonl, secured_server

POOLS = [("agent", "a"), ("agent", "b"), ("resource", "env_a"), ("resource", "env_b"), ("model", "m")]
REACH = Reach(agents={"a": ("env_a",), "b": ("env_b",)}, resources={})

# where a borrowed answer would go: another agent's results, the tasks stream's purge, another environment's
# sessions, a batch's cancel
TARGETS = ["gym.result.b.victim", "$JS.API.STREAM.PURGE.GYM_TASKS", "gym.res.env_b.seed", "gym.ctl.batch.victim.cancel"]

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
OWN = {"agent.None": {"gym.result.b.victim", "gym.res.env_b.seed"}}


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
                    with anyio.move_on_after(2.0):
                        while got < len(TARGETS):
                            await anyio.sleep(0.02)
                    await attacker.flush()
                    looped[(role, pool, loop)] = got
                    await sub.unsubscribe()
            finally:
                await attacker.close()
        await admin.flush()
        await anyio.sleep(0.3)  # a borrowed publish that got through has reached the spy by now
        borrowed = [(t, who) for t, who in arrived if t not in OWN.get(who, set())]
        assert borrowed == []
        assert (await admin.js.stream_info("GYM_TASKS")).state.messages == 3
        # the loops themselves worked where a credential may both publish and subscribe: only the answer failed
        for key in [
            ("agent", "a", "gym.live.agent.a"),
            ("agent", None, "gym.live.agent.a"),
            ("model", "m", "gym.live.model.m"),
            ("model", None, "gym.live.model.m"),
            ("agent", "a", "_INBOX.agent.a.x.agent.a.0"),
            ("resource", "env_a", "_INBOX.resource.env_a.x.res.env_a.0"),
            ("model", "m", "_INBOX.model.m.x.model.m.0"),
        ]:
            assert looped[key] == len(TARGETS), key
    finally:
        await admin.close()


# ----------------------------------------------------------------------- the server's own answers, borrowed
#
# Not closed (and not closable with NATS permissions, which never look at a reply subject): JetStream
# answers a request (a stored message's ack, a direct get, a pull's status) by publishing to the reply
# subject the requester named, as the server itself, past every permission. A direct get answer carries
# headers, so the JetStream API takes it as a request of its own; with ``no_hdr`` it carries the stored
# body alone, which a stream stores as it is. Each test below passes the day the attack stops working.


@pytest.mark.xfail(strict=True, reason="JetStream publishes its answers to any reply subject (docs/security.md)")
async def test_a_direct_get_answer_cannot_delete_a_stream(pooled) -> None:
    srv, auth = pooled
    admin, model = await connect_as(srv, auth, "admin", None), await connect_as(srv, auth, "model", "m")
    try:
        # a blob that does not exist: the answer is a header-only 404, which the API reads as an empty request
        await model.nc.publish(
            "$JS.API.DIRECT.GET.GYM_BLOBS_MODEL.gym.blob.model.m.nokey.0",
            b"",
            reply="$JS.API.STREAM.DELETE.GYM_RESULTS_b",
        )
        await model.flush()
        await anyio.sleep(0.5)
        assert await stream_config(admin, "GYM_RESULTS_b") is not None  # None: deleted
    finally:
        await model.close()
        await admin.close()


@pytest.mark.xfail(strict=True, reason="JetStream publishes its answers to any reply subject (docs/security.md)")
async def test_a_direct_get_answer_cannot_store_a_result_as_another_agent(pooled, tmp_path: Path) -> None:
    srv, auth = pooled
    admin, thief = await connect_as(srv, auth, "admin", None), await connect_as(srv, auth, "agent", "a")
    try:
        forged = RolloutResult(batch="victim", task_index=0, rollout_index=0, agent="b", row={"reward": 1337.0})
        await thief.js.publish("gym.blob.agent.a.forged.0", thief.codec.encode(forged), timeout=5.0)  # its own chunk
        # read back headerless (no_hdr) into agent b's result subject, which only b's pool may publish to
        await thief.nc.publish(
            "$JS.API.DIRECT.GET.GYM_BLOBS_AGENT.gym.blob.agent.a.forged.0",
            b'{"no_hdr": true}',
            reply="gym.result.b.victim",
        )
        await thief.flush()
        with anyio.fail_after(20):
            await Collector(admin, await put_batch(admin, "victim", 1, agent="b"), tmp_path / "out.jsonl").run()
        assert [r.get("reward") for r in read_jsonl(tmp_path / "out.jsonl")] != [1337.0]
    finally:
        await thief.close()
        await admin.close()


def test_an_agent_pool_without_the_config_is_one_line_exit_2(tmp_path: Path) -> None:
    """An agent pool may call only its own environment, which only the run's config names."""
    auth = str(tmp_path / "auth")
    for extra, said in [
        ([], "give the server the config (--config CONFIG)"),
        (["--config", "resources/counter/config.yaml"], "the config has no agents.weather_agent"),
    ]:
        r = cli("server", "--secure", auth, "--port", "0", "--pool", "agents.weather_agent", *extra, timeout=60)
        assert r.returncode == 2 and said in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
