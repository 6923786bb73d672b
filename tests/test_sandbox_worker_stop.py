"""A sandbox worker that stops while an engine call of a create, a fork or a close is under way leaves no container
behind, on a real nats-server and a real Docker engine, in process. Its handlers are cancelled with asyncio cancels
(``TaskSet``), which pass anyio's shields: a create cut after the engine made its container, or a close cut after
the sandbox left the worker's books, left a container no one removed (``transport.tasks.Whole``)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from gym_runtime.config import SandboxConfig
from gym_runtime.messages import SandboxSpec
from gym_runtime.sandboxes.client import Sandboxes
from gym_runtime.sandboxes.engine_api import POOL
from gym_runtime.sandboxes.engine_http import Engine
from gym_runtime.transport.bus import Bus
from gym_runtime.workers.sandbox_worker import SandboxWorker
from tests.test_sandbox_fork import fork_images, fork_volumes, holders, swept
from tests.test_sandbox_worker import pool

__all__ = ["pool", "swept"]  # the fixtures


@pytest.fixture
async def cleared(engine: Engine, pool: str, swept: None) -> AsyncIterator[None]:
    """After the test, whatever it asserted: none of its pool's containers left in the shared engine (one a cut
    create left is never started, so its keeper never ends it), then its fork images and snapshots (``swept``)."""
    yield
    for c in await engine.containers({POOL: f"gym.{pool}"}):
        await engine.remove(c["Id"])


@pytest.mark.parametrize("op", ["create", "fork", "fork-writable", "close"])
async def test_a_worker_stopping_mid_call_leaves_no_container(
    bus: Bus, engine: Engine, base_image: str, pool: str, cleared: None, monkeypatch: Any, op: str
) -> None:
    rootfs = "writable" if op == "fork-writable" else "read-only"
    worker = SandboxWorker(bus, pool, SandboxConfig(engine=f"unix://{engine.socket_path}", capacity=4, rootfs=rootfs))
    boxes = Sandboxes(bus, pool, deadline=time.time() + 300)
    under_way = anyio.Event()
    async with anyio.create_task_group() as tg:
        await tg.start(worker.run)
        assert worker.backend is not None
        box = await boxes.create(SandboxSpec()) if op != "create" else None
        eng = worker.backend.engine  # type: ignore[attr-defined]
        call = "remove" if op == "close" else "create"
        real = getattr(eng, call)

        async def slowed(*args: Any, **kw: Any) -> Any:  # the engine's own call, and the worker stopping after it
            out = await real(*args, **kw) if call == "create" else None
            under_way.set()
            await anyio.sleep(1.0)
            return out if call == "create" else await real(*args, **kw)

        monkeypatch.setattr(eng, call, slowed)
        if op == "create":
            tg.start_soon(boxes.create, SandboxSpec())
        elif op.startswith("fork"):
            assert box is not None
            tg.start_soon(box.fork)
        else:
            assert box is not None
            tg.start_soon(box.close)
        await under_way.wait()
        tg.cancel_scope.cancel()  # the worker stops (its handlers cancelled), and the call's caller with it
    assert await engine.containers({POOL: f"gym.{pool}"}) == []
    assert await fork_volumes(engine, pool) == [] and await holders(engine, pool) == []
    assert await fork_images(engine, pool) == []
