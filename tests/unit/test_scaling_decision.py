"""The scaler's whole decision (issue 74): ``backlog.decide``, a pure function beside ``backlog.wanted``, driven
here interval by interval with a clock of our own: no thread, no Ray, no bus."""

from __future__ import annotations

from gym_runtime.placement import backlog
from gym_runtime.placement.backlog import Decision, Demand, decide


def _run(role: str, asked: list[int], *, have: int, low: int = 0, high: int = 8, idle_s: float = 30.0) -> list[int]:
    """Replicas after each interval (10 s apart) of a role whose demand is ``asked`` (2 slots a replica)."""
    since: float | None = None
    out = []
    for i, n in enumerate(asked):
        step = decide(role, Demand(n, 2), have, low, high, surplus_since=since, now=100.0 + 10 * i, idle_s=idle_s)
        since = step.surplus_since
        have += step.add - step.remove
        out.append(have)
    return out


def test_more_are_added_at_once_within_the_bounds() -> None:
    assert decide("agents", Demand(7, 2), 1, 0, 8, surplus_since=None, now=0.0, idle_s=30) == Decision(4, 4, add=3)
    assert decide("agents", Demand(99, 2), 1, 0, 3, surplus_since=None, now=0.0, idle_s=30).add == 2  # max
    assert decide("agents", Demand(0, 2), 0, 2, 8, surplus_since=None, now=0.0, idle_s=30).add == 2  # min


def test_fewer_only_once_the_surplus_lasted_idle_s_and_a_new_demand_starts_the_wait_again() -> None:
    # 4 replicas, demand gone: drained at the interval where the surplus has lasted 30 s, not before
    assert _run("agents", [0, 0, 0, 0, 0], have=4) == [4, 4, 4, 0, 0]
    # the surplus is broken at the third interval: its wait starts over from the fourth
    assert _run("agents", [0, 0, 8, 0, 0, 0, 0], have=4) == [4, 4, 4, 4, 4, 4, 0]
    assert _run("agents", [0], have=4, idle_s=0) == [0]  # idle_s 0: at once


def test_a_pinned_pool_with_work_asked_never_scales_down_and_asks_ray_for_what_it_has() -> None:
    for role in backlog.PINNED:
        step = decide(role, Demand(1, 2), 4, 0, 8, surplus_since=90.0, now=1000.0, idle_s=30)
        assert step == Decision(want=1, ask=4)  # its sessions are on those 4
        assert _run(role, [1, 1, 1, 1, 1], have=4) == [4] * 5
        assert _run(role, [0, 0, 0, 0], have=4) == [4, 4, 4, 0]  # no work asked: not pinned
    assert decide("models", Demand(1, 2), 4, 0, 8, surplus_since=None, now=0.0, idle_s=30).ask == 1
