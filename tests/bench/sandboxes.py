"""The sandbox fleet against the raw Engine API, on this machine's Docker engine (``DOCKER_HOST``).

    eval "$(bash .ci/docker.sh start)"; python tests/bench/sandboxes.py [--creates 64] [--concurrency 8] [--pairs 2]
        [--execs 500] [--acquires 32] [--rounds 5]

Each row beside its baseline, measured in the same run (load stated in the header):

- cold creates/s: ``--creates`` sandboxes at ``--concurrency`` at once through one sandbox worker on a real
  nats-server (create, then close), against ``POST /containers/create`` + ``/start`` (then remove) made
  directly from one process with the same container body, in ``--pairs`` alternated pairs (raw, fleet, fleet,
  raw, ...), with each path's CPU per create: this process's (the fleet's worker and bus run in it), nats-server's,
  and the rest of the machine's (the engine: dockerd, containerd, the shims, runc);
- exec overhead: the median of ``--execs`` ``true`` commands through the fleet (the author's
  ``box.exec``) against the same exec made directly with the Engine API from one process;
- acquire latency, p50/p99: ``--acquires`` concurrent ``ctx.sandbox()`` (request to a held sandbox) from a
  pool with ``warm: --acquires`` (filled before each of ``--rounds`` rounds), against the same from a pool
  without a warm pool (cold: each acquire creates and starts a container).

Held idle (``--idle N [--hold 30]``, instead of the rows above): one sandbox worker process (``gym-runtime
start --only sandboxes.POOL``) holds N idle sandboxes (acquired 8 at a time), steady for ``--hold`` seconds:
all N still running on the engine at the end, a sample of 20 answering an exec; the worker's own memory
(its process tree's RSS) per sandbox, the engine's (the PSS of dockerd, containerd, the shims and what runs
in the containers) per sandbox, and the machine's (``MemTotal - MemAvailable``: noisy, as other sessions'
work shares it). ``--placement N``: the same with two
sandbox worker processes of one pool, each with ``capacity`` N/2 (placement by free capacity must fill
both), each in a network namespace of its own (``ip netns``, where this runs as root; the nats-server is
reached through a unix socket relay, ``tests/bench/relay.py``: no network joins the namespaces); how many
each holds, and creates/s beside one worker's in the same run.
Not a CI test.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import anyio
import yaml

from gym_runtime.config import SandboxConfig
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.sandboxes.backend import Resolved
from gym_runtime.sandboxes.client import Sandboxes
from gym_runtime.sandboxes.engine_api import OWNER, POOL, EngineBackend
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
                # raw, fleet, fleet, raw, ...: neither path always runs first (the engine still tidying the
                # previous round's removals), and each path's CPU is counted where it is spent
                spent = {"raw": Spent(), "fleet": Spent()}
                for i in range(2 * args.pairs):
                    path = "raw" if i % 4 in (0, 3) else "fleet"
                    with spent[path].counting(srv.pid):
                        await at_once(args.creates, args.concurrency, raw_create if path == "raw" else fleet_create)
                n = args.creates * args.pairs
                raw_rate, fleet_rate = n / spent["raw"].wall_s, n / spent["fleet"].wall_s

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
    print(f"CPU per cold create (ms; {args.pairs} alternated pairs of {args.creates}):")
    print()
    print("| path | this process (fleet: its worker and bus too) | nats-server | the rest of the machine (the engine) "
          "| machine |")  # fmt: skip
    print("| --- | --- | --- | --- | --- |")
    for path, cpu in spent.items():
        own, nats, machine = (1000 * v / n for v in (cpu.own_s, cpu.nats_s, cpu.machine_s))
        print(f"| {path} | {own:.1f} | {nats:.1f} | {machine - own - nats:.1f} | {machine:.1f} |")
    print()
    print(
        f"| acquire latency, {args.acquires} at once ({len(warm_ms)} warm, {len(cold_ms)} cold) | p50 (ms) | p99 (ms) |"
    )
    print("| --- | --- | --- |")
    for what, ms in (("cold (no warm pool)", cold_ms), (f"warm pool (`warm: {args.acquires}`)", warm_ms)):
        print(f"| {what} | {pct(ms, 50):.1f} | {pct(ms, 99):.1f} |")


class Spent:
    """Wall time and CPU seconds of the rounds of one path, summed: this process's, nats-server's, the machine's
    (every core's busy time from ``/proc/stat``: the engine's daemons, the shims and runc among it)."""

    def __init__(self) -> None:
        self.wall_s = self.own_s = self.nats_s = self.machine_s = 0.0

    @contextlib.contextmanager
    def counting(self, nats_pid: int | None) -> Iterator[None]:
        tick = os.sysconf("SC_CLK_TCK")
        before = (time.perf_counter(), time.process_time(), proc_cpu_s(nats_pid, tick), machine_busy_s(tick))
        yield
        after = (time.perf_counter(), time.process_time(), proc_cpu_s(nats_pid, tick), machine_busy_s(tick))
        wall, own, nats, machine = (b - a for a, b in zip(before, after, strict=True))
        self.wall_s += wall
        self.own_s += own
        self.nats_s += nats
        self.machine_s += machine


def proc_cpu_s(pid: int | None, tick: int) -> float:
    """A process's user + system CPU seconds (0 where there is none)."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14 and 15 of proc(5))


