"""The crash-testing file system itself (tests/lazyfs.py): a crash keeps exactly what was synced.

Each test mounts it, writes through the mount with plain system calls, crashes it and reads what came
back. ~1 s each; skipped without FUSE unless GYM_REQUIRE_FUSE=1.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from gym_runtime.data.durable import fsync_dir
from tests.lazyfs import LazyFS, require_fuse


def write(path: Path, data: bytes, *, sync: bool) -> None:
    with open(path, "ab") as f:
        f.write(data)
        f.flush()
        if sync:
            os.fsync(f.fileno())


@pytest.fixture(params=["strict", "journaled"])
def fs(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[LazyFS]:
    require_fuse()
    with LazyFS(tmp_path / "disk", names=request.param) as lazy:
        yield lazy


def test_synced_data_survives_and_the_unsynced_tail_does_not(fs: LazyFS) -> None:
    f = fs.mnt / "log"
    write(f, b"synced ", sync=True)
    fsync_dir(fs.mnt)
    write(f, b"lost", sync=False)
    assert f.read_bytes() == b"synced lost"
    fs.crash()
    assert f.read_bytes() == b"synced "


def test_a_name_survives_its_directory_sync_or_with_journaled_names_any_sync(fs: LazyFS) -> None:
    (fs.mnt / "d").mkdir()
    write(fs.mnt / "d" / "f", b"data", sync=True)  # the file's data is synced; no directory is
    fs.crash()
    if fs.names == "strict":
        assert not (fs.mnt / "d").exists()  # POSIX: a new name needs its directory synced
    else:
        assert (fs.mnt / "d" / "f").read_bytes() == b"data"  # ext4/XFS/btrfs: the fsync committed the names
    (fs.mnt / "d").mkdir(exist_ok=True)
    write(fs.mnt / "d" / "g", b"g", sync=True)
    fsync_dir(fs.mnt / "d")
    fsync_dir(fs.mnt)
    fs.crash()
    assert (fs.mnt / "d" / "g").read_bytes() == b"g"


def test_an_unsynced_rename_or_unlink_is_undone(fs: LazyFS) -> None:
    write(fs.mnt / "a", b"a", sync=True)
    write(fs.mnt / "b", b"b", sync=True)
    fsync_dir(fs.mnt)
    os.replace(fs.mnt / "a", fs.mnt / "c")
    os.unlink(fs.mnt / "b")
    fs.crash()
    assert sorted(os.listdir(fs.mnt)) == ["a", "b"]
    os.replace(fs.mnt / "a", fs.mnt / "c")
    fsync_dir(fs.mnt)
    fs.crash()
    assert sorted(os.listdir(fs.mnt)) == ["b", "c"] and (fs.mnt / "c").read_bytes() == b"a"


def test_o_sync_writes_and_truncates_are_persisted_as_synced(fs: LazyFS) -> None:
    f = fs.mnt / "s"
    fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_SYNC, 0o644)
    try:
        os.write(fd, b"0123456789")
        fsync_dir(fs.mnt)
        os.ftruncate(fd, 4)
        os.pwrite(fd, b"xy", 6)  # a hole of zeros between
        os.fsync(fd)
        os.ftruncate(fd, 2)  # not synced
    finally:
        os.close(fd)
    fs.crash()
    assert f.read_bytes() == b"0123\0\0xy"


def test_journaled_names_follow_a_folder_renamed_before_the_sync(tmp_path: Path) -> None:
    require_fuse()
    with LazyFS(tmp_path / "disk", names="journaled") as fs:
        (fs.mnt / "d").mkdir()
        write(fs.mnt / "d" / "f", b"f", sync=False)
        os.rename(fs.mnt / "d", fs.mnt / "e")
        write(fs.mnt / "g", b"g", sync=True)  # commits every name change so far, not f's data
        fs.crash()
        assert sorted(os.listdir(fs.mnt)) == ["e", "g"]
        assert (fs.mnt / "e" / "f").read_bytes() == b""
