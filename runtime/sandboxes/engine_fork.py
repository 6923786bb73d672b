"""Forking a container (``Capabilities.fork`` of the ``docker`` and ``podman`` backends): N new containers with
the parent's files, each made as any other (``EngineBackend.create``: its own lease label, limits, keeper and
``--network none``), so the reaper and the pool's quota treat them as any other.

What is copied is where a container's files live. A read-only pool's writable paths (``/work``, ``/tmp``,
``/root``) are tmpfs mounts, which ``docker commit`` and the engine's archive API do not see: they are read from
the parent as one tar stream (an exec), which the engine unpacks as it comes into a volume of its own (its archive
API, through a container that never runs: ``holder``), the parent's files at the fork: its *snapshot*. Each child
is created with the snapshot mounted read-only at ``FORK_DIR`` and copies it into its own tmpfs paths (a local
``tar | tar`` in the child, charged to the child's memory as any write there). Why not the tar stream into each
child, as before: feeding 52 MB through the engine's exec stream cost a child about 3x the CPU of a local copy
(the engine's own copies of the stream), most of a fork on a loaded machine. The image itself is the parent's,
unchanged.

A snapshot is used again while its parent's files are unchanged (a task's template forked once per repeat:
``seed_once``): a digest of the files' names, sizes, times, modes and owners is read first (one cheap command) and
where it matches the snapshot's, nothing is read. A snapshot goes (its volume removed) once it is neither kept (its
parent gone or changed, or more than ``KEPT`` parents kept) nor used by a child; one a dead worker left, once its
parent is gone and no container uses it (``sweep``).

A ``rootfs: writable`` pool's files are in the container's own layer: the parent is committed (paused for the
moment of the commit) to a temporary image the children are created from, removed as soon as its last child is
(``released``), or by a later sweep (``sweep``) where its worker died first. Running processes and memory are not
copied (no CRIU): a child starts with its keeper only, as a fresh container does.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime
from typing import Any, Protocol

import anyio
import msgspec

from gym_runtime.errors import Failure
from gym_runtime.observability import logs
from gym_runtime.sandboxes.backend import Resolved
from gym_runtime.sandboxes.engine_http import Engine, EngineError


class EngineBackend(Protocol):
    """What a fork needs of its backend (``engine_api.EngineBackend``): whether its root is writable, its ``create``
    (a child is made as any other sandbox) and the body of a snapshot's ``holder``."""

    writable: bool
    name: str  # docker | podman

    async def create(
        self,
        spec: Resolved,
        *,
        owner: str,
        lease: str,
        expires: float | None = None,
        snapshot: str = "",
        ready: Callable[[], Awaitable[None]] | None = None,
    ) -> str: ...

    def holder_body(self, spec: Resolved, volume: str, *, owner: str, until: float) -> dict[str, Any]: ...


log = logs.get("gym.sandbox")

FORK_OF = "gym-runtime.fork-of"  # a temporary image's or snapshot's label: the container it was made from
FORK_DIR = "/.gym-fork"  # where a read-only pool's copy sees its snapshot (read-only): the files it was forked with
HOLDER_DIR = "/snapshot"  # where a holder mounts the snapshot it fills
HOLD_S = 3600.0  # a snapshot's holder ends with its fork's copies' leases, at most this long after the fork
VOLUME_PREFIX = "gym-fork-"
IMAGE_GRACE_S = 300.0  # a fork image or snapshot no container uses is swept only this long after it was made
COPY_TIMEOUT_S = 600.0
RELEASE_WAIT_S = 60.0  # a stopping worker waits this long at most for the releases under way (``close``)
TAR_SLACK = 1 << 20  # the tar stream's headers beyond the files themselves
PUT_TRIES = 2  # a snapshot's unpack by the engine, tried again once where the engine failed it (``_fill``)
KEPT = 8  # parents whose last snapshot is kept (each at most the pool's disk_mb per copied path, on the engine's disk)
# what tells a parent's files unchanged since its last fork: every entry's name, size, times, mode, owner and link,
# as a digest (a file written, made, removed, or chmodded changes it); GNU find's -printf (the base image's)
DIGEST = "cd / && find {paths} -printf '%p %s %T@ %C@ %m %U %G %l\\n' 2>/dev/null | md5sum"
# a child's copy of its snapshot (argv: the copied paths); a snapshot without them (its volume gone, and the engine
# made an empty one of that name) fails the fork, never leaves a copy without its files. GNU tar's in records of
# 1 MiB (``-b 2048``; its default is 10 KiB): a fifth less CPU for 52 MB (other tars, e.g. BusyBox's, have no -b)
COPY = (
    f'cd {FORK_DIR} && for p in "$@"; do [ -d "$p" ] || {{ echo "the snapshot has no $p" >&2; exit 3; }}; done; '
    'b=; case "$(tar --version 2>/dev/null)" in *GNU*) b="-b 2048";; esac; '
    'tar $b -cf - "$@" | tar $b -C / -xpf -'
)
COPIED = "gym-runtime: copied"  # what a copy's main process says once its files are copied (``ENTRY``)
# a copy's main process (argv: the copied paths as one word, then its own main process): its snapshot copied
# (``COPY``), said on stdout, then its own main process in its place; a copy that fails ends it, saying why on stderr
ENTRY = f'w=$PWD; p=$1; shift; (set -- $p; {COPY}) || exit; cd "$w" && echo "{COPIED}" && exec "$@"'


