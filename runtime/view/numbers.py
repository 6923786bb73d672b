"""Means and spreads over numbers as rows hold them: any JSON number (±1e308, 10**400, a 40-digit integer, NaN,
the infinities), never overflowing. A page shows what these give; none of them raises.

Why scaled: the textbook sum of squares overflows at 1e154 (``(1e308) ** 2`` raises ``OverflowError``), and the
sum of two 1e308 rewards is infinite though their mean is 1e308. Dividing by the largest magnitude first keeps
every partial sum within a float; equal values stay exactly equal (x / x is 1), so a group whose members all got
the same reward has a spread of exactly 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def as_float(v: float) -> float:
    """``v`` as a float: an integer beyond a float's range (10**400) as the infinity of its sign."""
    try:
        return float(v)
    except OverflowError:
        return math.inf if v > 0 else -math.inf


def mean(values: Sequence[float]) -> float | None:
    """The mean (None: no value); infinite or NaN where a value is."""
    if not values:
        return None
    xs = [as_float(v) for v in values]
    if not all(math.isfinite(x) for x in xs):
        return sum(xs) / len(xs)  # inf, -inf or NaN (inf - inf), as floats say
    scale = max(abs(x) for x in xs)
    if scale == 0.0:
        return 0.0
    return math.fsum(x / scale for x in xs) / len(xs) * scale


def spread(values: Sequence[float]) -> float:
    """The population standard deviation (0 for fewer than two values); NaN where a value is not finite (an
    infinite reward's distance from the mean is not a number)."""
    xs = [as_float(v) for v in values]
    if len(xs) < 2:
        return 0.0
    if not all(math.isfinite(x) for x in xs):
        return math.nan
    scale = max(abs(x) for x in xs)
    if scale == 0.0:
        return 0.0
    ys = [x / scale for x in xs]
    m = math.fsum(ys) / len(ys)
    return math.sqrt(math.fsum((y - m) * (y - m) for y in ys) / len(ys)) * scale
