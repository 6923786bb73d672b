"""Forking a held sandbox (issue 78 items 1 and 6), on a real nats-server, a real Docker engine and the process
backend, in process: copies with the parent's files, each under its own lease, limits and ``--network none``; a
write in one is seen by no other nor by the parent (nor the parent's later writes by them); they count against the
pool's quota (a fork past it is ``sandbox_unavailable`` at once, not a wait); and nothing is left behind: no copy,
no temporary image, no snapshot volume, whether the copies are closed, their holder falls silent, or the worker
stops."""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from gym_runtime.config import SandboxConfig
from gym_runtime.errors import Failure
from gym_runtime.messages import SandboxSpec
from gym_runtime.sandboxes.backend import Resolved
from gym_runtime.sandboxes.client import Sandbox, Sandboxes
from gym_runtime.sandboxes.engine_api import HOLDER, LEASE, POOL, EngineBackend
from gym_runtime.sandboxes.engine_fork import FORK_DIR, FORK_OF, IMAGE_GRACE_S, VOLUME_PREFIX, EngineForks
from gym_runtime.sandboxes.engine_http import Engine
from gym_runtime.sandboxes.leases import lease_tag
from gym_runtime.transport.bus import Bus
from gym_runtime.workers.sandbox_worker import SandboxWorker
from tests.test_sandbox_worker import fleet, pool, wait_for

__all__ = ["pool"]  # the fixture


@pytest.fixture
def backend_name() -> str:  # tests/test_sandbox_podman.py runs these tests on Podman
    return "docker"


@pytest.fixture
async def swept(engine: Engine, pool: str) -> AsyncIterator[None]:
    """After the test, whatever it asserted: no fork image or snapshot of its pool left in the shared engine."""
    yield
    left = await fork_images(engine, pool), await fork_volumes(engine, pool)
    if left[0] or left[1]:
        for c in await engine.containers({POOL: f"gym.{pool}"}) + await holders(engine, pool):
            await engine.remove(c["Id"])
    for image in left[0]:
        await engine.remove_image(image)
    for volume in left[1]:
        await engine.remove_volume(volume)


def holder(bus: Bus, pool: str) -> Sandboxes:
    return Sandboxes(bus, pool, deadline=time.time() + 300)


async def containers(engine: Engine, pool: str) -> list[str]:
    return sorted(c["Id"] for c in await engine.containers({POOL: f"gym.{pool}"}))


async def fork_images(engine: Engine, pool: str) -> list[str]:
    return [i["Id"] for i in await engine.images({POOL: f"gym.{pool}"}) if FORK_OF in (i.get("Labels") or {})]


async def fork_volumes(engine: Engine, pool: str) -> list[str]:
    """A read-only pool's snapshots (``engine_fork``): the volumes its forks' copies copy from."""
    return [v["Name"] for v in await engine.volumes({POOL: f"gym.{pool}"}) if FORK_OF in (v.get("Labels") or {})]


async def holders(engine: Engine, pool: str) -> list[dict[str, Any]]:
    """The pool's snapshots' holders (not the pool's containers: no sandbox)."""
    return await engine.containers({HOLDER: f"gym.{pool}"})


async def cat(box: Sandbox, path: str) -> str:
    r = await box.exec(f"cat {path} 2>/dev/null || echo -")
    return r.stdout.decode().strip()


async def check_isolation(parent: Sandbox, kids: list[Sandbox], path: str) -> None:
    """Each copy has the parent's file as it was at the fork; a write in any is seen by no other."""
    for kid in kids:
        assert await cat(kid, path) == "set-up"
    await parent.exec(f"echo later > {path}")  # the parent's later write
    for i, kid in enumerate(kids):
        await kid.exec(f"echo kid{i} > {path}; echo kid{i} > {path}.mine")
    assert await cat(parent, path) == "later" and await cat(parent, f"{path}.mine") == "-"
    for i, kid in enumerate(kids):
        assert await cat(kid, path) == f"kid{i}"
        others = [await cat(kid, f"{path}.mine") for kid in kids]
        assert others == [f"kid{j}" for j in range(len(kids))]


