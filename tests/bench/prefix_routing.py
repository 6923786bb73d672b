"""Cache-aware model routing, simulated: prefix-cache hit rate today, with routing, and the ideal.

A stand-in engine (TEST DOUBLE for the LLM: ``PrefixEngine``) has vLLM's automatic prefix cache in
miniature: a prompt is cut into blocks of ``BLOCK`` tokens, each block named by the hash of everything up to
its end; a call hits the leading blocks the replica still holds (an LRU of ``--cache-blocks`` blocks per
replica), pays ``--prefill-us`` per token it misses (a sleep: the replica's prefill), then stores the prompt's
blocks. Its answer is the ``scripted`` double's.

The calls go through the real routing code (an agent worker's ``BusPort`` with its ``Affinity``: the replica
of the rollout's last turn first), a real nats-server and real model workers (one per replica, in this
process). Each rollout has a shared system prompt (``--system`` tokens), then ``--turns`` turns whose
prompt is the one before plus its answer plus a new user message (``--grow`` tokens): the history grows each
turn. Measured per replica count (2, 4, 64):

* **today**: routing off (``affinity_load: 0``: each turn to any replica with a free slot);
* **routed**: cache-aware routing on;
* **ideal**: what one replica with a cache large enough for everything would hit, on the same calls;
* the **load spread**: the most prompt tokens one replica served over the mean; and the time per rollout.

Run: ``python tests/bench/prefix_routing.py`` (a few minutes on 2 cores; ``--replicas 2 4`` for fewer).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import statistics
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gym_runtime.messages import CreateParams, Message, ModelRequest, Response, message_text, parse_items  # noqa: E402
from gym_runtime.model import ModelConfig, model_config  # noqa: E402
from gym_runtime.observability.tracing import Telemetry  # noqa: E402
from gym_runtime.ops.nats_server import EmbeddedServer  # noqa: E402
from gym_runtime.rollout.port import BusPort  # noqa: E402
from gym_runtime.transport.affinity import Affinity  # noqa: E402
from gym_runtime.transport.bus import Bus  # noqa: E402
from gym_runtime.workers.model_worker import ModelWorker  # noqa: E402
from models.scripted import ScriptedModel  # noqa: E402
from tests.helpers import resolved  # noqa: E402

BLOCK = 16  # tokens per cache block (vLLM's default block size)


def blocks(tokens: list[str]) -> list[bytes]:
    """Each full block's name: the hash of every token up to its end (a prefix, as vLLM hashes blocks)."""
    out: list[bytes] = []
    h = hashlib.blake2b(digest_size=8)
    for i in range(0, len(tokens) - len(tokens) % BLOCK, BLOCK):
        h.update(" ".join(tokens[i : i + BLOCK]).encode())
        out.append(h.copy().digest())
    return out


class BlockCache:
    """An LRU of block names; ``None`` capacity: unbounded (the ideal)."""

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self.held: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self.hits = 0  # tokens
        self.queries = 0  # tokens

    def lookup(self, tokens: list[str]) -> int:
        """The prompt's cached leading tokens (counted), then its blocks stored: what a prefill leaves."""
        names = blocks(tokens)
        hit = 0
        for name in names:
            if name not in self.held:
                break
            hit += 1
        for name in names:
            self.held[name] = None
            self.held.move_to_end(name)
        while self.capacity is not None and len(self.held) > self.capacity:
            self.held.popitem(last=False)
        self.hits += hit * BLOCK
        self.queries += len(tokens)
        return hit * BLOCK


class PrefixEngine(ScriptedModel):
    """One replica: its prefix cache and its prefill time (the answer is the scripted double's)."""

    def __init__(self, capacity: int, prefill_s: float, ideal: BlockCache) -> None:
        super().__init__()
        self.cache = BlockCache(capacity)
        self.prefill_s = prefill_s
        self.ideal = ideal  # every replica's calls, in the order they ran, through one unbounded cache
        self.prompt_tokens = 0

    async def generate(self, params: CreateParams, *, rollout_key: str | None = None) -> Response:
        tokens = prompt_tokens(params)
        hit = self.cache.lookup(tokens)
        self.ideal.lookup(tokens)
        self.prompt_tokens += len(tokens)
        await anyio.sleep((len(tokens) - hit) * self.prefill_s)
        return await super().generate(params, rollout_key=rollout_key)


def prompt_tokens(params: CreateParams) -> list[str]:
    items = params.input if isinstance(params.input, list) else []
    return " ".join(message_text(i) for i in items if isinstance(i, Message)).split()


