"""Cache-aware model routing: a rollout's later turns go to the replica that served its earlier turns while it
has a free slot; full, gone or drained, the call goes elsewhere at once and the affinity moves.

Real nats-server, real model workers (in this process), the scripted policy as the LLM; the rollouts' side is
the routing code itself (``call_model`` carrying the last turn's replica, as ``AgentContext.generate`` does), and
end to end the real agent worker.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import msgspec

from gym_runtime.config import config_from_dict, resolve_config
from gym_runtime.data.collector import Collector
from gym_runtime.data.inputs import publish_rows
from gym_runtime.messages import CreateParams, ModelRequest, ModelResponse, parse_items
from gym_runtime.model import ModelConfig, load_adapter, model_config
from gym_runtime.observability import meters
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.ops.nats_server import EmbeddedServer, free_port
from gym_runtime.ops.status import gather, render
from gym_runtime.service.runner import drain, make_workers, selected, start_workers
from gym_runtime.transport.affinity import Affinity
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.discovery import discover
from gym_runtime.transport.model_calls import call_model
from gym_runtime.workers.agent_worker import AgentWorker
from gym_runtime.workers.model_worker import ModelWorker
from tests.helpers import REPO, ROWS, put_batch, resolved
from tests.stub_openai import StubOpenAI
from tests.test_model_calls import serving, until
from tests.test_sandbox_metrics import labels, scrape


def scripted(*, concurrency: int, delay_s: float = 0.0, prefix_cache: bool = True) -> ModelConfig:
    """The scripted double, routed as an engine with a prefix cache (``prefix_cache``) unless told otherwise."""
    entry = {"adapter": "scripted", "concurrency": concurrency, "delay_s": delay_s, "prefix_cache": prefix_cache}
    return model_config(entry)


def request(text: str = "weather in sf?") -> ModelRequest:
    return ModelRequest(params=CreateParams(input=parse_items(text)), rollout_key="r")


@contextlib.asynccontextmanager
async def replicas(url: str, n: int, cfg: ModelConfig) -> AsyncIterator[list[ModelWorker]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(serving(url, cfg)) for _ in range(n)]


async def rollout(bus: Bus, turns: int, *, replica: str | None = None) -> list[ModelResponse]:
    """One rollout's turns, each carrying the replica of the one before (the agent's routing)."""
    out: list[ModelResponse] = []
    for _ in range(turns):
        reply = await call_model(bus, "policy", request(), timeout=30, replica=replica)
        replica = reply.worker
        out.append(reply)
    return out


async def test_a_rollouts_turns_stay_on_one_replica_while_it_has_a_free_slot(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    """12 rollouts of 6 turns on 3 replicas with room for all: each rollout's turns on one replica (picked at
    random per turn before: a rollout of 6 turns stayed on one of 3 replicas 1 time in 243)."""
    async with replicas(nats_server.url, 3, scripted(concurrency=8)) as workers:
        done: list[list[ModelResponse]] = []

        async def one() -> None:
            done.append(await rollout(bus, 6))

        async with anyio.create_task_group() as tg:
            for _ in range(12):
                tg.start_soon(one)
        assert [len({r.worker for r in turns}) for turns in done] == [1] * 12
        assert sum(w.routed["affine"] for w in workers) == 12 * 5  # every later turn, by affinity
        assert sum(w.routed["load"] + w.routed["moved"] for w in workers) == 0


async def test_a_full_replica_sends_the_turn_elsewhere_at_once_and_the_affinity_moves(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    """The rollout's replica has its one slot held by a 120 s call: the next turn goes to the other replica at
    once (not after the slow call), its later turns stay there."""
    async with replicas(nats_server.url, 2, scripted(concurrency=1)) as (a, b):
        first = await call_model(bus, "policy", request(), timeout=30)
        home = a if first.worker == a.worker_id else b
        other = b if home is a else a
        home.adapter._delay = 120.0  # type: ignore[attr-defined]  # its next call holds its one slot

        async def held() -> bool:
            return home.running.locked()

        async with anyio.create_task_group() as tg:
            slow = msgspec.structs.replace(request(), rollout_key="slow")
            tg.start_soon(lambda: call_model(bus, "policy", slow, timeout=300, replica=home.worker_id))
            # a pull request it sent while its slot was free may still deliver the queued turn: handed back to the
            # queue (``test_a_queued_call_delivered_to_a_full_replica_goes_back_to_the_queue``), not held
            await until(held)
            with anyio.fail_after(60):  # far under the slow call's 120 s
                turns = await rollout(bus, 3, replica=home.worker_id)
            tg.cancel_scope.cancel()
        assert [r.worker for r in turns] == [other.worker_id] * 3
        assert other.routed["load"] == 1 and other.routed["affine"] == 2


async def test_a_queued_call_delivered_to_a_full_replica_goes_back_to_the_queue(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    """The queue's trade-off: a pull request a replica sent while its slot was free delivers a queued call after a
    direct 120 s call took that slot. The call is nak'd back to the queue at once and served by a replica with a
    free slot, not held behind the long generation."""
    async with serving(nats_server.url, scripted(concurrency=1)) as home:
        puller = home.puller
        assert puller is not None
        puller.expires_s, puller._expires_ns = 120.0, int(120e9)  # its pull requests live long: the window is wide

        async def long_pull_out() -> bool:
            return bool(puller._requests) and puller._requests.oldest_expires_at() > time.monotonic() + 30

        await until(long_pull_out)
        home.adapter._delay = 120.0  # type: ignore[attr-defined]  # its next call holds its one slot
        async with anyio.create_task_group() as tg:
            slow = msgspec.structs.replace(request(), rollout_key="slow")
            tg.start_soon(lambda: call_model(bus, "policy", slow, timeout=300, replica=home.worker_id))

            async def held() -> bool:
                return home.running.locked()

            await until(held)
            assert puller.credits == 1  # the pull request sent while the slot was free is still out
            replies: list[ModelResponse] = []

            async def queued() -> None:  # home answers its direct try busy: it goes to the queue, and to home
                replies.append(await call_model(bus, "policy", request(), timeout=300))

            tg.start_soon(queued)

            async def delivered_to_home() -> bool:
                return puller.credits == 0

            await until(delivered_to_home)
            with anyio.fail_after(60):  # far under the slow call's 120 s
                async with serving(nats_server.url, scripted(concurrency=1)) as other:
                    await until(lambda: _true(replies), within=60)
            tg.cancel_scope.cancel()
        assert [r.worker for r in replies] == [other.worker_id]
        assert home.handed_back >= 1


async def _true(items: list[Any]) -> bool:
    return bool(items)


async def test_a_gone_replica_loses_only_its_rollouts_affinity(nats_server: EmbeddedServer, bus: Bus) -> None:
    async with serving(nats_server.url, scripted(concurrency=4)) as b:
        async with serving(nats_server.url, scripted(concurrency=4)) as a:
            gone = a.worker_id
        turns = await rollout(bus, 3, replica=gone)  # its replica stopped: the turn goes on at once
        assert [r.worker for r in turns] == [b.worker_id] * 3
        assert b.routed["moved"] == 1 and b.routed["affine"] == 2


async def test_a_draining_replica_sends_its_rollouts_elsewhere(nats_server: EmbeddedServer, bus: Bus) -> None:
    async with replicas(nats_server.url, 2, scripted(concurrency=4)) as (a, b):
        first = await call_model(bus, "policy", request(), timeout=30)
        home, other = (a, b) if first.worker == a.worker_id else (b, a)
        assert home.puller is not None
        home.puller.stop_pulling()  # as ``drain`` starts: no new work
        turns = await rollout(bus, 2, replica=home.worker_id)
        # not sent to the draining replica's own subject: it answered busy and the call went on at once, counted
        # as sent elsewhere for load
        assert home.routed["affine"] == 0
        assert home.routed["load"] + other.routed["load"] >= 1
        # a pull request it had out before the drain may still hand it the queued call, as with any queued call;
        # taken by the other replica, the affinity moved with it
        if turns[0].worker == other.worker_id:
            assert turns[1].worker == other.worker_id and other.routed["affine"] == 1


async def test_a_replica_added_mid_batch_takes_new_rollouts_at_once(nats_server: EmbeddedServer, bus: Bus) -> None:
    """Rollouts under way on replica a keep it; a replica b added meanwhile takes new rollouts from their first
    turn (no affinity holds a new rollout), and keeps their later turns."""
    async with serving(nats_server.url, scripted(concurrency=16)) as a:
        started = [await rollout(bus, 2) for _ in range(4)]
        assert {r.worker for turns in started for r in turns} == {a.worker_id}
        async with serving(nats_server.url, scripted(concurrency=16)) as b:
            old: list[list[ModelResponse]] = []
            new: list[list[ModelResponse]] = []

            async def go_on(replica: str) -> None:
                old.append(await rollout(bus, 3, replica=replica))

            async def fresh() -> None:
                new.append(await rollout(bus, 3))

            async with anyio.create_task_group() as tg:
                for turns in started:
                    tg.start_soon(go_on, turns[-1].worker)
                for _ in range(16):
                    tg.start_soon(fresh)
        assert {r.worker for turns in old for r in turns} == {a.worker_id}  # under way: their cache stays theirs
        on_b = [turns for turns in new if turns[0].worker == b.worker_id]
        assert on_b, "the added replica took none of 16 new rollouts"  # at random: 1 time in 65,536
        assert all({r.worker for r in turns} == {b.worker_id} for turns in on_b)


async def test_load_stays_within_a_quarter_of_the_mean_over_many_rollouts(bus: Bus, tmp_path: Path) -> None:
    """96 weather rollouts (two model turns each), 12 at once through the real agent worker, on 4 replicas of 4
    slots: no replica served more than 1.25x the mean of the prompt tokens, and most rows' turns stayed on one
    replica (at random 1 in 4: ~24 of 96; moved only when full). With more rollouts at once than slots (32), a
    turn's replica is full so often that how many stay (28-50 of 96 in 8 runs) cannot be told from chance well
    enough for a test; the balance at that load is the simulated benchmark's (``tests/bench/prefix_routing.py``)."""
    n = 96
    cfg = config_from_dict(
        {
            "namespace": "gym",
            "models": {
                "policy": {
                    "adapter": "scripted",
                    "concurrency": 4,
                    "replicas": 4,
                    "delay_s": 0.01,
                    "prefix_cache": True,
                }
            },
            "resources": {"env": {"server": "resources.weather"}},
            "agents": {"agent": {"agent": "agents.simple", "model": "policy", "resource": "env", "concurrency": 12}},
            "base_dir": str(REPO),
        }
    )
    workers = make_workers(bus, resolve_config(cfg), selected(cfg, None))
    models = [w for w in workers if isinstance(w, ModelWorker)]
    assert len(models) == 4
    tokens = {w.worker_id: 0 for w in models}
    for w in models:  # the test double's prompt tokens, counted per replica
        w.adapter = Counted(w.adapter, tokens, w.worker_id)
    out = tmp_path / "out.jsonl"
    async with anyio.create_task_group() as tg:
        await start_workers(tg, workers)
        await publish_rows(bus, [ROWS[i % len(ROWS)] for i in range(n)], batch="b", agents=["agent"])
        with anyio.fail_after(120):
            stats = await Collector(bus, await put_batch(bus, "b", n, agent="agent"), out).run()
        await drain(workers, timeout=5)
        tg.cancel_scope.cancel()
    assert (stats.rows, stats.failures) == (n, 0)
    rows = [msgspec.json.decode(line) for line in out.read_text().splitlines()]
    on_one = sum(len(r["provenance"]["workers"]["model"]) == 1 for r in rows)
    assert on_one >= 60, on_one  # at random 24 +- 4; routed, 79-88 in 8 runs at load 5
    mean = statistics.mean(tokens.values())
    assert max(tokens.values()) <= 1.25 * mean, tokens