def machine_busy_s(tick: int) -> float:
    """Every core's busy CPU seconds since boot (``/proc/stat``'s ``cpu`` line, idle and iowait left out)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(values[:8]) - values[3] - values[4]) / tick  # user nice system idle iowait irq softirq steal


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


def tree_rss_kb(pid: int) -> int:
    """Resident memory of ``pid`` and its descendants (kB)."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo.extend(kids.get(p, []))
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


def engine_pss_mb() -> float:
    """Proportional memory (PSS: shared pages split among their users) of the engine: dockerd, containerd,
    and every container's shim with what runs under it (the container's init and ``sleep``)."""
    kids: dict[int, list[int]] = {}
    roots: list[int] = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        comm, ppid = stat[stat.index("(") + 1 : stat.rindex(")")], int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(d))
        if comm in ("dockerd", "containerd") or comm.startswith("containerd-shim"):
            roots.append(int(d))
    seen: set[int] = set()
    total, todo = 0, roots
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        todo.extend(kids.get(p, []))
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def used_mb() -> float:
    info = {ln.split(":")[0]: int(ln.split()[1]) for ln in Path("/proc/meminfo").read_text().splitlines()}
    return (info["MemTotal"] - info["MemAvailable"]) / 1024


class Workers:
    """Sandbox worker processes of one pool (``gym-runtime start --only sandboxes.POOL``), each optionally in
    a network namespace of its own reached through a relay; all stopped (by PID) and removed at the end."""

    def __init__(self, tmp: Path, url: str, sock: str, pool: str, capacity: int) -> None:
        self.tmp, self.url, self.pool = tmp, url, pool
        cfg = {
            "namespace": "gym",
            "sandboxes": {
                pool: {"backend": "docker", "engine": f"unix://{sock}", "capacity": capacity, "idle_ttl_s": 7200}
            },
        }
        self.config = tmp / f"{pool}.yaml"
        self.config.write_text(yaml.safe_dump(cfg))
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: dict[int, Path] = {}
        self.netns: list[str] = []
        self.relay_sock = str(tmp / "nats.sock")

    def _spawn(self, argv: list[str], log: str) -> subprocess.Popen[bytes]:
        out = open(self.tmp / log, "wb")  # noqa: SIM115 (kept open for the child)
        p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(p)
        self.logs[p.pid] = self.tmp / log
        return p

    async def ready(self, proc: subprocess.Popen[bytes]) -> None:
        """Until ``start`` says ``workers ready`` (its sandbox worker takes creates)."""
        while b"workers ready" not in self.logs[proc.pid].read_bytes():
            assert proc.poll() is None, self.logs[proc.pid].read_text()[-2000:]
            await anyio.sleep(0.2)

    def start(self, *, netns: bool) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-m", "gym_runtime.cli", "start", str(self.config), "--only", f"sandboxes.{self.pool}"]
        if not netns:
            return self._spawn([*argv, "--nats", self.url], f"worker{len(self.procs)}.log")
        if not self.netns:  # the host side of the relay: the unix socket to the nats-server's TCP port
            self._spawn(
                [sys.executable, "tests/bench/relay.py", "unix-to-tcp", self.relay_sock, self.url.split("//")[1]],
                "relay-host.log",
            )
        ns = f"gymbench{uuid.uuid4().hex[:6]}"
        subprocess.run(["ip", "netns", "add", ns], check=True)
        self.netns.append(ns)
        subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"], check=True)
        into = ["ip", "netns", "exec", ns]
        self._spawn([*into, sys.executable, "tests/bench/relay.py", "tcp-to-unix", "127.0.0.1:4222", self.relay_sock],
                    f"relay-{ns}.log")  # fmt: skip
        return self._spawn([*into, *argv, "--nats", "nats://127.0.0.1:4222"], f"worker-{ns}.log")

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for ns in self.netns:
            subprocess.run(["ip", "netns", "del", ns], check=False)


