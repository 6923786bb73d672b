"""Saturation benchmark: are the inference slots busy while a batch has work?

The model is ``tests/bench/slot_model.py``, a TEST DOUBLE for a vLLM replica
(fixed slots like ``max_num_seqs``; lognormal call time scaled by output tokens;
optional slower replicas), served as real model workers on a real nats-server:
``replicas`` model workers of one model, each one replica with its own slots and
pull credit equal to them. The environment is a multi-step one (``weather``: a
tool call, the tool's answer, a final answer: two model calls and one resource
call per rollout; ``multi_turn``: the multi-turn Gymnasium environment, 1-3 policy
turns). Every rollout of the batch is in flight at once (agent concurrency = the
batch size). Everything but nats-server runs in this process (``run --processes
one``).

Printed per grid point:

* occupancy: busy slot-seconds / available slot-seconds over the steady phase
  (from the moment every slot has been filled once, to the moment fewer
  rollouts are unfinished than there are slots: after that the slots cannot all
  be busy whatever the runtime does);
* rollouts/s over the steady phase and over the whole batch, against the ideal
  the slots allow (sum over replicas of slots / mean call time there, divided
  by model calls per rollout);
* queue wait: from the end of a rollout's model call to the start (in a slot)
  of its next one (the step's tool call and the agent's work included), p50,
  p90, p99; a rollout's first call is not counted (it waits for the batch);
* tail: time from 95% to 100% of the batch's rollouts done, against the
  slowest single rollout (sum of its calls' times) plus one p99 queue wait;
* with slow replicas: each replica's share of the calls against its share of
  the capacity (slots / slowness).

    python tests/bench/saturation.py [--grid default|ceiling] [--json out.json]
    python tests/bench/saturation.py --point REPLICAS SLOTS MEDIAN_S IN_FLIGHT [--slow K --factor F]
    python tests/bench/saturation.py --inflight 100000 [--through 200000]   # memory per rollout in flight
    python tests/bench/saturation.py --share 400 100 --model 1 64 [--batches] [--long 30 120] [--ack-wait S]

``--share N1 N2 ...``: agents sharing one model (``--model REPLICAS SLOTS``), agent i with Ni rollouts
in flight, all batches published at once (``--batches``: one agent, one batch per Ni instead). Printed
per agent: its share of the model's slot-seconds while every agent still had work, against its share
of the demand (rollouts in flight); queue waits; when its batch ended. ``--long LO HI`` draws call
times uniformly from LO..HI s (long generations); ``--ack-wait S`` sets every model's and agent's
``ack_wait_s``. Redeliveries are counted from JetStream (each consumer's deliveries against the
messages it was given) and from the stand-in (model calls run more than once per rollout).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import anyio
import psutil

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from gym_runtime.cli._gc import freeze_startup, tune_gc  # noqa: E402
from gym_runtime.config import config_from_dict, resolve_config  # noqa: E402
from gym_runtime.data.batches import Owners, new_manifest  # noqa: E402
from gym_runtime.data.collector import Collector  # noqa: E402
from gym_runtime.observability import logs  # noqa: E402
from gym_runtime.observability.tracing import Telemetry  # noqa: E402
from gym_runtime.ops.nats_server import EmbeddedServer  # noqa: E402
from gym_runtime.service.loop import run_async  # noqa: E402
from gym_runtime.service.runner import (  # noqa: E402
    close_buses,
    drain,
    make_workers,
    open_buses,
    pool_key,
    publish_batch,
    run_batch,
    selected,
    start_workers,
)
from gym_runtime.transport.bus import Bus  # noqa: E402
from gym_runtime.transport.jetstream import ensure_streams  # noqa: E402
from gym_runtime.transport.subjects import Subjects  # noqa: E402
from gym_runtime.workers.model_worker import ModelWorker  # noqa: E402
from tests.bench import slot_model  # noqa: E402

ENVS = {
    "weather": ("resources.weather", "agents.simple", REPO / "resources/weather/data/example.jsonl", {}),
    "multi_turn": (
        "resources.multi_turn_gymnasium",
        "agents.multi_turn",
        REPO / "resources/multi_turn_gymnasium/data/example.jsonl",
        {"options": {"user": "follow_ups", "max_turns": 4}},
    ),
}


def config(env: str, run: str, replicas: int, slots: int, median_s: float, in_flight: int, **model: Any) -> Any:
    return config_from_dict(config_dict(env, run, replicas, slots, median_s, in_flight, **model))


def config_dict(
    env: str, run: str, replicas: int, slots: int, median_s: float, in_flight: int, **model: Any
) -> dict[str, Any]:
    server, agent, _, extra = ENVS[env]
    return {
        "namespace": "sat" + "".join(ch if ch.isalnum() else "_" for ch in run)[-40:],
        "models": {
            "policy": {
                "adapter": "tests.bench.slot_model",
                "replicas": replicas,
                "concurrency": slots,
                "slots": slots,
                "median_s": median_s,
                "run": run,
                **model,
            }
        },
        "resources": {"env": {"server": server}},
        "agents": {
            "agent": {
                "agent": agent,
                "model": "policy",
                "resource": "env",
                "concurrency": in_flight,
                "max_steps": 8,
                "timeout_s": 3600,
                **extra,
            }
        },
        "base_dir": str(REPO),
    }


def make_input(env: str, n: int, tmp: Path, tag: str = "") -> Path:
    rows = ENVS[env][2].read_text().splitlines()
    path = tmp / f"in_{env}_{n}{tag}.jsonl"
    path.write_text("".join(rows[i % len(rows)] + "\n" for i in range(n)))
    return path


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def point(
    env: str,
    replicas: int,
    slots: int,
    median_s: float,
    n: int,
    *,
    slow: int = 0,
    factor: float = 2.0,
    sigma: float = 0.8,
) -> dict[str, Any]:
    """One grid point: ``n`` rollouts, all in flight, against ``replicas`` x ``slots``."""
    run = f"{env}_{replicas}_{slots}_{median_s}_{n}_{slow}_{time.monotonic_ns()}"
    cfg = config(env, run, replicas, slots, median_s, n, slow_replicas=slow, slow_factor=factor, sigma=sigma)
    done: list[float] = []
    pauses: list[tuple[int, float]] = []
    began: list[float] = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], time.perf_counter() - began[0]))

    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        srv = EmbeddedServer(store_dir=str(tmp / "js"))
        srv.start()
        gc.callbacks.append(on_gc)
        try:
            inp = make_input(env, n, tmp)
            res = run_async(
                lambda: run_batch(
                    resolve_config(cfg),
                    srv.url,
                    input_path=inp,
                    out=tmp / "out.jsonl",
                    telemetry=Telemetry(),
                    agent="agent",
                    on_result=lambda ok, _r: done.append(time.monotonic()),
                )
            )
        finally:
            gc.callbacks.remove(on_gc)
            srv.stop()
    rec = slot_model.RECORDERS.pop(run)
    assert res.stats.failures == 0 and res.stats.rows == n, res.stats
    out = analyse(rec, done, n, res.elapsed_s - res.ready_s)
    out["gc_s"] = sum(d for _, d in pauses)
    out["gc_max_ms"] = 1000 * max((d for _, d in pauses), default=0.0)
    out["gc_old"] = sum(1 for g, _ in pauses if g == 2)
    old = [1000 * d for g, d in pauses if g == 2]
    out["gc_old_p50_ms"] = pct(old, 0.5)
    out["gc_young_p99_ms"] = pct([1000 * d for g, d in pauses if g < 2], 0.99)
    return out


def analyse(rec: slot_model.Recorder, done: list[float], n: int, work_s: float) -> dict[str, Any]:
    calls = rec.calls
    total_slots = sum(s for s, _ in rec.replicas.values())
    done.sort()
    # steady phase: every slot filled once .. fewer unfinished rollouts than slots
    starts = sorted(c.started for c in calls)
    t0 = starts[min(len(starts) - 1, total_slots - 1)]
    t1 = done[max(0, n - total_slots)] if n > total_slots else t0
    window = max(1e-9, t1 - t0)
    busy = sum(max(0.0, min(c.ended, t1) - max(c.started, t0)) for c in calls)
    occupancy = busy / (total_slots * window) if t1 > t0 else float("nan")
    per_rollout = len(calls) / n
    # the ideal: each replica's slots / its mean call time
    by_rep: dict[int, list[float]] = defaultdict(list)
    for c in calls:
        by_rep[c.replica].append(c.ended - c.started)
    ideal_calls = sum(rec.replicas[r][0] / statistics.fmean(d) for r, d in by_rep.items())
    ideal = ideal_calls / per_rollout
    steady_rate = sum(1 for t in done if t0 <= t <= t1) / window if t1 > t0 else float("nan")
    # queue wait between a rollout's consecutive calls
    by_key: dict[str | None, list[slot_model.Call]] = defaultdict(list)
    for c in calls:
        by_key[c.key].append(c)
    waits: list[float] = []
    service: list[float] = []
    for cs in by_key.values():
        cs.sort(key=lambda c: c.started)
        waits += [b.started - a.ended for a, b in zip(cs, cs[1:], strict=False)]
        service.append(sum(c.ended - c.started for c in cs))
    in_replica = [c.started - c.arrived for c in calls]
    tail = done[-1] - done[int(0.95 * (n - 1))]
    p99 = pct(waits, 0.99)
    bound = max(service) + p99
    share = {}
    if len({s for _, s in rec.replicas.values()}) > 1:
        cap = {r: s / slow for r, (s, slow) in rec.replicas.items()}
        got = defaultdict(int)
        for c in calls:
            got[c.replica] += 1
        share = {
            f"replica {r} (x{rec.replicas[r][1]:g} slower)": (got[r] / len(calls), cap[r] / sum(cap.values()))
            for r in sorted(cap)
        }
    return {
        "n": n,
        "calls_per_rollout": per_rollout,
        "occupancy": occupancy,
        "steady_s": window,
        "steady_rps": steady_rate,
        "batch_rps": n / work_s,
        "ideal_rps": ideal,
        "ideal_calls_s": ideal_calls,
        "wait_p50": pct(waits, 0.5),
        "wait_p90": pct(waits, 0.9),
        "wait_p99": p99,
        "in_replica_p99": pct(in_replica, 0.99),
        "median_call_s": statistics.median(c.ended - c.started for c in calls),
        "loop_lag_ms": 1000 * statistics.fmean(c.ended - c.started - c.drawn for c in calls),
        "tail_s": tail,
        "tail_bound_s": bound,
        "share": share,
    }


def fmt(label: str, r: dict[str, Any]) -> str:
    return (
        f"| {label} | {r['n']:,} | {r['median_call_s']:.2f} | {r['ideal_calls_s']:,.0f} | {100 * r['occupancy']:.1f}% "
        f"({r['steady_s']:.0f} s) | {r['steady_rps']:,.0f} / {r['batch_rps']:,.0f} / {r['ideal_rps']:,.0f} | "
        f"{1000 * r['wait_p50']:.0f} / {1000 * r['wait_p90']:.0f} / {1000 * r['wait_p99']:.0f} | "
        f"{r['tail_s']:.1f} / {r['tail_bound_s']:.1f} |"
    )


HEADER = (
    "| replicas x slots | rollouts in flight | median call s | ideal calls/s | occupancy (steady s) | "
    "rollouts/s steady / batch / ideal | queue wait ms p50 / p90 / p99 | tail s / bound s |\n"
    "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
)

# (replicas, slots, median_s, rollouts in flight, slow replicas): ideal call rates of 230-370/s, at most half of the
# ceiling measured on this machine (1,047 model calls/s at load 8-9: --grid ceiling)
GRID = [
    (1, 64, 0.2, 1000, 0),
    (4, 64, 0.5, 2000, 0),
    (4, 64, 0.5, 3000, 1),
    (16, 32, 1.0, 20000, 0),
]
# beyond half the ceiling (reported apart): 16 x 64 slots at 1 s: 740 calls/s
APART = [(16, 64, 1.0, 20000, 0)]


def ceiling(env: str, n: int) -> float:
    """Model calls/s through the runtime with a 1 ms stand-in (256 slots): the runtime's own ceiling here."""
    r = point(env, 1, 512, 0.001, n, sigma=0.0)
    return r["batch_rps"] * r["calls_per_rollout"]


