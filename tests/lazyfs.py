"""A file system that forgets what was not synced: LazyFS's crash semantics as a FUSE passthrough (tests only).

Jepsen found NATS losing acknowledged writes with LazyFS (dsrhaslab/lazyfs), a FUSE layer that keeps
unsynced writes in a cache of its own and drops them on command. This is the same idea, smaller and
stricter, on ``mfusepy`` (ctypes bindings for libfuse 3):

* every operation goes straight to a backing directory (``live/``), so the mount behaves as a disk;
* ``fsync``/``fdatasync`` of a file (or a write to a file opened ``O_SYNC``/``O_DSYNC``) copies the
  bytes written since its last sync into ``state/data/<file id>``: its data is persisted;
* ``fsync`` of a directory records its entries (name -> file id) in ``state/dirs/<dir id>.json``: the
  creates, renames and removals in it are persisted. ``names="journaled"`` persists every name change
  made so far on any fsync instead, as ext4 (data=ordered), XFS and btrfs do in practice (their fsync
  commits the journal, which holds every create and rename before it); ``"strict"`` is POSIX's promise;
* a crash (``LazyFS.crash``) ends the daemon, unmounts, and rebuilds ``live/`` from ``state/`` alone:
  the mount then shows only what was persisted. A name persisted without its data is an empty file.

LazyFS itself passes names through at once (only file data is lazy); the strict mode here drops
unsynced names too. Attributes (mode, owner, times) are not modelled: they change at once. File ids are
ours (an inode number is reused after an unlink), kept in memory per backing inode.

The handle, ``LazyFS``, runs the daemon as a child (``python -m tests.lazyfs``): the test crashes it
and remounts while nothing else in the test process changes.
"""

from __future__ import annotations

import argparse
import ctypes.util
import errno
import importlib.util
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

ROOT_ID = "root"
NAMES = ("strict", "journaled")
_STRIP = os.O_APPEND | os.O_SYNC | os.O_DSYNC | getattr(os, "O_DIRECT", 0)  # the daemon does these itself
_END = 1 << 62  # "to the end of the file", in a dirty range


