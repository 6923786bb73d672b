"""An honest huge row goes through every process it passes at a bounded cost in memory (issue 33, item 3).

A 60 MB result row (``tests/bench/big_row.py`` at 30 MB of tool output; the benchmark itself runs 90 MB) through
real pools, a trainer's ``Client`` and ``gym-runtime collect`` on a real nats-server: each of the agent worker,
the client and the collector peaks at most 3× the row above its idle, as the 270 MB bound for a 90 MB row
says, plus 16 MB for what a first rollout loads (imports, buffers) whatever its size. Before: the agent
worker held 4.2× a 90 MB row, and the rollout failed under load (a body's ~8 MB chunks fetched all at once:
``nats: timeout``).
"""

from __future__ import annotations

import pytest

from tests.bench.big_row import measure

pytestmark = pytest.mark.slow

FIRST_ROLLOUT = 16_000_000


def test_a_60_mb_row_costs_each_process_at_most_three_times_its_size() -> None:
    got = measure(30_000_000)
    assert got["error"] is None
    row = got["row_bytes"]
    assert 55_000_000 < row < 70_000_000
    over = {
        name: (peak - idle) / 1e6
        for name, (idle, peak) in got["processes"].items()
        if name in ("agent worker", "client (gather)", "collector") and peak - idle > 3 * row + FIRST_ROLLOUT
    }
    assert not over, f"MB above idle, over 3 × {row / 1e6:.0f} MB + 16 MB: {over}"