async def test_a_fork_copies_the_files_into_isolated_sandboxes_each_under_its_own_lease(
    bus: Bus, engine: Engine, base_image: str, pool: str, swept: None, backend_name: str
) -> None:
    async with fleet(bus, engine, pool) as worker:
        w = await worker(backend=backend_name, capacity=8)
        parent_lease = holder(bus, pool)
        parent = await parent_lease.create(SandboxSpec(memory_mb=256))
        await parent.exec("mkdir -p build && echo set-up > build/out && echo tmp > /tmp/t && echo home > /root/h")
        owners = [holder(bus, pool) for _ in range(3)]
        kids = await parent.fork(3, into=owners)
        assert [k._owner for k in kids] == owners and len({k.id for k in kids} | {parent.id}) == 4
        assert w.stats()["sandboxes"] == 4
        r = await kids[0].exec("cat /tmp/t /root/h; pwd")  # every writable path, the same working directory
        assert r.stdout == b"tmp\nhome\n/work\n"
        await check_isolation(parent, kids, "build/out")
        for kid, owner in zip(kids, owners, strict=True):  # as any sandbox: its limits, no network, its lease's label
            info = await engine.inspect(kid.id)
            assert info["HostConfig"]["NetworkMode"] == "none" and info["HostConfig"]["Memory"] == 256 << 20
            assert info["Config"]["Labels"][LEASE] == lease_tag(owner.lease)
            assert info["Image"] == (await engine.inspect(parent.id))["Image"]  # no image was made for them
        # a copy is served under its own lease only: the parent's lease does not reach it, nor a copy's the parent
        stolen = Sandbox(parent_lease, kids[0].id, kids[0]._address, kids[0].spec)
        with pytest.raises(Failure, match="not held by worker"):
            await stolen.exec("true")
        with pytest.raises(Failure, match="not held by worker"):
            await Sandbox(owners[1], parent.id, parent._address, parent.spec).exec("true")
        # a fork by default: a fresh lease per copy
        [extra] = await kids[1].fork()
        assert extra._owner.lease not in {o.lease for o in owners} | {parent_lease.lease}
        assert await cat(extra, "build/out") == "kid1"
        await extra.close()
        for owner in [*owners, parent_lease]:
            await owner.close_all()
        assert await containers(engine, pool) == []
        assert await fork_volumes(engine, pool) == []
        assert w.stats()["sandboxes"] == 0


async def test_a_read_only_pools_copies_copy_one_snapshot_that_goes_with_the_last_of_them_and_their_parent(
    bus: Bus, engine: Engine, base_image: str, pool: str, swept: None, backend_name: str
) -> None:
    """The engine unpacks the parent's files once, into a tmpfs volume of its own (a snapshot, which a container
    holds mounted); each copy mounts it read-only and copies it into its own tmpfs paths. No copy can change it (nor,
    so, another copy's files); it goes once neither a copy uses it nor its parent keeps it (for the next fork), and
    one whose holder ended is read again."""
    async with fleet(bus, engine, pool) as worker:
        w = await worker(backend=backend_name, capacity=8)
        assert w.backend is not None
        forks: EngineForks = w.backend.forks  # type: ignore[attr-defined]
        parents = holder(bus, pool)
        parent = await parents.create(SandboxSpec(memory_mb=256))
        await parent.exec("echo set-up > out && mkdir -p d && echo deep > d/f && chmod 640 d/f")
        owners = [holder(bus, pool) for _ in range(2)]
        kids = await parent.fork(2, into=owners)
        [snapshot] = await fork_volumes(engine, pool)
        for kid in kids:
            mounts = (await engine.inspect(kid.id))["Mounts"]
            assert [(m["Name"], m["Destination"], m["RW"]) for m in mounts] == [(snapshot, FORK_DIR, False)]
            r = await kid.exec(f"stat -c %a d/f; cat out; echo x > {FORK_DIR}/work/out; echo x > {FORK_DIR}/new")
            assert r.stdout == b"640\nset-up\n" and r.stderr.count(b"Read-only file system") == 2, r
        held = await holders(engine, pool)
        if backend_name == "podman":  # its snapshot on the engine's disk: its holder served the unpack alone
            assert held == [] and forks.holders == {}
        else:  # a tmpfs, held mounted
            assert [c["Id"] for c in held] == [forks.holders[snapshot]] and w.stats()["sandboxes"] == 3
        await owners[0].close_all()
        assert await fork_volumes(engine, pool) == [snapshot]  # the other copy uses it
        await owners[1].close_all()
        assert await fork_volumes(engine, pool) == [snapshot]  # its parent keeps it for its next fork
        [kid] = await parent.fork()
        assert forks.reads == 1 and await cat(kid, "out") == "set-up"
        await kid.close()
        if held:
            await engine.remove(held[0]["Id"])  # its holder ended (its tmpfs, the files, with it)
        else:
            await parent.exec("touch out")  # (Podman's has no holder to end: a change reads it again)
        [kid] = await parent.fork()  # read again
        assert forks.reads == 2 and await cat(kid, "out") == "set-up"
        await kid.close()
        assert len(await fork_volumes(engine, pool)) == 1  # the one before: gone
        await parents.close_all()
        assert await fork_volumes(engine, pool) == [] and forks.kept == {} and forks.users == {}
        assert await holders(engine, pool) == []


