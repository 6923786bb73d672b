"""Control messages are believed only as their senders send them (issue 52, item 2).

The attack, on a real ``server --secure``: another environment's agent pool stores a blob chunk of its own and
direct-gets it with the reply subject of a control message. JetStream answers as the server, past every
permission, into the subject the reply names, with the attacker's body: ``"ghost 100000"`` on a sandbox pool's
liveness subject made its room 0 (no container created, rollouts waiting without limit), and a ``PauseModel``
or ``ResumeModel`` on a model's control subject held a real model worker's calls, or released a genuine pause.

Now beacons, pauses, resumes and cancels are taken only with the runtime's own control header and none of a
direct get's (``Nats-Stream``, ``Nats-Sequence``, ``Nats-Subject``): the direct get's answer carries either no
header at all (``no_hdr``) or those. Real workers (a sandbox worker on the ``process`` backend, a model worker
on the scripted adapter) on their own pools' credentials.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from gym_runtime.config import SandboxConfig, config_from_dict, resolve_config
from gym_runtime.messages import CreateParams, ModelRequest, PauseModel, ResumeModel
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.ops.permissions import Reach
from gym_runtime.sandboxes.reaper import Peers, beacons
from gym_runtime.transport.model_calls import call_model
from gym_runtime.workers.control import send_pause, send_resume
from gym_runtime.workers.model_worker import ModelWorker
from gym_runtime.workers.sandbox_worker import SandboxWorker
from tests.helpers import connect_as, secured_server

POOLS = [("agent", "a"), ("agent", "b"), ("resource", "env_a"), ("model", "m"), ("sandbox", "sbx")]
REACH = Reach(agents={"a": ("env_a",), "b": ("env_a",)}, resources={})
GET = "$JS.API.DIRECT.GET.GYM_BLOBS_AGENT.gym.blob.agent.b.{key}.0"
HELLO = ModelRequest(params=CreateParams(input=[{"type": "message", "role": "user", "content": "hello"}]))


@pytest.fixture
def pooled(tmp_path: Path) -> Iterator[tuple[EmbeddedServer, Path]]:
    with secured_server(tmp_path, POOLS, REACH) as (srv, auth):
        yield srv, auth


async def forge(thief, key: str, body: bytes, reply: str) -> None:  # type: ignore[no-untyped-def]
    """The attack: ``body`` stored as the thief's own blob chunk, direct-got into ``reply`` with and without
    the stored message's headers."""
    await thief.js.publish(f"gym.blob.agent.b.{key}.0", body, timeout=5.0)
    await thief.nc.publish(GET.format(key=key), b'{"no_hdr": true}', reply=reply)
    await thief.nc.publish(GET.format(key=key), b"", reply=reply)


async def seen(spy_got: list[bytes], n: int) -> None:
    with anyio.fail_after(30):  # the forged messages were delivered (to every subscriber of the subject)
        while len(spy_got) < n:
            await anyio.sleep(0.01)


async def test_a_forged_beacon_cannot_freeze_a_sandbox_pool(pooled) -> None:
    srv, auth = pooled
    admin, thief = await connect_as(srv, auth, "admin", None), await connect_as(srv, auth, "agent", "b")
    pool_bus, peer = await connect_as(srv, auth, "sandbox", "sbx"), await connect_as(srv, auth, "sandbox", "sbx")
    worker = SandboxWorker(pool_bus, "sbx", SandboxConfig(backend="process", capacity=4, max_live=4, replicas=2))
    got: list[bytes] = []
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(worker.run)
            assert worker.room() == 4

            async def spy(msg) -> None:  # type: ignore[no-untyped-def]
                got.append(msg.data)

            await admin.nc.subscribe(admin.subjects.live("sandbox", "sbx"), cb=spy)
            await admin.flush()
            before = len(got)
            await forge(thief, "ghost", b"ghost 100000", admin.subjects.live("sandbox", "sbx"))
            with anyio.fail_after(30):
                while sum(g == b"ghost 100000" for g in got[before:]) < 2:
                    await anyio.sleep(0.01)
            # then a message the worker takes (a peer's genuine beacon, sent as the pool's workers send theirs):
            # once it has it, it has the forged ones, which the server delivered before
            twin = Peers("peer2")
            tg.start_soon(beacons, peer, peer.subjects.live("sandbox", "sbx"), twin)
            with anyio.fail_after(30):
                while "peer2" not in worker.peers.seen:
                    await anyio.sleep(0.01)
            assert "ghost" not in worker.peers.seen  # before: a peer holding 100,000 live sandboxes
            assert worker.room() == 2  # its half of max_live (before: 0, no create taken)
            tg.cancel_scope.cancel()
    finally:
        for b in (peer, pool_bus, thief, admin):
            await b.close()


async def _model_worker(srv: EmbeddedServer, auth: Path):  # type: ignore[no-untyped-def]
    bus = await connect_as(srv, auth, "model", "m")
    cfg = resolve_config(config_from_dict({"models": {"m": {"adapter": "scripted"}}}))
    return bus, ModelWorker(bus, "m", cfg)


async def test_a_forged_pause_holds_no_call_and_a_forged_resume_releases_no_pause(pooled) -> None:
    srv, auth = pooled
    admin, thief = await connect_as(srv, auth, "admin", None), await connect_as(srv, auth, "agent", "b")
    bus, worker = await _model_worker(srv, auth)
    got: list[bytes] = []
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(worker.run)

            async def spy(msg) -> None:  # type: ignore[no-untyped-def]
                got.append(msg.data)

            for subject in (admin.subjects.pause("m"), admin.subjects.resume("m")):
                await admin.nc.subscribe(subject, cb=spy)
            await admin.flush()
            await forge(thief, "pause", thief.codec.encode(PauseModel(model="m")), admin.subjects.pause("m"))
            await seen(got, 2)
            with anyio.fail_after(30):  # before: held until the trainer resumes (never, here)
                reply = await call_model(admin, "m", HELLO, timeout=30)
            assert reply.response.output and worker.gate.is_open

            # a genuine pause, then a forged resume: the pause holds
            acks = await send_pause(admin, "m", {worker.worker_id}, timeout=30)
            assert [a.worker for a in acks] == [worker.worker_id] and not worker.gate.is_open
            await forge(thief, "resume", thief.codec.encode(ResumeModel(model="m")), admin.subjects.resume("m"))
            await seen(got, 5)  # the genuine pause and the two forged resumes
            with anyio.move_on_after(3):  # a span with nothing in it: a call let through would end it early
                await call_model(admin, "m", HELLO, timeout=30)
                raise AssertionError("a forged resume released the pause")
            assert not worker.gate.is_open
            await send_resume(admin, "m")  # the genuine resume
            with anyio.fail_after(30):
                await call_model(admin, "m", HELLO, timeout=30)
            tg.cancel_scope.cancel()
    finally:
        for b in (bus, thief, admin):
            await b.close()
