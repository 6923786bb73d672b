"""The secured bus, rechecked (issue 65, item 5): under ``server --secure``, no credential but the one that owns a
control message can send one a worker believes.

Last round's forgeries (``test_forged_control.py``, ``test_borrowed_replies.py``) borrowed the server's own
answer into a control subject, which carries no control header as sent. Here every credential a node may hold
(each role's role-wide file and each pool's, the admin's aside: it may do anything) sends every control message
exactly as its owner sends it, with the runtime's ``Gym-Control`` header: a model's pause and resume, a policy
version and a batch cancel (the publisher's), their keys in the control bucket (the publisher's; what the
announcements only point at), a sandbox pool's liveness beacon (that pool's, and the role-wide sandbox file's,
which may do what each pool does) and the work queues' beacons (each agent's and model's own). An admin spy on
every subject sees what the server let through; real workers (a model worker, a sandbox worker, a worker's
control view) say what they believed. The owners' own messages, sent the same way, are seen and believed: the
test can tell.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio

from gym_runtime.config import SandboxConfig, config_from_dict, resolve_config
from gym_runtime.messages import CancelBatch, PauseModel, PolicyVersion, ResumeModel
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.ops.permissions import Reach
from gym_runtime.ops.security import ROLES
from gym_runtime.transport.headers import CONTROL
from gym_runtime.transport.subjects import Subjects, kv_key
from gym_runtime.workers.control import ControlView, send_pause, send_resume
from gym_runtime.workers.model_worker import ModelWorker
from gym_runtime.workers.sandbox_worker import SandboxWorker
from tests.helpers import connect_as, secured_server

POOLS = [
    ("agent", "a"),
    ("agent", "b"),
    ("resource", "env_a"),
    ("model", "m"),
    ("model", "m2"),
    ("sandbox", "sbx"),
    ("sandbox", "sbx2"),
]
REACH = Reach(agents={"a": ("env_a",), "b": ("env_a",)}, resources={})
FORGERS = [(role, None) for role in ROLES if role != "admin"] + POOLS
SENDER = "Gym-Test-Sender"  # which credential sent a message (its index in FORGERS; a header workers ignore)


def messages(s: Subjects, n: int) -> dict[str, tuple[str, Any, set[tuple[str, str | None]]]]:
    """Each control message as the ``n``th credential sends it (its values name it: version ``n``, batch
    ``b{n}``, beacon worker ``forger{n}``): its subject, its body as its owner sends it, and its owners."""
    publisher = {("publisher", None)}
    control = s.control_bucket
    beacon = f"forger{n} 100000 100000".encode()
    return {
        "pause": (s.pause("m"), PauseModel(model="m", mode="abort"), publisher),
        "resume": (s.resume("m"), ResumeModel(model="m"), publisher),
        "version": (s.policy_version("m"), PolicyVersion(model="m", version=n), publisher),
        "cancel": (s.cancel(f"b{n}"), CancelBatch(batch=f"b{n}"), publisher),
        "version key": (kv_key(control, Subjects.version_key("m")), str(n).encode(), publisher),
        "paused key": (kv_key(control, Subjects.paused_key("m")), b"1", publisher),
        "cancelled key": (kv_key(control, Subjects.cancelled_key(f"b{n}")), b"1", publisher),
        "sandbox beacon": (s.live("sandbox", "sbx"), beacon, {("sandbox", None), ("sandbox", "sbx")}),
        "agent queue beacon": (s.live("task", "a"), beacon, {("agent", None), ("agent", "a")}),
        "model queue beacon": (s.live("model", "m"), beacon, {("model", None), ("model", "m")}),
    }


async def test_only_a_control_messages_owner_can_send_one_a_worker_believes(tmp_path: Path) -> None:
    with secured_server(tmp_path, POOLS, REACH) as (srv, auth):
        await each_credential_sends_each_control_message(srv, auth)


async def each_credential_sends_each_control_message(srv: EmbeddedServer, auth: Path) -> None:
    admin = await connect_as(srv, auth, "admin", None)
    model_bus = await connect_as(srv, auth, "model", "m")
    model = ModelWorker(model_bus, "m", resolve_config(config_from_dict({"models": {"m": {"adapter": "scripted"}}})))
    pool_bus = await connect_as(srv, auth, "sandbox", "sbx")
    sandboxes = SandboxWorker(pool_bus, "sbx", SandboxConfig(backend="process", capacity=4, max_live=4, replicas=8))
    agent_bus = await connect_as(srv, auth, "agent", "a")
    view = ControlView(agent_bus)
    subjects = admin.subjects
    seen: set[tuple[str, int]] = set()  # (message, the sender's index) as the spy got them
    forgers = {}
    buses = [admin, model_bus, pool_bus, agent_bus]
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(model.run)
            await tg.start(sandboxes.run)
            await view.start(tg)
            for n in range(len(FORGERS)):
                by_subject = {subject: name for name, (subject, _, _) in messages(subjects, n).items()}

                async def spy(msg: Any, by_subject: dict[str, str] = by_subject) -> None:
                    sender = (msg.headers or {}).get(SENDER)
                    if sender is not None and msg.subject in by_subject:
                        seen.add((by_subject[msg.subject], int(sender)))

                for subject in by_subject:
                    await admin.nc.subscribe(subject, cb=spy)
            await admin.nc.flush()

            allowed: set[tuple[str, int]] = set()
            for n, (role, pool) in enumerate(FORGERS):
                forgers[n] = bus = await connect_as(srv, auth, role, pool)
                buses.append(bus)
                for name, (subject, body, owners) in messages(subjects, n).items():
                    data = body if isinstance(body, bytes) else bus.codec.encode(body)
                    await bus.nc.publish(subject, data, headers={**CONTROL, SENDER: str(n)})
                    if (role, pool) in owners:
                        allowed.add((name, n))
                # once the server answers this connection's ping it has routed (or refused) every publish
                # before it, into the spy's connection too, whose own ping then comes back after them
                await bus.nc.flush()
            await admin.nc.flush()
            with anyio.fail_after(30):  # the spy's callbacks have run once every owner's message is in
                while not allowed <= seen:
                    await anyio.sleep(0.01)
            refused = {(name, FORGERS[n]) for name, n in seen - allowed}
            assert refused == set(), sorted(refused, key=str)  # before a fix: every message a forger got through
            assert seen == allowed

            # what the workers believed: the owners' messages (the test can tell), no one else's
            me = FORGERS.index(("publisher", None))
            with anyio.fail_after(30):
                while await view.version("m") is None:
                    await view.refresh_version("m")
            assert await view.version("m") == me  # the publisher's version; any other sender's is above it
            cancelled = [n for n in range(len(FORGERS)) if await view.is_cancelled(f"b{n}")]
            assert cancelled == [me]
            pool_owners = [FORGERS.index(("sandbox", None)), FORGERS.index(("sandbox", "sbx"))]
            with anyio.fail_after(30):
                while not {f"forger{n}" for n in pool_owners} <= set(sandboxes.peers.seen):
                    await anyio.sleep(0.01)
            assert {w for w in sandboxes.peers.seen if w.startswith("forger")} == {f"forger{n}" for n in pool_owners}

            # the publisher's pause holds; resumes from every other credential, as the client sends one, release
            # nothing (the server refuses them: the spy would have seen them above)
            acks = await send_pause(forgers[me], "m", {model.worker_id}, timeout=30)
            assert [a.worker for a in acks] == [model.worker_id] and not model.gate.is_open
            for n, bus in forgers.items():
                if n != me:
                    await send_resume(bus, "m")
            assert not model.gate.is_open
            await send_resume(forgers[me], "m")
            with anyio.fail_after(30):
                while not model.gate.is_open:
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    finally:
        for b in buses:
            await b.close()