def rss(procs: list[psutil.Process]) -> dict[str, float]:
    return {p.name() if p.pid != psutil.Process().pid else "bench (all workers)": p.memory_info().rss for p in procs}


def inflight(n: int, median_s: float, through: int) -> None:
    """``n`` rollouts in flight against a slow stand-in (1 replica x 64 slots): RSS per process before and at
    ``n`` in flight, minus the bytes the server stores for them; then whether work still moves."""
    run = f"inflight_{time.monotonic_ns()}"
    cfg = config("weather", run, 1, 64, median_s, n, sigma=0.0)
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        srv = EmbeddedServer(store_dir=str(tmp / "js"))
        srv.start()
        procs = [psutil.Process(), psutil.Process(srv.pid)]
        inp = make_input("weather", n, tmp)

        async def go() -> None:
            bus = await Bus.connect(srv.url, namespace=cfg.namespace, telemetry=Telemetry(), name="inflight")
            try:
                await ensure_streams(bus)
                async with anyio.create_task_group() as tg:
                    workers = make_workers(bus, resolve_config(cfg), selected(cfg, None))
                    await start_workers(tg, workers)
                    await anyio.sleep(1.0)
                    gc.collect()
                    idle = rss(procs)
                    t0 = time.monotonic()
                    await publish_batch(bus, resolve_config(cfg), inp, agent="agent")
                    names = Subjects(cfg.namespace)
                    js = bus.js
                    # every rollout in flight: the agent holds all n tasks (each waits on a model call)
                    while True:
                        info = await js.consumer_info(names.tasks_stream, "agent_agent")
                        if info.num_pending == 0 and info.num_ack_pending >= n:
                            break
                        await anyio.sleep(0.5)
                    reached = time.monotonic() - t0
                    await anyio.sleep(2.0)
                    gc.collect()
                    full = rss(procs)
                    stored = 0
                    for s in names.values():
                        stored += (await js.stream_info(s)).state.bytes
                    moved = []
                    for _ in range(3):  # consecutive 10 s windows: does work keep moving at the slots' rate?
                        calls0 = len(slot_model.RECORDERS[run].calls)
                        await anyio.sleep(10.0)
                        moved.append(len(slot_model.RECORDERS[run].calls) - calls0)
                    expect = 64 / median_s * 10.0
                    print(f"{n:,} rollouts in flight after {reached:.1f} s (publish + pull)")
                    print("| process | idle RSS MiB | RSS at n in flight MiB | KiB per rollout |")
                    print("| --- | ---: | ---: | ---: |")
                    total = 0.0
                    for k in idle:
                        per = (full[k] - idle[k]) / n
                        total += per
                        print(f"| {k} | {idle[k] / 2**20:.0f} | {full[k] / 2**20:.0f} | {per / 1024:.2f} |")
                    print(
                        f"all processes: {total / 1024:.2f} KiB per rollout; stored message bytes "
                        f"{stored / n / 1024:.2f} KiB per rollout; difference {(total - stored / n) / 1024:.2f} KiB "
                        f"(target <= 20 KB)"
                    )
                    print(f"model calls finished in the next three 10 s windows: {moved} (slots allow {expect:.0f})")
                    await drain(workers, timeout=1.0)
                    tg.cancel_scope.cancel()
            finally:
                with anyio.CancelScope(shield=True):
                    await bus.close()

        try:
            run_async(go)
        finally:
            srv.stop()
            slot_model.RECORDERS.pop(run, None)
    if through:
        flat(through)


