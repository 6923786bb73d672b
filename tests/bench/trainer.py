"""Trainer-surface benchmark: the client API and the gateway next to publish + collect, same batch.

Weather environment, scripted policy (the LLM test double), one embedded nats-server, and the
config's workers warm in their own process (``gym-runtime start``). Three ways to get the same
N rollouts:

* **collect**: ``publish_batch`` of the JSONL file + ``Collector`` writing the JSONL (what
  ``gym-runtime publish`` + ``collect`` do);
* **client**: ``Client(workers=False).submit(rows).gather()``;
* **gateway**: ``gym-runtime gateway`` in its own process, N concurrent ``POST /run`` from an
  aiohttp client (at most ``--http-concurrency`` connections), as NeMo Gym integrations do.

Then latency at concurrency 1 (``--sequential`` rollouts one after another): ``client.run`` and
``POST /run`` end to end, next to the agent workers' own mean rollout time; the difference is what
the path adds per rollout.

    python tests/bench/trainer.py [--rows 2000] [--sequential 100] [--http-concurrency 256]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from gym_runtime import Client
from gym_runtime.config import load_config, resolve_config
from gym_runtime.data.collector import Collector
from gym_runtime.ops.nats_server import EmbeddedServer, free_port
from gym_runtime.service.loop import run_async
from gym_runtime.service.runner import publish_batch
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.discovery import discover

CONFIG = REPO / "resources/weather/config.yaml"
EXAMPLE = REPO / "resources/weather/data/example.jsonl"


def spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "gym_runtime.cli", *args],
        cwd=REPO,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )


def wait_line(proc: subprocess.Popen[str], prefix: str) -> str:
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if not line.startswith(prefix):
        raise SystemExit(f"expected {prefix!r}, got {line!r}")
    return line.strip()


async def agent_totals(bus: Bus) -> tuple[int, float]:
    """(rollouts completed, ms spent in them) summed over the agent workers (their own counters)."""
    ws = [w for w in await discover(bus) if w.get("role") == "agent"]
    done = sum(w.get("completed", 0) for w in ws)
    return done, sum((w.get("mean_rollout_ms") or 0) * w.get("completed", 0) for w in ws)


async def bench(args: argparse.Namespace, url: str, gw_url: str, tmp: Path) -> None:
    base = [json.loads(x) for x in EXAMPLE.read_text().splitlines() if x.strip()]
    rows = [base[i % len(base)] for i in range(args.rows)]
    data = tmp / "in.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(CONFIG)
    results: list[tuple[str, float]] = []
    async with Client(resolve_config(cfg), nats=url, workers=False) as client:
        # warm-up: every path once
        await (await client.submit(base)).gather()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=args.http_concurrency)) as http:
            async with http.post(f"{gw_url}/run", json=base[0]) as r:
                assert r.status == 200

            for rep in range(args.repeat):
                # collect
                t0 = time.perf_counter()
                m = await publish_batch(client.bus, client.config, data)
                stats = await Collector(client.bus, m, tmp / f"out{rep}.jsonl").run()
                assert stats.rows == args.rows, stats
                results.append(("collect", time.perf_counter() - t0))

                # client
                t0 = time.perf_counter()
                got = await (await client.submit(rows)).gather()
                assert len(got) == args.rows and all("reward" in r for r in got)
                results.append(("client", time.perf_counter() - t0))

                # gateway
                async def one(row: dict[str, Any]) -> int:
                    async with http.post(f"{gw_url}/run", json=row) as r:
                        await r.read()
                        return r.status

                t0 = time.perf_counter()
                statuses = await asyncio.gather(*(one(r) for r in rows))
                assert set(statuses) == {200}, set(statuses)
                results.append(("gateway", time.perf_counter() - t0))

            print(f"\nthroughput: {args.rows} weather rollouts, scripted policy, best of {args.repeat}")
            print(f"{'path':<10}{'seconds':>10}{'rollouts/s':>12}{'vs collect':>12}")
            best = {p: min(s for q, s in results if q == p) for p in ("collect", "client", "gateway")}
            for p, s in best.items():
                print(
                    f"{p:<10}{s:>10.2f}{args.rows / s:>12.0f}{(args.rows / s) / (args.rows / best['collect']):>11.0%}"
                )

            # latency at concurrency 1
            lat: dict[str, list[float]] = {"client.run": [], "POST /run": []}
            n0, ms0 = await agent_totals(client.bus)
            for i in range(args.sequential):
                t0 = time.perf_counter()
                await client.run(base[i % len(base)])
                lat["client.run"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                async with http.post(f"{gw_url}/run", json=base[i % len(base)]) as r:
                    await r.read()
                lat["POST /run"].append(time.perf_counter() - t0)
        n1, ms1 = await agent_totals(client.bus)
    agent_ms = (ms1 - ms0) / max(1, n1 - n0)  # the sequential rollouts only
    print(f"\nlatency at concurrency 1 ({args.sequential} rollouts each); agent's own mean rollout: {agent_ms:.2f} ms")
    print(f"{'path':<12}{'mean ms':>10}{'p50 ms':>10}{'added ms':>10}")
    for p, xs in lat.items():
        xs.sort()
        mean = 1000 * sum(xs) / len(xs)
        print(f"{p:<12}{mean:>10.2f}{1000 * xs[len(xs) // 2]:>10.2f}{mean - agent_ms:>10.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--sequential", type=int, default=100)
    ap.add_argument("--http-concurrency", type=int, default=256)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d, EmbeddedServer(store_dir=str(Path(d) / "js")) as srv:
        workers = spawn("start", str(CONFIG), "--nats", srv.url)
        port = free_port()
        gw = spawn("gateway", str(CONFIG), "--nats", srv.url, "--port", str(port))
        try:
            wait_line(workers, "workers ready")
            gw_url = wait_line(gw, "gateway listening on").split()[-1]
            run_async(lambda: bench(args, srv.url, gw_url, Path(d)))
        finally:
            for p in (gw, workers):
                p.terminate()
                p.wait(30)


if __name__ == "__main__":
    main()
