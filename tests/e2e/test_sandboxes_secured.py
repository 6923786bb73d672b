"""The sandbox role on a ``server --secure`` bus, for real: a secured nats-server, a sandbox worker of pool
``box`` with its own credential, a real Docker engine. An agent pool whose entry names ``box`` uses it;
one whose entry names none is refused by the server; the sandbox worker's credential can reach nothing but
its own pool's subjects."""

from __future__ import annotations

import secrets
import uuid
from pathlib import Path

import anyio
import nats.errors
import pytest

from gym_runtime.config import SandboxConfig
from gym_runtime.errors import Failure
from gym_runtime.messages import SandboxCall, SandboxSpec, SeedRequest
from gym_runtime.ops.permissions import Reach
from gym_runtime.sandboxes.client import Sandbox, Sandboxes
from gym_runtime.sandboxes.engine_api import POOL
from gym_runtime.sandboxes.engine_http import Engine
from gym_runtime.transport.jetstream import ensure_streams
from gym_runtime.transport.subjects import Subjects
from gym_runtime.workers.sandbox_worker import SandboxWorker
from tests.helpers import connect_as, secured_server


async def test_only_the_pools_an_entry_names_may_create_and_the_sandbox_role_reaches_only_its_own(
    tmp_path: Path, engine: Engine, base_image: str
) -> None:
    box = f"box{uuid.uuid4().hex[:6]}"
    reach = Reach(agents={"a": (), "b": ()}, agent_sandboxes={"a": (box,), "b": ()})
    pools = [("agent", "a"), ("agent", "b"), ("sandbox", box)]
    with secured_server(tmp_path, pools, reach) as (srv, auth):
        admin = await connect_as(srv, auth, "admin")
        await ensure_streams(admin)
        await admin.close()
        sbx = await connect_as(srv, auth, "sandbox", box)
        a = await connect_as(srv, auth, "agent", "a")
        b = await connect_as(srv, auth, "agent", "b")
        worker = SandboxWorker(sbx, box, SandboxConfig(engine=f"unix://{engine.socket_path}"))
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(worker.run)
                async with Sandboxes(a, box, lease="a:0:0").sandbox() as sandbox:
                    assert (await sandbox.exec("echo from-a")).stdout == b"from-a\n"
                    parts: list[bytes] = []  # streamed output rides the reply lane the sandbox role may answer in
                    r = await sandbox.exec("echo part", on_output=lambda _s, d: parts.append(d))
                    assert parts == [b"part\n"] == [r.stdout]
                    proc = await sandbox.spawn("echo bg")
                    assert (await proc.wait(timeout_s=30)).stdout == b"bg\n"
                # agent pool b's entry names no sandbox pool: the server drops its create, nobody answers
                call = SandboxCall(op="create", spec=SandboxSpec(), lease="b:0:0")
                with pytest.raises(Failure):
                    await b.request(
                        b.subjects.sandbox_create(box, b.caller), call, timeout=3, op="create", liveness_s=2
                    )
                assert worker.created == 1
                # the sandbox credential may not call an environment or a model, nor store a result
                with pytest.raises(Failure):
                    await sbx.request(
                        sbx.subjects.seed("env", sbx.caller), SeedRequest(row={}), timeout=3, op="seed", liveness_s=2
                    )
                # (a store the server allowed would be acknowledged by JetStream at once)
                with pytest.raises(nats.errors.TimeoutError):
                    await sbx.nc.request(sbx.subjects.result("a", "b1"), b"{}", timeout=1)
                tg.cancel_scope.cancel()
        finally:
            for bus in (sbx, a, b):
                await bus.close()
    assert await engine.containers({POOL: f"gym.{box}"}) == []


async def test_another_pool_with_a_sandboxs_id_and_its_stolen_lease_is_refused(
    tmp_path: Path, engine: Engine, base_image: str
) -> None:
    """Issue 73 item 3: a sandbox is bound to the pool that created it. Agent pools ``a`` and ``b`` both use pool
    ``box``; ``b`` holds ``a``'s sandbox id, its worker's address and even its lease (all a checkpoint of ``a``'s
    ever named), and is refused every operation: its calls name ``b`` as their caller (the server lets ``b`` name
    no other), and the worker serves a sandbox only to the caller that created it."""
    box = f"box{uuid.uuid4().hex[:6]}"
    reach = Reach(agents={"a": (), "b": ()}, agent_sandboxes={"a": (box,), "b": (box,)})
    pools = [("agent", "a"), ("agent", "b"), ("sandbox", box)]
    with secured_server(tmp_path, pools, reach) as (srv, auth):
        admin = await connect_as(srv, auth, "admin")
        await ensure_streams(admin)
        await admin.close()
        sbx = await connect_as(srv, auth, "sandbox", box)
        a = await connect_as(srv, auth, "agent", "a")
        b = await connect_as(srv, auth, "agent", "b")
        worker = SandboxWorker(sbx, box, SandboxConfig(engine=f"unix://{engine.socket_path}", lease_grace_s=60))
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(worker.run)
                mine = Sandboxes(a, box, lease=secrets.token_hex(16))
                sandbox = await mine.create(SandboxSpec(restartable=True))
                await sandbox.write("secret.txt", "pool-a-secret")
                [handle] = mine.handles()
                thief = Sandboxes(b, box, lease=mine.lease)  # the right id, the right lease, the wrong pool
                stolen = Sandbox(thief, handle.sandbox, handle.address, handle.spec)
                for op, do in {
                    "exec": lambda x: x.exec("cat secret.txt"),
                    "read": lambda x: x.read("secret.txt"),
                    "write": lambda x: x.write("planted.txt", "b"),
                    "spawn": lambda x: x.spawn("touch spawned.txt"),
                    "restart": lambda x: x.restart(),
                }.items():
                    with pytest.raises(Failure) as refused:
                        await do(stolen)
                    assert "pool-a-secret" not in refused.value.info.message, op
                await stolen.close()
                thief.take_up([handle])
                assert not await thief.reattach()
                # b naming a as the caller: the server drops it (b may publish only its own caller's subjects)
                forged = SandboxCall(op="exec", sandbox=handle.sandbox, lease=mine.lease, argv=["true"])
                with pytest.raises(Failure):
                    await b.request(
                        Subjects.sandbox_op(handle.address, "exec", a.caller), forged, timeout=3, op="x", liveness_s=2
                    )
                # a's sandbox is as a left it, and still a's
                assert (await sandbox.exec("cat secret.txt; ls")).stdout == b"pool-a-secretsecret.txt\n"
                assert worker.stats()["sandboxes"] == 1
                await mine.close_all()
                tg.cancel_scope.cancel()
        finally:
            for bus in (sbx, a, b):
                await bus.close()
    assert await engine.containers({POOL: f"gym.{box}"}) == []
