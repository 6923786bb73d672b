"""Forks on a real Podman engine (``tests/podman.py``): ``tests/test_sandbox_fork.py``'s engine cases (files,
isolation, snapshots and the writable pool's image, quota, clean-up and sweeps), as it runs them on Docker.

A module of its own, so a Podman service of its own (the fixture's scope): run after
``tests/test_sandbox_podman.py``'s cases in one service, they met containers that Podman showed as not running
("can only create exec sessions on running containers") in some runs here, not run apart. Not here: the reuse
of an unchanged parent's snapshot (engine-independent; on Docker), whose three forks at once met that even run
apart, on the tests' shared Podman store."""

from __future__ import annotations

from tests.podman import backend_name, base_image, engine, pool  # noqa: F401  (the Docker cases' fixtures, on Podman)
from tests.test_sandbox_fork import (  # noqa: F401  (the same cases, on this module's engine; ``swept``: theirs)
    swept,
    test_a_fork_copies_the_files_into_isolated_sandboxes_each_under_its_own_lease,
    test_a_fork_past_the_quota_is_sandbox_unavailable_at_once_and_makes_nothing,
    test_a_read_only_pools_copies_copy_one_snapshot_that_goes_with_the_last_of_them_and_their_parent,
    test_a_stopping_worker_leaves_no_copy_no_image_and_no_snapshot,
    test_a_sweep_removes_a_snapshot_once_its_parent_is_gone_and_no_container_uses_it,
    test_a_sweep_removes_fork_images_no_container_uses,
    test_a_writable_pools_fork_commits_an_image_that_goes_with_its_last_copy,
    test_copies_whose_holder_falls_silent_are_reaped_with_their_image,
)