async def test_a_parent_forked_again_unchanged_is_read_once_and_a_change_is_always_seen(
    bus: Bus, engine: Engine, base_image: str, pool: str, swept: None, backend_name: str
) -> None:
    """A task's template forked once per repeat (``seed_once``): its files are read once while they stay as they
    were; any change since (a write of the same size at once, a new file, a chmod) is read again, never the old."""
    async with fleet(bus, engine, pool) as worker:
        w = await worker(backend=backend_name, capacity=8)
        assert w.backend is not None
        forks: EngineForks = w.backend.forks  # type: ignore[attr-defined]
        parents = holder(bus, pool)
        parent = await parents.create(SandboxSpec())
        await parent.exec("echo aaaa > f && mkdir d && echo x > d/g")
        kids: list[Sandbox] = []

        async def fork_one() -> None:
            kids.extend(await parent.fork())

        async with anyio.create_task_group() as tg:  # a group's forks at once: one read between them
            for _ in range(3):
                tg.start_soon(fork_one)
        assert forks.reads == 1
        [kid] = await parent.fork()
        assert forks.reads == 1 and [await cat(k, "f") for k in [*kids, kid]] == ["aaaa"] * 4
        for k in [*kids, kid]:
            await k.close()
        changes = ["echo bbbb > f", "echo y > d/h", "chmod 600 d/g", "rm d/h"]
        for i, change in enumerate(changes):
            await parent.exec(change)
            [kid] = await parent.fork()
            assert forks.reads == 2 + i, change
            r = await kid.exec("cat f; ls d; stat -c %a d/g")
            assert r.stdout == (await parent.exec("cat f; ls d; stat -c %a d/g")).stdout, change
            await kid.close()
        assert len(await fork_volumes(engine, pool)) == 1  # the snapshots of the changes before the last: gone
        await parents.close_all()
        assert parent.id not in forks.kept  # its snapshot went with it
    assert await containers(engine, pool) == [] and await fork_volumes(engine, pool) == []


