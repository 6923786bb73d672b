"""Forking a container (``Capabilities.fork`` of the ``docker`` and ``podman`` backends): N new containers with
the parent's files, each made as any other (``EngineBackend.create``: its own lease label, limits, keeper and
``--network none``), so the reaper and the pool's quota treat them as any other.

What is copied is where a container's files live. A read-only pool's writable paths (``/work``, ``/tmp``,
``/root``) are tmpfs mounts, which ``docker commit`` and the engine's archive API do not see: they are read from
the parent as one tar stream and unpacked into each child as it comes (``Tar``: each child's ``tar -x`` is fed the
parts read so far, then the rest as they arrive; the image itself is the parent's, unchanged). A ``rootfs:
writable`` pool's files are in the container's own layer: the parent is committed (paused for the moment of the
commit) to a temporary image the children are created from, removed as soon as its last child is (``released``),
or by a later sweep (``sweep``) where its worker died first. Running processes and memory are not copied (no CRIU): a
child starts with its keeper only, as a fresh container does.

A parent forked again with its files unchanged (a task's template, forked once per repeat: ``seed_once``) is not
read again: the tar of its last fork is kept (``Packed``) with a digest of its files' names, sizes, times, modes
and owners, read first by one cheap command; the digest matches, the kept tar is unpacked. The tar goes with the
parent, or when more parents are kept than ``KEPT_PACKS``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Protocol

import anyio
import msgspec

from gym_runtime.errors import Failure
from gym_runtime.observability import logs
from gym_runtime.sandboxes.backend import Resolved
from gym_runtime.sandboxes.engine_http import Engine, EngineError


class EngineBackend(Protocol):
    """What a fork needs of its backend (``engine_api.EngineBackend``): whether its root is writable, and its
    ``create`` (a child is made as any other sandbox)."""

    writable: bool

    async def create(self, spec: Resolved, *, owner: str, lease: str, expires: float | None = None) -> str: ...


log = logs.get("gym.sandbox")

FORK_OF = "gym-runtime.fork-of"  # a temporary image's label: the container it was committed from
IMAGE_GRACE_S = 300.0  # a fork image no container uses is swept only this long after its commit (a fork under way)
COPY_TIMEOUT_S = 600.0
TAR_SLACK = 1 << 20  # the tar stream's headers beyond the files themselves
KEPT_PACKS = 8  # parents whose last tar is kept (each at most the pool's disk_mb per copied path)
# what tells a parent's files unchanged since its last fork: every entry's name, size, times, mode, owner and link,
# as a digest (a file written, made, removed, or chmodded changes it); GNU find's -printf (the base image's)
DIGEST = "cd / && find {paths} -printf '%p %s %T@ %C@ %m %U %G %l\\n' 2>/dev/null | md5sum"


class Tar:
    """A parent's tar as it is read: its parts so far, whole once ``end`` is called; any number of children read
    it at once (``parts``), from its start, while it is still read (a failed read fails them too)."""

    __slots__ = ("chunks", "done", "failed", "_more")

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.done = False
        self.failed: Failure | None = None
        self._more = anyio.Event()

    def add(self, chunk: bytes) -> None:
        self.chunks.append(chunk)
        self._wake()

    def end(self, failed: Failure | None = None) -> None:
        self.done, self.failed = True, failed
        self._wake()

    def _wake(self) -> None:
        self._more.set()
        self._more = anyio.Event()

    async def parts(self) -> AsyncIterator[bytes]:
        i = 0
        while True:
            more = self._more
            while i < len(self.chunks):
                yield self.chunks[i]
                i += 1
            if self.done:
                if self.failed is not None:
                    raise self.failed
                return
            await more.wait()


class Packed:
    """A parent's last tar (or the one being read), and the digest of its files when its read began."""

    __slots__ = ("digest", "tar")

    def __init__(self, digest: str, tar: Tar) -> None:
        self.digest, self.tar = digest, tar