def flat(n: int) -> None:
    """A batch of ``n`` rollouts through a fast stand-in (4 replicas x 64 slots, 20 ms) with 10,000 in flight:
    every process's RSS sampled each 5 s; flat means the last third's mean is within 10% of the middle third's."""
    run = f"flat_{time.monotonic_ns()}"
    # record=False: the stand-in's own per-call record (~0.6 KiB per rollout) is not the runtime's memory
    cfg = config("weather", run, 4, 64, 0.02, 10_000, sigma=0.5, record=False)
    samples: list[tuple[float, dict[str, float]]] = []
    stop = threading.Event()
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        srv = EmbeddedServer(store_dir=str(tmp / "js"))
        srv.start()
        procs = [psutil.Process(), psutil.Process(srv.pid)]

        def sample() -> None:
            t0 = time.monotonic()
            while not stop.wait(5.0):
                samples.append((time.monotonic() - t0, rss(procs)))

        threading.Thread(target=sample, daemon=True).start()
        done = [0]
        try:
            inp = make_input("weather", n, tmp)
            res = run_async(
                lambda: run_batch(
                    resolve_config(cfg),
                    srv.url,
                    input_path=inp,
                    out=tmp / "out.jsonl",
                    telemetry=Telemetry(),
                    agent="agent",
                    on_result=lambda ok, _r: done.__setitem__(0, done[0] + 1),
                )
            )
        finally:
            stop.set()
            srv.stop()
            slot_model.RECORDERS.pop(run, None)
    print(
        f"\n{n:,} rollouts through (10,000 in flight): {res.stats.rows:,} rows, {res.stats.failures} failed, "
        f"{n / (res.elapsed_s - res.ready_s):,.0f} rollouts/s"
    )
    keys = list(samples[0][1]) if samples else []
    print("| t s | " + " | ".join(f"{k} RSS MiB" for k in keys) + " |")
    print("| ---: |" + " ---: |" * len(keys))
    for t, s in samples:
        print(f"| {t:.0f} | " + " | ".join(f"{s[k] / 2**20:.0f}" for k in keys) + " |")
    third = max(1, len(samples) // 3)
    for k in keys:
        mid = statistics.fmean(s[k] for _, s in samples[third : 2 * third] or samples)
        last = statistics.fmean(s[k] for _, s in samples[2 * third :] or samples)
        print(
            f"{k}: last third {last / 2**20:.0f} MiB vs middle third {mid / 2**20:.0f} MiB "
            f"({100 * (last / mid - 1):+.1f}%)"
        )


def shared(
    demand: list[int],
    replicas: int,
    slots: int,
    *,
    batches: bool = False,
    median_s: float = 0.5,
    sigma: float = 0.8,
    long: list[float] | None = None,
    ack_wait: float | None = None,
    budget: float | None = None,
    timeout: float | None = None,
    agent_slots: int | None = None,
) -> dict[str, Any]:
    """Agents (or batches of one agent) sharing one model: ``demand[i]`` rollouts in flight for the i-th,
    every batch published at once. Returns the shares, waits, ends and the redeliveries counted."""
    run = f"share_{time.monotonic_ns()}"
    model: dict[str, Any] = {"sigma": sigma, **({"uniform_s": long} if long else {})}
    if budget:
        model["budget_s"] = budget
    waits: dict[str, Any] = {"ack_wait_s": ack_wait} if ack_wait else {}
    raw = config_dict("weather", run, replicas, slots, median_s, sum(demand), **model, **waits)
    agent = raw["agents"].pop("agent")
    jobs: list[tuple[str, str, int]] = []  # (agent, batch, rollouts)
    for i, n in enumerate(demand):
        name = "agent" if batches else f"agent{i}"
        slots_here = agent_slots or (sum(demand) if batches else n)
        raw["agents"][name] = {**agent, "concurrency": slots_here, **waits}
        if timeout:
            raw["agents"][name]["timeout_s"] = timeout
        jobs.append((name, f"b{i}", n))
    cfg = config_from_dict(raw)
    done: dict[str, list[float]] = {b: [] for _, b, _ in jobs}
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        srv = EmbeddedServer(store_dir=str(tmp / "js"))
        srv.start()
        try:
            t_start = time.monotonic()
            js = run_async(lambda: _shared(cfg, srv.url, tmp, jobs, done))
        finally:
            srv.stop()
    rec = slot_model.RECORDERS.pop(run)
    return analyse_shared(rec, jobs, done, t_start, js)


async def _shared(
    cfg: Any, url: str, tmp: Path, jobs: list[tuple[str, str, int]], done: dict[str, list[float]]
) -> dict[str, Any]:
    pairs = selected(cfg, None)
    buses = await open_buses(
        url,
        ["publisher", *(pool_key(r, n) for r, n in pairs)],
        namespace=cfg.namespace,
        telemetry=Telemetry(),
        name="sat-share",
    )
    bus = buses["publisher"]
    names = Subjects(cfg.namespace)
    consumers = [(names.model_stream, Subjects.durable("model", "policy"))] + [
        (names.tasks_stream, Subjects.durable("task", a)) for a in sorted({a for a, _, _ in jobs})
    ]
    peak: dict[str, int] = defaultdict(int)  # num_redelivered (pending redeliveries) seen, sampled each second
    rows: dict[str, tuple[int, int]] = {}
    try:
        await ensure_streams(bus)
        async with anyio.create_task_group() as tg:
            workers = make_workers(buses, resolve_config(cfg), pairs)
            await start_workers(tg, workers)

            async def watch() -> None:
                while True:
                    for stream, c in consumers:
                        info = await bus.js.consumer_info(stream, c)
                        peak[c] = max(peak[c], info.num_redelivered)
                    await anyio.sleep(1.0)

            tg.start_soon(watch)

            async def one(agent: str, batch: str, n: int) -> None:
                inp = make_input("weather", n, tmp, tag=batch)
                col = Collector(
                    bus,
                    new_manifest(batch, Owners.one(agent, n), repeats=1, input_path=str(inp)),
                    tmp / f"{batch}.jsonl",
                    on_result=lambda ok, _r: done[batch].append(time.monotonic()),
                )
                async with anyio.create_task_group() as g:
                    got: dict[str, Any] = {}

                    async def collect() -> None:
                        got["stats"] = await col.run()

                    g.start_soon(collect)
                    await publish_batch(bus, resolve_config(cfg), inp, agent=agent, batch=batch)
                rows[batch] = (got["stats"].rows, got["stats"].failures)

            async with anyio.create_task_group() as jg:
                for job in jobs:
                    jg.start_soon(one, *job)
            # the model's work left when every batch has ended (calls of rollouts that timed out): how long
            # the slots stay busy for nobody, up to 120 s
            ended = time.monotonic()
            models = [w for w in workers if isinstance(w, ModelWorker)]
            with anyio.move_on_after(120):
                while (await bus.js.stream_info(names.model_stream)).state.messages or any(
                    w.stats()["in_flight"] for w in models
                ):
                    await anyio.sleep(0.2)
            busy_after = time.monotonic() - ended
            infos = {c: await bus.js.consumer_info(s, c) for s, c in consumers}
            # deliveries (consumer_seq counts each one, redeliveries included) against the messages delivered
            delivered = {c: i.delivered.consumer_seq + i.num_pending for c, i in infos.items()}
            queued = (await bus.js.stream_info(names.model_stream)).state.last_seq
            await drain(workers, timeout=5.0)
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await close_buses(buses)
    model_c = consumers[0][1]
    tasks = sum(n for _, _, n in jobs)
    return {
        "rows": rows,
        "queued_calls": queued,
        "model_redelivered": delivered[model_c] - queued,
        "task_redelivered": sum(v for c, v in delivered.items() if c != model_c) - tasks,
        "peak_pending_redelivered": dict(peak),
        "model_busy_after_s": busy_after,
        "expired": sum(getattr(w, "expired", 0) for w in models),
    }


def analyse_shared(
    rec: slot_model.Recorder,
    jobs: list[tuple[str, str, int]],
    done: dict[str, list[float]],
    t0: float,
    js: dict[str, Any],
) -> dict[str, Any]:
    """Each batch's share of the slot-seconds while every batch still had work, its waits and its end."""
    total_slots = sum(s for s, _ in rec.replicas.values())
    # steady: from every slot filled once to the first batch's end, or fewer unfinished rollouts than slots
    ends = sorted(t for d in done.values() for t in d)
    n = len(ends)
    first_end = min(min(max(d) for d in done.values()), ends[max(0, n - total_slots)] if n > total_slots else ends[-1])
    starts = sorted(c.started for c in rec.calls)
    w0 = starts[min(len(starts) - 1, total_slots - 1)]  # every slot filled once
    by_batch: dict[str, list[slot_model.Call]] = defaultdict(list)
    by_key: dict[str | None, list[slot_model.Call]] = defaultdict(list)
    for c in rec.calls:
        by_batch[(c.key or "").split(":")[0]].append(c)
        by_key[c.key].append(c)
    per_rollout = statistics.mode(len(cs) for cs in by_key.values())
    rerun = sum(max(0, len(cs) - per_rollout) for cs in by_key.values())
    window = max(1e-9, first_end - w0)

    def busy(cs: list[slot_model.Call]) -> float:
        return sum(max(0.0, min(c.ended, first_end) - max(c.started, w0)) for c in cs)

    all_busy = busy(rec.calls)
    out: dict[str, Any] = {
        "occupancy": all_busy / (total_slots * window),
        "window_s": window,
        "calls_per_rollout": per_rollout,
        "calls_rerun": rerun,
        "calls_run": len(rec.calls),
        "median_call_s": statistics.median(c.ended - c.started for c in rec.calls),
        **js,
        "batches": {},
    }
    demand = sum(n for _, _, n in jobs)
    for agent, batch, n in jobs:
        cs = by_batch[batch]
        waits: list[float] = []
        for key in {c.key for c in cs}:
            ks = sorted(by_key[key], key=lambda c: c.started)
            waits += [b.started - a.ended for a, b in zip(ks, ks[1:], strict=False)]
        out["batches"][batch] = {
            "agent": agent,
            "n": n,
            "demand": n / demand,
            "share": busy(cs) / all_busy if all_busy else float("nan"),
            "first_wait_p50": pct(
                [c.started - t0 for c in cs if c is min(by_key[c.key], key=lambda k: k.started)], 0.5
            ),
            "wait_p50": pct(waits, 0.5),
            "wait_p99": pct(waits, 0.99),
            "end_s": max(done[batch]) - t0,
            "rows": js["rows"][batch],
        }
    return out


def print_shared(label: str, r: dict[str, Any]) -> None:
    print(
        f"\n{label}: median call {r['median_call_s']:.2f} s; occupancy {100 * r['occupancy']:.1f}% over the "
        f"{r['window_s']:.0f} s every batch had work and the slots could all be busy"
    )
    print(
        "| batch (agent) | rollouts in flight | share of demand | share of slot-seconds | "
        "first call starts p50 s | queue wait p50 / p99 s | batch ends s | rows / failed |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for b, x in r["batches"].items():
        print(
            f"| {b} ({x['agent']}) | {x['n']:,} | {100 * x['demand']:.1f}% | {100 * x['share']:.1f}% | "
            f"{x['first_wait_p50']:.1f} | {x['wait_p50']:.2f} / {x['wait_p99']:.2f} | {x['end_s']:.1f} | "
            f"{x['rows'][0]:,} / {x['rows'][1]} |"
        )
    print(
        f"redeliveries (JetStream): model calls {r['model_redelivered']} of {r['queued_calls']:,} queued, tasks "
        f"{r['task_redelivered']}; pending redeliveries at most {r['peak_pending_redelivered']}; model calls run "
        f"more than once (stand-in): {r['calls_rerun']} ({r['calls_per_rollout']} per rollout); model calls run in "
        f"all: {r['calls_run']:,} for {sum(x['rows'][0] for x in r['batches'].values()):,} completed rollouts; "
        f"the model "
        f"was busy {r['model_busy_after_s']:.1f} s after the last batch ended; queued calls not run (expired): "
        f"{r['expired']}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", choices=sorted(ENVS), default="weather")
    ap.add_argument("--grid", choices=["default", "apart", "ceiling"], default="default")
    ap.add_argument("--point", nargs=4, type=float, metavar=("REPLICAS", "SLOTS", "MEDIAN_S", "IN_FLIGHT"))
    ap.add_argument("--slow", type=int, default=0, help="with --point: this many replicas are slower")
    ap.add_argument("--factor", type=float, default=2.0, help="how much slower (default 2)")
    ap.add_argument("--sigma", type=float, default=0.8, help="lognormal shape of output tokens (default 0.8)")
    ap.add_argument("--inflight", type=int, help="memory per rollout in flight at this many rollouts")
    ap.add_argument("--inflight-median", type=float, default=60.0, help="call time of the slow stand-in (s)")
    ap.add_argument("--through", type=int, default=0, help="then a batch of this many rollouts: memory flat?")
    ap.add_argument("--no-freeze", action="store_true", help="leave start-up's objects to the collector (before)")
    ap.add_argument(
        "--share", nargs="+", type=int, metavar="N", help="agents sharing one model: rollouts in flight each"
    )
    ap.add_argument("--model", nargs=2, type=int, default=[1, 64], metavar=("REPLICAS", "SLOTS"), help="with --share")
    ap.add_argument("--median", type=float, default=0.5, help="with --share: median call time (s)")
    ap.add_argument("--batches", action="store_true", help="with --share: one agent, one batch per N")
    ap.add_argument("--long", nargs=2, type=float, metavar=("LO", "HI"), help="call time uniform in LO..HI s")
    ap.add_argument("--ack-wait", type=float, help="every model's and agent's ack_wait_s (default: the config's)")
    ap.add_argument("--budget", type=float, help="the stand-in's call budget (s): callers wait this + ack_wait + 5 s")
    ap.add_argument("--timeout", type=float, help="with --share: the agents' timeout_s (default 3600)")
    ap.add_argument("--agent-slots", type=int, help="with --share: each agent's concurrency (default: its N)")
    ap.add_argument("--log", default="warning", help="log level of the workers (default warning)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    logs.configure(level=args.log)
    tune_gc()  # as the CLI does in the processes it owns
    if not args.no_freeze:
        freeze_startup()  # as `run` and `start` do once everything is imported
    if args.inflight:
        inflight(args.inflight, args.inflight_median, args.through)
        return
    if args.through:
        flat(args.through)
        return
    if args.share:
        r = shared(
            args.share,
            *args.model,
            batches=args.batches,
            median_s=args.median,
            sigma=args.sigma,
            long=args.long,
            ack_wait=args.ack_wait,
            budget=args.budget,
            timeout=args.timeout,
            agent_slots=args.agent_slots,
        )
        calls = f"uniform {args.long[0]:g}-{args.long[1]:g} s" if args.long else f"median {args.median:g} s"
        print_shared(
            f"{'batches of one agent' if args.batches else 'agents'} {args.share} on {args.model[0]} x "
            f"{args.model[1]} slots, calls {calls}, ack_wait_s {args.ack_wait or 'default'}, call budget "
            f"{args.budget or 480:g} s, rollout timeout_s {args.timeout or 3600:g}, agent concurrency "
            f"{args.agent_slots or 'N'}; load "
            f"{psutil.getloadavg()[0]:.1f}",
            r,
        )
        if args.json:
            Path(args.json).write_text(json.dumps(r, indent=1))
        return
    results: list[dict[str, Any]] = []
    if args.grid == "ceiling":
        c = ceiling(args.env, 4000)
        print(f"runtime ceiling on this machine ({args.env}, 1 ms stand-in, 4,000 rollouts): {c:,.0f} model calls/s")
        return
    grid = (
        [tuple(int(x) if i != 2 else x for i, x in enumerate(args.point)) + (args.slow,)]
        if args.point
        else (GRID if args.grid == "default" else APART)
    )
    print(f"{args.env}, lognormal sigma {args.sigma}; load average {psutil.getloadavg()[0]:.1f}\n")
    print(HEADER)
    for replicas, slots, median, n, slow in grid:
        r = point(
            args.env,
            int(replicas),
            int(slots),
            float(median),
            int(n),
            slow=int(slow),
            factor=args.factor,
            sigma=args.sigma,
        )
        label = f"{replicas} x {slots}" + (f" ({slow} x{args.factor:g} slower)" if slow else "")
        print(fmt(label, r), flush=True)
        print(
            f"|   event loop lag (call held longer than drawn) {r['loop_lag_ms']:.0f} ms mean; GC {r['gc_s']:.2f} s "
            f"in all, longest pause {r['gc_max_ms']:.0f} ms, {r['gc_old']} oldest-generation passes (median "
            f"{r['gc_old_p50_ms']:.0f} ms; younger passes p99 {r['gc_young_p99_ms']:.0f} ms); load "
            f"{psutil.getloadavg()[0]:.1f} | | | | | | | |"
        )
        for k, (got, want) in r["share"].items():
            print(f"|   {k}: {100 * got:.1f}% of calls, {100 * want:.1f}% of capacity | | | | | | | |")
        results.append({"label": label, **r})
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
