"""The sandbox fleet against the raw Engine API, on this machine's Docker engine (``DOCKER_HOST``).

    eval "$(bash .ci/docker.sh start)"; python tests/bench/sandboxes.py [--creates 64] [--concurrency 8] [--execs 500]
        [--acquires 32] [--rounds 5]

Each row beside its baseline, measured in the same run (load stated in the header):

- cold creates/s: ``--creates`` sandboxes at ``--concurrency`` at once through one sandbox worker on a real
  nats-server (create, then close), against ``POST /containers/create`` + ``/start`` (then remove) made
  directly from one process with the same container body;
- exec overhead: the median of ``--execs`` ``true`` commands through the fleet (the author's
  ``box.exec``) against the same exec made directly with the Engine API from one process;
- acquire latency, p50/p99: ``--acquires`` concurrent ``ctx.sandbox()`` (request to a held sandbox) from a
  pool with ``warm: --acquires`` (filled before each of ``--rounds`` rounds), against the same from a pool
  without a warm pool (cold: each acquire creates and starts a container).
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
                warm_ms = await acquires(bus, tg, sock, args, warm=True)
                cold_ms = await acquires(bus, tg, sock, args, warm=False)
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
    print()
    print(
        f"| acquire latency, {args.acquires} at once ({len(warm_ms)} warm, {len(cold_ms)} cold) | p50 (ms) | p99 (ms) |"
    )
    print("| --- | --- | --- |")
    for what, ms in (("cold (no warm pool)", cold_ms), (f"warm pool (`warm: {args.acquires}`)", warm_ms)):
        print(f"| {what} | {pct(ms, 50):.1f} | {pct(ms, 99):.1f} |")


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered)) - 1))]


async def acquires(
    bus: Bus, tg: anyio.abc.TaskGroup, sock: str, args: argparse.Namespace, *, warm: bool
) -> list[float]:
    """Latencies (ms) of ``args.acquires`` concurrent acquires, ``args.rounds`` times (cold: 2 rounds), from a
    pool of its own (with a warm pool of that size, filled before each round, or none)."""
    n = args.acquires
    pool = f"acq{uuid.uuid4().hex[:6]}"
    worker = SandboxWorker(bus, pool, SandboxConfig(engine=f"unix://{sock}", capacity=2 * n, warm=n if warm else 0))
    await tg.start(worker.run)
    boxes = Sandboxes(bus, pool, lease="bench", deadline=time.time() + 3600)
    out: list[float] = []
    for _ in range(args.rounds if warm else 2):
        while warm and (len(worker.warm) < n or worker.warming):
            await anyio.sleep(0.05)

        async def one() -> None:
            t = time.perf_counter()
            await boxes.sandbox()  # held by ``boxes`` until close_all
            out.append((time.perf_counter() - t) * 1000)

        async with anyio.create_task_group() as inner:
            for _ in range(n):
                inner.start_soon(one)
        await boxes.close_all()
    assert not warm or worker.warm_hits == n * args.rounds, worker.stats()
    await worker.drain()
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--creates", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--execs", type=int, default=500)
    p.add_argument("--acquires", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    anyio.run(main, p.parse_args())
