"""The task sampler (issue 79): estimates from known outcomes, exploration that starves no task, failures of the
environment not counted as hard, and its statistics durable in a real nats-server's KV, per run."""

from __future__ import annotations

import math
import random
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest

from gym_runtime.client.sampler import TaskSampler, sampler_config
from gym_runtime.data.sampling import (
    SamplerConfig,
    TaskStats,
    cannot_teach,
    choose,
    observe,
    outcome,
    signal,
    task_key,
    weights,
    zero_spread_chance,
)
from gym_runtime.errors import ClientError
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.transport.bus import Bus

LEARN = SamplerConfig(score="learnability", floor=0.1)


def scored(reward: float) -> dict[str, Any]:
    return {"reward": reward, "response": {"output": []}}


def failed(error_class: str, attribution: str | None = None) -> dict[str, Any]:
    row: dict[str, Any] = {"error_class": error_class}
    if attribution:
        row["failure_attribution"] = attribution
    return row


def test_outcomes_count_policy_failures_and_not_environment_ones() -> None:
    assert outcome(scored(1.0)) == 1.0 and outcome(scored(0.0)) == 0.0
    assert outcome(scored(7.0)) == 1.0 and outcome(scored(-2.0)) == 0.0  # clipped to a share of a pass
    assert outcome(failed("timeout", "policy")) == 0.0  # the policy's failure is a fail
    assert outcome(failed("input_crash")) == 0.0
    for cls in ("verify_error", "tool_error", "worker_lost", "model_error", "sandbox_unavailable"):
        assert outcome(failed(cls)) is None, cls  # no outcome: the task is not harder for it


def test_estimates_from_known_outcomes() -> None:
    s = TaskStats()
    assert signal(s) == pytest.approx(1 / 6)  # Beta(1, 1): E[p(1-p)]
    always = observe(s, [scored(1.0)] * 8)
    never = observe(s, [scored(0.0)] * 8)
    half = observe(s, [scored(1.0)] * 4 + [scored(0.0)] * 4)
    assert (always.passes, always.outcomes, always.groups, always.zero_spread) == (8, 8, 1, 1)
    assert (half.zero_spread, never.zero_spread) == (0, 1)
    # Beta(9, 1): 9 / (10 * 11); Beta(5, 5): 25 / (10 * 11)
    assert signal(always) == pytest.approx(9 / 110) and signal(never) == pytest.approx(9 / 110)
    assert signal(half) == pytest.approx(25 / 110)
    for _ in range(20):  # more evidence of a solved task: its signal goes to 0
        always = observe(always, [scored(1.0)] * 8)
    assert signal(always) < 0.01 < signal(half)
    w = weights([always, half, never], LEARN)
    assert sum(w) == pytest.approx(1.0) and w[1] > 0.5 and min(w) >= LEARN.floor / 3


def test_old_outcomes_decay_so_a_learned_task_is_left_and_a_new_learnable_one_found() -> None:
    """With ``half_life`` an outcome counts half after that many later outcomes of its task: a task learnable for
    50 groups and then solved 4 times in a row is no longer favoured, and one impossible for 50 groups that starts
    being solved half the time is found again within a few groups. Without decay both keep their old look."""
    half = [scored(1.0)] * 4 + [scored(0.0)] * 4
    fresh = TaskStats()
    for _ in range(6):
        fresh = observe(fresh, half)  # a task learnable now
    for cfg in (SamplerConfig(score="learnability", half_life=0), SamplerConfig(score="learnability")):
        learned, found = TaskStats(), TaskStats()
        for _ in range(50):
            learned = observe(learned, half, half_life=cfg.half_life)
            found = observe(found, [scored(0.0)] * 8, half_life=cfg.half_life)
        for _ in range(4):
            learned = observe(learned, [scored(1.0)] * 8, half_life=cfg.half_life)
            found = observe(found, half, half_life=cfg.half_life)
        w = weights([learned, found, fresh], msgspec.structs.replace(cfg, floor=0.0))
        if cfg.half_life == 0:  # the whole history: the learned task still looks learnable, the new one not
            assert signal(learned) > 0.2 and signal(found) < 0.1 and w[0] > 0.3 > w[1]
        else:
            assert signal(learned) < 0.15 < 0.2 < signal(found), (signal(learned), signal(found))
            assert w[0] < 0.05 and w[1] > 0.3, w
    # the kept counts are bounded: about half_life / ln 2 outcomes at most, whatever the history
    never = TaskStats()
    for _ in range(1000):
        never = observe(never, [scored(0.0)] * 8, half_life=16)
    assert 16 / math.log(2) < never.outcomes < 16 / math.log(2) + 8 and never.passes == 0
    assert never.groups == 1000 and never.zero_spread == 1000  # the metrics' counts are not decayed