async def hold(bus: Bus, engine: Engine, pool: str, n: int, seconds: float, ready: float) -> dict[str, object]:
    """Acquire ``n`` idle sandboxes 8 at a time (as many as can be had), hold them ``seconds``, check them,
    release them; what was held and how fast."""
    boxes = Sandboxes(bus, pool, lease="idle", deadline=time.time() + 7200, absent_grace_s=ready)
    got: list[object] = []
    errors: list[str] = []
    t0 = time.perf_counter()

    async def one() -> None:
        if errors:
            return
        try:
            got.append(await boxes.sandbox())
        except Exception as e:  # the largest number held is what is reported
            errors.append(repr(e))

    await at_once(n, 8, one)
    create_s = time.perf_counter() - t0
    await anyio.sleep(seconds)
    running = await engine.containers({POOL: f"gym.{pool}"})
    alive = [c for c in running if c.get("State") == "running"]
    owners: dict[str, int] = {}
    for c in alive:
        owner = c.get("Labels", {}).get(OWNER, "?")
        owners[owner] = owners.get(owner, 0) + 1
    sample = random.sample(got, min(20, len(got)))
    lat = []
    for box in sample:
        t = time.perf_counter()
        r = await box.exec(["true"], timeout_s=60)  # type: ignore[attr-defined]
        lat.append((time.perf_counter() - t) * 1000)
        assert r.exit_code == 0, r
    return {
        "held": len(got), "running": len(alive), "create_s": create_s, "errors": errors[:1], "owners": owners,
        "exec_ms": statistics.median(lat) if lat else 0.0, "boxes": boxes,
    }  # fmt: skip


async def release(engine: Engine, pool: str, boxes: Sandboxes) -> float:
    t0 = time.perf_counter()
    opened = list(boxes._open.values())
    await at_once(len(opened), 8, lambda: opened.pop().close())
    while await engine.containers({POOL: f"gym.{pool}"}):
        await anyio.sleep(0.5)
    return time.perf_counter() - t0