class Counted:
    """A model adapter whose calls' prompt tokens are added up under its worker's id."""

    def __init__(self, inner: Any, tokens: dict[str, int], worker: str) -> None:
        self.inner, self.tokens, self.worker = inner, tokens, worker

    async def generate(self, params: CreateParams, *, rollout_key: str | None = None) -> Any:
        response = await self.inner.generate(params, rollout_key=rollout_key)
        self.tokens[self.worker] += response.usage.input_tokens if response.usage else 0
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_two_model_worker_processes_send_a_rollout_to_the_same_endpoint(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    """Two ``start`` processes of one ``vllm`` entry in front of 3 endpoints (stub vLLM servers): each rollout's
    turns, taken by whichever process the queue group picks as rollouts run in no fixed order, reach one endpoint
    (before: each process kept its own rollout -> endpoint map, filled by least load in the order it saw them,
    so a rollout's turns split between endpoints). The endpoints hold the cache, so the processes themselves are
    not routed to (``holds_prefix_cache``): the endpoint's choice is agreed instead."""
    with contextlib.ExitStack() as stack:
        stubs = [stack.enter_context(StubOpenAI()) for _ in range(3)]
        urls = ", ".join(s.base_url for s in stubs)
        config = tmp_path / "config.yaml"
        config.write_text(
            "namespace: gym\nmodels:\n  policy: {adapter: vllm, model: tiny, base_url: [" + urls + "]}\n"
            "resources: {}\nagents: {}\n"
        )
        procs = [stack.enter_context(started(config, nats_server.url)) for _ in range(2)]
        assert len(procs) == 2
        await discover(bus, until=lambda ws: len([w for w in ws if w.get("role") == "model"]) >= 2)
        order = list(range(24))
        served: dict[int, set[str]] = {}  # rollout -> the processes that took its turns
        for turn in range(4):  # the rollouts in another order each turn, each call to either process
            random.Random(turn).shuffle(order)
            for k in order:
                params = CreateParams(input=parse_items(f"rollout {k} turn {turn}"))
                req = ModelRequest(params=params, rollout_key=f"b:{k}:0")
                served.setdefault(k, set()).add((await call_model(bus, "policy", req, timeout=30)).worker or "")
        assert any(len(ws) == 2 for ws in served.values())  # both processes took turns of one rollout
        where: dict[int, set[int]] = {}
        for i, stub in enumerate(stubs):
            for r in stub.requests:
                text = json.dumps(r.body)
                if (m := re.search(r"rollout (\d+) turn", text)) is not None:
                    where.setdefault(int(m.group(1)), set()).add(i)
        assert sorted(where) == list(range(24))
        assert all(len(eps) == 1 for eps in where.values()), where
        assert len({next(iter(eps)) for eps in where.values()}) > 1  # and the rollouts spread over the endpoints


@contextlib.contextmanager
def started(config: Path, url: str) -> Iterator[subprocess.Popen[str]]:
    """A ``start --only models.policy`` process, ready, for the block."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "gym_runtime.cli", "start", str(config), "--nats", url, "--only", "models.policy"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None and "ready" in proc.stdout.readline()
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


async def test_a_rollouts_later_turns_reach_their_replica_on_a_secured_bus(buses: dict[str, Bus]) -> None:
    """The agent role may call a replica by name and the model role serve its own subject (permissions)."""
    worker = ModelWorker(buses["model"], "policy", resolved(models={"policy": scripted(concurrency=4)}))
    async with anyio.create_task_group() as tg:
        await tg.start(worker.run)
        with anyio.fail_after(8):  # under the bus's liveness (10 s): a refused publish would wait that long
            turns = await rollout(buses["agent"], 3)
        tg.cancel_scope.cancel()
    assert {r.worker for r in turns} == {worker.worker_id}
    assert worker.routed == {"affine": 2, "load": 0, "moved": 0}


def test_only_models_whose_replicas_hold_a_prefix_cache_are_routed() -> None:
    """An in-process engine's replicas hold the cache (routed unless its prefix caching is off); the scripted
    double and an HTTP adapter's workers do not (the endpoints hold it, chosen by the adapter): not routed."""
    engine = {"adapter": "vllm_engine", "model": "tiny"}
    assert model_config(engine).routed_load() == ModelConfig().affinity_load
    assert model_config({**engine, "engine_args": {"enable_prefix_caching": False}}).routed_load() == 0
    assert model_config({**engine, "affinity_load": 0}).routed_load() == 0
    assert model_config({"adapter": "vllm", "model": "tiny", "base_url": "http://127.0.0.1:1/v1"}).routed_load() == 0
    assert model_config({"adapter": "scripted"}).routed_load() == 0
    assert Affinity.of({"policy": 0.0}) is None


async def test_a_model_without_a_prefix_cache_costs_nothing_to_route(bus: Bus, tmp_path: Path) -> None:
    """Weather rollouts through the real agent worker on the scripted model (no cache): no call carries a
    route, no replica serves a subject of its own, the agent worker keeps no affinity (before: every later
    turn went to its replica's own subject, at a cost in instructions per rollout and nothing gained)."""
    n = 8
    cfg = config_from_dict(
        {
            "namespace": "gym",
            "models": {"policy": {"adapter": "scripted", "concurrency": 4, "replicas": 2}},
            "resources": {"env": {"server": "resources.weather"}},
            "agents": {"agent": {"agent": "agents.simple", "model": "policy", "resource": "env", "concurrency": 8}},
            "base_dir": str(REPO),
        }
    )
    workers = make_workers(bus, resolve_config(cfg), selected(cfg, None))
    models = [w for w in workers if isinstance(w, ModelWorker)]
    agents = [w for w in workers if isinstance(w, AgentWorker)]
    assert agents and all(a._models.affinity is None for a in agents)
    out = tmp_path / "out.jsonl"
    async with anyio.create_task_group() as tg:
        await start_workers(tg, workers)
        for w in models:
            own = bus.subjects.model_replica("policy", w.worker_id)
            assert (await bus.try_direct(own, request(), timeout=10, op="generate policy"))[0] == "absent"
        await publish_rows(bus, [ROWS[i % len(ROWS)] for i in range(n)], batch="b", agents=["agent"])
        with anyio.fail_after(120):
            stats = await Collector(bus, await put_batch(bus, "b", n, agent="agent"), out).run()
        await drain(workers, timeout=5)
        tg.cancel_scope.cancel()
    assert (stats.rows, stats.failures) == (n, 0)
    assert sum(w.served for w in models) == 2 * n
    assert [sum(w.routed.values()) for w in models] == [0, 0]


class Cached:
    """The scripted double reporting prefix-cache counters as ``vllm_engine`` does (its engine's, here fixed)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def generate(self, params: CreateParams, *, rollout_key: str | None = None) -> Any:
        return await self.inner.generate(params, rollout_key=rollout_key)

    def prefix_cache(self) -> dict[str, int]:
        return {"hits": 150, "queries": 300}

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_status_and_metrics_show_the_routes_and_the_engines_prefix_cache(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    """A replica's calls by route and its engine's prefix-cache hits and queries: in ``status`` and in the
    Prometheus metrics (``gym_model_routed_total``, ``gym_model_prefix_cache_total``)."""
    port = free_port()
    tel = Telemetry(meters=meters.start(service="gym-runtime.test", role="start", port=port))
    wbus = await Bus.connect(nats_server.url, namespace="gym", telemetry=tel, name="model")
    cfg = scripted(concurrency=4)
    worker = ModelWorker(wbus, "policy", resolved(models={"policy": cfg}), adapter=Cached(load_adapter(cfg)))
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(worker.run)
            await rollout(bus, 3)
            shown = render(await gather(bus))  # what `gym-runtime status` prints
            lines = await anyio.to_thread.run_sync(scrape, port)
            tg.cancel_scope.cancel()
    finally:
        await wbus.close()
        tel.shutdown()
    assert "routed affine 67%, load 0%, moved 0% of 3 calls; prefix cache hits 50% of 300 prompt tokens" in shown
    routed = {
        d["gym_route"]: line.rsplit(" ", 1)[1]
        for line in lines
        if line.startswith("gym_model_routed_total{")
        for d in labels([line], "gym_model_routed_total")
    }
    assert routed == {"affine": "2.0", "load": "0.0", "moved": "0.0"}, routed
    cache = {
        d["gym_kind"]: line.rsplit(" ", 1)[1]
        for line in lines
        if line.startswith("gym_model_prefix_cache_total{")
        for d in labels([line], "gym_model_prefix_cache_total")
    }
    assert cache == {"hits": "150.0", "queries": "300.0"}, cache
