"""Set up once, fork for the group (issue 78, item 5), on this machine's Docker engine (``DOCKER_HOST``).

    eval "$(bash .ci/docker.sh start)"; python tests/bench/fork.py [--group 8] [--rounds 3] [--latency 20]

One sandbox worker of a read-only Docker pool on a real nats-server, in this process. The set-up task builds a
small package in the sandbox: a copy of Python's standard library (no tests, no GUI) byte-compiled ``--rounds``
times at three optimisation levels (``compileall -f -o 0 -o 1 -o 2``: CPU-bound, no network), about 55 MB in
``/work`` at its end; its solo time is printed (the issue asks for a set-up of at least 20 s). Then, for a group of
``--group``:

- forked: one sandbox set up, then forked into ``--group`` copies (``box.fork``) and closed;
- set up N times: ``--group`` sandboxes, each running the set-up, at once;

each to the group's first turn (every sandbox of the group answering an ``exec``): its wall time and
sandbox-seconds (the seconds each sandbox was held until then, summed). Then fork latency per child, p50/p99:
``--latency`` forks of one child each, one after another, from a set-up sandbox (the child answering an exec),
against ``--latency`` cold creates (``ctx.sandbox()``, answering an exec) on the same engine. The load average
is printed in the header: wall times on a shared machine move with it. Not a CI test.

``--parts`` picks what runs (default all): ``group`` (the two above), ``fork`` (the first alone), ``latency``, and
``seed_once``: the same
set-up as a task's ``seed`` (``tests/envs/seeded_box.py`` with ``resources.env.seed_once``), a batch of one task
with ``--group`` repeats run end to end (the scripted policy, a TEST DOUBLE for the LLM; agent, environment and
sandbox workers in this process): with ``seed_once`` (seeded once, each repeat restored into a fork of its
sandbox) against without (each repeat seeds its own), wall time from submit to the group's last row, and seeds.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import anyio
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from gym_runtime.client import Client  # noqa: E402
from gym_runtime.config import SandboxConfig, SandboxLimits, load_config, resolve_config  # noqa: E402
from gym_runtime.messages import SandboxSpec  # noqa: E402
from gym_runtime.observability.tracing import Telemetry  # noqa: E402
from gym_runtime.ops.nats_server import EmbeddedServer  # noqa: E402
from gym_runtime.sandboxes.client import Sandbox, Sandboxes  # noqa: E402
from gym_runtime.sandboxes.engine_api import POOL  # noqa: E402
from gym_runtime.sandboxes.engine_http import Engine, socket_of  # noqa: E402
from gym_runtime.sandboxes.images import ensure_base  # noqa: E402
from gym_runtime.transport.bus import Bus  # noqa: E402
from gym_runtime.transport.jetstream import ensure_streams  # noqa: E402
from gym_runtime.workers.sandbox_worker import SandboxWorker  # noqa: E402
from tests.envs.seeded_box import task as box_task  # noqa: E402

SETUP = (
    "set -e; mkdir -p /work; cp -r /usr/lib/python3.11 /work/pkg; cd /work/pkg; "
    "rm -rf test idlelib tkinter lib2to3/tests; "
    "find . -name __pycache__ -prune -exec rm -rf {} +; "
    'for i in $(seq "$1"); do python3 -m compileall -q -f -j 1 -o 0 -o 1 -o 2 . >/dev/null; done; '
    "python3 -c 'import sys; sys.path.insert(0, \".\"); import json, email, asyncio' && du -sm /work | cut -f1"
)
FIRST_TURN = "ls /work/pkg/__pycache__ | wc -l"


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(p / 100 * len(xs)) - 1))]


class Group:
    """Sandboxes of one group and when each was acquired: its sandbox-seconds at the first turn."""

    def __init__(self) -> None:
        self.held: dict[str, float] = {}
        self.ended: dict[str, float] = {}

    def got(self, box: Sandbox, at: float | None = None) -> None:
        self.held[box.id] = time.monotonic() if at is None else at

    def closed(self, box: Sandbox) -> None:
        self.ended[box.id] = time.monotonic()

    def seconds(self, ready: float) -> float:
        return sum(self.ended.get(sid, ready) - t for sid, t in self.held.items())


async def set_up(box: Sandbox, rounds: int) -> float:
    started = time.monotonic()
    r = await box.exec(["sh", "-c", SETUP, "setup", str(rounds)], timeout_s=3600)
    assert r.exit_code == 0, r.stderr.decode(errors="replace")
    return time.monotonic() - started


async def first_turn(boxes: list[Sandbox]) -> None:
    async with anyio.create_task_group() as tg:
        for box in boxes:

            async def one(b: Sandbox = box) -> None:
                r = await b.exec(FIRST_TURN)
                assert r.exit_code == 0 and int(r.stdout) > 100, r

            tg.start_soon(one)


async def forked(bus: Bus, pool: str, n: int, rounds: int) -> tuple[float, float, float]:
    """Wall to the first turn, sandbox-seconds, and the fork's own time."""
    group, started = Group(), time.monotonic()
    template = Sandboxes(bus, pool, deadline=time.time() + 7200)
    parent = await template.create(template_spec())
    group.got(parent, started)
    await set_up(parent, rounds)
    t = time.monotonic()
    kids = await parent.fork(n)
    fork_s = time.monotonic() - t
    for kid in kids:
        group.got(kid, t)
    await parent.close()
    group.closed(parent)
    await first_turn(kids)
    ready = time.monotonic()
    for kid in kids:
        await kid._owner.close_all()
    return ready - started, group.seconds(ready), fork_s


