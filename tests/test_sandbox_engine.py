"""The docker backend against a real engine (``.ci/docker.sh start``): round trips, limits, isolation.

Each test creates its containers with a test-owned pool label and removes them; a few seconds each.
"""

from __future__ import annotations

import os
import statistics
import time
import uuid
from collections.abc import AsyncIterator

import anyio
import pytest

from gym_runtime.errors import Failure
from gym_runtime.sandboxes.backend import Resolved
from gym_runtime.sandboxes.engine_api import OWNER, EngineBackend, renew_every
from gym_runtime.sandboxes.engine_http import Engine, cgroup_cpu_s
from gym_runtime.sandboxes.images import BaseImage, cache_dir
from tests.envs.cpu_burn import program


@pytest.fixture
async def backend(engine: Engine) -> AsyncIterator[EngineBackend]:
    b = EngineBackend(engine, name="docker", pool=f"test{uuid.uuid4().hex[:8]}")
    try:
        yield b
    finally:
        for c in await b.list_owned():
            await b.close(c.id)


@pytest.fixture
def backend_name() -> str:  # tests/test_sandbox_podman.py runs these tests on Podman
    return "docker"


def spec(image: str, **kw: object) -> Resolved:
    base: dict[str, object] = dict(
        image=image, cpu=1.0, memory_mb=128, pids=64, disk_mb=16, timeout_s=30.0, max_output=1 << 16
    )
    base.update(kw)
    return Resolved(**base)  # type: ignore[arg-type]


async def test_the_base_image_is_built_once_and_cached_by_content(base_image: str) -> None:
    spec_ = BaseImage()
    assert base_image == spec_.ref
    assert (cache_dir() / f"debian-{spec_.suite}-{spec_.digest}.tar").is_file()
    assert BaseImage(packages=("python3", "git")).digest != spec_.digest


async def test_exec_round_trip_and_files(backend: EngineBackend, base_image: str) -> None:
    sid = await backend.create(spec(base_image), owner="w1", lease="b:0:0")
    r = await backend.exec(
        sid, ["python3", "-c", "import sys; print('hi'); print('err', file=sys.stderr)"], timeout_s=20, max_output=1024
    )
    assert (r.exit_code, r.stdout, r.stderr, r.truncated) == (0, b"hi\n", b"err\n", False)
    r = await backend.exec(sid, ["sh", "-c", "exit 3"], timeout_s=20, max_output=1024)
    assert r.exit_code == 3
    blob = bytes(range(256)) * 100
    await backend.write(sid, "sub/dir/data.bin", blob)
    assert await backend.read(sid, "/work/sub/dir/data.bin", max_bytes=1 << 20) == blob
    with pytest.raises(Failure, match="larger than"):
        await backend.read(sid, "sub/dir/data.bin", max_bytes=100)
    with pytest.raises(Failure, match="No such file"):
        await backend.read(sid, "/nope", max_bytes=100)
    [owned] = await backend.list_owned()
    assert (owned.id, owned.owner, owned.lease) == (sid, "w1", "b:0:0")
    await backend.close(sid)
    assert await backend.list_owned() == []
    with pytest.raises(Failure, match="gone"):
        await backend.exec(sid, ["true"], timeout_s=5, max_output=10)


async def test_limits_memory_pids_wall_clock_output_disk(backend: EngineBackend, base_image: str) -> None:
    sid = await backend.create(spec(base_image, memory_mb=64, pids=32, disk_mb=4), owner="w1", lease="l")
    # memory: a 256 MiB allocation in a 64 MiB sandbox is killed by the kernel
    r = await backend.exec(
        sid, ["python3", "-c", "b = bytearray(256 << 20); print('survived')"], timeout_s=20, max_output=1024
    )
    assert r.exit_code == 137 and b"survived" not in r.stdout and not r.timed_out
    # pids: forking stops at the limit
    forks = (
        "import os, time\nkids = []\ntry:\n    while len(kids) < 500:\n        pid = os.fork()\n"
        "        if pid == 0:\n            time.sleep(30)\n            os._exit(0)\n        kids.append(pid)\n"
        "except OSError:\n    print('refused at', len(kids))\nfor k in kids:\n    os.kill(k, 9)\n"
    )
    r = await backend.exec(sid, ["python3", "-c", forks], timeout_s=20, max_output=1024)
    assert r.stdout.startswith(b"refused at") and int(r.stdout.split()[-1]) < 32, r
    # wall clock: the command and its children die at timeout_s
    r = await backend.exec(sid, ["sh", "-c", "sleep 30 & sleep 30"], timeout_s=1, max_output=64)
    # uncapped, ``sleep 30`` alone takes 30 s whatever the load: under that is the 1 s timeout acting
    assert r.timed_out and r.exit_code is None and r.duration_s < 30
    # output: capped while read
    r = await backend.exec(sid, ["sh", "-c", "head -c 5000000 /dev/zero"], timeout_s=20, max_output=1000)
    assert r.truncated and len(r.stdout) == 1000 and r.exit_code == 0
    # disk: the writable paths are 4 MiB tmpfs mounts; the root file system is read-only
    r = await backend.exec(sid, ["sh", "-c", "head -c 8000000 /dev/zero > /work/big"], timeout_s=20, max_output=1024)
    assert r.exit_code != 0 and b"No space left" in r.stderr
    r = await backend.exec(sid, ["sh", "-c", "echo x > /etc/x"], timeout_s=20, max_output=1024)
    assert r.exit_code != 0 and b"Read-only" in r.stderr


