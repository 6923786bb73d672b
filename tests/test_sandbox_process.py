"""The ``process`` backend (the project's code sandbox) for machines without an engine: the same calls as
a container's, no image, no network, a private working directory."""

from __future__ import annotations

import anyio
import pytest

from gym_runtime.config import SandboxConfig
from gym_runtime.errors import Failure
from gym_runtime.messages import SandboxCall, SandboxReply, SandboxSpec
from gym_runtime.sandboxes.backend import Resolved
from gym_runtime.sandboxes.client import Sandboxes
from gym_runtime.sandboxes.process import ProcessBackend
from gym_runtime.transport.bus import Bus
from gym_runtime.workers.sandbox_worker import SandboxWorker
from tests.helpers import with_late_reads

SPEC = Resolved(image="", cpu=1.0, memory_mb=256, pids=64, disk_mb=16, timeout_s=10, max_output=1000)


async def test_exec_files_caps_and_wall_clock_in_the_process_sandbox() -> None:
    b = ProcessBackend(pool="p")
    sid = await b.create(SPEC, owner="w", lease="l")
    try:
        r = await b.exec(sid, ["sh", "-c", "echo hi; echo err >&2; exit 3"], timeout_s=10, max_output=1000)
        assert (r.exit_code, r.stdout, r.stderr) == (3, b"hi\n", b"err\n")
        await b.write(sid, "d/x.bin", bytes(range(256)))
        assert await b.read(sid, "d/x.bin", max_bytes=1000) == bytes(range(256))
        with pytest.raises(Failure, match="leaves the working directory"):
            await b.read(sid, "../../etc/passwd", max_bytes=1000)
        r = await b.exec(sid, ["sh", "-c", "head -c 5000 /dev/zero"], timeout_s=10, max_output=1000)
        assert r.truncated and len(r.stdout) == 1000
        r = await b.exec(sid, ["sleep", "30"], timeout_s=1, max_output=1000)
        assert r.timed_out and r.exit_code is None
        r = await b.exec(sid, ["python3", "-c", "import socket; socket.create_connection(('1.1.1.1', 53), timeout=2)"],
                         timeout_s=10, max_output=1000)  # fmt: skip
        assert r.exit_code != 0
    finally:
        await b.close(sid)
    with pytest.raises(Failure, match="gone"):
        await b.exec(sid, ["true"], timeout_s=1, max_output=10)


def test_output_written_just_before_the_command_ends_is_kept(tmp_path) -> None:
    """CI once got exit code 3 and no output from ``echo hi; echo err >&2; exit 3``: the command wrote and
    ended between the payload's reads and its check for an end."""
    got = with_late_reads(
        tmp_path,
        """
        from gym_runtime.sandboxes import process_payload as p
        head, out, err = p._exec(["sh", "-c", "echo hi; echo err >&2; exit 3"], 10, 1000)
        print(head["exit_code"], out, err)
        """,
    )
    assert got == "3 b'hi\\n' b'err\\n'"


async def test_a_process_pool_serves_the_authors_api_without_an_engine(bus: Bus) -> None:
    worker = SandboxWorker(bus, "proc", SandboxConfig(backend="process"))
    async with anyio.create_task_group() as tg:
        await tg.start(worker.run)
        boxes = Sandboxes(bus, "proc", lease="b:0:0")
        async with boxes.sandbox(memory_mb=128) as box:
            await box.write("grade.py", "print(6 * 7)")
            r = await box.exec("python3 grade.py")
            assert (r.exit_code, r.stdout) == (0, b"42\n")
            got: list[tuple[str, bytes]] = []  # no streaming here (Capabilities.stream): the output, once, at its end
            r = await box.exec("echo out; echo err >&2", on_output=lambda s, d: got.append((s, d)))
            assert got == [("stdout", b"out\n"), ("stderr", b"err\n")] and r.stdout == b"out\n"
            with pytest.raises(
                Failure,
                match=r": sandboxes\.proc: the process backend has no background processes \(Capabilities\.background",
            ):
                await box.spawn("sleep 1")
            with pytest.raises(Failure, match=r": sandboxes\.proc: the process backend has no restart \(Capabilities"):
                await box.restart()  # a verify in a policy's own sandbox needs an engine's (Harbor's pools are)
        with pytest.raises(Failure, match=r": sandboxes\.proc: the process backend has no restart \(Capabilities"):
            await boxes.sandbox(restartable=True)  # said at its open, not at the verify that would restart it
        assert worker.stats()["sandboxes"] == 0
        tg.cancel_scope.cancel()


async def test_each_try_of_one_create_gets_the_one_sandbox_made_for_it(bus: Bus) -> None:
    """A server restarted mid-create: the create reached the worker, its reply was lost at the reconnect, and the
    caller asked again. Each try names the create (``SandboxCall.key``), so the worker answers with the sandbox it
    made, not a second one held until the pool's idle timeout (seen as a lease held after the batch, under load, in
    tests/e2e/test_lease_release.py)."""
    worker = SandboxWorker(bus, "proc", SandboxConfig(backend="process"))

    async def create(key: str) -> SandboxReply:
        call = SandboxCall(op="create", spec=SandboxSpec(), lease="b:0:0", key=key)
        reply: SandboxReply = await bus.request(
            bus.subjects.sandbox_create("proc", bus.caller), call, timeout=30, op="create"
        )
        return reply

    async with anyio.create_task_group() as tg:
        await tg.start(worker.run)
        first = await create("k1")
        assert (await create("k1")).sandbox == first.sandbox  # asked again once it was made
        same: list[str] = []

        async def add(key: str) -> None:
            same.append((await create(key)).sandbox)

        async with anyio.create_task_group() as tries:  # asked again while it is being made
            tries.start_soon(add, "k2")
            tries.start_soon(add, "k2")
        assert len(set(same)) == 1 and same[0] != first.sandbox
        assert worker.stats()["sandboxes"] == 2
        assert (await create("k3")).sandbox not in (first.sandbox, same[0])  # another create: another sandbox
        tg.cancel_scope.cancel()
