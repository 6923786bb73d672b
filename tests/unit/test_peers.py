"""A sandbox pool's view of its peers (issue 52, item 2): what a beacon may make the pool-wide quota believe."""

from __future__ import annotations

import time

from gym_runtime.sandboxes.reaper import DEAD_AFTER_S, Peers


def test_a_peers_live_is_bounded_by_capacity_and_the_quota_counts_at_most_replicas_workers() -> None:
    peers = Peers("me", capacity=4, replicas=2)
    peers.heard("first", 100_000, 100_000)  # declares more than the pool's capacity: bounded by the pool's
    peers.heard("second", 3, 4)  # one more than replicas: heard (its containers are not reaped), not counted
    peers.heard("liar", -5)
    assert peers.alive("second") and peers.alive("liar")
    assert peers.alive_ids() == ["first", "me"]
    assert peers.others_live() == 4  # before: 100,000 (the pool's room 0)
    assert peers.share(8) == 4


def test_a_peer_declaring_less_capacity_is_held_to_it_and_no_live_count_is_negative() -> None:
    peers = Peers("me", capacity=10)
    peers.heard("small", 7, 2)
    peers.heard("liar", -1_000_000, 10)
    assert peers.load == {"small": 2, "liar": 0}


def test_a_ghost_is_forgotten_after_dead_after_s() -> None:
    peers = Peers("me", capacity=4, replicas=3)
    peers.heard("ghost", 4)
    peers.seen["ghost"] = time.monotonic() - DEAD_AFTER_S - 1  # unheard since
    peers.heard("peer", 1)
    assert "ghost" not in peers.seen and "ghost" not in peers.load
    assert peers.alive_ids() == ["me", "peer"] and peers.others_live() == 1