def test_decay_never_starves_a_hopeless_task() -> None:
    """A task never solved in 8,000 outcomes keeps its floor share, and with decay a posterior that is not
    certain of it (its signal bounded below), so it is tried again."""
    never = TaskStats()
    for _ in range(1000):
        never = observe(never, [scored(0.0)] * 8, half_life=LEARN.half_life)
    assert signal(never) > 0.015
    learnable = TaskStats(passes=20, outcomes=40, groups=5)
    stats = [never] + [learnable] * 9
    rng = random.Random(2)
    cfg = msgspec.structs.replace(LEARN, revisit_after=10**9)
    n = sum(0 in choose(stats, 1, cfg, rng, 0).tasks for _ in range(5000))
    assert n / 5000 >= cfg.floor / 10 * 0.8


SKIP = SamplerConfig(score="learnability", floor=0.1, skip_below=0.05)


def _settled(reward: float, groups: int = 6) -> TaskStats:
    """A task that gave ``reward`` to every rollout of its last ``groups`` groups of 8 (faded as the sampler does)."""
    s = TaskStats()
    for _ in range(groups):
        s = observe(s, [scored(reward)] * 8, half_life=SKIP.half_life)
    return s


def test_a_task_that_cannot_teach_is_skipped_but_for_the_floor() -> None:
    """``skip_below``: a task solved (or failed) in every recent outcome gets the floor's share of picks alone and
    is not revisited; a task learnable at a 1-in-8 pass rate, or never seen, or failed in just two groups, is not
    skipped. Without it the revisits alone give each such task a pick every ``revisit_after`` picks."""
    solved, impossible = _settled(1.0), _settled(0.0)
    one_in_8 = observe(TaskStats(), [scored(1.0)] + [scored(0.0)] * 7, half_life=SKIP.half_life)
    unlucky = _settled(0.0, groups=2)  # a 1-in-8 task's two all-wrong groups (12% of the time): not yet hopeless
    assert cannot_teach([solved, impossible, one_in_8, unlucky, TaskStats()], SKIP) == [True, True, False, False, False]
    assert cannot_teach([solved], msgspec.structs.replace(SKIP, skip_below=0.0)) == [False]  # off by default
    stats = [solved] * 8 + [impossible] * 8 + [one_in_8] * 8
    dead = {"skip": 0, "no skip": 0}
    for name, cfg in (("skip", SKIP), ("no skip", msgspec.structs.replace(SKIP, skip_below=0.0))):
        sampler = TaskSampler([{"t": i} for i in range(24)], cfg, None, seed=5)
        sampler.stats = list(stats)
        for _ in range(2000):
            dead[name] += sum(1 for i in sampler.pick(2) if i < 16)
        assert not sampler.exhausted
    # the floor's share: 10% of 4000 picks spread over 24 tasks, 16 of them dead: about 267 (the revisits: 16 in
    # every 96 picks, about 667 more)
    assert 180 < dead["skip"] < 360 and dead["no skip"] > 700, dead
    m = sampler.metrics()
    assert m["gym_runtime/sampler/skipped_cannot_teach"] == 0  # without skip_below nothing is skipped for it