def copies_at_start(spec: Resolved) -> bool:
    """Whether a copy made as ``spec`` copies its snapshot as it starts (``ENTRY``), not by an exec once started.
    Not a restartable one: its restart would copy the snapshot again (a restart empties the tmpfs paths)."""
    return not spec.restartable


def entry(main: list[str], copied: tuple[str, ...]) -> list[str]:
    """The main process of a copy that copies its snapshot (``copied``: its paths, as tar names) as it starts."""
    return ["sh", "-c", ENTRY, "fork", " ".join(copied), *main]


async def start_copy(engine: Engine, cid: str, ready: Callable[[], Awaitable[None]] | None) -> None:
    """Start a copy made with ``entry`` once its snapshot is whole (``ready``), and wait for its files: its output,
    attached before its start, read until its main process says them copied. One exec fewer than a copy after the
    start (an exec's create, start and inspect, and its process set up by the runtime: most of a fork's time
    under load). Raises why a copy failed (it ended)."""
    if ready is not None:
        await ready()
    out, err = bytearray(), bytearray()
    with anyio.move_on_after(COPY_TIMEOUT_S) as scope:
        async with engine.watched("a forked sandbox's copy"), engine.attached(cid) as frames:
            await engine.start(cid)
            async for stream, chunk in frames:
                kept = out if stream == 1 else err
                kept.extend(chunk[: max(0, 4096 - len(kept))])
                if COPIED.encode() in out:
                    return
    why = err.decode(errors="replace").strip()[:500] or "it ended"
    if scope.cancelled_caught:
        why = f"not copied in {COPY_TIMEOUT_S:g} s"
    raise Failure("tool_error", f"copying files into a forked sandbox failed: {why}")


class Snapshot:
    """A parent's files at a fork, in volume ``volume``: the digest of its files when its read began ("": not to be
    used again), and how its fill ended (``ready``: once filled; raises how it failed)."""

    __slots__ = ("volume", "digest", "holder", "done", "failed", "_ended")

    def __init__(self, volume: str) -> None:
        self.volume, self.digest = volume, ""
        self.holder = ""  # the container that keeps its tmpfs mounted (``_fill``)
        self.done = False
        self.failed: Failure | None = None
        self._ended = anyio.Event()

    def end(self, failed: Failure | None = None) -> None:
        self.done, self.failed = True, failed
        self._ended.set()

    async def ready(self) -> None:
        await self._ended.wait()
        if self.failed is not None:
            raise self.failed