class EngineForks:
    """One backend's forks: the temporary images it committed and the children that use each."""

    def __init__(self, engine: Engine, pool: str, labels: tuple[str, tuple[str, ...]]) -> None:
        self.engine, self.pool = engine, pool
        self.pool_label, self.copied = labels  # the pool's label key; the tmpfs paths a fork copies, as tar names
        self.users: dict[str, set[str]] = {}  # a temporary image -> its children still there
        self.image_of: dict[str, str] = {}  # a child -> its temporary image
        self.packed: dict[str, Packed] = {}  # a parent -> its last tar (``_files``), oldest first
        self._packing: dict[str, anyio.Lock] = {}  # a parent -> one read of it at a time (a group's forks share it)
        self.reads = 0  # parents' files read (a tar), not kept ones reused (tests)

    async def fork(
        self, backend: EngineBackend, sid: str, spec: Resolved, *, owner: str, tags: list[str], expires: float
    ) -> list[str]:
        """``len(tags)`` children of ``sid`` (one per lease tag, in order); all or none."""
        image = ""
        if backend.writable:
            image = await self._commit(sid)
            spec = msgspec.structs.replace(spec, image=image)
        tars: list[Tar] = []
        found = anyio.Event()
        children: list[str] = [""] * len(tags)

        async def pack() -> None:
            tar, read = await self._files(sid)
            tars.append(tar)
            found.set()
            if read:
                await self._pack(sid, spec, tar)

        async def one(i: int) -> None:  # created while the parent's files are read, and unpacked as they come
            cid = children[i] = await backend.create(spec, owner=owner, lease=tags[i], expires=expires)
            if not backend.writable:
                await found.wait()
                await self._unpack(cid, tars[0])

        try:
            with anyio.CancelScope(shield=True):  # every child made is either handed out or removed here
                async with anyio.create_task_group() as tg:
                    if not backend.writable:
                        tg.start_soon(pack)
                    for i in range(len(tags)):
                        tg.start_soon(one, i)
        except BaseException as e:
            for cid in children:
                if cid:
                    await self.engine.remove(cid)
            if image:
                await self.engine.remove_image(image)
            failed = e.exceptions[0] if isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1 else e
            raise failed from None
        if image:
            self.users[image] = set(children)
            self.image_of.update(dict.fromkeys(children, image))
        return children

    async def _commit(self, sid: str) -> str:
        try:
            return await self.engine.commit(sid, {self.pool_label: self.pool, FORK_OF: sid[:12]})
        except EngineError as e:
            raise Failure("tool_error", f"forking sandbox {sid[:12]} failed (commit): {e}", retryable=True) from e

    async def _files(self, sid: str) -> tuple[Tar, bool]:
        """The parent's tmpfs paths as one tar, and whether the caller reads it (``_pack``): the one kept from its
        last fork where its files are unchanged since, or the one being read now (forks at once share it)."""
        lock = self._packing.setdefault(sid, anyio.Lock())
        async with lock:
            kept = self.packed.get(sid)
            if kept is not None and (
                not kept.tar.done or (kept.tar.failed is None and await self._digest(sid) == kept.digest)
            ):
                self.packed[sid] = self.packed.pop(sid)  # the most recently used
                return kept.tar, False
            self.reads += 1
            tar = Tar()
            self.packed.pop(sid, None)
            self.packed[sid] = Packed("", tar)
            while len(self.packed) > KEPT_PACKS:
                del self.packed[next(iter(self.packed))]
            return tar, True

    async def _digest(self, sid: str) -> str:
        """The digest of the parent's files now (``DIGEST``); "" where it cannot be read (never equal to a kept one)."""
        argv = ["sh", "-c", DIGEST.format(paths=" ".join(self.copied))]
        try:
            out = await self.engine.exec(sid, argv, timeout_s=COPY_TIMEOUT_S, max_output=4096)
        except EngineError:
            return ""
        digest = out.stdout.decode(errors="replace").strip()
        return digest if out.exit_code == 0 and digest else ""

    async def _pack(self, sid: str, spec: Resolved, tar: Tar) -> None:
        """Read the digest of the parent's files, then its tmpfs paths as one tar stream into ``tar`` (bounded by
        their size limits); one command: the digest on stderr, before the tar. Kept (``packed``) with that digest
        where it read cleanly; else dropped once whole."""
        cap = len(self.copied) * (spec.disk_mb << 20) + TAR_SLACK
        script = DIGEST.format(paths=" ".join(self.copied)) + ' >&2; exec tar -C / -cf - "$@"'
        argv = ["sh", "-c", script, "pack", *self.copied]
        size, err = 0, bytearray()
        failed: Failure | None = None
        digest = ""
        try:
            eid = await self.engine.exec_create(sid, argv)
            with anyio.move_on_after(COPY_TIMEOUT_S) as scope:
                async for stream, chunk in self.engine.exec_stream(eid, None):
                    if stream != 1:
                        err += chunk[: max(0, 4096 - len(err))]
                    elif size + len(chunk) <= cap:  # stdout is kept by ``tar`` alone, as it comes
                        size += len(chunk)
                        tar.add(chunk)
                    else:
                        size = cap + 1
                        break
            if scope.cancelled_caught:
                await self.engine.kill_exec(eid)
            code = (await self.engine.exec_info(eid)).get("ExitCode")
            # tar's 1: a file changed while it was read (a process of the parent still writing): copied as it was
            if code not in (0, 1) or size > cap:
                why = err.decode(errors="replace").strip()[:500] or f"exit {code}"
                if size > cap:
                    why = f"over {cap} bytes"
                failed = Failure("tool_error", f"forking sandbox {sid[:12]} failed: its image needs tar ({why})")
            else:
                first = err.decode(errors="replace").partition("\n")[0].strip()
                # a file changed while tar read it: copied as it was, not kept (the digest is older)
                digest = first if code == 0 and first.endswith(" -") else ""
        except EngineError as e:
            failed = Failure("tool_error", f"forking sandbox {sid[:12]} failed: {e}", retryable=True)
        except BaseException:
            failed = Failure("tool_error", f"forking sandbox {sid[:12]} failed: its read was cancelled")
            raise
        finally:
            kept = self.packed.get(sid)
            if kept is not None and kept.tar is tar:
                if digest:
                    kept.digest = digest
                else:
                    del self.packed[sid]
            tar.end(failed)
        if failed is not None:
            raise failed

    async def _unpack(self, cid: str, tar: Tar) -> None:
        argv = ["tar", "-C", "/", "-xpf", "-"]
        out = await self.engine.exec(cid, argv, feed=tar.parts(), timeout_s=COPY_TIMEOUT_S, max_output=4096)
        if out.exit_code != 0:
            why = out.stderr.decode(errors="replace").strip()[:500]
            raise Failure("tool_error", f"copying files into a forked sandbox failed: {why}")

    async def released(self, cid: str) -> None:
        """Container ``cid`` was removed: its kept tar goes; a child's temporary image too, if no other child uses
        it."""
        self.packed.pop(cid, None)
        self._packing.pop(cid, None)
        image = self.image_of.pop(cid, "")
        users = self.users.get(image)
        if users is None:
            return
        users.discard(cid)
        if not users:
            del self.users[image]
            if not await self.engine.remove_image(image):
                log.info("sandbox.fork_image_kept", image=image[:19])  # a sweep tries again

    async def sweep(self, now: float | None = None) -> int:
        """Remove the pool's temporary images that no container uses (their worker died, or a removal failed),
        once older than ``IMAGE_GRACE_S``; how many went. One a container still uses is refused by the engine."""
        now = time.time() if now is None else now
        gone = 0
        for img in await self.engine.images({self.pool_label: self.pool}):
            labels = img.get("Labels") or {}
            if FORK_OF not in labels or img["Id"] in self.users:
                continue
            if now - float(img.get("Created") or 0) < IMAGE_GRACE_S:
                continue
            if await self.engine.remove_image(img["Id"]):
                gone += 1
                log.info("sandbox.fork_image_swept", image=img["Id"][:19])
        return gone