async def test_a_copy_copies_its_snapshot_as_it_starts_with_no_exec_in_it(
    bus: Bus, engine: Engine, base_image: str, pool: str, swept: None, backend_name: str, monkeypatch: Any
) -> None:
    """A copy's main process copies its snapshot, says so, then becomes its keeper; the fork answers once it has
    said so. No exec in the copy (each is a create, a start and an inspect, and a process the runtime sets up: most
    of a one-child fork under load): a repeat of an unchanged parent runs one exec, the parent's digest."""
    async with fleet(bus, engine, pool) as worker:
        w = await worker(backend=backend_name, capacity=8)
        assert w.backend is not None
        parents = holder(bus, pool)
        parent = await parents.create(SandboxSpec())
        await parent.exec("echo set-up > out && echo t > /tmp/t")
        [first] = await parent.fork()
        await first.close()
        execs: list[str] = []
        real = w.backend.engine.exec_create  # type: ignore[attr-defined]

        async def counted(cid: str, argv: list[str], **kw: Any) -> str:
            execs.append(cid)
            return await real(cid, argv, **kw)

        monkeypatch.setattr(w.backend.engine, "exec_create", counted)  # type: ignore[attr-defined]
        [kid] = await parent.fork()
        assert execs == [parent.id]  # the digest of its files; nothing in the copy
        assert (await kid.exec("cat out /tmp/t; pwd")).stdout == b"set-up\nt\n/work\n"
        await parents.close_all()
        await kid.close()
    assert await containers(engine, pool) == [] and await fork_volumes(engine, pool) == []


async def test_a_copy_whose_snapshot_lacks_its_files_fails_in_one_line_and_is_removed(
    engine: Engine, base_image: str, pool: str, backend_name: str
) -> None:
    """A snapshot without the paths it copies (its volume gone, and the engine made an empty one of that name): the
    copy's main process says why and ends; its create fails in one line and leaves no container."""
    label = f"gym.{pool}"
    backend = EngineBackend(engine, name=backend_name, pool=label)
    volume = await engine.create_volume(f"{VOLUME_PREFIX}{secrets.token_hex(8)}", {POOL: label, FORK_OF: "gone"})
    spec = Resolved(image=base_image, cpu=1, memory_mb=128, pids=64, disk_mb=16, timeout_s=60, max_output=4096)
    try:
        with pytest.raises(Failure, match="copying files into a forked sandbox failed: the snapshot has no work$"):
            await backend.create(spec, owner="test", lease="t", expires=time.time() + 300, snapshot=volume)

        async def none_left() -> bool:
            return await containers(engine, pool) == []

        await wait_for(none_left, timeout=60)  # (Docker's auto-removal of the ended copy may still be under way)
    finally:
        for c in await engine.containers({POOL: label}):
            await engine.gone(c["Id"])
        await engine.remove_volume(volume)


async def test_a_restartable_sandboxs_copies_copy_by_an_exec_and_start_empty_at_a_restart(
    bus: Bus, engine: Engine, base_image: str, pool: str, swept: None, backend_name: str
) -> None:
    """A restartable sandbox's copies (a hosted server's) are restarted before a verify: one that copied its
    snapshot as it starts would copy it again then. Theirs copy by an exec once started, and a restart leaves
    their tmpfs paths empty, as any read-only sandbox's."""
    async with fleet(bus, engine, pool) as worker:
        await worker(backend=backend_name, capacity=8)
        parents = holder(bus, pool)
        parent = await parents.create(SandboxSpec(restartable=True))
        await parent.exec("echo set-up > out")
        [kid] = await parent.fork()
        assert await cat(kid, "out") == "set-up"
        await kid.restart()
        assert await cat(kid, "out") == "-"
        await kid.close()
        await parents.close_all()
    assert await containers(engine, pool) == [] and await fork_volumes(engine, pool) == []


async def test_a_group_of_copies_has_every_byte_of_the_parents_files(
    bus: Bus, engine: Engine, base_image: str, pool: str, swept: None, backend_name: str
) -> None:
    """The parent's tar read in many parts (a few MB) into its snapshot, three copies at once: each has every byte."""
    async with fleet(bus, engine, pool) as worker:
        await worker(backend=backend_name, capacity=8)
        parents = holder(bus, pool)
        parent = await parents.create(SandboxSpec())
        made = "head -c 6000000 /dev/urandom > big && mkdir -p d && for i in $(seq 200); do echo $i > d/$i; done"
        await parent.exec(made)
        sums = "md5sum big d/* | md5sum"
        want = (await parent.exec(sums)).stdout
        kids = await parent.fork(3)
        assert [(await k.exec(sums)).stdout for k in kids] == [want] * 3
        for k in kids:
            await k._owner.close_all()
        await parents.close_all()
    assert await containers(engine, pool) == []


