"""data.batches: the manifest records each task's agent as index ranges, and readers look owners up in them."""

from __future__ import annotations

import msgspec

from gym_runtime.data.batches import Manifest, Owners, TaskOwners, new_manifest


def test_owners_are_ranges_in_task_order_and_readers_find_each_tasks_agent() -> None:
    owners = Owners()
    for agent in ["a", "a", "b", "a", "c", "c", "c"]:
        owners.add(agent)
    assert list(owners.ranges()) == [(0, 2, "a"), (2, 3, "b"), (3, 4, "a"), (4, 7, "c")]
    manifest = new_manifest("m", owners, repeats=3, input_path="in.jsonl")
    assert (manifest.tasks, manifest.expected, manifest.agents) == (7, 21, {"a": 3, "b": 1, "c": 3})
    stored = msgspec.json.decode(msgspec.json.encode(manifest), type=Manifest)  # as collect reads it back
    lookup = TaskOwners(stored)
    assert [lookup.owner(t) for t in range(7)] == ["a", "a", "b", "a", "c", "c", "c"]
    assert lookup.allows(2, "b") and not lookup.allows(2, "a") and not lookup.allows(7, "c")
    assert not lookup.allows(-1, "a") and lookup.owner(7) == ""


def test_a_million_rows_alternating_between_agents_fit_in_one_manifest() -> None:
    """The worst case for ranges (every row another agent): ~4 bytes a row, under the 8 MB max payload."""
    owners = Owners()
    for i in range(1_000_000):
        owners.add("weather_agent" if i % 2 else "math_agent")
    size = len(msgspec.json.encode(new_manifest("m", owners, repeats=1, input_path="-")))
    assert size < 4.2e6


def test_a_manifest_written_before_owners_names_only_its_agents() -> None:
    one = Manifest(batch="m", expected=3, tasks=3, repeats=1, agents={"a": 3}, input="-")
    assert TaskOwners(one).allows(2, "a") and not TaskOwners(one).allows(2, "b") and TaskOwners(one).owner(0) == "a"
    two = Manifest(batch="m", expected=3, tasks=3, repeats=1, agents={"a": 2, "b": 1}, input="-")
    assert TaskOwners(two).allows(0, "b") and not TaskOwners(two).allows(0, "c") and TaskOwners(two).owner(0) == ""
