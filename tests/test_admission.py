"""The admission point's bookkeeping (``gym_runtime.admission``): AReaL's rule as the staleness window counts
it, and gates asked all-or-none (what the sandbox fleet's quotas and the ledger's budgets plug into)."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from gym_runtime.admission import Admission, Budget, StalenessWindow, Work, parse_budget
from gym_runtime.messages import RolloutResult


def test_the_window_is_areals_rule_when_the_trainer_consumes_b_per_version() -> None:
    S, B = 1, 4
    window = StalenessWindow(B, version=0)
    admission = Admission(window)
    started = 0
    for v in range(5):  # a trainer that submits at each version and consumes B rows per version
        window.updated(v)
        while admission.admit(Work(1, version=v, max_staleness=S)):
            started += 1
        assert started == (v - 0 + S + 1) * B  # AReaL: started <= (v_now - v_0 + S + 1) * B, and no fewer
        window.consumed(B)
    assert not admission.admit(Work(1, version=4, max_staleness=S))  # consumed, not updated: no room


def test_staleness_counts_from_the_submit_and_an_expired_task_can_no_longer_start() -> None:
    window = StalenessWindow(2, version=3)
    old, fresh = Work(1, version=2, max_staleness=1), Work(1, version=3, max_staleness=1)
    assert window.room(old) == 2 and window.room(fresh) == 4  # the older submit has one version less of room
    window.updated(4)
    assert window.expired(old) and window.room(old) == 0 and not window.expired(fresh)
    assert window.room(Work(1)) > 1 << 40  # no staleness bound: the window does not limit it


class Quota:
    """A gate as a sandbox pool's quota would be one: units per owner, given back when they end."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0

    def room(self, work: Work) -> int:
        return self.limit - self.used

    def charge(self, work: Work) -> None:
        self.used += work.units


async def test_gates_admit_all_or_none_and_waiters_wake_when_room_is_freed() -> None:
    window, quota = StalenessWindow(8, version=0), Quota(3)
    admission = Admission(window, quota)
    assert admission.admit(Work(2, version=0, max_staleness=0, owner="pool"))
    assert not admission.admit(Work(2, version=0, max_staleness=0, owner="pool"))  # the quota says no
    assert window.outstanding == 2 and quota.used == 2  # and the refused work charged neither gate
    woke = anyio.Event()

    async def waiter() -> None:
        await admission.wait()
        woke.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        quota.used = 0
        admission.changed()
        with anyio.fail_after(5):
            await woke.wait()
    assert admission.admit(Work(2, version=0, max_staleness=0)) and admission.admitted == 4


def _result(tokens: int, estimate: float | None = None) -> RolloutResult:
    cost: dict[str, Any] = {"models": {"policy": {"calls": 1, "input_tokens": tokens - 7, "output_tokens": 7}}}
    if estimate is not None:
        cost["estimated_cost"] = estimate
    return RolloutResult(batch="b", task_index=0, rollout_index=0, agent="a", row={"reward": 1.0, "cost": cost})


def test_a_budget_runs_one_rollout_until_one_finished_then_counts_in_flight_at_the_mean() -> None:
    budget = Budget(100, tokens=True)
    admission = Admission(budget)
    assert admission.admit(Work(1)) and not admission.admit(Work(1))  # no mean yet: one at a time
    budget.done(_result(27))
    # 27 spent, mean 27: two more fit (27 + 2 * 27 = 81 <= 100), a third would pass it (108)
    assert admission.admit(Work(1)) and admission.admit(Work(1)) and not admission.admit(Work(1))
    budget.done(_result(27))
    budget.done(_result(27))
    assert budget.spent == 81 and budget.in_flight == 0 and not admission.admit(Work(1))
    money = Budget(1.0, tokens=False)
    money.done(_result(27, estimate=0.3), in_flight=False)  # an earlier run's result: spent, never in flight
    assert (
        money.spent == 0.3 and money.room(Work(1)) == 2
    )  # 0.3 + 2 * 0.3 <= 1.0 < 0.3 + 3 * 0.3 and money.in_flight == 0
    money.done(_result(27, estimate=0.9), in_flight=False)
    assert money.room(Work(1)) == 0  # spent (1.2 > 1.0): no room at all


def test_a_budget_is_money_or_tokens_and_never_zero_or_negative() -> None:
    assert (parse_budget("2.50").limit, parse_budget("2.50").tokens) == (2.5, False)
    assert (parse_budget("200000tokens").limit, parse_budget("200_000 tokens").tokens) == (200000, True)
    for bad in ("-1", "0", "0tokens", "nan", "inf", "2.5tokens", "ten euros", ""):
        with pytest.raises(ValueError):
            parse_budget(bad)