async def test_no_network_no_engine_socket_no_host_mounts(
    backend: EngineBackend, engine: Engine, base_image: str
) -> None:
    sid = await backend.create(spec(base_image), owner="w1", lease="l")
    r = await backend.exec(sid, ["ls", "/sys/class/net"], timeout_s=20, max_output=1024)
    assert r.stdout.split() == [b"lo"]
    probe = (
        "import os, socket\n"
        "hits = [p for p in ('/var/run/docker.sock', '/run/docker.sock', '/var/run/podman') if os.path.exists(p)]\n"
        "hits += [k for k in os.environ if 'NATS' in k or 'DOCKER' in k or 'GYM' in k]\n"
        "try:\n    socket.create_connection(('1.1.1.1', 53), timeout=2); hits.append('net')\n"
        "except OSError: pass\n"
        "print(hits)\n"
    )
    r = await backend.exec(sid, ["python3", "-c", probe], timeout_s=20, max_output=1024)
    assert r.stdout.strip() == b"[]"
    info = await engine.inspect(sid)
    assert info["HostConfig"]["NetworkMode"] == "none"
    assert [m["Type"] for m in info["Mounts"]] == []  # tmpfs mounts are HostConfig.Tmpfs, nothing bound
    assert info["HostConfig"]["Binds"] in (None, [])
    assert info["Config"]["Labels"][OWNER] == "w1"


async def test_a_writable_pool_writes_the_images_own_directories_and_keeps_its_workdir(
    engine: Engine, base_image: str
) -> None:
    """``rootfs: writable`` (NeMo Gym's container servers write /testbed, /eval.sh, /tests): the image's file
    system is the container's, with no tmpfs over it; ``workdir=""`` is the image's WORKDIR. The rest of the
    safety holds (no network, capabilities dropped)."""
    backend = EngineBackend(engine, name="docker", pool=f"test{uuid.uuid4().hex[:8]}", writable=True)
    try:
        sid = await backend.create(spec(base_image, workdir=""), owner="w1", lease="l")
        r = await backend.exec(sid, ["sh", "-c", "pwd; echo x > /etc/x && cat /etc/x"], timeout_s=20, max_output=1024)
        assert (r.exit_code, r.stdout) == (0, b"/\nx\n")  # the base's WORKDIR is /
        await backend.write(sid, "/eval.sh", b"echo ran")
        assert await backend.read(sid, "/eval.sh", max_bytes=100) == b"echo ran"
        info = await engine.inspect(sid)
        assert info["HostConfig"]["ReadonlyRootfs"] is False
        assert list(info["HostConfig"].get("Tmpfs") or {}) == ["/sys/fs/cgroup"]  # read-only (below), no other
        assert (info["HostConfig"]["NetworkMode"], info["HostConfig"]["CapDrop"]) == ("none", ["ALL"])
        other = await backend.create(spec(base_image), owner="w1", lease="l")  # workdir default: /work
        assert (await backend.exec(other, ["pwd"], timeout_s=20, max_output=1024)).stdout == b"/work\n"
    finally:
        for c in await backend.list_owned():
            await backend.close(c.id)


@pytest.mark.parametrize("writable", [False, True], ids=["read-only", "writable"])
async def test_the_cgroup_file_system_is_read_only(
    engine: Engine, base_image: str, backend_name: str, writable: bool
) -> None:
    """Docker's cgroup v1 layout mounts a tmpfs at ``/sys/fs/cgroup``: writable, 125 MiB were written into it in a
    128 MB sandbox (round 4 of the red team). Read-only in every pool, as the rest of the root outside the
    writable paths is; what the sandbox reads of its own cgroup is not needed (the limits are the engine's)."""
    backend = EngineBackend(engine, name=backend_name, pool=f"test{uuid.uuid4().hex[:8]}", writable=writable)
    try:
        sid = await backend.create(spec(base_image, memory_mb=128), owner="w1", lease="l")
        attack = (
            "for d in /sys/fs/cgroup /sys/fs/cgroup/memory /sys/fs/cgroup/x; do mkdir -p $d 2>/dev/null; "
            "head -c 4000000 /dev/zero > $d/fill 2>/dev/null && echo wrote $d; done; "
            "mount -o remount,rw /sys/fs/cgroup 2>/dev/null && echo remounted; true"
        )
        r = await backend.exec(sid, ["sh", "-c", attack], timeout_s=30, max_output=4096)
        assert r.exit_code == 0 and r.stdout == b"", r
    finally:
        for c in await backend.list_owned():
            await backend.close(c.id)


