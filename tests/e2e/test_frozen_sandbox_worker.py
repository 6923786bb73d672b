"""A frozen sandbox worker is named by its process (``node/pid``) even for a call it never sent a keepalive for
(issue 77): the reply that handed the sandbox out names the worker's process, as a resource session's seed does, so
the call's silence points at it (``why``, ``worker.silent``), not only at its pool. Real server, a real sandbox
worker process (the ``process`` backend: no engine needed), SIGSTOPped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import yaml

from gym_runtime.errors import Failure
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.sandboxes.client import Sandboxes
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.discovery import discover
from tests.helpers import REPO, eventually


async def test_a_frozen_sandbox_workers_silent_call_names_its_process_before_any_keepalive(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    config = tmp_path / "config.yaml"
    pool = "box"
    sandboxes = {pool: {"backend": "process", "capacity": 4, "limits": {"timeout_s": 60}}}
    config.write_text(yaml.safe_dump({"namespace": "gym", "sandboxes": sandboxes}))
    worker = subprocess.Popen(
        [sys.executable, "-m", "gym_runtime.cli", "start", str(config), "--nats", nats_server.url,
         "--only", f"sandboxes.{pool}", "--in-process"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    stopped = False
    try:
        found: list[str] = []
        with anyio.fail_after(60):
            while not found:
                found = [str(w["process"]) for w in await discover(bus, wait_s=0.5) if w.get("role") == "sandbox"]
        tag = found[0]
        assert tag.endswith(f"/{worker.pid}"), tag
        boxes = Sandboxes(bus, pool, lease="frozen-test", deadline=time.time() + 600)
        box = await boxes.sandbox()
        assert (await box.exec("echo hi")).stdout.strip() == b"hi"
        os.kill(worker.pid, signal.SIGSTOP)
        stopped = True
        failed: list[Failure] = []

        async def call_it() -> None:
            try:
                await box.exec("true")
            except Failure as e:
                failed.append(e)

        async with anyio.create_task_group() as tg:
            tg.start_soon(call_it)
            # before: a call the frozen worker never beat for had no process (``by`` empty): only the pool named
            await eventually(lambda: any(".exec" in c.subject for c in bus.calls_in_flight()), within=30)
            assert [c.by for c in bus.calls_in_flight() if ".exec" in c.subject] == [tag]
            with anyio.fail_after(60):  # the bus's liveness window (10 s) fails it
                while not failed:
                    await anyio.sleep(0.2)
        assert failed[0].info.error_class == "worker_lost", failed[0].info
        assert [by for by, _ in bus.went_silent.values()] == [tag]  # what ``why`` names once the call has failed
    finally:
        if stopped:
            os.kill(worker.pid, signal.SIGCONT)
        worker.terminate()
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
