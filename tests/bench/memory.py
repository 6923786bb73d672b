"""Memory over a long batch: does any process grow with the rollouts it has finished?

One batch of weather rollouts through the scripted (zero-latency) policy, every role
in this process as ``gym-runtime run --processes one`` runs them, on a real nats-server.
Every ``--every`` finished rollouts it records:

* this process (all the workers and the collector): RSS, and after a full
  collection the interpreter's live blocks (``sys.getallocatedblocks``), which do not
  depend on when the collector last ran or on what the allocator keeps;
* nats-server: RSS and the Go heap in use (its profiling port), which do not
  depend on the load either, and the bytes its streams store.

Flat means the last quarter grows by (close to) nothing per finished rollout;
the results the stream stores are expected to cost the server something each
(retention and purge as they are). Also prints the cycle collector's pauses.

    python tests/bench/memory.py [--rollouts 200000] [--every 10000] [--in-flight 1024] [--duplicate-window S]
                                 [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import anyio
import psutil

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from gym_runtime.cli._gc import freeze_startup, tune_gc  # noqa: E402
from gym_runtime.config import config_from_dict, resolve_config  # noqa: E402
from gym_runtime.observability import logs  # noqa: E402
from gym_runtime.observability.tracing import Telemetry  # noqa: E402
from gym_runtime.ops.nats_server import EmbeddedServer, free_port  # noqa: E402
from gym_runtime.service.loop import run_async  # noqa: E402
from gym_runtime.service.runner import run_batch  # noqa: E402
from gym_runtime.transport import jetstream  # noqa: E402
from gym_runtime.transport.bus import Bus  # noqa: E402
from gym_runtime.transport.subjects import Subjects  # noqa: E402

DATA = REPO / "resources/weather/data/example.jsonl"


def heap_profile(port: int, *, collect: bool = False) -> str:
    query = "debug=1&gc=1" if collect else "debug=1"
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/debug/pprof/heap?{query}", timeout=10).read().decode()


def go_heap(port: int, *, collect: bool = False) -> int:
    """nats-server's Go heap in use (bytes), from its profiling port; ``collect``: right after a forced
    Go collection, so what is live, whenever its collector last ran (what a table of ids holds)."""
    text = heap_profile(port, collect=collect)
    m = re.search(r"# HeapInuse = (\d+)", text)
    return int(m.group(1)) if m else -1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rollouts", type=int, default=200_000)
    ap.add_argument("--every", type=int, default=10_000)
    ap.add_argument("--in-flight", type=int, default=1024, help="agent concurrency (default: the config default)")
    ap.add_argument(
        "--duplicate-window",
        type=float,
        help="jetstream.duplicate_window_s (default: the config default; 3600 was the default before)",
    )
    ap.add_argument("--no-freeze", action="store_true", help="leave start-up's objects to the collector (before)")
    ap.add_argument("--json", help="write the samples here")
    ap.add_argument("--server-profile", help="write nats-server's heap profile (text) at the end here")
    args = ap.parse_args()
    logs.configure(level="warning")
    tune_gc()  # as the CLI does
    cfg = config_from_dict(
        {
            "namespace": f"mem{time.monotonic_ns()}",
            "models": {"policy": {"adapter": "scripted"}},
            "resources": {"weather": {"server": "resources.weather"}},
            "agents": {
                "weather_agent": {
                    "agent": "agents.simple",
                    "model": "policy",
                    "resource": "weather",
                    "max_steps": 8,
                    "concurrency": args.in_flight,
                }
            },
            "base_dir": str(REPO),
            **({"jetstream": {"duplicate_window_s": args.duplicate_window}} if args.duplicate_window else {}),
        }
    )
    pauses: list[tuple[int, float]] = []  # (generation, seconds)
    began = [0.0]

    mine = [False]  # our own gc.collect() before a sample is not a pause the runtime pays

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if mine[0]:
            return
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], time.perf_counter() - began[0]))

    samples: list[dict[str, Any]] = []
    done = [0]
    me = psutil.Process()
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        rows = DATA.read_text().splitlines()
        inp = tmp / "in.jsonl"
        with inp.open("w") as f:
            for i in range(args.rollouts):
                f.write(rows[i % len(rows)] + "\n")
        prof = free_port()
        srv = EmbeddedServer(store_dir=str(tmp / "js"), extra_blocks=[f"prof_port: {prof}"])
        srv.start()
        server = psutil.Process(srv.pid)
        t0 = time.monotonic()

        def sample(n: int, blocks: int, tracked: int) -> None:
            samples.append(
                {
                    "rollouts": n,
                    "t_s": round(time.monotonic() - t0, 1),
                    "workers_rss": me.memory_info().rss,
                    "workers_blocks": blocks,
                    "workers_tracked": tracked,  # what an oldest-generation pass walks (frozen objects not)
                    "server_rss": server.memory_info().rss,
                    "server_heap": go_heap(prof),
                    "server_live": go_heap(prof, collect=True),  # last: the forced collection moves nothing above
                }
            )
            last = samples[-1]
            print(  # as it goes: a run cut short still shows its curve
                f"{n:,} done at {last['t_s']:.0f} s: workers RSS {last['workers_rss'] / 2**20:.1f} MiB, "
                f"{tracked / 1000:.0f}k tracked; nats-server RSS {last['server_rss'] / 2**20:.1f} MiB, "
                f"Go heap {last['server_heap'] / 2**20:.1f} MiB, live {last['server_live'] / 2**20:.1f} MiB",
                file=sys.stderr,
                flush=True,
            )

        def on_result(_ok: bool, _reward: float | None) -> None:
            done[0] += 1
            if done[0] % args.every == 0:
                # in the loop: the sample sees this process between messages, after a full collection
                mine[0] = True
                gc.collect()
                mine[0] = False
                sample(done[0], sys.getallocatedblocks(), len(gc.get_objects()))

        if not args.no_freeze:
            freeze_startup()  # as `run` does once everything is imported
        gc.collect()
        sample(0, sys.getallocatedblocks(), len(gc.get_objects()))
        gc.callbacks.append(on_gc)
        try:
            res = run_async(
                lambda: run_batch(
                    resolve_config(cfg),
                    srv.url,
                    input_path=inp,
                    out=tmp / "out.jsonl",
                    telemetry=Telemetry(),
                    on_result=on_result,
                )
            )

            async def stored() -> int:
                bus = await Bus.connect(srv.url, namespace=cfg.namespace, telemetry=Telemetry(), name="mem")
                try:
                    s = Subjects(cfg.namespace)
                    names = (s.tasks_stream, s.model_stream, *await jetstream.results_streams(bus))
                    return sum([(await bus.js.stream_info(s)).state.bytes for s in names])
                finally:
                    await bus.close()

            stored_bytes = anyio.run(stored)
            if args.server_profile:
                Path(args.server_profile).write_text(heap_profile(prof))
        finally:
            gc.callbacks.remove(on_gc)
            srv.stop()
    n = args.rollouts
    print(
        f"{n:,} weather rollouts (scripted policy, {args.in_flight} in flight, one process): "
        f"{res.stats.rows:,} rows, {res.stats.failures} failed, {n / (res.elapsed_s - res.ready_s):,.0f} rollouts/s; "
        f"streams store {stored_bytes / n:,.0f} B per rollout; load average {psutil.getloadavg()[0]:.1f}"
    )
    print(
        "| rollouts | workers RSS MiB | workers live blocks (k) | GC-tracked objects (k) | nats-server RSS MiB "
        "| nats-server Go heap MiB | nats-server Go heap after a collection MiB |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for s in samples:
        print(
            f"| {s['rollouts']:,} | {s['workers_rss'] / 2**20:.1f} | {s['workers_blocks'] / 1000:.0f} | "
            f"{s['workers_tracked'] / 1000:.0f} | "
            f"{s['server_rss'] / 2**20:.1f} | {s['server_heap'] / 2**20:.1f} | {s['server_live'] / 2**20:.1f} |"
        )
    q = max(1, len(samples) // 4)
    a, b = samples[-1 - q], samples[-1]
    span = b["rollouts"] - a["rollouts"]
    if span:
        print(
            f"last quarter ({a['rollouts']:,} -> {b['rollouts']:,}), per finished rollout: workers RSS "
            f"{(b['workers_rss'] - a['workers_rss']) / span:+.0f} B, live blocks "
            f"{(b['workers_blocks'] - a['workers_blocks']) / span:+.2f}; nats-server RSS "
            f"{(b['server_rss'] - a['server_rss']) / span:+.0f} B, "
            f"Go heap {(b['server_heap'] - a['server_heap']) / span:+.0f} B, "
            f"after a collection {(b['server_live'] - a['server_live']) / span:+.0f} B"
        )
    for label, gens in (("young and middle", (0, 1)), ("oldest", (2,))):
        ms = sorted(1000 * d for g, d in pauses if g in gens)
        if ms:
            p50, p90, p99 = (ms[min(len(ms) - 1, int(q * len(ms)))] for q in (0.5, 0.9, 0.99))
            print(
                f"GC, {label} generation passes: {len(ms)}, {sum(ms) / 1000:.2f} s in all, p50 {p50:.1f} ms, "
                f"p90 {p90:.1f} ms, p99 {p99:.1f} ms, max {ms[-1]:.1f} ms"
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"samples": samples, "gc": pauses, "stored_bytes": stored_bytes}))


if __name__ == "__main__":
    main()