async def test_a_container_nobody_renews_ends_by_itself_and_a_renewed_one_stays(
    engine: Engine, base_image: str
) -> None:
    """A container outlives its worker (SIGKILLed with its node or bus) only until its keeper's window passes
    with no renewal: then it ends and the engine removes it, with no worker of the pool alive. The renewed one
    keeps running and working, also while a fork bomb holds every pid it may have (its keeper forks nothing);
    one past its lease's end ends however often it is renewed (a policy renewing its own keeper gains nothing
    past that). Docker only: Podman's containers have no keeper yet (docs/sandboxes.md)."""
    # a window of 5 s, renewed every 1.7 s: a loaded engine's slow answers stay well inside it
    backend = EngineBackend(engine, name="docker", pool=f"test{uuid.uuid4().hex[:8]}", orphan_after_s=10)
    try:
        kept = await backend.create(spec(base_image, pids=24), owner="w1", lease="kept")
        orphan = await backend.create(spec(base_image), owner="w1", lease="orphan")
        # its lease ends in 3 s: the keeper's hard deadline is LEASE_GRACE_S later
        ending = await backend.create(spec(base_image), owner="w1", lease="ending", expires=time.time() + 3 - 60)
        bomb = (  # every pid taken, and forks tried again and again, for 12 s (two keeper windows and more)
            "import os, time\nend, kids, refused = time.time() + 12, [], 0\nwhile time.time() < end:\n    try:\n"
            "        pid = os.fork()\n    except OSError:\n        refused += 1\n        continue\n    if pid == 0:\n"
            "        time.sleep(max(0, end - time.time()))\n        os._exit(0)\n    kids.append(pid)\n"
            "for k in kids:\n    os.waitpid(k, 0)\nprint(refused)\n"
        )

        async def ids() -> set[str]:
            return {c.id for c in await backend.list_owned()}

        async with anyio.create_task_group() as tg:

            async def renew() -> None:
                while True:  # as a worker does: a round every third of a window
                    await anyio.sleep(renew_every(backend.orphan_after_s))
                    assert await backend.renew(kept)
                    await backend.renew(ending)

            tg.start_soon(renew)
            with anyio.fail_after(120):  # the bounds are 3-10 s after their creation: generous for a loaded engine
                while await ids() & {orphan, ending}:
                    await anyio.sleep(0.5)
            r = await backend.exec(kept, ["python3", "-c", bomb], timeout_s=60, max_output=1024)
            assert r.exit_code == 0 and int(r.stdout) > 0, r  # forks were refused: every pid was taken
            r = await backend.exec(kept, ["echo", "alive"], timeout_s=30, max_output=1024)
            assert r.stdout == b"alive\n", r
            assert await ids() == {kept}
            tg.cancel_scope.cancel()
        assert not await backend.renew(orphan)  # gone: no error
    finally:
        for c in await backend.list_owned():
            await backend.close(c.id)


async def test_a_containers_cpu_seconds_are_read_from_its_cgroup_at_once(
    backend: EngineBackend, engine: Engine, base_image: str
) -> None:
    """Issue 58: a close reads its sandbox's CPU (``Engine.cpu_s``) from the container's cgroup on this host (the
    local engine of these tests), not from the engine's stats, which Docker 20.10 answers at its collector's next
    tick (a second apart: on average half of a quiet engine's cold create, per close). The same count as the
    stats give; a cgroup that is not the container's is never read; a removed container's count is None."""
    sid = await backend.create(spec(base_image), owner="w1", lease="l")
    r = await backend.exec(sid, ["python3", "-c", program(0.5)], timeout_s=30, max_output=1024)
    measured = float(r.stdout)
    pid = (await engine.inspect(sid))["State"]["Pid"]
    here = cgroup_cpu_s(pid, sid)
    # the program's own count, plus the engine's work in the container (the exec's start)
    assert here is not None and measured <= here <= measured + 0.5, (here, measured)
    stats = await engine._stats_cpu_s(sid)  # the engine's count of the same (idle) container
    assert stats is not None and abs(stats - here) <= 0.02 * here, (stats, here)
    took, got = [], []
    for _ in range(3):
        t = time.perf_counter()
        got.append(await backend.cpu_s(sid))
        took.append(time.perf_counter() - t)
    assert all(g is not None and abs(g - here) <= 0.02 * here for g in got), (got, here)
    assert statistics.median(took) < 0.3, took  # the stats' wait: ~1 s each, one after another
    assert cgroup_cpu_s(os.getpid(), sid) is None  # this process's cgroup is not the container's
    assert cgroup_cpu_s(pid, sid[:12]) is None  # only the full id names it
    await backend.close(sid)
    assert await backend.cpu_s(sid) is None
