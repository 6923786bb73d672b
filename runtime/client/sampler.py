"""``TaskSampler``: the runtime's choice of which tasks to run next, for one's own loop and every trainer adapter.

    sampler = await TaskSampler.open(client, rows, SamplerConfig(score="learnability", run="exp1"))
    for step in range(steps):
        picked = sampler.pick(8)                         # dataset positions, the most signal per cost first
        batch = await client.submit([rows[i] for i in picked], repeats=8)
        for i, group in zip(picked, [g async for g in batch.groups()]):
            await sampler.observe(i, group)              # counted, and stored in the bus's KV

Decisions are ``data.sampling``'s (pure); statistics are kept per run in the bus's KV (``data.sampler_store``), so a
restarted trainer resumes them. ``metrics()`` gives the share of zero-spread groups, the tasks skipped and why, and
the estimated signal, since its last call (what the trainer adapters log). With ``skip_below``, ``exhausted`` says
that no task of the set can teach (said once in a ``sampler.exhausted`` line naming the run): one's own loop ends
there (``if sampler.exhausted: break``), the trainer adapters end the training run (``trainers.exhausted``).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from gym_runtime.data.sampler_store import SamplerStore
from gym_runtime.data.sampling import (
    SamplerConfig,
    TaskStats,
    cannot_teach,
    choose,
    observe,
    outcome,
    signal,
    task_key,
    zero_spread_chance,
)
from gym_runtime.errors import ClientError
from gym_runtime.observability import logs
from gym_runtime.transport.bus import Bus

__all__ = ["SamplerConfig", "SamplerWindow", "TaskSampler", "sampler_config"]

log = logs.get("gym.sampler")


def sampler_config(given: SamplerConfig | dict[str, Any] | None) -> SamplerConfig:
    """A ``SamplerConfig`` from itself, a plain dict (a recipe's YAML) or None (uniform); a mistake is one line."""
    if given is None:
        return SamplerConfig()
    if isinstance(given, SamplerConfig):
        return given
    try:
        return msgspec.convert(given, SamplerConfig)
    except (msgspec.ValidationError, ValueError) as e:
        raise ClientError(f"sampler: {e}") from None


@dataclass
class SamplerWindow:
    """What happened since the last ``metrics()``: groups seen, those with no spread, picks and skips."""

    groups: int = 0
    zero_spread: int = 0
    picked: int = 0
    revisited: int = 0
    skipped_low_signal: int = 0
    skipped_cannot_teach: int = 0
    exhausted_picks: int = 0  # picks made when no task could teach (the floor's exploration alone)
    signal: list[float] = field(default_factory=list)
    zero_uniform: list[float] = field(default_factory=list)  # the expected zero-spread share of uniform picks
    zero_picked: list[float] = field(default_factory=list)  # ... and of the picks made


class TaskSampler:
    """Picks dataset positions of ``rows`` by ``config`` and learns from the groups it is shown."""

    def __init__(
        self, rows: Sequence[dict[str, Any]], config: SamplerConfig, store: SamplerStore | None, *, seed: int = 0
    ) -> None:
        if not rows:
            raise ClientError("sampler: no task rows to choose from")
        self.config = config
        self.keys = [task_key(r) for r in rows]
        self.position = {key: i for i, key in reversed(list(enumerate(self.keys)))}  # a task's first position
        self.stats = [TaskStats() for _ in rows]
        self.store = store
        self.rng = random.Random(seed)
        self.clock = 0  # tasks picked so far (the revisit clock)
        self.group_size = 8  # the last group's size: what the expected zero-spread shares are of
        self.window = SamplerWindow()
        self.totals = SamplerWindow()
        self._dirty: set[int] = set()
        self._reported: set[int] = set()  # tasks named in the environment-failure line already
        self._said_exhausted = False  # the exhausted line is said once per time the set runs out

    @classmethod
    async def open(
        cls, client: Any, rows: Sequence[dict[str, Any]], config: SamplerConfig | dict[str, Any] | None = None, *,
        seed: int = 0, store: bool = True,
    ) -> TaskSampler:  # fmt: skip
        """The sampler of ``rows`` with its run's statistics read from ``client``'s bus (``store=False``: kept in
        memory only). ``client``: a ``Client`` (or its ``Bus``)."""
        cfg = sampler_config(config)
        bus = client if isinstance(client, Bus) else client.bus
        try:
            kept = await SamplerStore.open(bus, cfg.run) if store else None
        except Exception as e:  # a secured bus provisioned by an older version: no bucket, and no right to make it
            raise ClientError(
                f"sampler: the bucket {bus.subjects.sampler_bucket} cannot be opened ({type(e).__name__}: {e}); on a "
                "secured bus the admin makes it (restart `gym-runtime server --secure`), or give store=False"
            ) from None
        sampler = cls(rows, cfg, kept, seed=seed)
        if kept is not None:
            found = await kept.load(sampler.keys)
            for i, key in enumerate(sampler.keys):
                if key in found:
                    sampler.stats[i] = found[key]
            sampler.clock = 1 + max((s.last_pick for s in sampler.stats), default=-1)
            if found:
                log.info("sampler.resumed", run=cfg.run, tasks=len(found), clock=sampler.clock)
        return sampler

    @classmethod
    def open_sync(cls, client: Any, rows: Sequence[dict[str, Any]], config: Any = None, **kw: Any) -> TaskSampler:
        """``open`` from a ``SyncClient``."""
        sampler: TaskSampler = client.spawn(lambda: cls.open(client.client, rows, config, **kw)).result()
        return sampler

    # ------------------------------------------------------------------------------------------ deciding

    def pick(self, k: int) -> list[int]:
        """``k`` distinct dataset positions (fewer when there are fewer rows), each marked picked now."""
        got = choose(self.stats, k, self.config, self.rng, self.clock)
        for i in got.tasks:
            self.stats[i] = msgspec.structs.replace(self.stats[i], last_pick=self.clock)
            self._dirty.add(i)
            self.clock += 1
        for w in (self.window, self.totals):
            w.picked += len(got.tasks)
            w.revisited += got.revisited
            w.skipped_low_signal += got.skipped_low_signal
            w.skipped_cannot_teach += got.skipped_cannot_teach
            w.exhausted_picks += len(got.tasks) if got.exhausted else 0
            w.signal.append(got.signal)
        self._say_exhausted(got.exhausted)
        if self.config.score != "uniform" and got.tasks:  # uniform: the two are the same, and not worth a pass
            chance = [zero_spread_chance(s, self.group_size, self.config.prior) for s in self.stats]
            for w in (self.window, self.totals):
                w.zero_uniform.append(sum(chance) / len(chance))
                w.zero_picked.append(sum(chance[i] for i in got.tasks) / len(got.tasks))
        return got.tasks

    @property
    def exhausted(self) -> bool:
        """No task of the set can teach now (each one's expected signal below ``skip_below``; never without it)."""
        if self.config.score == "uniform" or self.config.skip_below <= 0:
            return False
        out = all(cannot_teach(self.stats, self.config))
        self._say_exhausted(out)
        return out

    def _say_exhausted(self, now: bool) -> None:
        """The ``sampler.exhausted`` line, once each time the set runs out of tasks that teach."""
        if now and not self._said_exhausted:
            log.warning(
                "sampler.exhausted",
                run=self.config.run,
                tasks=len(self.stats),
                skip_below=self.config.skip_below,
                then="no task of the set can teach (each one solved or failed every time, lately): stop the run, "
                "or give new tasks; picks go on at the floor's exploration alone",
            )
        self._said_exhausted = now

    def saw(self, task: int, rows: Sequence[dict[str, Any]]) -> None:
        """Count one group of ``task``'s rows (kept in memory until ``flush``)."""
        before = self.stats[task]
        counted = sum(1 for r in rows if outcome(r) is not None)
        self.group_size = counted or self.group_size
        after = observe(before, rows, self.config.cost, self.config.half_life)
        self.stats[task] = after
        self._dirty.add(task)
        if after.groups > before.groups:
            for w in (self.window, self.totals):
                w.groups += 1
                w.zero_spread += after.zero_spread - before.zero_spread
        if after.env_failures and not after.outcomes and task not in self._reported:
            self._reported.add(task)  # the systematic-failure line: not hard, broken
            log.warning(
                "sampler.environment_failures_only",
                task=task,
                failures=after.env_failures,
                then="no outcome counted: the task is not taken for hard (look at its environment)",
            )

    async def flush(self) -> None:
        """The changed records written to the bus's KV."""
        dirty, self._dirty = self._dirty, set()
        if self.store is not None:
            for i in sorted(dirty):
                await self.store.save(self.keys[i], self.stats[i])

    async def observe(self, task: int, rows: Sequence[dict[str, Any]]) -> None:
        """``saw`` then ``flush``: one group counted and stored."""
        self.saw(task, rows)
        await self.flush()

    # ------------------------------------------------------------------------------------------ seeing

    def estimate(self, task: int) -> float:
        """``task``'s expected signal (the posterior mean of p(1-p))."""
        return signal(self.stats[task], self.config.prior)

    def metrics(self) -> dict[str, float]:
        """The window's figures (then a new window), named as the trainer adapters log them."""
        w, self.window = self.window, SamplerWindow()
        t = self.totals
        return {
            "gym_runtime/sampler/zero_spread_share": w.zero_spread / w.groups if w.groups else 0.0,
            "gym_runtime/sampler/zero_spread_share_all": t.zero_spread / t.groups if t.groups else 0.0,
            "gym_runtime/sampler/groups": float(w.groups),
            "gym_runtime/sampler/picked": float(w.picked),
            "gym_runtime/sampler/revisited": float(w.revisited),
            "gym_runtime/sampler/skipped_low_signal": float(w.skipped_low_signal),
            "gym_runtime/sampler/skipped_cannot_teach": float(w.skipped_cannot_teach),
            "gym_runtime/sampler/cannot_teach_tasks": float(sum(cannot_teach(self.stats, self.config))),
            "gym_runtime/sampler/exhausted": float(self.exhausted),
            "gym_runtime/sampler/exhausted_picks": float(w.exhausted_picks),
            "gym_runtime/sampler/signal": sum(w.signal) / len(w.signal) if w.signal else 0.0,
            "gym_runtime/sampler/zero_spread_expected_uniform": _mean(w.zero_uniform),
            "gym_runtime/sampler/zero_spread_expected_picked": _mean(w.zero_picked),
            "gym_runtime/sampler/env_failure_only_tasks": float(len(self._reported)),
        }


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
