"""The sandbox fleet against the raw Engine API, on this machine's Docker engine (``DOCKER_HOST``).

    eval "$(bash .ci/docker.sh start)"; python tests/bench/sandboxes.py [--creates 64] [--concurrency 8] [--execs 500]

Each row beside its baseline, measured in the same run (load stated in the header):

- cold creates/s: ``--creates`` sandboxes at ``--concurrency`` at once through one sandbox worker on a real
  nats-server (create, then close), against ``POST /containers/create`` + ``/start`` (then remove) made
  directly from one process with the same container body;
- exec overhead: the median of ``--execs`` ``true`` commands through the fleet (the author's
  ``box.exec``) against the same exec made directly with the Engine API from one process.
Not a CI test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable

import anyio

from gym_runtime.config import SandboxConfig
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.sandboxes.backend import Resolved
from gym_runtime.sandboxes.client import Sandboxes
from gym_runtime.sandboxes.engine_api import EngineBackend
from gym_runtime.sandboxes.engine_http import Engine, socket_of
from gym_runtime.sandboxes.images import ensure_base
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.jetstream import ensure_streams
from gym_runtime.workers.sandbox_worker import SandboxWorker


async def at_once(n: int, concurrency: int, one: Callable[[], Awaitable[None]]) -> float:
    """Seconds for ``n`` calls of ``one`` at most ``concurrency`` at a time."""
    limit = anyio.Semaphore(concurrency)

    async def run() -> None:
        async with limit:
            await one()

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(n):
            tg.start_soon(run)
    return time.perf_counter() - started


async def main(args: argparse.Namespace) -> None:
    sock = socket_of(os.environ.get("DOCKER_HOST") or "")
    tmp = f"/tmp/gym-bench-sandboxes-{uuid.uuid4().hex[:6]}"
    srv = EmbeddedServer(store_dir=f"{tmp}/js", sync="interval")
    srv.start()
    pool = f"bench{uuid.uuid4().hex[:6]}"
    try:
        async with Engine(sock) as engine:
            image = await ensure_base(engine)
            raw = EngineBackend(engine, name="docker", pool=f"raw.{pool}")
            lim = SandboxConfig().limits
            spec = Resolved(
                image=image, cpu=lim.cpu, memory_mb=lim.memory_mb, pids=lim.pids, disk_mb=lim.disk_mb,
                timeout_s=lim.timeout_s, max_output=lim.max_output,
            )  # fmt: skip
            body = raw.container_body(spec, owner="bench", lease="bench", expires=time.time() + 3600)

            async def raw_create() -> None:
                cid = await engine.create(body)
                await engine.start(cid)
                await engine.remove(cid)

            bus = await Bus.connect(srv.url, namespace="gym", telemetry=Telemetry(), name="bench")
            await ensure_streams(bus)
            worker = SandboxWorker(bus, pool, SandboxConfig(engine=f"unix://{sock}", capacity=10_000))
            boxes = Sandboxes(bus, pool, lease="bench", deadline=time.time() + 3600)

            async def fleet_create() -> None:
                box = await boxes.sandbox()
                await box.close()

            async with anyio.create_task_group() as tg:
                await tg.start(worker.run)
                await at_once(4, 4, raw_create)  # warm both paths
                await at_once(4, 4, fleet_create)
                t_raw = await at_once(args.creates, args.concurrency, raw_create)
                t_fleet = await at_once(args.creates, args.concurrency, fleet_create)
                raw_rate, fleet_rate = args.creates / t_raw, args.creates / t_fleet

                async with boxes.sandbox() as box:
                    direct, through = [], []
                    for _ in range(args.execs):
                        t = time.perf_counter()
                        await engine.exec(box.id, ["true"], timeout_s=30, max_output=1024)
                        direct.append(time.perf_counter() - t)
                        t = time.perf_counter()
                        await box.exec(["true"], timeout_s=30)
                        through.append(time.perf_counter() - t)
                tg.cancel_scope.cancel()
            await bus.close()
    finally:
        srv.stop()
    load = os.getloadavg()
    d_med, f_med = statistics.median(direct) * 1000, statistics.median(through) * 1000
    print(f"sandbox fleet vs raw Engine API (Docker {os.uname().nodename}, {os.cpu_count()} cores, "
          f"load {load[0]:.1f} {load[1]:.1f} {load[2]:.1f})")  # fmt: skip
    print()
    print("| measure | raw Engine API, one process | through the fleet | fleet / raw |")
    print("| --- | --- | --- | --- |")
    print(f"| cold creates/s ({args.creates} at {args.concurrency} at once, create+start+remove) "
          f"| {raw_rate:.1f} | {fleet_rate:.1f} | {fleet_rate / raw_rate:.0%} |")  # fmt: skip
    print(f"| exec `true`, median of {args.execs} (ms) | {d_med:.1f} | {f_med:.1f} | +{f_med - d_med:.1f} ms |")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--creates", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--execs", type=int, default=500)
    anyio.run(main, p.parse_args())
