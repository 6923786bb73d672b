"""A pull worker's live requests: the credits it counts are always what its requests have left, through
every change a delivery, an expiry, a status answer or a reconnect makes (kept as a running total, which
the worker reads for every delivery)."""

from __future__ import annotations

import random

from gym_runtime.transport.pull import Requests


def test_credits_are_what_the_live_requests_have_left_through_any_sequence_of_changes() -> None:
    rng = random.Random(7)
    reqs, model = Requests(), []  # model: [expires_at, left] per live request, oldest first
    for step in range(5_000):
        op = rng.choice(["add", "consume", "consume", "consume", "drop", "clear"] if step % 500 else ["clear"])
        if op == "add":
            n = rng.randint(1, 64)
            reqs.add(float(step), n)
            model.append([float(step), n])
        elif op == "consume" and model:
            reqs.consume()
            model[0][1] -= 1
            if model[0][1] == 0:
                model.pop(0)
        elif op == "drop" and model:
            assert reqs.oldest_expires_at() == model[0][0]
            reqs.drop_oldest()
            model.pop(0)
        elif op == "clear":
            reqs.clear()
            model = []
        assert reqs.credits == sum(left for _, left in model), step
        assert bool(reqs) == bool(model)
    reqs.consume()  # a delivery with no live request (one that outlived its request's expiry) counts nothing
    assert reqs.credits == sum(left for _, left in model) >= 0
