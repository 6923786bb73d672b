"""No pool can starve another role's large bodies, and no header makes a reader fetch more than a body's limit
(issue 33, items 3 and 6), on a real ``server --secure`` bus with per-pool credentials.

Attacks by a node holding one agent pool's credentials: it floods the blob store with chunks no message
refers to (the red team's: one shared stream, no quota, kept 7 days, so every role's large bodies were refused
for a week); and it sends a ``Gym-Blob`` header naming a thousand chunks (before: fetched all at once, and the
server dropped the reader as a slow consumer). What must hold: the flooding pool is refused in its own role's
stream, the publisher's, a model's and an environment's large bodies still store and read back; the pool
cannot write into another pool's key space or another role's stream; the inflated header is refused before
a single chunk is asked for. And the body of a call, which nothing stored refers to, expires on its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anyio
import nats.errors
import nats.js.errors
import pytest
from nats.aio.msg import Msg

from gym_runtime.config import JetStreamConfig, config_from_dict
from gym_runtime.errors import Failure
from gym_runtime.messages import RolloutResult
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.ops.permissions import Reach
from gym_runtime.ops.security import ensure_auth_dir
from gym_runtime.transport import jetstream
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.headers import BLOB_HEADER
from gym_runtime.transport.subjects import Subjects
from tests.helpers import pool_bus

S = Subjects("gym")
POOLS = [("agent", "weather_agent"), ("agent", "other_agent"), ("resource", "weather"), ("model", "policy")]
CONFIG = {
    "namespace": "gym",
    "models": {"policy": {"adapter": "scripted"}},
    "resources": {"weather": {"server": "resources.weather"}},
    "agents": {
        "weather_agent": {"agent": "agents.simple", "model": "policy", "resource": "weather"},
        "other_agent": {"agent": "agents.simple", "model": "policy", "resource": "weather"},
    },
}


@pytest.fixture
def quota(tmp_path: Path) -> Iterator[tuple[EmbeddedServer, Path]]:
    """A secured server whose blob streams hold 40 MB each (five of the largest chunks)."""
    auth = tmp_path / "auth"
    ensure_auth_dir(auth, pools=POOLS)
    srv = EmbeddedServer(
        store_dir=str(tmp_path / "js"),
        secure_dir=str(auth),
        jetstream=JetStreamConfig(blobs_max_bytes="40MB"),
        reach=Reach.of(config_from_dict(CONFIG)),
    )
    srv.start()
    try:
        yield srv, auth
    finally:
        srv.stop()


def _msg(bus: Bus, headers: dict[str, str]) -> Msg:
    return Msg(_client=bus.nc, subject="gym.x", data=b"", headers=headers)


def _big(bus: Bus, tag: str) -> RolloutResult:
    """A result whose body takes two chunks."""
    row = {"tag": tag, "pad": "y" * (bus.blob_threshold + 200_000)}
    return RolloutResult(batch="b", task_index=0, rollout_index=0, agent="a", row=row)


async def test_a_pool_flooding_the_blob_store_starves_no_other_role(quota) -> None:
    srv, auth = quota
    thief = await pool_bus(srv.url, auth, "agent", "other_agent")
    others = {
        "publisher": await pool_bus(srv.url, auth, "publisher"),
        "model": await pool_bus(srv.url, auth, "model", "policy"),
        "resource": await pool_bus(srv.url, auth, "resource", "weather"),
    }
    try:
        # chunks no message refers to, in its own key space, until its role's stream refuses
        chunk, stored = b"z" * (thief.blob_threshold - 1000), 0
        with pytest.raises(nats.js.errors.APIError, match="maximum bytes"):
            for i in range(100):  # 800 MB: 20 times the stream
                await thief.js.publish(S.blob("agent.other_agent", "flood", i), chunk, timeout=5.0)
                stored += 1
        assert 2 <= stored <= 5
        # nor can it write into another pool's key space, or another role's stream
        for space in ("agent.weather_agent", "model.policy", "publisher._"):
            with pytest.raises((nats.errors.TimeoutError, nats.js.errors.APIError)):
                await thief.js.publish(S.blob(space, "flood", 0), b"z", timeout=1.0)
        # every other role's large bodies still store, and any role reads them back by their key
        for role, bus in others.items():
            headers: dict[str, str] = {}
            body = _big(bus, role)
            assert await bus.encode(body, headers) == b""
            assert headers[BLOB_HEADER].startswith(f"{role}.")
            assert await thief.decode(_msg(thief, headers)) == body
    finally:
        for b in (thief, *others.values()):
            await b.close()


async def test_a_header_naming_a_thousand_chunks_is_refused_before_any_fetch(quota) -> None:
    srv, auth = quota
    thief = await pool_bus(srv.url, auth, "agent", "other_agent")
    reader = await pool_bus(srv.url, auth, "model", "policy")
    spy = await pool_bus(srv.url, auth, "admin")
    asked: list[str] = []

    async def seen(msg: Msg) -> None:
        asked.append(msg.subject)

    sub = await spy.nc.subscribe("$JS.API.DIRECT.GET.>", cb=seen)
    await spy.nc.flush()
    try:
        headers: dict[str, str] = {}
        await thief.encode(_big(thief, "genuine"), headers)  # a genuine reference, then its count inflated
        parts = headers[BLOB_HEADER].split(".")
        parts[-2] = "1000"  # 1000 chunks of ~1 MB: far over the 256 MiB body limit
        with pytest.raises(Failure, match="over the"):
            await reader.decode(_msg(reader, {BLOB_HEADER: ".".join(parts)}))
        # the genuine one is read (two chunks asked for), which says the spy hears the reader's gets
        assert (await reader.decode(_msg(reader, headers))).row["tag"] == "genuine"
        with anyio.fail_after(10):
            while len(asked) < 2:
                await anyio.sleep(0.05)
        assert len(asked) == 2, asked
    finally:
        await sub.unsubscribe()
        for b in (thief, reader, spy):
            await b.close()


async def test_the_large_body_of_a_call_expires_and_a_stored_ones_stays(nats_server: EmbeddedServer) -> None:
    """A call's or a reply's body carries a per-message TTL (``jetstream.blob_ttl_s``): nothing stored refers to
    it, so it leaves the stream by itself; a stored message's body lives as long as the message may."""
    bus = await Bus.connect(
        nats_server.url,
        namespace="ttl",
        telemetry=Telemetry(),
        name="t",
        role="agent",
        pool="a",
        jetstream=JetStreamConfig(blob_ttl_s=1),
    )
    try:
        call: dict[str, str] = {}
        await bus.encode(_big(bus, "call"), call)
        kept: dict[str, str] = {}
        await bus.encode(_big(bus, "stored"), kept, stored=True)
        stream = bus.subjects.blob_stream("agent")
        assert await jetstream.message_count(bus, stream) == 4
        with anyio.fail_after(20):
            while await jetstream.message_count(bus, stream) > 2:
                await anyio.sleep(0.2)
        with pytest.raises(Failure, match="missing"):
            await bus.decode(_msg(bus, call))
        assert (await bus.decode(_msg(bus, kept))).row["tag"] == "stored"
    finally:
        await bus.close()