async def test_a_writable_pools_fork_commits_an_image_that_goes_with_its_last_copy(
    bus: Bus, engine: Engine, base_image: str, pool: str, swept: None, backend_name: str
) -> None:
    async with fleet(bus, engine, pool) as worker:
        await worker(backend=backend_name, capacity=8, rootfs="writable")
        parents = holder(bus, pool)
        parent = await parents.create(SandboxSpec())
        await parent.exec("mkdir -p /opt/pkg && echo set-up > /opt/pkg/out")
        owners = [holder(bus, pool) for _ in range(2)]
        kids = await parent.fork(2, into=owners)
        [image] = await fork_images(engine, pool)
        assert {(await engine.inspect(k.id))["Image"] for k in kids} == {image}
        await check_isolation(parent, kids, "/opt/pkg/out")
        await owners[0].close_all()
        assert await fork_images(engine, pool) == [image]  # the other copy still uses it
        await owners[1].close_all()
        assert await fork_images(engine, pool) == []
        await parents.close_all()
        assert await containers(engine, pool) == []


async def test_copies_whose_holder_falls_silent_are_reaped_with_their_image(
    bus: Bus, engine: Engine, base_image: str, pool: str, swept: None, backend_name: str
) -> None:
    async with fleet(bus, engine, pool) as worker:
        await worker(backend=backend_name, capacity=8, rootfs="writable", lease_grace_s=2, reap_interval_s=0.3)
        parents = holder(bus, pool)
        parent = await parents.create(SandboxSpec())
        await parent.exec("echo x > /etc/forked")
        owners = [holder(bus, pool) for _ in range(2)]
        await parent.fork(2, into=owners)
        assert len(await fork_images(engine, pool)) == 1
        for owner in owners:
            owner.let_go()  # their rollout died: no renewals, no close

        async def only_parent() -> bool:
            return await containers(engine, pool) == [parent.id] and await fork_images(engine, pool) == []

        await wait_for(only_parent, timeout=60)
        await parents.close_all()


@pytest.mark.parametrize("rootfs", ["writable", "read-only"])
async def test_a_stopping_worker_leaves_no_copy_no_image_and_no_snapshot(
    bus: Bus, engine: Engine, base_image: str, pool: str, swept: None, backend_name: str, rootfs: str
) -> None:
    async with fleet(bus, engine, pool) as worker:
        w = await worker(backend=backend_name, capacity=8, rootfs=rootfs)
        parent = await holder(bus, pool).create(SandboxSpec())
        await parent.exec("echo x > f")
        await parent.fork(3)
        made = await fork_images(engine, pool) + await fork_volumes(engine, pool)
        held = 1 if rootfs == "read-only" and backend_name == "docker" else 0  # a snapshot's holder (Docker's)
        assert len(await containers(engine, pool)) == 4 and len(await holders(engine, pool)) == held
        assert len(made) == 1
        assert w.stats()["sandboxes"] == 4
    # the fleet's block cancelled the worker: it removed what it held (its own clean-up, before the fixture's)
    assert await fork_images(engine, pool) == [] and await fork_volumes(engine, pool) == []
    assert await holders(engine, pool) == []


async def test_a_fork_past_the_quota_is_sandbox_unavailable_at_once_and_makes_nothing(
    bus: Bus, engine: Engine, base_image: str, pool: str, swept: None, backend_name: str
) -> None:
    async with fleet(bus, engine, pool) as worker:
        w = await worker(
            backend=backend_name, capacity=3, lease_wait_s=600
        )  # a wait for a lease would outlast the test
        parents = holder(bus, pool)
        parent = await parents.create(SandboxSpec())
        started = time.monotonic()
        with pytest.raises(Failure) as refused:
            await parent.fork(3)
        assert refused.value.info.error_class == "sandbox_unavailable"
        assert "needs 3 free sandboxes on its worker, which has 2" in refused.value.info.message
        assert time.monotonic() - started < 60  # answered, not waited (lease_wait_s is 600)
        assert await containers(engine, pool) == [parent.id] and w.stats()["sandboxes"] == 1
        assert len(await parent.fork(2)) == 2  # within it: made
        await parents.close_all()


