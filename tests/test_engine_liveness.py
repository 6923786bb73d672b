"""A stopped or frozen engine fails a sandbox call typed within seconds; a slow call on a live one is never cut off.

The hung engine is a real unix socket that accepts connections and never answers (what a SIGSTOPped ``dockerd``
does: the kernel still accepts on its socket); the live one is the shared test engine (``.ci/docker.sh start``).
"""

from __future__ import annotations

import asyncio
import shutil
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
from tests.test_sandbox_engine import spec


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
