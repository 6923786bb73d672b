"""Forks on a real Podman engine (``tests/podman.py``): ``tests/test_sandbox_fork.py``'s engine cases (files,
isolation, snapshots and their reuse, the writable pool's image, quota, clean-up and sweeps), as it runs them on
Docker.

A module of its own, so a Podman service of its own (the fixture's scope). The containers Podman once showed here
as not running ("can only create exec sessions on running containers"), which had kept the reuse of an unchanged
parent's snapshot out of this module, were the tests' store refreshed by a Podman process whose temporary
directory a pytest run had deleted (``tests/podman.py``; the last test here checks it)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from gym_runtime.sandboxes.backend import Resolved
from gym_runtime.sandboxes.engine_api import EngineBackend
from gym_runtime.sandboxes.engine_http import Engine
from tests.podman import backend_name, base_image, engine, podman_store, pool  # noqa: F401  (the Docker cases' fixtures)
from tests.test_sandbox_fork import (  # noqa: F401  (the same cases, on this module's engine; ``swept``: theirs)
    swept,
    test_a_copy_copies_its_snapshot_as_it_starts_with_no_exec_in_it,
    test_a_copy_whose_snapshot_lacks_its_files_fails_in_one_line_and_is_removed,
    test_a_fork_copies_the_files_into_isolated_sandboxes_each_under_its_own_lease,
    test_a_fork_past_the_quota_is_sandbox_unavailable_at_once_and_makes_nothing,
    test_a_parent_forked_again_unchanged_is_read_once_and_a_change_is_always_seen,
    test_a_read_only_pools_copies_copy_one_snapshot_that_goes_with_the_last_of_them_and_their_parent,
    test_a_restartable_sandboxs_copies_copy_by_an_exec_and_start_empty_at_a_restart,
    test_a_stopping_worker_leaves_no_copy_no_image_and_no_snapshot,
    test_a_sweep_removes_a_snapshot_once_its_parent_is_gone_and_no_container_uses_it,
    test_a_sweep_removes_fork_images_no_container_uses,
    test_a_writable_pools_fork_commits_an_image_that_goes_with_its_last_copy,
    test_copies_whose_holder_falls_silent_are_reaped_with_their_image,
)


async def test_podmans_temporary_directory_is_the_stores_own_where_no_pytest_run_deletes_it(
    engine: Engine,  # noqa: F811  (the fixtures imported above)
    base_image: str,  # noqa: F811
    pool: str,  # noqa: F811
) -> None:
    """What a stopping container's ``podman container cleanup`` is given as its temporary directory (its conmon's
    exit command) is the store's (``tests/podman.py``): one under pytest's ``/tmp/pytest-of-*``, which the store's
    first database had kept, was deleted by later pytest runs, and that cleanup then refreshed the store, showing
    every container as not running (why the reuse case above had been left out here)."""
    backend = EngineBackend(engine, name="podman", pool=f"gym.{pool}")
    spec = Resolved(image=base_image, cpu=1, memory_mb=128, pids=64, disk_mb=16, timeout_s=60, max_output=4096)
    cid = await backend.create(spec, owner="test", lease="t", expires=time.time() + 300)
    try:
        argv = []
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            with contextlib.suppress(OSError):
                args = cmdline.read_bytes().split(b"\0")
                if args[0].endswith(b"conmon") and cid.encode() in args:
                    argv = [a.decode() for a in args]
        exit_args = [argv[i + 1] for i, a in enumerate(argv) if a == "--exit-command-arg"]
        assert "cleanup" in exit_args, argv
        assert exit_args[exit_args.index("--tmpdir") + 1] == str(podman_store() / "tmp")
    finally:
        await engine.remove(cid)