async def eight_set_ups(bus: Bus, pool: str, n: int, rounds: int) -> tuple[float, float]:
    group, started = Group(), time.monotonic()
    holders = [Sandboxes(bus, pool, deadline=time.time() + 7200) for _ in range(n)]
    boxes: list[Sandbox] = []

    async def one(h: Sandboxes) -> None:
        box = await h.create(template_spec())
        group.got(box, started)
        boxes.append(box)
        await set_up(box, rounds)

    async with anyio.create_task_group() as tg:
        for h in holders:
            tg.start_soon(one, h)
    await first_turn(boxes)
    ready = time.monotonic()
    for h in holders:
        await h.close_all()
    return ready - started, group.seconds(ready)


async def latencies(bus: Bus, pool: str, n: int, rounds: int) -> tuple[list[float], list[float]]:
    template = Sandboxes(bus, pool, deadline=time.time() + 7200)
    parent = await template.create(template_spec())
    await set_up(parent, 1)
    fork_s, cold_s = [], []
    for _ in range(n):
        t = time.monotonic()
        [kid] = await parent.fork(1)
        await kid.exec("true")
        fork_s.append(time.monotonic() - t)
        await kid.close()
        cold = Sandboxes(bus, pool, deadline=time.time() + 600)
        t = time.monotonic()
        box = await cold.create(template_spec())
        await box.exec("true")
        cold_s.append(time.monotonic() - t)
        await box.close()
    await template.close_all()
    return fork_s, cold_s


async def seed_once_batch(url: str, sock: str, group: int, rounds: int, once: bool) -> tuple[float, int, list[float]]:
    """One task's ``group`` repeats through every worker, ``seed_once`` or not: wall s from submit to the last row,
    how many seeds ran, the rewards."""
    pool = f"once{uuid.uuid4().hex[:6]}"
    with tempfile.TemporaryDirectory() as tmp:
        seeds = Path(tmp) / "seeds"
        setup = f"sh -c {shlex.quote(SETUP)} setup {rounds} >/dev/null"
        env = {"server": "tests.envs.seeded_box", "sandbox": pool, "seed_once": once, "concurrency": 4 * group}
        env["options"] = {"seeds": str(seeds), "setup": setup}
        limits = {"disk_mb": 256, "timeout_s": 3600, "memory_mb": 1024}
        cfg = {
            "namespace": "gym",
            "models": {"policy": {"adapter": "scripted", "concurrency": 4 * group}},
            "sandboxes": {pool: {"engine": f"unix://{sock}", "capacity": 4 * group, "limits": limits}},
            "resources": {"env": env},
            "agents": {
                "agent": {
                    "agent": "agents.simple",
                    "model": "policy",
                    "resource": "env",
                    "timeout_s": 3600,
                    "concurrency": 4 * group,
                }
            },
        }
        path = Path(tmp) / "config.yaml"
        path.write_text(yaml.safe_dump(cfg))
        async with Client(resolve_config(load_config(path)), nats=url) as client:
            started = time.monotonic()
            batch = await client.submit([box_task("pkg")], repeats=group)
            rows = await batch.gather()
            wall = time.monotonic() - started
        return wall, len(seeds.read_text().split()), [r.get("reward", -1.0) for r in rows]


def template_spec() -> SandboxSpec:
    return SandboxSpec(timeout_s=3600)


