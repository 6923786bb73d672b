"""``view``'s means and spreads over any number a row holds (issue 73 item 7): never raising, exact where the
values are equal, infinite or "not a number" only where a value is. The pages: ``tests/test_view_training.py``."""

from __future__ import annotations

import math

import pytest

from gym_runtime.view.numbers import mean, spread


def test_huge_values_keep_their_mean_and_spread() -> None:
    assert mean([1e308, 1e308]) == 1e308  # (their sum is beyond a float)
    assert spread([1e308, -1e308]) == pytest.approx(1e308)  # ((1e308) ** 2 raised OverflowError)
    assert mean([10**400, 10**400]) == math.inf and math.isnan(spread([10**400, 1]))
    big = 1234567890123456789012345678901234567890
    assert mean([big, big]) == pytest.approx(float(big)) and spread([big, big]) == 0.0


def test_equal_values_have_exactly_no_spread_and_non_finite_ones_none() -> None:
    assert spread([0.1, 0.1, 0.1]) == 0.0 and spread([0, 0]) == 0.0 and spread([1.0]) == 0.0
    assert spread([0.0, 1.0]) == pytest.approx(0.5) and mean([0.0, 1.0]) == 0.5
    assert math.isnan(mean([math.inf, -math.inf])) and math.isnan(spread([math.nan, 1.0]))
    assert mean([math.inf, 1.0]) == math.inf and mean([]) is None