async def held_idle(args: argparse.Namespace) -> None:
    sock = socket_of(os.environ.get("DOCKER_HOST") or "")
    tmp = Path(f"/tmp/gym-bench-idle-{uuid.uuid4().hex[:6]}")
    tmp.mkdir()
    srv = EmbeddedServer(store_dir=str(tmp / "js"), sync="interval")
    srv.start()
    rows: list[str] = []
    try:
        async with Engine(sock) as engine:
            await ensure_base(engine)
            bus = await Bus.connect(srv.url, namespace="gym", telemetry=Telemetry(), name="bench")
            await ensure_streams(bus)
            if args.idle:
                pool = f"idle{uuid.uuid4().hex[:6]}"
                workers = Workers(tmp, srv.url, sock, pool, capacity=args.idle + 8)
                try:
                    proc = workers.start(netns=False)
                    await workers.ready(proc)
                    rss0, used0, eng0 = tree_rss_kb(proc.pid), used_mb(), engine_pss_mb()
                    r = await hold(bus, engine, pool, args.idle, args.hold, ready=60)
                    rss1, used1, eng1 = tree_rss_kb(proc.pid), used_mb(), engine_pss_mb()
                    n = max(1, int(r["held"]))  # type: ignore[call-overload]
                    rows.append(
                        f"| one worker | {r['held']} of {args.idle} | {r['running']} | {n / float(r['create_s']):.1f} "  # type: ignore[arg-type]
                        f"| {r['exec_ms']:.0f} | {(rss1 - rss0) / 1024:.0f} MB ({(rss1 - rss0) / n:.0f} kB) "
                        f"| {eng1 - eng0:.0f} MB ({(eng1 - eng0) / n:.2f} MB) "
                        f"| {used1 - used0:.0f} MB ({(used1 - used0) / n:.2f} MB) | {r['errors'] or ''} |"
                    )
                    print(rows[-1], flush=True)
                    print(f"released in {await release(engine, pool, r['boxes']):.0f} s", flush=True)  # type: ignore[arg-type]
                finally:
                    workers.stop()
            if args.placement:
                n = args.placement
                for netns in (False, True) if args.netns else (False,):
                    for count in (1, 2):
                        pool = f"place{uuid.uuid4().hex[:6]}"
                        workers = Workers(tmp, srv.url, sock, pool, capacity=n if count == 1 else n // 2)
                        try:
                            procs = [workers.start(netns=netns) for _ in range(count)]
                            for proc in procs:
                                await workers.ready(proc)
                            rss0, used0, eng0 = [tree_rss_kb(p.pid) for p in procs], used_mb(), engine_pss_mb()
                            r = await hold(bus, engine, pool, n, args.hold, ready=60)
                            rss1, used1, eng1 = [tree_rss_kb(p.pid) for p in procs], used_mb(), engine_pss_mb()
                            held = max(1, int(r["held"]))  # type: ignore[call-overload]
                            split = " + ".join(str(v) for v in sorted(r["owners"].values(), reverse=True))  # type: ignore[attr-defined]
                            per = " / ".join(f"{(b - a) / 1024:.0f}" for a, b in zip(rss0, rss1, strict=True))
                            where = "own netns each" if netns else "host netns"
                            rows.append(
                                f"| {count} worker(s), capacity {n if count == 1 else n // 2} each, {where} "
                                f"| {r['held']} of {n} | {split} | {held / float(r['create_s']):.1f} "  # type: ignore[arg-type]
                                f"| {r['exec_ms']:.0f} | {per} MB | {eng1 - eng0:.0f} MB | {used1 - used0:.0f} MB "
                                f"| {r['errors'] or ''} |"
                            )
                            print(rows[-1], flush=True)
                            await release(engine, pool, r["boxes"])  # type: ignore[arg-type]
                        finally:
                            workers.stop()
            await bus.close()
    finally:
        srv.stop()
    load = os.getloadavg()
    print(f"\nidle sandboxes held (Docker {os.uname().nodename}, {os.cpu_count()} cores, load "
          f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f}, held {args.hold:g} s)\n")  # fmt: skip
    print(
        "| fleet | held | running (by worker) | creates/s | exec ms (20) | worker memory | engine PSS "
        "| machine used | error |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(row)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--creates", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--pairs", type=int, default=2, help="alternated pairs of --creates: raw, fleet, fleet, raw, ...")
    p.add_argument("--execs", type=int, default=500)
    p.add_argument("--acquires", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--idle", type=int, default=0, help="hold this many idle sandboxes on one worker process")
    p.add_argument("--placement", type=int, default=0, help="hold this many on one, then two worker processes")
    p.add_argument("--netns", action="store_true", help="--placement also with each worker in its own netns")
    p.add_argument("--hold", type=float, default=30.0)
    a = p.parse_args()
    for flag, value in (("--pairs", a.pairs), ("--creates", a.creates), ("--concurrency", a.concurrency)):
        if value < 1:
            p.error(f"{flag} must be at least 1, not {value}")
    anyio.run(held_idle if a.idle or a.placement else main, a)
