"""A vLLM replica stand-in: TEST DOUBLE for the LLM, used only by the saturation benchmarks.

``adapter: tests.bench.slot_model`` (the repository root on ``sys.path``). Each
adapter instance is one replica: ``slots`` calls run at once (like vLLM's
``max_num_seqs``); more calls wait inside the replica, first come first served.
A call holds its slot for ``tokens * s_per_token`` seconds, with ``tokens`` drawn
from a lognormal distribution (median ``median_tokens``, shape ``sigma``, capped
at ``max_tokens`` like a request's ``max_tokens``): a heavy tail scaled by output
tokens. ``uniform_s: [lo, hi]`` draws the call time uniformly from ``lo``..``hi``
seconds instead (long generations: 30-120 s). Replica ``i`` (in creation order) is
``slow_factor`` times slower when ``i < slow_replicas``. The answer itself is the
``scripted`` test double's.

Every call is recorded on the replica (``Recorder``): when it arrived, when it
got a slot, when it ended, and its rollout key; the benchmark reads them in the
same process (the workers run in the benchmark's process).
"""

from __future__ import annotations

import itertools
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import anyio

from gym_runtime.model import AdapterOptions, Partial
from models.scripted import Options as ScriptedOptions
from models.scripted import ScriptedModel


class Options(AdapterOptions, kw_only=True, forbid_unknown_fields=True):
    """``adapter: tests.bench.slot_model`` keys."""

    slots: int = 64
    median_s: float = 0.5  # median time of one call on a normal replica
    median_tokens: int = 256
    sigma: float = 0.8  # lognormal shape: 0.8 puts p99 near 6.4x the median
    max_tokens: int = 4096
    slow_replicas: int = 0
    slow_factor: float = 2.0
    seed: int = 0
    run: str = "default"  # which Recorder the replicas of this run report to
    record: bool = True  # False: keep no Call per call (a long batch's memory is then the runtime's alone)
    uniform_s: list[float] = []  # [lo, hi]: call time uniform in lo..hi seconds (long calls), not lognormal
    budget_s: float = 480.0  # what one call may take (an HTTP adapter's timeout_s x attempts): the callers' patience
    # True: calls generate "tokens" one by one (fake ids, so the answer carries token fields) and a pause's
    # ``stop`` ends them at once with the tokens so far (``pause(mode="interrupt"|"abort")``, tests/bench/async_rl.py)
    interruptible: bool = False

    def call_budget_s(self) -> float:
        return self.budget_s


@dataclass
class Call:
    replica: int
    key: str | None
    arrived: float
    started: float
    ended: float
    drawn: float  # the call time drawn; ended - started exceeds it by the event loop's lag


@dataclass
class Try:
    """One try of an interruptible call: its slot time and the tokens it generated (``stopped``: by a pause)."""

    replica: int
    started: float
    ended: float
    tokens: int
    stopped: bool


@dataclass
class Recorder:
    """What the replicas of one benchmark run saw (filled in this process, read by the benchmark)."""

    calls: list[Call] = field(default_factory=list)
    tries: list[Try] = field(default_factory=list)  # interruptible calls: one per try
    replicas: dict[int, tuple[int, float]] = field(default_factory=dict)  # index -> (slots, slowness)
    ids: itertools.count[int] = field(default_factory=itertools.count)


RECORDERS: dict[str, Recorder] = {}  # bench-only: a test double's record, keyed by Options.run


class SlotReplica:
    """One replica: ``slots`` concurrent calls, lognormal call time scaled by output tokens."""

    def __init__(self, cfg: Options, *, concurrency: int, base_dir: str | None) -> None:
        self.cfg = cfg
        self.rec = RECORDERS.setdefault(cfg.run, Recorder())
        self.index = next(self.rec.ids)
        self.slowness = cfg.slow_factor if self.index < cfg.slow_replicas else 1.0
        self.rec.replicas[self.index] = (cfg.slots, self.slowness)
        self.s_per_token = cfg.median_s / cfg.median_tokens * self.slowness
        self.rng = random.Random(cfg.seed * 1000 + self.index)
        self.sem = anyio.Semaphore(cfg.slots)
        self.inner = ScriptedModel(ScriptedOptions(model="slot-model"))

    def call_time(self) -> float:
        if self.cfg.uniform_s:
            lo, hi = self.cfg.uniform_s
            return self.rng.uniform(lo, hi) * self.slowness
        return self.draw_tokens() * self.s_per_token

    def draw_tokens(self) -> float:
        return min(self.cfg.max_tokens, self.cfg.median_tokens * math.exp(self.rng.gauss(0.0, self.cfg.sigma)))

    @property
    def can_interrupt(self) -> bool:
        return self.cfg.interruptible

    async def generate_until(self, params: Any, *, rollout_key: str | None, stop: Any, partial: Partial | None) -> Any:
        """Generate the drawn tokens (``s_per_token`` each) unless ``stop`` is set first: then the tokens so far."""
        if partial is None:
            partial = Partial(prompt_token_ids=[1], state=max(1, round(self.draw_tokens())))
        total, done = int(partial.state), len(partial.generation_token_ids)
        async with self.sem:
            started = time.monotonic()
            with anyio.move_on_after((total - done) * self.s_per_token):
                await stop.wait()
            ended = time.monotonic()
        stopped = stop.is_set()
        made = min(total - done, int((ended - started) / self.s_per_token)) if stopped else total - done
        if self.cfg.record:
            self.rec.tries.append(Try(self.index, started, ended, made, stopped))
        ids = [0] * (done + made)
        lps = [*partial.generation_log_probs, *[-1.0] * made]
        if done + made < total:
            return Partial(prompt_token_ids=[1], generation_token_ids=ids, generation_log_probs=lps, state=total)
        response = await self.inner.generate(params, rollout_key=rollout_key)
        last = response.output[-1]
        last.prompt_token_ids, last.generation_token_ids, last.generation_log_probs = [1], ids, lps  # type: ignore[union-attr]
        return response

    async def generate(self, params: Any, *, rollout_key: str | None = None) -> Any:
        arrived = time.monotonic()
        async with self.sem:
            started = time.monotonic()
            drawn = self.call_time()
            await anyio.sleep(drawn)
            ended = time.monotonic()
        if self.cfg.record:
            self.rec.calls.append(Call(self.index, rollout_key, arrived, started, ended, drawn))
        return await self.inner.generate(params, rollout_key=rollout_key)

    async def aclose(self) -> None:
        await self.inner.aclose()


def interrupt_problem(options: Options) -> str | None:
    return None if options.interruptible else "set interruptible: true"


def create(options: Options, *, concurrency: int = 64, base_dir: str | None = None) -> SlotReplica:
    return SlotReplica(options, concurrency=concurrency, base_dir=base_dir)