def unavailable() -> str | None:
    """Why a FUSE mount cannot be made here (one line), or None."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    if os.geteuid() != 0 and shutil.which("fusermount3") is None:
        return "not root and no fusermount3 (Debian: fuse3)"
    if ctypes.util.find_library("fuse3") is None:
        return "no libfuse3 (Debian: fuse3 / libfuse3-3)"
    if importlib.util.find_spec("mfusepy") is None:
        return "no mfusepy (pip install mfusepy; in the dev extra)"
    return None


def _die_with_parent() -> None:  # in the child between fork and exec: a daemon never outlives its test
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def require_fuse() -> None:
    """Skip (one line) where no FUSE mount can be made, or fail where CI requires one (GYM_REQUIRE_FUSE=1)."""
    import pytest  # the daemon imports nothing it does not use: it starts at every crash

    reason = unavailable()
    if reason is None:
        return
    if os.environ.get("GYM_REQUIRE_FUSE") == "1":
        pytest.fail(f"GYM_REQUIRE_FUSE=1 but no FUSE mount can be made: {reason}")
    pytest.skip(f"crash tests need FUSE: {reason}")


class LazyFS:
    """A mount of the lazy file system under ``root`` (``root/mnt``): ``mount``, ``crash``, ``unmount``."""

    def __init__(self, root: Path, names: str = "strict") -> None:
        assert names in NAMES, names
        self.root, self.names = root, names
        self.mnt, self.live, self.state = root / "mnt", root / "live", root / "state"
        self._proc: subprocess.Popen[str] | None = None
        self.crashes = 0

    def mount(self, *, recover: bool = False) -> Path:
        self.mnt.mkdir(parents=True, exist_ok=True)  # root too
        cmd = [sys.executable, "-m", "tests.lazyfs", str(self.root), "--names", self.names]
        if recover:
            cmd.append("--recover")
        log = open(self.root / "lazyfs.log", "a")  # noqa: SIM115 - handed to the child
        try:
            self._proc = subprocess.Popen(
                cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True, preexec_fn=_die_with_parent
            )
        finally:
            log.close()
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()  # "ready" once the kernel has the mount (FUSE init)
        if line.strip() != "ready":
            self._proc.wait(10)
            raise RuntimeError(f"lazyfs did not mount {self.mnt}: {(self.root / 'lazyfs.log').read_text()[-2000:]}")
        return self.mnt

    def crash(self) -> None:
        """The machine loses power: the daemon dies with every unsynced write, the disk comes back with
        what was persisted. Kill every process using the mount first (they die with the machine too)."""
        self._stop(signal.SIGKILL)
        self.crashes += 1
        self.mount(recover=True)

    def unmount(self) -> None:
        """A clean unmount (the daemon exits on the kernel's word); a stuck one is detached."""
        if self._proc is not None and self._proc.poll() is None:
            if subprocess.run(["umount", str(self.mnt)], capture_output=True, check=False).returncode == 0:
                self._proc.wait(30)
        self._stop(signal.SIGKILL)

    def _stop(self, sig: int) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(sig)
            proc.wait(30)
        if proc.stdout is not None:
            proc.stdout.close()
        # a killed daemon leaves its mount behind ("transport endpoint is not connected"): detach it
        subprocess.run(["umount", "-l", str(self.mnt)], capture_output=True, check=False)

    def __enter__(self) -> LazyFS:
        self.mount()
        return self

    def __exit__(self, *exc: object) -> None:
        self.unmount()


# --- the daemon -----------------------------------------------------------------------------------------


def trace(*what: str) -> None:
    """With LAZYFS_TRACE=1, the daemon's log lists every create, rename and sync (what a crash keeps)."""
    if os.environ.get("LAZYFS_TRACE") == "1":
        print(*what, file=sys.stderr, flush=True)


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def _attrs(st: os.stat_result) -> dict[str, int]:
    keys = ("st_mode", "st_ino", "st_nlink", "st_uid", "st_gid", "st_size", "st_blocks", "st_blksize")
    out = {k: getattr(st, k) for k in keys}
    out.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
    return out


class Store:
    """What survives a crash: file data by id (``data/``) and directory entries by dir id (``dirs/``)."""

    def __init__(self, state: Path) -> None:
        self.data, self.dirs = state / "data", state / "dirs"
        self.data.mkdir(parents=True, exist_ok=True)
        self.dirs.mkdir(parents=True, exist_ok=True)

    def entries(self, dir_id: str) -> dict[str, dict[str, Any]]:
        path = self.dirs / f"{dir_id}.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def set_entries(self, dir_id: str, entries: dict[str, dict[str, Any]]) -> None:
        _write_json(self.dirs / f"{dir_id}.json", entries)

    def persist_data(self, file_id: str, src_fd: int, ranges: list[tuple[int, int]]) -> None:
        size = os.fstat(src_fd).st_size
        dst = os.open(self.data / file_id, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            for a, b in _merge(ranges):
                pos, end = a, min(b, size)
                while pos < end:
                    chunk = os.pread(src_fd, min(end - pos, 1 << 20), pos)
                    if not chunk:
                        break
                    os.pwrite(dst, chunk, pos)
                    pos += len(chunk)
            os.ftruncate(dst, size)
        finally:
            os.close(dst)

    def rebuild(self, live: Path) -> dict[int, str]:
        """Lay ``live`` out afresh from what was persisted; drop data no name reaches. Returns inode -> id."""
        shutil.rmtree(live, ignore_errors=True)
        live.mkdir(parents=True)
        ids = {live.stat().st_ino: ROOT_ID}
        placed: dict[str, Path] = {}  # file id -> first path (hard links)
        pending = [(ROOT_ID, live)]
        while pending:
            dir_id, path = pending.pop()
            for name, e in self.entries(dir_id).items():
                target = path / name
                if e["dir"]:
                    target.mkdir(mode=e["mode"] & 0o7777)
                    pending.append((e["id"], target))
                elif e["id"] in placed:
                    os.link(placed[e["id"]], target)
                    continue
                else:
                    data = self.data / e["id"]
                    if data.exists():
                        shutil.copyfile(data, target)
                    else:
                        target.touch()
                    os.chmod(target, e["mode"] & 0o7777)
                    placed[e["id"]] = target
                ids[target.stat().st_ino] = e["id"]
        reached = set(ids.values())
        for f in self.data.iterdir():
            if f.name not in reached:
                f.unlink()
        for f in self.dirs.iterdir():
            if f.stem not in reached:
                f.unlink()
        return ids


def _operations(live: Path, store: Store, ids: dict[int, str], names: str) -> Any:
    import mfusepy

    class Lazy(mfusepy.Operations):  # type: ignore[misc]
        """Passthrough to ``live`` that copies to ``store`` what a sync persists."""

        use_ns = True

        def __init__(self) -> None:
            self.fds: dict[int, str] = {}  # open fd -> file id
            self.sync_fds: set[int] = set()  # opened O_SYNC / O_DSYNC: every write is synced
            self.dirty: dict[str, list[tuple[int, int]]] = {}  # file id -> ranges written since its last sync
            self.changed: set[str] = set()  # journaled: folders whose names changed since the last snapshot
            self.moved_folder = False  # ... and a renamed folder, whose old path no longer leads to it

        def _p(self, path: str) -> str:
            return str(live) + path

        def _new_id(self, path: str) -> None:
            trace("create", path)
            ids[os.lstat(self._p(path)).st_ino] = uuid.uuid4().hex
            self._changed(path)

        def _id(self, path: str) -> str:
            ino = os.lstat(self._p(path)).st_ino
            return ids.setdefault(ino, uuid.uuid4().hex)

        def _changed(self, path: str) -> None:
            self.changed.add(os.path.dirname(path))

        def _mark(self, file_id: str, a: int, b: int) -> None:
            self.dirty.setdefault(file_id, []).append((a, b))

        def _persist(self, fd: int) -> None:
            file_id = self.fds[fd]
            reader = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)  # fd may be write-only or unlinked
            try:
                store.persist_data(file_id, reader, self.dirty.pop(file_id, []))
            finally:
                os.close(reader)
            if names == "journaled":
                self._journal()

        def _snapshot(self, path: str) -> None:
            entries = {}
            for name in os.listdir(self._p(path)):
                sub = f"{path.rstrip('/')}/{name}"
                st = os.lstat(self._p(sub))
                entries[name] = {"id": self._id(sub), "dir": stat.S_ISDIR(st.st_mode), "mode": st.st_mode}
            store.set_entries(self._id(path), entries)

        def _journal(self) -> None:
            """Journaled names: every change of name made so far is persisted (ext4, XFS, btrfs in practice)."""
            folders, self.changed = self.changed, set()
            if self.moved_folder:
                rels = (os.path.relpath(d, live) for d, _, _ in os.walk(live))
                folders = {"/" if rel == "." else "/" + rel for rel in rels}
                self.moved_folder = False
            for folder in folders:
                if os.path.isdir(self._p(folder)):  # else removed: its parent's snapshot drops it
                    self._snapshot(folder)

        # -- names
        def getattr(self, path: str, fh: int | None = None) -> dict[str, int]:
            return _attrs(os.fstat(fh) if fh is not None else os.lstat(self._p(path)))

        def readdir(self, path: str, fh: int) -> list[str]:
            return [".", "..", *os.listdir(self._p(path))]

        def mkdir(self, path: str, mode: int) -> int:
            os.mkdir(self._p(path), mode)
            self._new_id(path)
            return 0

        def rmdir(self, path: str) -> int:
            os.rmdir(self._p(path))
            self._changed(path)
            return 0

        def unlink(self, path: str) -> int:
            os.unlink(self._p(path))
            self._changed(path)
            return 0

        def rename(self, old: str, new: str) -> int:
            trace("rename", old, new)
            os.rename(self._p(old), self._p(new))
            self._changed(old)
            self._changed(new)
            self.moved_folder |= os.path.isdir(self._p(new))
            return 0

        def link(self, target: str, source: str) -> int:
            os.link(self._p(source), self._p(target))
            self._changed(target)
            return 0

        def chmod(self, path: str, mode: int) -> int:
            os.chmod(self._p(path), mode)
            return 0

        def chown(self, path: str, uid: int, gid: int) -> int:
            os.chown(self._p(path), uid, gid)
            return 0

        def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
            if times is None:
                os.utime(self._p(path))
            else:
                os.utime(self._p(path), ns=times)
            return 0

        def access(self, path: str, amode: int) -> int:
            if not os.access(self._p(path), amode):
                raise mfusepy.FuseOSError(errno.EACCES)
            return 0

        def statfs(self, path: str) -> dict[str, int]:
            sv = os.statvfs(self._p(path))
            keys = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files", "f_flag")
            return {k: getattr(sv, k) for k in (*keys, "f_frsize", "f_namemax")}

        def fsyncdir(self, path: str, datasync: int, fh: int) -> int:
            trace("fsyncdir", path)
            if names == "journaled":
                self._journal()
            else:
                self._snapshot(path)
            return 0

        # -- data
        def _opened(self, path: str, fd: int, flags: int) -> int:
            self.fds[fd] = self._id(path)
            if flags & (os.O_SYNC | os.O_DSYNC):
                self.sync_fds.add(fd)
            if flags & os.O_TRUNC:
                self._mark(self.fds[fd], 0, _END)
            return fd

        def create(self, path: str, mode: int, flags: int) -> int:
            existed = os.path.lexists(self._p(path))
            fd = os.open(self._p(path), (flags & ~_STRIP) | os.O_CREAT, mode)
            if not existed:
                self._new_id(path)
            return self._opened(path, fd, flags)

        def open(self, path: str, flags: int) -> int:
            return self._opened(path, os.open(self._p(path), flags & ~_STRIP), flags)

        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            return os.pread(fh, size, offset)

        def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
            n = os.pwrite(fh, data, offset)
            self._mark(self.fds[fh], offset, offset + n)
            if fh in self.sync_fds:
                self._persist(fh)
            return n

        def truncate(self, path: str, length: int, fh: int | None = None) -> int:
            if fh is None:
                old, file_id = os.lstat(self._p(path)).st_size, self._id(path)
                os.truncate(self._p(path), length)
            else:
                old, file_id = os.fstat(fh).st_size, self.fds[fh]
                os.ftruncate(fh, length)
            self._mark(file_id, min(old, length), _END)
            return 0

        def fsync(self, path: str, datasync: int, fh: int) -> int:
            trace("fsync", path)
            self._persist(fh)
            return 0

        def flush(self, path: str, fh: int) -> int:
            return 0

        def release(self, path: str, fh: int) -> int:
            self.fds.pop(fh, None)
            self.sync_fds.discard(fh)
            os.close(fh)
            return 0

        def init(self, path: str) -> None:
            print("ready", flush=True)

    return Lazy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path)
    ap.add_argument("--names", choices=NAMES, default="strict")
    ap.add_argument("--recover", action="store_true", help="after a crash: lay live/ out from state/ alone")
    args = ap.parse_args()
    import mfusepy

    live, store = args.root / "live", Store(args.root / "state")
    if args.recover:
        ids = store.rebuild(live)
    else:
        shutil.rmtree(args.root / "state", ignore_errors=True)
        store = Store(args.root / "state")
        shutil.rmtree(live, ignore_errors=True)
        live.mkdir(parents=True)
        ids = {live.stat().st_ino: ROOT_ID}
    mfusepy.FUSE(
        _operations(live, store, ids, args.names),
        str(args.root / "mnt"),
        foreground=True,
        nothreads=True,
        hard_remove=True,
        fsname="lazyfs",
    )


if __name__ == "__main__":
    main()
