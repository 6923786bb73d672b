"""A stopped or frozen engine fails a sandbox call typed within seconds; a slow call on a live one is never cut off.

The hung engine is a real unix socket that accepts connections and never answers (what a SIGSTOPped ``dockerd``
does: the kernel still accepts on its socket); the live one is the shared test engine (``.ci/docker.sh start``).
A background process's stream is frozen mid-run through a socket in front of the live engine that stops passing
bytes (the shared engine itself is never stopped).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket as socketlib
import subprocess
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from gym_runtime.errors import Failure
from gym_runtime.sandboxes.engine_api import EngineBackend
from gym_runtime.sandboxes.engine_http import PING_S, STALL_S, Engine
from tests.docker import docker_socket
from tests.helpers import eventually, freeze
from tests.test_sandbox_engine import spec

DOCKERD = "/usr/sbin/dockerd"


@pytest.fixture
async def hung_engine() -> AsyncIterator[str]:
    """The socket of an "engine" that accepts every connection, reads what it is sent, and never answers."""
    where = Path(tempfile.mkdtemp(prefix="gym-hung-", dir="/tmp"))  # short: a unix socket's path is at most 107
    path = str(where / "engine.sock")

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read(1 << 16):
            pass
        writer.close()

    server = await asyncio.start_unix_server(hold, path)
    try:
        yield path
    finally:
        server.close()
        shutil.rmtree(where, ignore_errors=True)


async def test_a_create_on_an_engine_that_never_answers_fails_sandbox_unavailable_within_seconds(
    hung_engine: str,
) -> None:
    async with Engine(hung_engine) as engine:
        backend = EngineBackend(engine, name="docker", pool=f"test{uuid.uuid4().hex[:8]}")
        started = time.monotonic()
        with anyio.fail_after(60), pytest.raises(Failure) as got:  # before: the create's 120 s engine timeout
            await backend.create(spec("any:image"), owner="w1", lease="b:0:0")
        took = time.monotonic() - started
    assert got.value.info.error_class == "sandbox_unavailable", got.value.info
    assert got.value.info.retryable and got.value.observed
    said = got.value.info.message
    assert hung_engine in said and "does not answer" in said and "POST /containers/create" in said, said
    assert "\n" not in said
    assert STALL_S <= took < STALL_S + PING_S + 15, took


async def test_a_long_quiet_exec_on_a_live_engine_is_not_cut_off(engine: Engine, base_image: str) -> None:
    backend = EngineBackend(engine, name="docker", pool=f"test{uuid.uuid4().hex[:8]}")
    sid = await backend.create(spec(base_image), owner="w1", lease="b:0:0")
    try:
        quiet_s = STALL_S + PING_S + 2  # no output past a ping's whole window: only the pings say it is alive
        r = await backend.exec(sid, ["sleep", f"{quiet_s:g}"], timeout_s=quiet_s + 60, max_output=1024)
        assert (r.exit_code, r.timed_out) == (0, False), r
        assert r.duration_s >= quiet_s
    finally:
        await backend.close(sid)


@pytest.fixture
async def private_dockerd() -> AsyncIterator[tuple[str, subprocess.Popen[bytes]]]:
    """A dockerd of this test's own (started as ``.ci/docker.sh`` starts the shared one, no image in it), to
    freeze: the shared engine is never stopped. Its socket and process; stopped by its PID at the end."""
    if not os.path.exists(DOCKERD) or os.geteuid() != 0:
        pytest.skip(f"{DOCKERD} (run as root) is needed for a private engine to freeze")
    where = Path(tempfile.mkdtemp(prefix="gym-dockerd-", dir="/tmp"))
    sock = str(where / "docker.sock")
    argv = [DOCKERD, "--bridge=none", "--iptables=false", "--ip-forward=false", "--ip-masq=false"]
    argv += ["--data-root", str(where / "root"), "--exec-root", str(where / "exec")]
    argv += ["--pidfile", str(where / "dockerd.pid"), "-H", f"unix://{sock}"]
    with open(where / "dockerd.log", "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        await eventually(lambda: _pings(sock), within=60)
        yield sock, proc
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(where, ignore_errors=True)


def _pings(sock: str) -> bool:
    try:
        with socketlib.socket(socketlib.AF_UNIX) as s:
            s.settimeout(2)
            s.connect(sock)
            s.sendall(b"GET /_ping HTTP/1.0\r\nHost: engine\r\n\r\n")
            return s.recv(64).split(b" ", 2)[1:2] == [b"200"]
    except OSError:
        return False


async def test_a_frozen_dockerd_fails_a_create_sandbox_unavailable_within_seconds(
    private_dockerd: tuple[str, subprocess.Popen[bytes]],
) -> None:
    sock, proc = private_dockerd
    async with Engine(sock) as engine:
        backend = EngineBackend(engine, name="docker", pool=f"test{uuid.uuid4().hex[:8]}")
        with pytest.raises(Failure) as live:  # alive: the image is missing, said at once
            await backend.create(spec("gym-missing:image"), owner="w1", lease="b:0:0")
        assert live.value.info.error_class == "tool_error", live.value.info
        freeze(proc.pid)  # every thread stopped: a request sent right after a kill was answered under load
        started = time.monotonic()
        with anyio.fail_after(60), pytest.raises(Failure) as got:  # before: the create's 120 s engine timeout
            await backend.create(spec("gym-missing:image"), owner="w1", lease="b:0:0")
        took = time.monotonic() - started
    assert got.value.info.error_class == "sandbox_unavailable", got.value.info
    assert sock in got.value.info.message, got.value.info.message
    assert took < STALL_S + PING_S + 15, took
    print(f"frozen dockerd: the create failed sandbox_unavailable {took:.1f}s after the freeze")


class FreezableEngine:
    """A unix socket in front of the live engine that passes bytes both ways until ``frozen``; frozen, it accepts
    connections and reads nothing more on, answers nothing (what a SIGSTOPped ``dockerd``'s socket does)."""

    def __init__(self, target: str, path: str) -> None:
        self.target, self.path = target, path
        self.thawed = asyncio.Event()
        self.thawed.set()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self.thawed.wait()
        up_reader, up_writer = await asyncio.open_unix_connection(self.target)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(1 << 16):
                    await self.thawed.wait()  # frozen: what came is held, nothing is passed on
                    dst.write(data)
                    await dst.drain()
                if dst.can_write_eof():
                    dst.write_eof()  # half-closed, as the client did (an exec's input ended)
            except OSError:
                pass

        try:
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        finally:
            up_writer.close()
            writer.close()


@pytest.fixture
async def freezable_engine() -> AsyncIterator[FreezableEngine]:
    target = docker_socket()
    where = Path(tempfile.mkdtemp(prefix="gym-freeze-", dir="/tmp"))
    proxy = FreezableEngine(target, str(where / "engine.sock"))
    server = await asyncio.start_unix_server(proxy.serve, proxy.path)
    try:
        yield proxy
    finally:
        proxy.thawed.set()
        server.close()
        shutil.rmtree(where, ignore_errors=True)


async def test_a_background_process_whose_engine_freezes_fails_sandbox_unavailable_within_seconds(
    engine: Engine, base_image: str, freezable_engine: FreezableEngine
) -> None:
    """Issue 77: a background process (``box.spawn``) read through an engine that then stops answering ended only
    when its lease did (its stream silent, unwatched); now its engine's pings bound it, and it ends typed."""
    pool = f"test{uuid.uuid4().hex[:8]}"
    live = EngineBackend(engine, name="docker", pool=pool)
    sid = await live.create(spec(base_image), owner="w1", lease="b:0:0")
    try:
        async with Engine(freezable_engine.path) as via:
            proc = EngineBackend(via, name="docker", pool=pool).spawn(
                sid, ["sh", "-c", "echo started; exec sleep 300"], timeout_s=600, max_output=1024
            )
            async with anyio.create_task_group() as tg:
                await tg.start(proc.run)
                await eventually(lambda: b"started" in proc.result().stdout, within=60)
                freezable_engine.thawed.clear()
                started = time.monotonic()
                with anyio.fail_after(60):  # before: the stream waited, silent, for the command's 300 s
                    await proc.done.wait()
                took = time.monotonic() - started
                freezable_engine.thawed.set()
        assert proc.failure is not None, proc.result()
        assert proc.failure.info.error_class == "sandbox_unavailable", proc.failure.info
        said = proc.failure.info.message
        assert freezable_engine.path in said and "background process 'sh'" in said and "\n" not in said, said
        assert took < STALL_S + PING_S + 15, took
        print(f"frozen engine: a background process's read failed sandbox_unavailable {took:.1f}s after the freeze")
    finally:
        await live.close(sid)


async def test_a_long_quiet_background_process_on_a_live_engine_is_not_cut_off(engine: Engine, base_image: str) -> None:
    backend = EngineBackend(engine, name="docker", pool=f"test{uuid.uuid4().hex[:8]}")
    sid = await backend.create(spec(base_image), owner="w1", lease="b:0:0")
    try:
        quiet_s = STALL_S + PING_S + 2  # no output past a ping's whole window: only the pings say it is alive
        proc = backend.spawn(sid, ["sleep", f"{quiet_s:g}"], timeout_s=quiet_s + 60, max_output=1024)
        async with anyio.create_task_group() as tg:
            await tg.start(proc.run)
            with anyio.fail_after(quiet_s + 60):
                await proc.done.wait()
        r = proc.result()
        assert proc.failure is None and r.exit_code == 0, (proc.failure, r)
        assert r.duration_s >= quiet_s
    finally:
        await backend.close(sid)