def test_no_task_that_can_teach_is_said_once_and_a_task_that_becomes_learnable_is_found_again(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Every task solved or failed lately: the set is exhausted (the property, ``Pick.exhausted``, the metric, and
    one ``sampler.exhausted`` line naming the run), picks go on at the floor's exploration (uniform); when one task
    starts passing half the time the floor finds it, the set is no longer exhausted, and the picks move to it."""
    cfg = msgspec.structs.replace(SKIP, run="exp7")
    rows = [{"t": i} for i in range(12)]
    sampler = TaskSampler(rows, cfg, None, seed=6)
    sampler.stats = [_settled(1.0) if i % 2 else _settled(0.0) for i in range(12)]
    assert sampler.exhausted
    picks = Counter(i for _ in range(600) for i in sampler.pick(2))
    assert len(picks) == 12 and min(picks.values()) > 50  # uniform over the whole set: no task starved
    m = sampler.metrics()
    assert m["gym_runtime/sampler/exhausted"] == 1 and m["gym_runtime/sampler/exhausted_picks"] == 1200
    assert m["gym_runtime/sampler/cannot_teach_tasks"] == 12
    logged = "".join(capfd.readouterr())
    assert logged.count("sampler.exhausted") == 1 and "exp7" in logged, logged
    # task 4 becomes learnable: it is found at the floor's rate, and then favoured
    found = None
    for step in range(2000):
        for i in sampler.pick(2):
            p = 0.5 if i == 4 else float(i % 2)
            sampler.saw(i, [scored(1.0 if k < 8 * p else 0.0) for k in range(8)])
            if i == 4 and found is None:
                found = step
        if found is not None and step > found + 10:
            break
    assert found is not None and not sampler.exhausted
    sampler.metrics()
    later = Counter(i for _ in range(100) for i in sampler.pick(1))
    assert later[4] > 80, later
    assert sampler.metrics()["gym_runtime/sampler/exhausted"] == 0


def test_skipping_needs_a_floor_and_a_signal_below_a_quarter() -> None:
    with pytest.raises(ClientError, match="skip_below 0.05 with floor 0"):
        sampler_config({"score": "learnability", "skip_below": 0.05, "floor": 0})
    with pytest.raises(ClientError, match="skip_below 0.3"):
        sampler_config({"score": "learnability", "skip_below": 0.3})


def test_a_bad_half_life_is_one_line() -> None:
    with pytest.raises(ClientError, match="half_life -1"):
        sampler_config({"score": "learnability", "half_life": -1})


def test_environment_failures_are_not_taken_for_hard() -> None:
    broken = observe(TaskStats(), [failed("verify_error")] * 8)
    assert (broken.outcomes, broken.env_failures, broken.groups, broken.rollouts) == (0, 8, 0, 8)
    assert signal(broken) == signal(TaskStats())  # as unknown as before: not a task the policy fails
    mixed = observe(TaskStats(), [scored(1.0), failed("worker_lost"), scored(0.0)])
    assert (mixed.outcomes, mixed.env_failures, mixed.zero_spread) == (2, 1, 0)
    sampler = TaskSampler([{"t": 0}, {"t": 1}], LEARN, None)  # the broken task is named once, not taken for hard
    sampler.saw(0, [failed("verify_error")] * 4)
    sampler.saw(0, [failed("verify_error")] * 4)
    sampler.saw(1, [scored(0.0)] * 4)
    m = sampler.metrics()
    assert m["gym_runtime/sampler/env_failure_only_tasks"] == 1 and m["gym_runtime/sampler/groups"] == 1
    assert sampler.estimate(0) > sampler.estimate(1)


def test_cost_divides_the_signal() -> None:
    cost = {"models": {"policy": {"output_tokens": 10}}}
    cheap = observe(TaskStats(), [{**scored(r), "cost": cost} for r in (1.0, 0.0, 1.0, 0.0)], "tokens")
    dear_cost = {"models": {"policy": {"output_tokens": 100}}}
    dear = observe(TaskStats(), [{**scored(r), "cost": dear_cost} for r in (1.0, 0.0, 1.0, 0.0)], "tokens")
    w = weights([cheap, dear], SamplerConfig(score="learnability", floor=0.0, cost="tokens", sharpness=1))
    assert w[0] == pytest.approx(10 * w[1])
    sharp = weights([cheap, dear], SamplerConfig(score="learnability", floor=0.0, cost="tokens", sharpness=2))
    assert sharp[0] == pytest.approx(100 * sharp[1])


def test_uniform_is_the_default_and_picks_every_task_alike() -> None:
    assert SamplerConfig().score == "uniform"
    stats = [observe(TaskStats(), [scored(1.0)] * 8)] * 3 + [TaskStats()]
    rng = random.Random(0)
    counts = Counter(i for _ in range(4000) for i in choose(stats, 1, SamplerConfig(), rng, 0).tasks)
    assert all(900 < counts[i] < 1100 for i in range(4)), counts


def test_exploration_never_starves_a_task() -> None:
    """A task with no signal at all (solved 1000 times) keeps the floor's share of picks, and is picked again
    outright when not picked for ``revisit_after`` picks."""
    solved = TaskStats(passes=1000, outcomes=1000, groups=125, zero_spread=125)
    learnable = TaskStats(passes=50, outcomes=100, groups=12)
    stats = [solved] + [learnable] * 9
    rng = random.Random(1)
    no_revisit = SamplerConfig(score="learnability", floor=0.2, revisit_after=10**9)
    n = sum(0 in choose(stats, 1, no_revisit, rng, 0).tasks for _ in range(5000))
    assert n / 5000 == pytest.approx(0.2 / 10, abs=0.01)  # the floor's share, spread over 10 tasks
    # the revisit: with no floor, the solved task still comes back every revisit_after picks
    cfg = SamplerConfig(score="learnability", floor=0.0, revisit_after=20)
    sampler = TaskSampler([{"t": i} for i in range(10)], cfg, None)
    sampler.stats = list(stats)
    picks = [sampler.pick(1)[0] for _ in range(200)]
    at = [i for i, t in enumerate(picks) if t == 0]
    gaps = [b - a for a, b in zip([-1, *at], at)]
    assert len(gaps) >= 9 and max(gaps) <= 21, gaps


def test_picks_are_distinct_and_the_sampler_favours_learnable_tasks() -> None:
    """On a mixed set (a third solved, a third impossible, a third learnable), once it has seen a few groups,
    the sampler picks the learnable third far more often than uniform would."""
    rows = [{"kind": k, "n": i} for k in ("solved", "impossible", "learnable") for i in range(4)]
    sampler = TaskSampler(rows, LEARN, None, seed=3)
    rng = random.Random(4)
    seen = Counter()
    for step in range(200):
        picked = sampler.pick(4)
        assert len(set(picked)) == 4
        for i in picked:
            p = {"solved": 1.0, "impossible": 0.0, "learnable": 0.5}[rows[i]["kind"]]
            sampler.saw(i, [scored(float(rng.random() < p)) for _ in range(8)])
            if step >= 50:
                seen[rows[i]["kind"]] += 1
    assert seen["learnable"] / sum(seen.values()) > 0.6, seen
    assert min(seen.values()) > 0, seen  # the others are still tried
    m = sampler.metrics()
    assert m["gym_runtime/sampler/zero_spread_share_all"] < 0.5 and m["gym_runtime/sampler/signal"] > 0


def test_the_metrics_say_the_zero_spread_share_expected_before_and_after_the_choice() -> None:
    """``zero_spread_expected_uniform``: the share of groups with no spread uniform picks would give, by the
    estimates (before); ``zero_spread_expected_picked``: the share the sampler's picks are expected to give (after)."""
    assert zero_spread_chance(TaskStats(), 8) == pytest.approx(2 / 9)  # Beta(1, 1): E[p^8 + (1-p)^8]
    solved = observe(TaskStats(), [scored(1.0)] * 8)
    assert zero_spread_chance(solved, 8) == pytest.approx(9 / 17, abs=1e-4)  # Beta(9, 1): E[p^8] = 9/17, and ~0
    assert zero_spread_chance(observe(TaskStats(), [scored(1.0)] * 800), 8) > 0.98
    rows = [{"kind": k, "n": i} for k in ("solved", "impossible", "learnable") for i in range(4)]
    sampler = TaskSampler(rows, LEARN, None, seed=3)
    for i, row in enumerate(rows):  # every task seen twice: the solved and impossible ones certain enough
        p = {"solved": 1.0, "impossible": 0.0, "learnable": 0.5}[row["kind"]]
        for _ in range(3):
            sampler.saw(i, [scored(p)] * 4 + [scored(p if p != 0.5 else 0.0)] * 2 + [scored(min(1.0, 2 * p))] * 2)
    sampler.metrics()
    for _ in range(20):
        sampler.pick(4)
    m = sampler.metrics()
    before, after = (
        m["gym_runtime/sampler/zero_spread_expected_uniform"],
        m["gym_runtime/sampler/zero_spread_expected_picked"],
    )
    assert 0.4 < before < 0.8 and after < 0.5 * before, m  # two thirds of the set teach nothing; the picks avoid it


def test_task_keys_are_stable_and_a_bad_config_is_one_line() -> None:
    assert task_key({"a": 1, "b": [2]}) == task_key({"b": [2], "a": 1}) != task_key({"a": 2, "b": [2]})
    assert task_key({"a": 1}) == task_key({"a": 1, "_ng_task_index": 5})
    with pytest.raises(ClientError, match="floor 2"):
        sampler_config({"score": "learnability", "floor": 2})
    with pytest.raises(ClientError, match="run"):
        sampler_config({"run": "a.b"})
    with pytest.raises(ClientError, match="scor"):
        sampler_config({"scor": "uniform"})


async def _learned(bus: Bus, run: str, rows: list[dict[str, Any]]) -> TaskSampler:
    sampler = await TaskSampler.open(bus, rows, {"score": "learnability", "run": run})
    for i in sampler.pick(2):
        for _ in range(2):  # the second group fades the first: the record holds fractions
            await sampler.observe(i, [scored(1.0)] * 3 + [scored(0.0)])
    return sampler


async def test_statistics_survive_a_restart_and_runs_stay_apart(tmp_path: Path) -> None:
    """A real nats-server, stopped and started again on its store: the same run reads back what it learned (its
    faded counts exactly, and its revisit clock); another run in the same namespace starts afresh; the same run
    shares."""
    rows = [{"q": "a"}, {"q": "b"}, {"q": "c"}]
    store = str(tmp_path / "js")
    with EmbeddedServer(store_dir=store, sync="always") as srv:
        bus = await Bus.connect(srv.url, namespace="gym", name="test-sampler", telemetry=Telemetry())
        try:
            first = await _learned(bus, "run1", rows)
        finally:
            await bus.close()
    learned = {i: s for i, s in enumerate(first.stats) if s.outcomes}
    fade = 0.5 ** (4 / 16)  # the default half_life: 16 outcomes
    assert len(learned) == 2 and all(s.groups == 2 and s.rollouts == 8 for s in learned.values())
    assert all(s.passes == 3 * fade + 3 and s.outcomes == 4 * fade + 4 for s in learned.values())
    with EmbeddedServer(store_dir=store, sync="always") as srv:
        bus = await Bus.connect(srv.url, namespace="gym", name="test-sampler", telemetry=Telemetry())
        try:
            again = await TaskSampler.open(bus, rows, {"score": "learnability", "run": "run1"})
            other = await TaskSampler.open(bus, rows, {"score": "learnability", "run": "run2"})
        finally:
            await bus.close()
    assert again.stats == first.stats and again.clock == first.clock == 2
    assert all(s == TaskStats() for s in other.stats) and other.clock == 0


async def test_on_a_secured_bus_the_publisher_keeps_the_statistics(buses: dict[str, Bus]) -> None:
    """``server --secure``: the bucket is provisioned by the admin; the publisher (a trainer) reads and writes it."""
    rows = [{"q": "a"}, {"q": "b"}]
    first = await _learned(buses["publisher"], "run1", rows)
    again = await TaskSampler.open(buses["publisher"], rows, {"score": "learnability", "run": "run1"})
    assert again.stats == first.stats and sum(s.groups for s in again.stats) == 4
