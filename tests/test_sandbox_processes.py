"""Background processes and streamed exec output, through sandbox workers on a real nats-server and a real
Docker engine: a server in the box, a client exec'd against it, its kill; output as the command makes it;
a command that prints forever (capped, the worker still answers others)."""

from __future__ import annotations

import time
import uuid
from typing import Any

import anyio
import pytest

from gym_runtime.config import SandboxLimits
from gym_runtime.errors import Failure
from gym_runtime.sandboxes.client import Sandboxes
from gym_runtime.sandboxes.engine_api import POOL
from gym_runtime.sandboxes.engine_http import Engine
from gym_runtime.sandboxes.forward import CHUNK
from gym_runtime.sandboxes.spec import ExecResult
from gym_runtime.transport.bus import Bus
from tests.test_sandbox_worker import fleet

CLIENT = "import urllib.request as u; print(u.urlopen('http://127.0.0.1:8000/hello.txt').read().decode())"


@pytest.fixture
def pool() -> str:
    return f"b{uuid.uuid4().hex[:8]}"


@pytest.fixture
def backend_name() -> str:  # tests/test_sandbox_podman.py runs these tests on Podman
    return "docker"


RUNNING = r"grep -l 'http[.]server' /proc/[0-9]*/cmdline"  # its own argv does not match


async def test_a_server_in_the_background_a_client_against_it_and_its_kill(
    bus: Bus, engine: Engine, base_image: str, pool: str, backend_name: str
) -> None:
    async with fleet(bus, engine, pool) as worker:
        w = await worker(backend=backend_name, limits=SandboxLimits(memory_mb=256, timeout_s=60))
        boxes = Sandboxes(bus, pool, lease="bg:0:0", deadline=time.time() + 300)
        async with boxes.sandbox() as box:
            await box.write("hello.txt", "hello from the box")
            server = await box.spawn("python3 -u -m http.server 8000 --bind 127.0.0.1")
            with anyio.fail_after(60):  # its output so far, while it runs
                while b"Serving HTTP" not in (seen := await server.poll()).stdout:
                    assert seen.exit_code is None, seen
                    await anyio.sleep(0.1)
            r = await box.exec(["python3", "-c", CLIENT], timeout_s=30)
            assert (r.exit_code, r.stdout) == (0, b"hello from the box\n")
            assert (await box.exec(RUNNING)).exit_code == 0
            end = await server.kill()
            assert end.exit_code == 137 and b"GET /hello.txt" in end.stderr  # its request log, read to its end
            assert (await box.exec(RUNNING)).exit_code == 1  # it and what it started are gone
            with pytest.raises(Failure, match=f"no background process '{server.id}'"):
                await server.poll()  # forgotten once its end was returned

            done = await box.spawn("echo out; echo err >&2; exit 3")
            r = await done.wait(timeout_s=30)
            assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (3, b"out\n", b"err\n", False)

            sleeper = await box.spawn(["sleep", "300"])
            r = await sleeper.wait(timeout_s=0.5)
            assert r.timed_out and r.exit_code is None  # still running: the author decides
            assert len(w.procs[box.id]) == 1
        # the lease's end: the sandbox, with its still-running process, is gone
        assert w.procs == {} and await engine.containers({POOL: f"gym.{pool}"}) == []
        with pytest.raises(Failure, match="is closed"):
            await sleeper.poll()


async def test_exec_output_reaches_the_caller_as_the_command_produces_it(
    bus: Bus, engine: Engine, base_image: str, pool: str, backend_name: str
) -> None:
    async with fleet(bus, engine, pool) as worker:
        await worker(backend=backend_name, limits=SandboxLimits(memory_mb=128, timeout_s=120))
        boxes = Sandboxes(bus, pool, lease="st:0:0", deadline=time.time() + 300)
        async with boxes.sandbox() as box:
            parts: list[tuple[str, bytes]] = []
            ready = anyio.Event()

            async def on_output(stream: str, data: bytes) -> None:
                parts.append((stream, data))
                if b"".join(d for s, d in parts if s == "stdout") == b"ready\n":
                    ready.set()

            async def answer() -> None:  # the command waits for this file, written only once "ready" came
                await ready.wait()
                await box.write("go", "")

            cmd = "echo ready; while [ ! -e go ]; do sleep 0.05; done; echo done >&2; echo bye"
            with anyio.fail_after(100):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(answer)
                    r = await box.exec(cmd, timeout_s=90, on_output=on_output)
            assert (r.exit_code, r.stdout, r.stderr) == (0, b"ready\nbye\n", b"done\n")
            assert b"".join(d for s, d in parts if s == "stdout") == r.stdout
            assert b"".join(d for s, d in parts if s == "stderr") == r.stderr
            got: list[bytes] = []  # a plain function will do too
            r = await box.exec(["sh", "-c", "printf abc"], on_output=lambda s, d: got.append(d))
            assert (r.stdout, b"".join(got)) == (b"abc", b"abc")

            def refuse(stream: str, data: bytes) -> None:
                raise ValueError(f"no {data!r}")

            with pytest.raises(ValueError, match="no b'abc'"):  # the author's own error, as it is
                await box.exec(["sh", "-c", "printf abc; sleep 60"], on_output=refuse)
            assert (await box.exec("echo still")).stdout == b"still\n"