async def test_a_sweep_removes_fork_images_no_container_uses(engine: Engine, base_image: str, pool: str) -> None:
    """A worker that died between its fork and its copies' removal leaves an image: a later sweep removes it
    once no container uses it (and not while one does, nor while it is young: a fork under way)."""
    label = f"gym.{pool}"
    body = {"Image": base_image, "Cmd": ["sleep", "600"], "NetworkDisabled": True, "Labels": {POOL: label}}
    body["HostConfig"] = {"NetworkMode": "none"}
    cid = await engine.create(body)
    image = await engine.commit(cid, {POOL: label, FORK_OF: cid[:12]})
    user = await engine.create({**body, "Image": image})
    forks = EngineForks(engine, label, (POOL, ("work",)))
    try:
        assert await forks.sweep() == 0  # young
        later = time.time() + IMAGE_GRACE_S + 1
        assert await forks.sweep(now=later) == 0  # a container uses it
        await engine.remove(user)
        assert await forks.sweep(now=later) == 1
        assert await fork_images(engine, pool) == []
    finally:
        for c in (cid, user):
            await engine.remove(c)
        await engine.remove_image(image)


async def test_a_sweep_removes_a_snapshot_once_its_parent_is_gone_and_no_container_uses_it(
    engine: Engine, base_image: str, pool: str
) -> None:
    """A worker that died leaves its parents' snapshots: a later sweep removes one once its parent is gone (while
    it is there, a live worker may keep it for its next fork), no container uses it, and it is not young."""
    label = f"gym.{pool}"
    body = {"Image": base_image, "Cmd": ["sleep", "600"], "NetworkDisabled": True, "Labels": {POOL: label}}
    body["HostConfig"] = {"NetworkMode": "none"}
    parent = await engine.create(body)
    volume = await engine.create_volume(f"{VOLUME_PREFIX}{secrets.token_hex(8)}", {POOL: label, FORK_OF: parent})
    mount = {"Type": "volume", "Source": volume, "Target": FORK_DIR, "ReadOnly": True}
    user = await engine.create({**body, "HostConfig": {"NetworkMode": "none", "Mounts": [mount]}})
    forks = EngineForks(engine, label, (POOL, ("work",)))
    later = time.time() + IMAGE_GRACE_S + 1
    try:
        assert await forks.sweep(now=later) == 0  # its parent is there
        await engine.remove(parent)
        assert await forks.sweep() == 0  # young
        assert await forks.sweep(now=later) == 0  # a container uses it
        await engine.remove(user)
        assert await forks.sweep(now=later) == 1
        assert await fork_volumes(engine, pool) == []
    finally:
        for c in (parent, user):
            await engine.remove(c)
        await engine.remove_volume(volume)


async def test_the_process_backend_forks_by_copying_its_working_directory(bus: Bus) -> None:
    name = f"p{secrets.token_hex(4)}"
    worker = SandboxWorker(bus, name, SandboxConfig(backend="process", capacity=4))
    async with anyio.create_task_group() as tg:
        await tg.start(worker.run)
        parents = holder(bus, name)
        parent = await parents.create(SandboxSpec(memory_mb=128))
        await parent.write("build/out", "set-up\n")
        await parent.exec("chmod +x build; printf '#!/bin/sh\\necho ran\\n' > build/run.sh; chmod +x build/run.sh")
        owners = [holder(bus, name) for _ in range(2)]
        kids = await parent.fork(2, into=owners)
        assert (await kids[0].exec("./build/run.sh")).stdout == b"ran\n"  # modes kept
        await check_isolation(parent, kids, "build/out")
        with pytest.raises(Failure) as refused:
            await parent.fork(2)  # 3 held, capacity 4
        assert refused.value.info.error_class == "sandbox_unavailable"
        for owner in [*owners, parents]:
            await owner.close_all()
        assert worker.stats()["sandboxes"] == 0
        tg.cancel_scope.cancel()