@contextlib.asynccontextmanager
async def replicas(url: str, n: int, *, affinity: bool, args: argparse.Namespace) -> AsyncIterator[list[ModelWorker]]:
    # the stand-in engine holds a prefix cache: routed as vllm_engine's replicas are (``holds_prefix_cache``)
    load = args.load if affinity else 0.0
    cfg = model_config({"adapter": "scripted", "concurrency": args.slots, "prefix_cache": True, "affinity_load": load})
    ideal = BlockCache(None)
    async with contextlib.AsyncExitStack() as stack, anyio.create_task_group() as tg:
        workers = []
        for _ in range(n):
            bus = await Bus.connect(url, namespace="gym", telemetry=Telemetry(), name="model")
            stack.push_async_callback(bus.close)
            engine = PrefixEngine(args.cache_blocks, args.prefill_us / 1e6, ideal)
            w = ModelWorker(bus, "policy", resolved(models={"policy": cfg}), adapter=engine)
            await tg.start(w.run)
            workers.append(w)
        yield workers
        tg.cancel_scope.cancel()


async def rollout(port: BusPort, k: int, args: argparse.Namespace, system: str) -> float:
    """One rollout's turns through an agent worker's port (``port.affinity``: the agent process's routing)."""
    started = time.perf_counter()
    history = [{"role": "system", "content": system}]
    key = f"b:{k}:0"
    for turn in range(args.turns):
        words = " ".join(f"r{k}t{turn}w{i}" for i in range(args.grow))
        history.append({"role": "user", "content": words})
        req = ModelRequest(params=CreateParams(input=parse_items(history)), rollout_key=key)
        await port.model("policy", req, timeout=120, liveness_s=None, wait_s=120, on_output=None)
        answer = " ".join(f"r{k}t{turn}a{i}" for i in range(args.answer))  # the model's answer, as long as said
        history.append({"role": "assistant", "content": answer})
    if port.affinity is not None:
        port.affinity.ended(key)
    return time.perf_counter() - started


async def measure(url: str, n: int, *, affinity: bool, args: argparse.Namespace) -> dict[str, float]:
    system = " ".join(f"sys{i}" for i in range(args.system))
    async with replicas(url, n, affinity=affinity, args=args) as workers:
        bus = await Bus.connect(url, namespace="gym", telemetry=Telemetry(), name="agent")
        times: list[float] = []
        port = BusPort(bus, Affinity.of({"policy": args.load if affinity else 0.0}))
        try:

            async def one(k: int) -> None:
                times.append(await rollout(port, k, args, system))

            async with anyio.create_task_group() as tg:
                for k in range(n * args.rollouts_per_replica):
                    tg.start_soon(one, k)
        finally:
            await bus.close()
        engines = [w.adapter for w in workers]
        hits = sum(e.cache.hits for e in engines)  # type: ignore[attr-defined]
        queries = sum(e.cache.queries for e in engines)  # type: ignore[attr-defined]
        ideal = engines[0].ideal  # type: ignore[attr-defined]
        loads = [e.prompt_tokens for e in engines]  # type: ignore[attr-defined]
        routed = collections.Counter[str]()
        for w in workers:
            routed.update(w.routed)
        served = sum(w.served for w in workers)
        return {
            "hit": hits / queries,
            "ideal": ideal.hits / ideal.queries,
            "spread": max(loads) / statistics.mean(loads),
            "rollout_s": statistics.mean(times),
            "affine": routed["affine"] / served,
        }


async def main(args: argparse.Namespace) -> None:
    with EmbeddedServer() as srv:
        print(
            f"{args.turns} turns per rollout, {args.rollouts_per_replica} rollouts per replica at once, "
            f"{args.slots} slots per replica, system prompt {args.system} tokens, +{args.grow} user and "
            f"{args.answer} answer tokens a turn; cache {args.cache_blocks} blocks of {BLOCK} tokens per replica, "
            f"prefill {args.prefill_us:g} us/token, affinity_load {args.load:g}"
        )
        print("| replicas | hit rate today | with routing | ideal | routing / ideal | load spread (max/mean) | "
              "affine calls | time per rollout today → routed |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|")
        for n in args.replicas:
            today = await measure(srv.url, n, affinity=False, args=args)
            routed = await measure(srv.url, n, affinity=True, args=args)
            print(
                f"| {n} | {today['hit']:.1%} | {routed['hit']:.1%} | {routed['ideal']:.1%} | "
                f"{routed['hit'] / routed['ideal']:.0%} | {today['spread']:.2f} → {routed['spread']:.2f} | "
                f"{routed['affine']:.0%} | {today['rollout_s']:.2f} s → {routed['rollout_s']:.2f} s |",
                flush=True,
            )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[2, 4, 64])
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--rollouts-per-replica", type=int, default=8)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--system", type=int, default=512)
    p.add_argument("--grow", type=int, default=64)
    p.add_argument("--answer", type=int, default=96)
    p.add_argument("--cache-blocks", type=int, default=1024)
    p.add_argument("--prefill-us", type=float, default=20.0)
    p.add_argument(
        "--load",
        type=float,
        default=ModelConfig().affinity_load,
        help="affinity_load: the bound on a replica's rollouts",
    )
    anyio.run(main, p.parse_args())