async def test_a_command_printing_forever_sends_its_capped_output_and_the_worker_serves_others(
    bus: Bus, engine: Engine, base_image: str, pool: str, backend_name: str
) -> None:
    cap = 50_000
    async with fleet(bus, engine, pool) as worker:
        await worker(backend=backend_name, limits=SandboxLimits(memory_mb=128, timeout_s=60, max_output=cap))
        boxes = Sandboxes(bus, pool, lease="yes:0:0", deadline=time.time() + 300)
        async with boxes.sandbox() as noisy, boxes.sandbox() as quiet:
            parts: list[tuple[str, bytes]] = []
            first = anyio.Event()
            ended: list[ExecResult] = []

            def on_output(stream: str, data: bytes) -> None:
                parts.append((stream, data))
                first.set()

            async def flood() -> None:
                ended.append(await noisy.exec("yes", timeout_s=8, on_output=on_output))

            with anyio.fail_after(120):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(flood)
                    await first.wait()
                    r = await quiet.exec("echo alive", timeout_s=30)  # while the flood runs
                    assert r.stdout == b"alive\n" and not ended
            [r] = ended
            assert r.timed_out and r.truncated and len(r.stdout) == cap
            assert b"".join(d for s, d in parts if s == "stdout") == r.stdout  # no more than the cap was sent
            assert all(s == "stdout" and len(d) <= CHUNK for s, d in parts) and len(parts) <= 20


ALIVE = r"grep -l 'outlive[r]' /proc/[0-9]*/cmdline"  # the processes below (its own argv does not match)


async def test_a_restart_ends_every_process_however_started_and_keeps_the_files(
    bus: Bus, engine: Engine, base_image: str, pool: str, backend_name: str
) -> None:
    """``box.restart``: what a verify in the policy's own sandbox does first (Harbor's). Processes started to
    outlive their command (``setsid``, a double fork, a chain of short-lived ones, a background ``spawn``, one as
    an unprivileged user) are all gone after it; the image's file system of a writable pool is as it was left."""
    async with fleet(bus, engine, pool) as worker:
        w = await worker(backend=backend_name, rootfs="writable", limits=SandboxLimits(memory_mb=256, timeout_s=60))
        boxes = Sandboxes(bus, pool, lease="rs:0:0", deadline=time.time() + 300)
        async with boxes.sandbox(restartable=True) as box:
            started = await box.exec(
                "echo kept > /etc/kept.txt\n"
                "setsid bash -c 'exec -a outliver sleep 300' </dev/null >/dev/null 2>&1 &\n"
                "(bash -c 'exec -a outliver sleep 300' </dev/null >/dev/null 2>&1 &)\n"
                "echo 'bash -c \"exec -a outliver sleep 0.05\"; sh /tmp/chain.sh </dev/null >/dev/null 2>&1 &' "
                "> /tmp/chain.sh && sh /tmp/chain.sh </dev/null >/dev/null 2>&1 &\n"
                "setpriv --reuid=65534 --regid=65534 --clear-groups bash -c 'exec -a outliver sleep 300' "
                "</dev/null >/dev/null 2>&1 &\n"
                "echo started",
                timeout_s=30,
            )
            assert started.stdout == b"started\n", started
            await box.spawn(["bash", "-c", "exec -a outliver sleep 300"])
            with anyio.fail_after(60):  # every one of them running (the chain's current link among them)
                while len((await box.exec(ALIVE)).stdout.split()) < 5:
                    await anyio.sleep(0.1)
            await box.restart()
            assert w.procs.get(box.id, {}) == {}  # the background process was forgotten with its end
            for _ in range(5):  # nothing left, not even the chain's next link a moment later
                assert (await box.exec(ALIVE)).stdout == b""
                await anyio.sleep(0.1)
            assert (await box.exec("cat /etc/kept.txt")).stdout == b"kept\n"


async def test_restarts_at_once_keep_every_sandbox_and_one_not_opened_restartable_is_refused(
    bus: Bus, engine: Engine, base_image: str, pool: str, backend_name: str
) -> None:
    """Six sandboxes restarted five times each, all at once: each is still there after every restart, its files
    kept (on Docker 20.10 one of about thirty-five restarts under load lost its container while it ran with the
    engine's auto-removal: moby#43751, fixed in 23.0; a restartable one is made without it). One opened without
    ``restartable=True`` is refused its restart in one line, and keeps running."""
    async with fleet(bus, engine, pool) as worker:
        await worker(backend=backend_name, rootfs="writable", limits=SandboxLimits(memory_mb=64, timeout_s=60))
        boxes = Sandboxes(bus, pool, lease="rs:1:0", deadline=time.time() + 300)
        opened = [await boxes.sandbox(restartable=True) for _ in range(6)]

        async def five_restarts(box: Any, n: int) -> None:
            await box.write("/etc/which.txt", f"box {n}")
            for _ in range(5):
                await box.restart()
                assert (await box.exec("cat /etc/which.txt")).stdout == f"box {n}".encode()

        async with anyio.create_task_group() as tg:
            for n, box in enumerate(opened):
                tg.start_soon(five_restarts, box, n)
        ids = {c["Id"] for c in await engine.containers({POOL: f"gym.{pool}"})}
        assert {b.id for b in opened} <= ids
        plain = await boxes.sandbox()
        with pytest.raises(Failure, match=r"was not opened restartable: open it with sandbox\(restartable=True\)"):
            await plain.restart()
        assert (await plain.exec("echo alive")).stdout == b"alive\n"
        await boxes.close_all()
