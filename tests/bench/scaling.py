"""Scaling benchmarks for durable batches (issue: worker pools and JetStream queues).

    python tests/bench/scaling.py [--only a b c d] [--sizes 10000 100000]

(a) model latency simulated at 50 ms, model replicas 1/2/4 -> rollouts/s
(b) one model replica 5x slower than the other -> share of calls each served
(c) a model replica added mid-batch -> time until throughput rises
(d) peak RSS of the collector and of each worker process, for two batch sizes
    (must stay flat: nothing holds a whole batch in memory)
(e) is tests/bench/overhead.py (zero-latency model, per-role processes, raw ceiling).

Each model replica here serves at most ``MODEL_SLOTS`` calls at once, like a GPU
server with a fixed batch size, so that replicas — not the agent — bound throughput.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import psutil

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from gym_runtime.config import load_config, resolve_config  # noqa: E402
from gym_runtime.data.batches import Owners, new_manifest  # noqa: E402
from gym_runtime.data.collector import Collector  # noqa: E402
from gym_runtime.observability.tracing import Telemetry  # noqa: E402
from gym_runtime.ops.nats_server import EmbeddedServer  # noqa: E402
from gym_runtime.service.loop import run_async  # noqa: E402
from gym_runtime.service.runner import make_workers, publish_batch, selected, start_workers  # noqa: E402
from gym_runtime.transport.bus import Bus  # noqa: E402
from gym_runtime.workers.model_worker import ModelWorker  # noqa: E402

CONFIG = REPO / "resources/weather/config.yaml"
DATA = REPO / "resources/weather/data/example.jsonl"
MODEL_SLOTS = 8


def make_input(n: int, tmp: Path) -> Path:
    rows = [line for line in DATA.read_text().splitlines() if line.strip()]
    path = tmp / f"tasks_{n}.jsonl"
    with path.open("w") as f:
        for i in range(n):
            f.write(rows[i % len(rows)] + "\n")
    return path


async def batch_with_models(
    url: str,
    tmp: Path,
    n: int,
    delays: list[float],
    *,
    add_at_s: float | None = None,
    add_delay: float = 0.05,
    agent_slots: int = 512,
) -> dict[str, Any]:
    """Run n rollouts with one model replica per entry of ``delays``; agents and resources in-process."""
    cfg = load_config(
        CONFIG, [f"agents.weather_agent.concurrency={agent_slots}", f"models.policy.concurrency={MODEL_SLOTS}"]
    )
    bus = await Bus.connect(url, namespace=cfg.namespace, telemetry=Telemetry(), name="bench")
    timeline: list[tuple[float, int]] = []
    async with anyio.create_task_group() as tg:
        models = []
        for d in delays:
            mcfg = resolve_config(
                load_config(CONFIG, [f"models.policy.concurrency={MODEL_SLOTS}", f"models.policy.delay_s={d}"])
            )
            models.append(ModelWorker(bus, "policy", mcfg))
        await start_workers(tg, models + make_workers(bus, resolve_config(cfg), selected(cfg, ["resources", "agents"])))
        t0 = time.perf_counter()
        added_at = None

        def progress(done: int, total: int) -> None:
            timeline.append((time.perf_counter() - t0, done))

        batch = f"b{len(delays)}_{n}_{add_at_s}"
        manifest = new_manifest(batch, Owners.one("weather_agent", n), repeats=1, input_path="-")
        collector = Collector(bus, manifest, tmp / "out.jsonl", on_progress=progress)
        done = anyio.Event()

        async def collect() -> None:
            await collector.run()
            done.set()

        tg.start_soon(collect)
        await publish_batch(bus, resolve_config(cfg), make_input(n, tmp), batch=collector.batch)
        if add_at_s is not None:
            await anyio.sleep(add_at_s - (time.perf_counter() - t0))
            mcfg = resolve_config(
                load_config(CONFIG, [f"models.policy.concurrency={MODEL_SLOTS}", f"models.policy.delay_s={add_delay}"])
            )
            extra = ModelWorker(bus, "policy", mcfg)
            added_at = time.perf_counter() - t0
            await tg.start(extra.run)
            models.append(extra)
        await done.wait()
        elapsed = time.perf_counter() - t0
        tg.cancel_scope.cancel()
    await bus.close()
    return {"rps": n / elapsed, "served": [m.served for m in models], "timeline": timeline, "added_at": added_at}


def rate_between(timeline: list[tuple[float, int]], a: float, b: float) -> float:
    pts = [(t, d) for t, d in timeline if a <= t <= b]
    if len(pts) < 2:
        return 0.0
    return (pts[-1][1] - pts[0][1]) / max(1e-9, pts[-1][0] - pts[0][0])


def bench_a(url: str, tmp: Path) -> None:
    print("(a) model latency 50 ms, each replica serves 8 calls at once; 2 model calls per rollout")
    print(f"{'model replicas':>14} | {'rollouts/s':>10} | {'ideal':>6}")
    for k in (1, 2, 4):
        n = 160 * k
        r = run_async(lambda n=n, k=k: batch_with_models(url, tmp, n, [0.05] * k))
        ideal = k * MODEL_SLOTS / 0.05 / 2
        print(f"{k:>14} | {r['rps']:>10.1f} | {ideal:>6.0f}")


def bench_b(url: str, tmp: Path) -> None:
    r = run_async(lambda: batch_with_models(url, tmp, 400, [0.05, 0.25]))
    total = sum(r["served"])
    print("\n(b) two replicas, 50 ms and 250 ms per call (5x slower)")
    print(f"{'replica':>10} | {'calls served':>12} | {'share':>6}")
    for name, s in zip(("fast 50ms", "slow 250ms"), r["served"], strict=True):
        print(f"{name:>10} | {s:>12} | {100 * s / total:>5.1f}%")
    print(f"  (expected by capacity: fast {100 * 5 / 6:.1f}%, slow {100 / 6:.1f}%)")


def bench_c(url: str, tmp: Path) -> None:
    # 32 rollouts in flight: completions flow steadily instead of in one wave behind a deep queue
    r = run_async(lambda: batch_with_models(url, tmp, 800, [0.05], add_at_s=3.0, agent_slots=32))
    tl, added = r["timeline"], r["added_at"]
    before = rate_between(tl, added - 2.0, added)
    rises = None
    for t, _ in tl:
        if t > added and rate_between(tl, t - 0.5, t) > 1.5 * before:
            rises = t - added
            break
    after = rate_between(tl, added + 1.0, added + 3.0)
    print("\n(c) a second model replica added 3 s into the batch")
    print(
        f"  rollouts/s before: {before:.0f}   after: {after:.0f}   "
        f"throughput rose (>1.5x) {rises:.2f} s after the replica started"
        if rises is not None
        else f"  rollouts/s before: {before:.0f}   after: {after:.0f}   (no rise detected)"
    )


class Peak:
    def __init__(self, procs: dict[str, psutil.Process]) -> None:
        self.procs = procs
        self.peak = {k: 0 for k in procs}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for k, p in self.procs.items():
                try:
                    self.peak[k] = max(self.peak[k], p.memory_info().rss)
                except psutil.Error:
                    pass
            self._stop.wait(0.1)

    def __enter__(self) -> Peak:
        self._t.start()
        return self

    def __exit__(self, *a: object) -> None:
        self._stop.set()
        self._t.join()


def bench_d(url: str, tmp: Path, sizes: list[int]) -> None:
    print("\n(d) peak RSS (MB) by process, zero-latency model, each role in its own process")
    roles = ["agents", "models", "resources"]
    print(f"{'tasks':>8} | {'collector':>9} | " + " | ".join(f"{r:>9}" for r in roles) + f" | {'seconds':>7}")
    for n in sizes:
        inp = make_input(n, tmp)
        ns = f"mem{n}"
        sets = ["--set", f"namespace={ns}", "--set", "agents.weather_agent.concurrency=256"]
        procs = {}
        for role in roles:
            p = subprocess.Popen(
                [sys.executable, "-m", "gym_runtime.cli", "start", str(CONFIG), "--nats", url, "--only", role, *sets],
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            assert p.stdout is not None and "ready" in p.stdout.readline()
            procs[role] = p
        t0 = time.perf_counter()
        batch = subprocess.run(
            [sys.executable, "-m", "gym_runtime.cli", "publish", str(CONFIG), "-i", str(inp), "--nats", url, *sets],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        col = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gym_runtime.cli",
                "collect",
                "--batch",
                batch,
                "--nats",
                url,
                "--namespace",
                ns,
                "-o",
                str(tmp / f"mem_{n}.jsonl"),
            ],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        watched = {"collector": psutil.Process(col.pid), **{r: psutil.Process(p.pid) for r, p in procs.items()}}
        with Peak(watched) as peak:
            col.wait()
        secs = time.perf_counter() - t0
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            p.wait(60)
        mb = {k: v / 2**20 for k, v in peak.peak.items()}
        print(f"{n:>8} | {mb['collector']:>9.0f} | " + " | ".join(f"{mb[r]:>9.0f}" for r in roles) + f" | {secs:>7.1f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="+", default=["a", "b", "c", "d"])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        with EmbeddedServer(store_dir=str(tmp / "js")) as srv:
            if "a" in args.only:
                bench_a(srv.url, tmp)
            if "b" in args.only:
                bench_b(srv.url, tmp)
            if "c" in args.only:
                bench_c(srv.url, tmp)
            if "d" in args.only:
                bench_d(srv.url, tmp, args.sizes)


if __name__ == "__main__":
    main()