class EngineForks:
    """One backend's forks: the temporary images and snapshots it made, the children that use each, and the
    snapshot each parent keeps."""

    def __init__(self, engine: Engine, pool: str, labels: tuple[str, tuple[str, ...]]) -> None:
        self.engine, self.pool = engine, pool
        self.pool_label, self.copied = labels  # the pool's label key; the tmpfs paths a fork copies, as tar names
        self.users: dict[str, set[str]] = {}  # an image or snapshot volume -> its children (and forks under way)
        self.used: dict[str, str] = {}  # a child -> its image or snapshot volume
        self.kept: dict[str, Snapshot] = {}  # a parent -> its last snapshot, oldest first
        self.holders: dict[str, str] = {}  # a snapshot's volume -> its holder
        self.made: set[str] = set()  # the snapshots' volumes it made (``close``)
        self._reading: dict[str, anyio.Lock] = {}  # a parent -> one read of it at a time (a group's forks share it)
        self._releasing = 0  # ``released`` calls under way, and an event set when none is (``close``)
        self._quiet: anyio.Event | None = None
        self.reads = 0  # parents' files read (a snapshot filled), not kept ones reused (tests)

    async def fork(
        self, backend: EngineBackend, sid: str, spec: Resolved, *, owner: str, tags: list[str], expires: float
    ) -> list[str]:
        """``len(tags)`` children of ``sid`` (one per lease tag, in order); all or none."""
        made = ""  # what the children are made from: a temporary image, or the snapshot they copy
        snap: Snapshot | None = None
        token = f"forking-{uuid.uuid4().hex}"  # holds the snapshot for this fork until its children do
        children: list[str] = []
        errors: list[Exception] = []
        with anyio.CancelScope(shield=True):  # every child made is either handed out or removed here
            try:
                if backend.writable:
                    made = await self._commit(sid)
                    spec = msgspec.structs.replace(spec, image=made)
                    children, errors, _ = await self._copies(backend, sid, spec, None, owner, tags, expires)
                else:
                    stale: Snapshot | None = None
                    while True:
                        snap, fill, check = await self._snapshot(sid, token, self._tmpfs(backend, spec), stale)
                        made = snap.volume
                        children, errors, fresh = await self._copies(
                            backend, sid, spec, snap, owner, tags, expires, fill=fill, check=check
                        )
                        if fresh:
                            break
                        # the kept snapshot is older than the parent's files (or its holder ended): its copies go, and
                        # the parent is read again (the next ``_snapshot`` drops the stale one)
                        for cid in children:
                            if cid:
                                await self.engine.remove(cid)
                        self.users.get(made, set()).discard(token)
                        stale, made, children, errors = snap, "", [], []
            except Exception as e:
                errors.append(e)
            if errors:
                for cid in children:
                    if cid:
                        await self.engine.remove(cid)
                if snap is not None and self.kept.get(sid) is snap:
                    del self.kept[sid]  # read again next time (it failed, or its volume went)
                if made:
                    self.users.get(made, set()).discard(token)
                    await self._release(made)
                raise errors[0]
        users = self.users.setdefault(made, set())
        users.discard(token)
        users.update(children)
        self.used.update(dict.fromkeys(children, made))
        return children

    async def _copies(
        self,
        backend: EngineBackend,
        sid: str,
        spec: Resolved,
        snap: Snapshot | None,
        owner: str,
        tags: list[str],
        expires: float,
        *,
        fill: bool = False,
        check: bool = False,
    ) -> tuple[list[str], list[Exception], bool]:
        """Make the children at once, while the snapshot fills (``fill``) or is checked (``check``: a kept one, whose
        parent may have changed since; ``_unchanged``): their ids ("" for one that failed), the failures, and whether
        the snapshot still has the parent's files (True where not checked). A kept snapshot is checked beside its
        copies' creates, not before them: an unchanged parent (a task's template forked once per repeat) waits
        for no check, and a changed one's copies go (the caller removes them) once it is seen."""
        children = [""] * len(tags)
        errors: list[Exception] = []  # each task's own, so none cancels another mid-create (a child then unknown)
        fresh = True
        at_start = snap is not None and copies_at_start(spec)

        async def one(i: int) -> None:
            try:
                children[i] = await backend.create(
                    spec,
                    owner=owner,
                    lease=tags[i],
                    expires=expires,
                    snapshot=snap.volume if snap is not None else "",
                    ready=snap.ready if snap is not None and at_start else None,
                )
                if snap is not None and not at_start:  # started while the snapshot fills; copied once it is whole
                    await snap.ready()
                    await self._copy(children[i])
            except Exception as e:
                errors.append(e)

        async def checked() -> None:
            nonlocal fresh
            assert snap is not None
            try:
                fresh = await self._unchanged(sid, snap)
            except Exception:
                fresh = False

        async with anyio.create_task_group() as tg:
            if snap is not None and fill:  # its failure: ``snap.ready``'s
                tg.start_soon(self._fill, backend, sid, spec, snap, owner, expires)
            if snap is not None and check:
                tg.start_soon(checked)
            for i in range(len(tags)):
                tg.start_soon(one, i)
        return children, errors, fresh

    async def _commit(self, sid: str) -> str:
        try:
            return await self.engine.commit(sid, {self.pool_label: self.pool, FORK_OF: sid[:12]})
        except EngineError as e:
            raise Failure("tool_error", f"forking sandbox {sid[:12]} failed (commit): {e}", retryable=True) from e

    def _tmpfs(self, backend: EngineBackend, spec: Resolved) -> dict[str, str] | None:
        """A snapshot's volume: on Docker a tmpfs (as large as the paths it copies may be), which its holder keeps
        mounted; None on Podman: a directory on the engine's disk, its holder never run (Podman 4.3 here left a
        tmpfs volume mounted after its last user ended, then failed to remove it: "device or resource busy")."""
        if backend.name != "docker":
            return None
        return {"type": "tmpfs", "device": "tmpfs", "o": f"size={len(self.copied) * spec.disk_mb}m,nosuid,nodev"}

    async def _snapshot(
        self, sid: str, token: str, tmpfs: dict[str, str] | None, stale: Snapshot | None = None
    ) -> tuple[Snapshot, bool, bool]:
        """The parent's snapshot for a fork, held for it by ``token``; whether the caller fills it (``_fill``), and
        whether it checks it (``_copies``). The one kept from its last fork, read whole (checked), unless ``stale``
        (found older than the parent's files); or the one filling now (forks at once share it); else a new one (its
        volume made here)."""
        lock = self._reading.setdefault(sid, anyio.Lock())
        evicted: list[Snapshot] = []
        async with lock:
            kept = self.kept.get(sid)
            if kept is not None and kept is not stale and (not kept.done or (kept.failed is None and kept.digest)):
                self.kept[sid] = self.kept.pop(sid)  # the most recently used
                self.users.setdefault(kept.volume, set()).add(token)
                return kept, False, kept.done
            self.reads += 1
            snap = Snapshot(f"{VOLUME_PREFIX}{uuid.uuid4().hex[:20]}")
            try:
                await self.engine.create_volume(snap.volume, {self.pool_label: self.pool, FORK_OF: sid}, tmpfs)
                self.made.add(snap.volume)
            except EngineError as e:
                raise Failure("tool_error", f"forking sandbox {sid[:12]} failed: {e}", retryable=True) from e
            self.users.setdefault(snap.volume, set()).add(token)
            if (old := self.kept.pop(sid, None)) is not None:
                evicted.append(old)
            self.kept[sid] = snap
            while len(self.kept) > KEPT:
                evicted.append(self.kept.pop(next(iter(self.kept))))
        for old in evicted:
            await self._release(old.volume)
        return snap, True, False

    async def _unchanged(self, sid: str, snap: Snapshot) -> bool:
        """Whether a kept snapshot still has the parent's files: their digest is the one it was read with, and it is
        still there (a tmpfs's holder still runs; one on disk has none)."""
        if not snap.digest or await self._digest(sid) != snap.digest:
            return False
        if snap.volume not in self.holders:
            return True
        try:
            return bool(((await self.engine.inspect(snap.holder)).get("State") or {}).get("Running"))
        except EngineError:
            return False

    async def _digest(self, sid: str) -> str:
        """The digest of the parent's files now (``DIGEST``); "" where it cannot be read (never equal to a kept one)."""
        argv = ["sh", "-c", DIGEST.format(paths=" ".join(self.copied))]
        try:
            out = await self.engine.exec(sid, argv, timeout_s=COPY_TIMEOUT_S, max_output=4096)
        except EngineError:
            return ""
        digest = out.stdout.decode(errors="replace").strip()
        return digest if out.exit_code == 0 and digest else ""

    async def _fill(
        self, backend: EngineBackend, sid: str, spec: Resolved, snap: Snapshot, owner: str, expires: float
    ) -> None:
        """Start the snapshot's holder (its tmpfs volume mounted while it runs: until the copies' leases end, at
        most), then read the digest of the parent's files and its tmpfs paths as one tar stream (bounded by their
        size limits), unpacked by the engine into the snapshot as it comes; one command: the digest on stderr,
        before the tar. Its digest kept where it read cleanly; never raises: a failure ends the snapshot (its children's
        ``Snapshot.ready`` raises it)."""
        cap = len(self.copied) * (spec.disk_mb << 20) + TAR_SLACK
        script = DIGEST.format(paths=" ".join(self.copied)) + ' >&2; exec tar -C / -cf - "$@"'
        argv = ["sh", "-c", script, "pack", *self.copied]
        size, over, err = 0, False, bytearray()
        failed: Failure | None = None
        eid = holder = ""
        memory = False

        async def tar() -> AsyncIterator[bytes]:
            nonlocal size, over
            async with contextlib.aclosing(self.engine.exec_stream(eid, None)) as frames:
                async for stream, chunk in frames:
                    if stream != 1:
                        err.extend(chunk[: max(0, 4096 - len(err))])
                    elif size + len(chunk) > cap:
                        over = True  # the engine gets a cut tar (and fails it); the fork fails below
                        return
                    else:
                        size += len(chunk)
                        yield chunk

        try:
            until = min(expires, time.time() + HOLD_S)
            holder = snap.holder = await self.engine.create(
                backend.holder_body(spec, snap.volume, owner=owner, until=until)
            )
            if memory := backend.name == "docker":  # a tmpfs: held mounted while the holder runs
                self.holders[snap.volume] = holder
                await self.engine.start(holder)
            for tries_left in reversed(range(PUT_TRIES)):
                size, over, err[:] = 0, False, b""
                eid = await self.engine.exec_create(sid, argv)
                put: EngineError | None = None
                with anyio.move_on_after(COPY_TIMEOUT_S) as scope:
                    try:
                        await self.engine.put_archive(holder, HOLDER_DIR, tar())
                    except EngineError as e:
                        put = e
                if scope.cancelled_caught or over:
                    await self.engine.kill_exec(eid)
                code = None if over or scope.cancelled_caught else (await self.engine.exec_info(eid)).get("ExitCode")
                if put is None or over or scope.cancelled_caught or code not in (0, 1, None) or not tries_left:
                    break
                # the engine's unpack failed, not the parent's read (Podman's, about 1 in 10 under load here: "passing
                # bulk input to subprocess: write |1: broken pipe"): read and unpacked again, over what it had
                if code is None:  # the read was cut with it
                    await self.engine.kill_exec(eid)
                log.info("sandbox.fork_unpack_again", sandbox=sid[:12], error=str(put)[:200])
            # tar's 1: a file changed while it was read (a process of the parent still writing): copied as it was
            if over:
                failed = Failure("tool_error", f"forking sandbox {sid[:12]} failed: its files are over {cap} bytes")
            elif scope.cancelled_caught:
                failed = Failure("tool_error", f"forking sandbox {sid[:12]} failed: not read in {COPY_TIMEOUT_S:g} s")
            elif put is not None and code in (0, 1, None):  # the engine's unpack failed
                failed = Failure("tool_error", f"forking sandbox {sid[:12]} failed: {put}", retryable=True)
            elif code not in (0, 1):
                lines = err.decode(errors="replace").strip().splitlines()
                why = "\n".join(lines[1:] if lines and lines[0].endswith(" -") else lines)[:500] or f"exit {code}"
                failed = Failure("tool_error", f"forking sandbox {sid[:12]} failed: its image needs tar ({why})")
            else:
                first = err.decode(errors="replace").partition("\n")[0].strip()
                # a file changed while tar read it: copied as it was, not used again (the digest is older)
                snap.digest = first if code == 0 and first.endswith(" -") else ""
        except Exception as e:  # the engine's (EngineError), or anything else: the snapshot fails, never the group
            failed = Failure("tool_error", f"forking sandbox {sid[:12]} failed: {e}", retryable=True)
        except BaseException:
            failed = Failure("tool_error", f"forking sandbox {sid[:12]} failed: its read was cancelled")
            raise
        finally:
            snap.end(failed)
            if holder and not memory:  # its files are on the engine's disk: it served the unpack alone
                with anyio.CancelScope(shield=True):
                    await self.engine.remove(holder)

    async def _copy(self, cid: str) -> None:
        """A child's copy of its snapshot into its own tmpfs paths (``COPY``)."""
        argv = ["sh", "-c", COPY, "copy", *self.copied]
        out = await self.engine.exec(cid, argv, timeout_s=COPY_TIMEOUT_S, max_output=4096)
        if out.exit_code != 0:
            why = out.stderr.decode(errors="replace").strip()[:500] or f"exit {out.exit_code}"
            raise Failure("tool_error", f"copying files into a forked sandbox failed: {why}")

    async def released(self, cid: str) -> None:
        """Container ``cid`` was removed: its kept snapshot goes, and the image or snapshot it used if nothing else
        uses it. Shielded: a caller cancelled mid-way (its worker stopping) would leave a snapshot's holder running
        once it is no longer listed, its volume in use past ``close``; ``close`` waits for releases under way."""
        with anyio.CancelScope(shield=True):
            if not self._releasing:
                self._quiet = anyio.Event()
            self._releasing += 1
            try:
                self._reading.pop(cid, None)
                snap = self.kept.pop(cid, None)
                made = self.used.pop(cid, "")
                if made:
                    self.users.get(made, set()).discard(cid)
                    await self._release(made)
                if snap is not None:
                    await self._release(snap.volume)
            finally:
                self._releasing -= 1
                if not self._releasing and self._quiet is not None:
                    self._quiet.set()

    async def _release(self, made: str) -> None:
        """Remove a temporary image or snapshot that no child (nor fork under way) uses and no parent keeps."""
        if self.users.get(made) or any(s.volume == made for s in self.kept.values()):
            return
        self.users.pop(made, None)
        if made.startswith(VOLUME_PREFIX):
            gone = await self._drop(made)
        else:
            gone = await self.engine.remove_image(made)
        if not gone:
            log.info("sandbox.fork_image_kept", image=made[:27])  # a sweep tries again

    async def close(self) -> None:
        """Its worker stops (what it held removed): remove every snapshot it made that is still there and no container
        uses (one a removal refused while a copy's removal was under way), and their holders; releases under way
        (``released``) end first, bounded."""
        if self._releasing and self._quiet is not None:
            with anyio.move_on_after(RELEASE_WAIT_S):
                await self._quiet.wait()
        for volume in sorted(self.made | set(self.holders)):
            await self._drop(volume)
        self.made.clear()

    async def _drop(self, volume: str) -> bool:
        """Remove a snapshot's volume and its holder; whether it went. One the engine refuses (in use) is tried again
        once whatever still mounts it is gone: a holder or a copy whose removal is under way (ended by its deadline,
        or its remover cancelled mid-call: the stopping worker's subscriptions cancel their handlers), which no
        container of a live lease can be (the snapshot has no users left)."""
        if holder := self.holders.get(volume, ""):
            await self.engine.remove(holder)
            self.holders.pop(volume, None)  # listed until removed: ``close`` tries one whose removal failed again
        gone = await self.engine.remove_volume(volume)
        if not gone:
            try:
                for cid in await self.engine.using(volume):
                    await self.engine.gone(cid)
                # again even where none is listed now: the one that held it may have gone between the two calls
                gone = await self.engine.remove_volume(volume)
            except EngineError as e:  # a sweep tries again
                log.warning("sandbox.fork_snapshot_kept", volume=volume, error=str(e))
        if gone:
            self.made.discard(volume)
        return gone

    async def sweep(self, now: float | None = None) -> int:
        """Remove the pool's temporary images and snapshots that no container uses (their worker died, or a removal
        failed), once older than ``IMAGE_GRACE_S`` (a snapshot: once its parent is gone too, as no live worker
        keeps it then); how many went. One a container still uses is refused by the engine."""
        now = time.time() if now is None else now
        gone = 0
        mine = {self.pool_label: self.pool}
        for img in await self.engine.images(mine):
            labels = img.get("Labels") or {}
            if FORK_OF not in labels or img["Id"] in self.users:
                continue
            if now - float(img.get("Created") or 0) < IMAGE_GRACE_S:
                continue
            if await self.engine.remove_image(img["Id"]):
                gone += 1
                log.info("sandbox.fork_image_swept", image=img["Id"][:19])
        volumes = [v for v in await self.engine.volumes(mine) if FORK_OF in (v.get("Labels") or {})]
        if not volumes:
            return gone
        there = {c["Id"] for c in await self.engine.containers({self.pool_label: self.pool})}
        kept = {s.volume for s in self.kept.values()}
        for v in volumes:
            name = v["Name"]
            if name in self.users or name in kept or v["Labels"][FORK_OF] in there:
                continue
            if now - _created(v.get("CreatedAt")) < IMAGE_GRACE_S:
                continue
            if await self.engine.remove_volume(name):
                gone += 1
                log.info("sandbox.fork_snapshot_swept", volume=name)
        return gone


def _created(stamp: object) -> float:
    """A volume's ``CreatedAt`` (RFC 3339; Podman's with nanoseconds) in unix seconds; 0 where it cannot be read."""
    text = str(stamp or "").replace("Z", "+00:00")
    head, dot, rest = text.partition(".")
    if dot:  # at most microseconds for fromisoformat
        digits = len(rest) - len(rest.lstrip("0123456789"))
        text = f"{head}.{rest[: min(digits, 6)]}{rest[digits:]}"
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return 0.0
