"""Cache-aware model routing on real vLLM, read from vLLM's own prefix-cache counters.

Real vLLM engines (``vllm_engine``: ``AsyncLLM`` in process, vLLM's CPU build the vLLM tier uses) on a tiny
random-weight model the benchmark builds (``tests/test_vllm.py``'s), one real model worker each, a real
nats-server, and the rollouts' calls through an agent worker's port (``BusPort`` with its ``Affinity``: the
real routing code). Each rollout has a long system prompt shared by all and a tool, then ``--turns`` turns:
the model's answer (token ids, spliced as training needs them) and a new user message each turn, so each
turn's prompt is the one before plus its answer plus the new message.

The hit rates are vLLM's: its scheduler's prefix-cache hits over queries (prompt tokens found in the cache over
those looked up: ``PrefixCacheStats``, what ``vllm:prefix_cache_hits`` / ``_queries`` export), summed over the
replicas, every engine's cache emptied before each run. Per replica count:

* **today**: routing off (``affinity_load: 0``: each turn to any replica with a free slot);
* **routed**: cache-aware routing on (the default ``affinity_load``);
* **ideal**: the same rollouts on one replica whose cache holds everything: what it hits is what an earlier
  call already computed (the rollout's own earlier turns, and the shared system prompt);
* the load spread (the most prompt tokens one replica served over the mean) and the time per rollout.

Run (the engines start once each, about a minute apiece on 2 idle cores, and serve every run)::

    python tests/bench/prefix_cache_vllm.py [--replicas 2 4] [--turns 10] [--rollouts 16]

in an environment with vLLM's CPU build (the vLLM tier's venv, with this tree on ``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB per engine: room for every run's prompts
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from gym_runtime.messages import CreateParams, ModelRequest, parse_items  # noqa: E402
from gym_runtime.model import ModelConfig, model_config  # noqa: E402
from gym_runtime.observability.tracing import Telemetry  # noqa: E402
from gym_runtime.ops.nats_server import EmbeddedServer  # noqa: E402
from gym_runtime.rollout.port import BusPort  # noqa: E402
from gym_runtime.transport.affinity import Affinity  # noqa: E402
from gym_runtime.transport.bus import Bus  # noqa: E402
from gym_runtime.workers.model_worker import ModelWorker  # noqa: E402
from tests.helpers import resolved  # noqa: E402

BLOCK = 32  # tokens per KV block (vLLM caches and counts whole blocks; its CPU attention takes multiples of 32)
TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city, today.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def system_prompt(words: int) -> str:
    """A long instruction every rollout shares (as an agent's system prompt and tool descriptions are)."""
    vocab = "the weather tool call user assistant what's it like in sf cold".split()
    return " ".join(vocab[(i * 7) % len(vocab)] for i in range(words))


def build_model(path: Path, context: int) -> None:
    """The vLLM tier's tiny random Llama, its context widened so a rollout's growing history fits."""
    from tests.test_vllm import _build_tiny_model

    _build_tiny_model(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["max_position_embeddings"] = context
    (path / "config.json").write_text(json.dumps(cfg))


def engine_entry(model: Path, args: argparse.Namespace, load: float) -> ModelConfig:
    return model_config(
        {
            "adapter": "vllm_engine",
            "model": str(model),
            "concurrency": args.slots,
            "affinity_load": load,
            "return_token_ids": True,
            "engine_args": {
                "max_model_len": args.context,
                "enforce_eager": True,
                "dtype": "float32",
                "block_size": BLOCK,
                "enable_prefix_caching": True,
            },
        }
    )


async def _kept() -> None:
    """An engine's ``aclose`` during the runs: it serves the next run (closed once at the end)."""


@contextlib.asynccontextmanager
async def serving(url: str, engines: list[Any], cfg: ModelConfig) -> AsyncIterator[list[ModelWorker]]:
    """One model worker per engine, for the block; each engine's cache emptied first."""
    async with contextlib.AsyncExitStack() as stack, anyio.create_task_group() as tg:
        workers = []
        for engine in engines:
            await engine._engine.reset_prefix_cache()
            bus = await Bus.connect(url, namespace="gym", telemetry=Telemetry(), name="model")
            stack.push_async_callback(bus.close)
            w = ModelWorker(bus, "policy", resolved(models={"policy": cfg}), adapter=engine)
            await tg.start(w.run)
            workers.append(w)
        yield workers
        tg.cancel_scope.cancel()


async def rollout(port: BusPort, k: int, args: argparse.Namespace, system: str) -> tuple[float, dict[str, int]]:
    """One rollout's turns through the port; its time and the prompt tokens each replica served it."""
    started = time.perf_counter()
    conv = parse_items([{"role": "system", "content": system}, {"role": "user", "content": f"rollout {k}: sf?"}])
    key, served = f"b:{k}:0", dict[str, int]()
    for turn in range(args.turns):
        extra = {"seed": k * 100 + turn, "ignore_eos": True}
        params = CreateParams(input=conv, tools=[TOOL], max_output_tokens=args.answer, extra=extra)
        reply = await port.model(
            "policy", ModelRequest(params=params, rollout_key=key), timeout=600, liveness_s=None, wait_s=600,
            on_output=None,
        )  # fmt: skip
        usage = reply.response.usage
        served[reply.worker or "?"] = served.get(reply.worker or "?", 0) + (usage.input_tokens if usage else 0)
        conv = [*conv, *reply.response.output, *parse_items(f"turn {turn}: and in la? what's it like")]
    if port.affinity is not None:
        port.affinity.ended(key)
    return time.perf_counter() - started, served


async def measure(url: str, engines: list[Any], cfg: ModelConfig, args: argparse.Namespace) -> dict[str, float]:
    """The rollouts on ``engines``' replicas, routed by ``cfg``: vLLM's hit rate, load spread, time per rollout."""
    before = [dict(e.cache.counts()) for e in engines]
    async with serving(url, engines, cfg) as workers:
        bus = await Bus.connect(url, namespace="gym", telemetry=Telemetry(), name="agent")
        port = BusPort(bus, Affinity.of({"policy": cfg.routed_load()}))
        done: list[tuple[float, dict[str, int]]] = []
        system = system_prompt(args.system)
        try:

            async def one(k: int) -> None:
                done.append(await rollout(port, k, args, system))

            async with anyio.create_task_group() as tg:
                for k in range(args.rollouts):
                    tg.start_soon(one, k)
        finally:
            await bus.close()
        routed = {r: sum(w.routed[r] for w in workers) for r in ("affine", "load", "moved")}
        served = sum(w.served for w in workers)
    after = [e.cache.counts() for e in engines]
    hits = sum(a.get("hits", 0) - b.get("hits", 0) for a, b in zip(after, before, strict=True))
    queries = sum(a.get("queries", 0) - b.get("queries", 0) for a, b in zip(after, before, strict=True))
    loads: dict[str, int] = {}
    for _, by in done:
        for w, n in by.items():
            loads[w] = loads.get(w, 0) + n
    spread = max(loads.values()) / (sum(loads.values()) / len(engines))
    return {
        "hit": hits / queries if queries else 0.0,
        "queries": queries,
        "spread": spread,
        "rollout_s": statistics.mean(t for t, _ in done),
        "affine": routed["affine"] / served,
    }


async def main(args: argparse.Namespace) -> None:
    from gym_runtime.models.vllm_engine import VLLMEngineModel

    with tempfile.TemporaryDirectory() as d, EmbeddedServer() as srv:
        model = Path(d) / "tiny"
        build_model(model, args.context)
        routed_cfg = engine_entry(model, args, ModelConfig().affinity_load)
        today_cfg = engine_entry(model, args, 0.0)
        engines: list[Any] = []
        closes: list[Any] = []

        async def grown(n: int) -> list[Any]:
            """``n`` engines, started as needed (one at a time: vLLM's start blocks its loop)."""
            while len(engines) < n:
                started = time.perf_counter()
                e = VLLMEngineModel(routed_cfg.options, concurrency=args.slots)
                await e._ensure()
                print(f"engine {len(engines) + 1} started in {time.perf_counter() - started:.0f} s", flush=True)
                closes.append(e.aclose)
                e.aclose = _kept  # the model workers' close at the end of a run leaves the engine for the next
                engines.append(e)
            return engines[:n]

        try:
            ideal = await measure(srv.url, await grown(1), routed_cfg, args)
            print(
                f"{args.rollouts} rollouts at once, {args.turns} turns each, {args.slots} slots per replica, "
                f"system prompt {args.system} words + a tool, {args.answer} answer tokens a turn, block {BLOCK} "
                f"tokens; affinity_load {ModelConfig().affinity_load:g}; ideal (one replica): {ideal['hit']:.1%} "
                f"of {ideal['queries']:.0f} prompt tokens, {ideal['rollout_s']:.1f} s per rollout"
            )
            print("| replicas | vLLM hit rate today | with routing | ideal | routing / ideal | load spread (max/mean) "
                  "today → routed | affine calls | time per rollout today → routed |")  # fmt: skip
            print("|---|---|---|---|---|---|---|---|", flush=True)
            for n in args.replicas:
                today = await measure(srv.url, await grown(n), today_cfg, args)
                routed = await measure(srv.url, await grown(n), routed_cfg, args)
                print(
                    f"| {n} | {today['hit']:.1%} | {routed['hit']:.1%} | {ideal['hit']:.1%} | "
                    f"{routed['hit'] / ideal['hit']:.0%} | {today['spread']:.2f} → {routed['spread']:.2f} | "
                    f"{routed['affine']:.0%} | {today['rollout_s']:.1f} s → {routed['rollout_s']:.1f} s |",
                    flush=True,
                )
        finally:
            for close in closes:
                await close()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--rollouts", type=int, default=16)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--system", type=int, default=300, help="words of the shared system prompt")
    p.add_argument("--answer", type=int, default=12, help="tokens the model generates a turn")
    p.add_argument("--context", type=int, default=4096)
    anyio.run(main, p.parse_args())