async def main(args: argparse.Namespace) -> None:
    parts = set(args.parts.split(","))
    sock = socket_of(os.environ.get("DOCKER_HOST") or "")
    tmp = f"/tmp/gym-bench-fork-{uuid.uuid4().hex[:6]}"
    srv = EmbeddedServer(store_dir=f"{tmp}/js", sync="interval")
    srv.start()
    pool = f"fork{uuid.uuid4().hex[:6]}"
    try:
        async with Engine(sock) as engine:
            await ensure_base(engine)
            bus = await Bus.connect(srv.url, namespace="gym", telemetry=Telemetry(), name="bench")
            await ensure_streams(bus)
            limits = SandboxLimits(disk_mb=256, timeout_s=3600, memory_mb=1024)
            cfg = SandboxConfig(engine=f"unix://{sock}", capacity=4 * args.group, limits=limits, rootfs=args.rootfs)
            worker = SandboxWorker(bus, pool, cfg)
            print(f"# rootfs {args.rootfs}; load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
            async with anyio.create_task_group() as tg:
                await tg.start(worker.run)
                solo = Sandboxes(bus, pool, deadline=time.time() + 7200)
                box = await solo.create(template_spec())
                one_s = await set_up(box, args.rounds)
                size = (await box.exec("du -sm /work | cut -f1")).stdout.decode().strip()
                await solo.close_all()
                print(f"one set-up alone: {one_s:.1f} s ({size} MB in /work)", flush=True)
                if "fork" in parts and "group" not in parts:
                    f_wall, f_sbx, fork_s = await forked(bus, pool, args.group, args.rounds)
                    print(f"group of {args.group} forked: ready in {f_wall:.1f} s ({f_wall / one_s:.2f} x one set-up)")
                    print(f"the fork of {args.group} itself: {fork_s:.2f} s ({fork_s / args.group:.2f} s per child)")
                    print(f"load average now: {os.getloadavg()[0]:.1f}", flush=True)
                if "group" in parts:
                    f_wall, f_sbx, fork_s = await forked(bus, pool, args.group, args.rounds)
                    print(f"load average now: {os.getloadavg()[0]:.1f}")
                    s_wall, s_sbx = await eight_set_ups(bus, pool, args.group, args.rounds)
                    print(f"load average now: {os.getloadavg()[0]:.1f}")
                    print(f"\ngroup of {args.group}, to its first turn      wall s   sandbox-s   x one set-up")
                    print(f"forked (1 set-up + fork)          {f_wall:8.1f}  {f_sbx:9.1f}   {f_wall / one_s:6.2f}")
                    eight = f"set up {args.group} times"
                    print(f"{eight:34}{s_wall:8.1f}  {s_sbx:9.1f}   {s_wall / one_s:6.2f}")
                    print(f"the fork of {args.group} itself: {fork_s:.2f} s ({fork_s / args.group:.2f} s per child)")
                if "latency" in parts:
                    fork_lat, cold_lat = await latencies(bus, pool, args.latency, args.rounds)
                    print(f"\nper child ({args.latency} each)     p50 s   p99 s")
                    print(f"fork of one child      {pct(fork_lat, 50):6.2f}  {pct(fork_lat, 99):6.2f}")
                    print(f"cold create            {pct(cold_lat, 50):6.2f}  {pct(cold_lat, 99):6.2f}")
                    print(f"(means: fork {statistics.mean(fork_lat):.2f} s, cold {statistics.mean(cold_lat):.2f} s)")
                    print(f"load average now: {os.getloadavg()[0]:.1f}", flush=True)
                if "seed_once" in parts:
                    print(f"\na batch of 1 task x {args.group}, submit to last row   wall s   x one set-up   seeds")
                    for once in (True, False):
                        wall, seeds, rewards = await seed_once_batch(srv.url, sock, args.group, args.rounds, once)
                        assert rewards == [1.0] * args.group, rewards
                        what = "seed_once (seeded once, forked)" if once else f"without (seeded {args.group} times)"
                        print(f"{what:40} {wall:8.1f}   {wall / one_s:12.2f}   {seeds:5}", flush=True)
                        print(f"load average now: {os.getloadavg()[0]:.1f}", flush=True)
                tg.cancel_scope.cancel()
            await bus.close()
            left = await engine.containers({POOL: f"gym.{pool}"})
            print(f"containers left: {len(left)}; load average at end: {os.getloadavg()[0]:.1f}")
    finally:
        srv.stop()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3, help="compile rounds of the set-up")
    p.add_argument("--latency", type=int, default=20, help="forks and cold creates timed one by one")
    p.add_argument("--parts", default="group,latency,seed_once", help="what runs: group, fork, latency, seed_once")
    p.add_argument("--rootfs", choices=["read-only", "writable"], default="read-only", help="the pool's rootfs")
    anyio.run(main, p.parse_args())
