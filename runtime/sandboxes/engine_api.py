"""The ``docker`` and ``podman`` backends: containers through the Engine API (``engine_http``).

Every container is made safe by construction, whatever the spec asks:

- ``NetworkMode: none``: a loopback interface and nothing else (these machines flag bridge traffic);
- no mounts of the host (no engine socket, no credentials): only tmpfs mounts of its own;
- a read-only root file system; the writable paths (``/work``, ``/tmp``, ``/root``) are tmpfs mounts of
  ``disk_mb`` each: the disk limit (the engines' ``--storage-opt size`` needs xfs with project quotas,
  and these machines' root file system is ext4), charged to the container's memory as they fill;
- cpu (``NanoCpus``), memory (swap off) and pids limits, all capabilities dropped but the few a shell
  needs, ``no-new-privileges``, an init that reaps orphans;
- labels ``gym-runtime.owner`` (the worker), ``gym-runtime.lease`` (its lease's tag, never the lease),
  ``gym-runtime.pool`` and ``gym-runtime.expires`` (when the lease ends), which the reaper reads;
- a main process that ends the container unless its worker renews it (``KEEPER``), and ``AutoRemove``: a
  container whose worker died (SIGKILLed with its node or its bus) is gone within ``orphan_after_s`` by itself,
  whatever else runs on the engine.

**Why a keeper renewed by a signal.** The worker sends ``SIGWINCH`` to each container it holds (the engine's
kill endpoint; the init forwards it to the keeper) every third of a window; a window without one ends the
keeper, so the container ends at most ``orphan_after_s`` after its last renewal. One engine call per
container, no exec (no process in the sandbox, no output to read), and nothing on the host that must outlive
the worker: a host-side watchdog would die with it (a cgroup kill of the service, a lost node). ``SIGWINCH``
is ignored by default, so one that comes before the keeper set its trap is lost, never fatal. A policy in the
sandbox can renew its own keeper (it shares its user); the keeper also ends at a hard deadline no signal
moves (the lease's end, a warm container's ``2 x max_lease_s``: its ``expires`` label), so a container outlives
a dead worker by at most that. It also ends, renewed or not, if the policy kills it (its own loss).

Exec output is capped while it is read (and handed on as it comes: ``Capabilities.stream``); a command is
wrapped in ``timeout -s KILL`` (its whole process group dies at the wall clock) and the host kills it too if
the stream outlives that. A background command (``spawn``) is an exec instance the worker keeps reading; it
leads its own process group (``timeout``'s), which ``kill`` kills from the host, and it dies with its container.
"""

from __future__ import annotations

import contextlib
import resource
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.abc

from gym_runtime.errors import Failure, observed
from gym_runtime.observability import logs
from gym_runtime.sandboxes.backend import Owned, Resolved
from gym_runtime.sandboxes.engine_fork import FORK_DIR, HOLDER_DIR, EngineForks, copies_at_start, entry, start_copy
from gym_runtime.sandboxes.engine_http import Capture, Engine, EngineError, EngineUnavailable
from gym_runtime.sandboxes.spec import Capabilities, ExecResult, OnOutput

log = logs.get("gym.sandbox")

OWNER, LEASE, POOL, EXPIRES = "gym-runtime.owner", "gym-runtime.lease", "gym-runtime.pool", "gym-runtime.expires"
HOLDER = "gym-runtime.holds-for"  # a fork snapshot's holder (``holder_body``): the pool it holds one for
ORPHAN = "gym-runtime.orphan-after"  # the container ends this many seconds after its last renewal (KEEPER)
RENEW_SIGNAL = "WINCH"  # ignored by default: a renewal before the keeper's trap is set is lost, never fatal
LEASE_GRACE_S = 60.0  # the keeper's hard deadline past the lease's end (the worker removes it at the end itself)
# The container's main process ($1: a window in seconds, $2: a hard deadline in unix seconds): a window
# with no renewal (SIGWINCH sets r) ends it, and so does the deadline. Under bash (where the image has it) it forks
# nothing: a window is a ``read -t`` on its stdin (held open, never written: ``OpenStdin``), the time a builtin, so
# a sandbox holding every pid keeps its keeper. Else under sh, whose ``sleep`` and ``date`` fork: a sleep that
# cannot fork is tried again; but dash exits when it cannot fork, so there such a sandbox can end (docs).
KEEPER_BASH = (
    'r=1; trap "r=1" WINCH; while [ "$r" = 1 ]; do r=0; read -r -t "$1" _; '
    'printf -v t "%(%s)T" -1; [ "$t" -lt "$2" ] || exit 0; done'
)
KEEPER = (
    'if command -v bash >/dev/null 2>&1; then exec bash -c "$3" keeper "$1" "$2"; fi; '
    'r=1; trap "r=1" WINCH; while [ "$r" = 1 ]; do r=0; until sleep "$1"; do :; done; '
    't=$(date +%s) || t=0; [ "${t:-0}" -lt "$2" ] || exit 0; done'
)
WRITABLE = ("/work", "/tmp", "/root")
# the engines' cgroup v1 layout is a writable tmpfs at /sys/fs/cgroup (a sandbox filled 125 MiB of it): an empty
# read-only one instead (what a sandbox would read there, its limits, are the engine's to enforce, not its own)
CGROUP_FS = ("/sys/fs/cgroup", "ro,nosuid,nodev,noexec")
NOFILE = 4096  # open files per process in a sandbox
_NPROC = resource.getrlimit(resource.RLIMIT_NPROC)[1]  # this host's own hard limit (RLIM_INFINITY is -1)
# Podman (4.3) runs its containers under its own RLIMIT_NPROC hard limit, 32768, whatever the host's: a
# container asking more needs CAP_SYS_RESOURCE, which these machines do not grant (the start fails, EPERM)
PODMAN_NPROC = 32768
KEEP_CAPS = ["CHOWN", "DAC_OVERRIDE", "FOWNER", "KILL", "SETGID", "SETUID"]
_WRITE = 'mkdir -p "$(dirname "$1")" && cat > "$1"'


READ_ONLY_HINT = (
    "the sandbox's root file system is read-only: write under /work, /tmp or /root, or give the pool `rootfs: writable`"
)


def _unwrapped(stderr: bytes, program: str) -> bytes:
    """An exec's stderr as the command's own: a program that could not be run is named, not the ``timeout`` that
    wraps every exec (``timeout: failed to run command 'x': No such file or directory``, exit 127)."""
    head = f"timeout: failed to run command '{program}': ".encode()
    if not stderr.startswith(head):
        return stderr
    return f"{program}: ".encode() + stderr[len(head) :]


def keeper_window(orphan_after_s: float) -> int:
    """The keeper's window (whole seconds, for ``sleep``): two windows without a renewal end it at the latest."""
    return max(1, int(orphan_after_s // 2))


def renew_every(orphan_after_s: float) -> float:
    """How often a worker renews what it holds: three times a window, so a late round still lands in each."""
    return keeper_window(orphan_after_s) / 3


class EngineBackend:
    """Containers of one pool on one engine (Docker or Podman's compatible service)."""

    capabilities = Capabilities(
        exec=True, file_transfer=True, images=True, background=True, stream=True, restart=True, fork=True
    )

    def __init__(
        self,
        engine: Engine,
        *,
        name: str,
        pool: str,
        writable: bool = False,
        orphan_after_s: float = 60.0,
        warm_max_s: float = 7200.0,
    ) -> None:
        self.engine = engine
        self.name = name  # docker | podman
        self.pool = pool
        self.writable = writable  # the pool's ``rootfs: writable``: the image's file system, writable and uncapped
        self.orphan_after_s = orphan_after_s  # a container not renewed this long ends by itself (KEEPER)
        self.warm_max_s = warm_max_s  # the hard deadline of a container made with no lease end (a warm one)
        self.forks = EngineForks(engine, pool, (POOL, tuple(p.lstrip("/") for p in WRITABLE)))

    def _window_s(self) -> int:
        return keeper_window(self.orphan_after_s)

    def container_body(
        self, spec: Resolved, *, owner: str, lease: str, expires: float, snapshot: str = ""
    ) -> dict[str, object]:
        mem = spec.memory_mb << 20
        nproc = _NPROC
        if self.name == "podman" and not 0 <= nproc <= PODMAN_NPROC:
            nproc = PODMAN_NPROC
        tmpfs = {} if self.writable else {p: f"rw,nosuid,nodev,size={spec.disk_mb}m,mode=1777" for p in WRITABLE}
        tmpfs[CGROUP_FS[0]] = CGROUP_FS[1]
        main = self._main(expires)
        body: dict[str, object] = {
            "Image": spec.image,
            "Cmd": entry(main, self.forks.copied) if snapshot and copies_at_start(spec) else main,
            "Env": [f"{k}={v}" for k, v in spec.env.items()] + ["HOME=/root"],
            "NetworkDisabled": True,
            "OpenStdin": self.expiring,  # the keeper's stdin: a pipe nobody writes, its ``read -t`` windows
            "Labels": {
                OWNER: owner,
                LEASE: lease,
                POOL: self.pool,
                EXPIRES: f"{expires:.0f}",
                **({ORPHAN: f"{self.orphan_after_s:g}"} if self.expiring else {}),
            },
            "HostConfig": {
                "NetworkMode": "none",
                "Memory": mem,
                "MemorySwap": mem,
                "NanoCpus": int(spec.cpu * 1e9),
                "PidsLimit": spec.pids,
                "ReadonlyRootfs": not self.writable,
                "Tmpfs": tmpfs,
                "CapDrop": ["ALL"],
                "CapAdd": KEEP_CAPS,
                "SecurityOpt": ["no-new-privileges"],
                "Init": True,
                # ended (its keeper's deadline, or killed): gone, nobody removes it. Not a restartable one: an
                # engine before 23.0 may remove it on its restart (moby#43751); ended, a reaper removes it
                "AutoRemove": self.expiring and not spec.restartable,
                # set, not left to the engine: Podman asks for more than many hosts' hard limits allow (the
                # pids limit is the process cap; RLIMIT_NPROC counts a uid's processes host-wide)
                "Ulimits": [
                    {"Name": "nofile", "Soft": NOFILE, "Hard": NOFILE},
                    {"Name": "nproc", "Soft": nproc, "Hard": nproc},
                ],
                "Binds": [],
                # a fork's copy: the snapshot it copies its files from (``engine_fork``), read-only
                "Mounts": [{"Type": "volume", "Source": snapshot, "Target": FORK_DIR, "ReadOnly": True}]
                if snapshot
                else [],
                "Privileged": False,
            },
        }
        if spec.workdir:  # "": the image's own WORKDIR (a writable pool's images keep their work there)
            body["WorkingDir"] = spec.workdir
        return body

    @property
    def expiring(self) -> bool:
        """Whether its containers end by themselves (``KEEPER``): Docker's. Not yet Podman's (untested: a container
        ending by itself on the tests' store set off a state refresh that showed others as ``created``, since found
        to be that store's temporary directory deleted under it (``tests/podman.py``), and AutoRemove raced forced
        removals); its containers are reaped as before."""
        return self.name == "docker"

    def _main(self, expires: float) -> list[str]:
        if not self.expiring:
            return ["sleep", "infinity"]
        return ["sh", "-c", KEEPER, "keeper", str(self._window_s()), f"{self._deadline(expires):.0f}", KEEPER_BASH]

    def _deadline(self, expires: float) -> float:
        """The keeper's hard deadline: past the lease's end (a warm container's: its longest wait and lease)."""
        return expires + LEASE_GRACE_S

    async def renew(self, sid: str) -> bool:
        """Keep a held container alive for another ``orphan_after_s``; False: it is gone."""
        if not self.expiring:
            return True
        try:
            return await self.engine.signal(sid, RENEW_SIGNAL)
        except EngineError as e:
            raise _gone(e, sid) from e

    def holder_body(self, spec: Resolved, volume: str, *, owner: str, until: float) -> dict[str, object]:
        """The container that holds a fork's snapshot (``engine_fork``): it keeps its tmpfs volume mounted (so its
        files) until ``until`` at the latest, and does nothing else; made safe as the pool's containers are."""
        body = self.container_body(spec, owner=owner, lease="", expires=until)
        body["Cmd"] = ["sleep", f"{max(1, until - time.time()):.0f}"]
        body["OpenStdin"] = False
        # not the pool's label: no sandbox, so none of its listings' (the reaper's, a test's count); it ends by
        # itself at ``until`` (Docker's AutoRemove), or goes with its snapshot
        body["Labels"] = {HOLDER: self.pool, OWNER: owner}
        host: dict[str, object] = body["HostConfig"]  # type: ignore[assignment]
        host["Tmpfs"] = dict([CGROUP_FS])
        host["Mounts"] = [{"Type": "volume", "Source": volume, "Target": HOLDER_DIR}]
        host["AutoRemove"] = self.expiring  # ended (its deadline): gone (Podman's: reaped at its label's end)
        return body

    async def create(
        self,
        spec: Resolved,
        *,
        owner: str,
        lease: str,
        expires: float | None = None,
        snapshot: str = "",
        ready: Callable[[], Awaitable[None]] | None = None,
    ) -> str:
        """A running container of ``spec``. ``snapshot``: a fork's copy, the volume it copies from; one that copies
        it as it starts (``engine_fork.entry``) is started once ``ready`` returns (its snapshot whole) and returned
        once its files are copied (``engine_fork.start_copy``); else started at once."""
        expires = time.time() + 3600 if expires is None else expires
        # a warm one (no lease yet) is labelled past any lease it can be given (``warm_max_s``): a reaper that
        # never heard its worker removes it after that, as any container whose lease has ended
        expires = expires or time.time() + self.warm_max_s
        body = self.container_body(spec, owner=owner, lease=lease, expires=expires, snapshot=snapshot)
        try:
            cid = await self.engine.create(body, name=f"gym-{self.pool}-{uuid.uuid4().hex[:12]}")
        except EngineError as e:
            if e.status == 404:
                raise Failure("tool_error", f"sandbox image {spec.image!r} is not in the {self.name} engine") from e
            if (unavailable := _unavailable(e)) is not None:
                raise unavailable from e
            raise Failure("tool_error", f"creating a sandbox failed: {e}", retryable=True) from e
        try:
            if snapshot and copies_at_start(spec):
                await start_copy(self.engine, cid, ready)
            else:
                await self.engine.start(cid)
        except EngineError as e:
            if (unavailable := _unavailable(e)) is not None:
                raise unavailable from e
            await self.engine.remove(cid)
            raise Failure("tool_error", f"starting a sandbox failed: {e}", retryable=True) from e
        except BaseException:  # its snapshot failed, or its copy: no copy is left half made (else the reaper's)
            with anyio.CancelScope(shield=True), contextlib.suppress(EngineError):
                await self.engine.remove(cid)
            raise
        return cid

    async def exec(
        self, sid: str, argv: list[str], *, timeout_s: float, max_output: int, on_output: OnOutput | None = None
    ) -> ExecResult:
        wrapped = ["timeout", "-s", "KILL", f"{timeout_s:g}", *argv]
        try:
            out = await self.engine.exec(
                sid, wrapped, timeout_s=timeout_s + 5, max_output=max_output, on_output=on_output
            )
        except EngineError as e:
            raise _gone(e, sid) from e
        timed_out = out.timed_out or (out.exit_code == 137 and out.duration_s >= timeout_s * 0.98)
        return ExecResult(
            exit_code=None if timed_out else out.exit_code,
            stdout=out.stdout,
            stderr=_unwrapped(out.stderr, argv[0]) if out.exit_code in (126, 127) else out.stderr,
            truncated=out.truncated,
            timed_out=timed_out,
            duration_s=out.duration_s,
        )

    def spawn(self, sid: str, argv: list[str], *, timeout_s: float, max_output: int) -> EngineProcess:
        return EngineProcess(self.engine, sid, ["timeout", "-s", "KILL", f"{timeout_s:.0f}", *argv], max_output)

    async def write(self, sid: str, path: str, data: bytes) -> None:
        # through an exec, not the archive API: that one cannot write into tmpfs mounts
        try:
            out = await self.engine.exec(
                sid, ["sh", "-c", _WRITE, "sh", path], stdin=data, timeout_s=120, max_output=4096
            )
        except EngineError as e:
            raise _gone(e, sid) from e
        if out.exit_code != 0:
            why = out.stderr.decode(errors="replace").strip()
            if not self.writable and "Read-only file system" in why:
                why += f" ({READ_ONLY_HINT})"
            raise Failure("tool_error", f"writing {path} failed: {why}")

    async def read(self, sid: str, path: str, *, max_bytes: int) -> bytes:
        try:
            out = await self.engine.exec(sid, ["cat", "--", path], timeout_s=120, max_output=max_bytes)
        except EngineError as e:
            raise _gone(e, sid) from e
        if out.exit_code != 0:
            raise Failure("tool_error", f"reading {path} failed: {out.stderr.decode(errors='replace').strip()}")
        if out.truncated:
            raise Failure("tool_error", f"{path} is larger than {max_bytes} bytes (the pool's max_output)")
        return out.stdout

    async def cpu_s(self, sid: str) -> float | None:
        return await self.engine.cpu_s(sid)

    async def restart(self, sid: str) -> int:
        """End every process of the sandbox by restarting its container (a new PID namespace; the image's file
        system kept, tmpfs paths emptied), then confirm from the engine that none of those seen before is left.
        Robust where killing from inside is not: nothing in the container (whose binaries a root policy may have
        replaced) takes part, and a fork loop's newest process dies with the namespace. How many it ended."""
        try:
            podman = self.name == "podman"
            before = await self.engine.pids(sid, podman=podman)
            await self.engine.restart(sid)
            after = await self.engine.pids(sid, podman=podman)
        except EngineError as e:
            raise _gone(e, sid) from e
        if not after or before & after:
            left = f"{len(before & after)} of its processes outlived" if after else "it is not running after"
            raise Failure("tool_error", f"sandbox {sid[:12]}: {left} its restart")
        return len(before)

    async def fork(self, sid: str, spec: Resolved, *, owner: str, leases: list[str], expires: float) -> list[str]:
        """Copies of ``sid`` (``engine_fork``), one per lease tag, made as ``spec``."""
        return await self.forks.fork(self, sid, spec, owner=owner, tags=leases, expires=expires)

    async def close(self, sid: str) -> None:
        await self.engine.remove(sid)
        await self.forks.released(sid)

    async def sweep_images(self) -> int:
        """Temporary fork images and snapshots no container uses any more (``EngineForks.sweep``)."""
        return await self.forks.sweep()

    async def image_id(self, sid: str) -> str:
        """The container's ``Image``: the Id of the image it was created from, whatever its name points at now."""
        try:
            return str((await self.engine.inspect(sid)).get("Image") or "")
        except EngineError as e:  # gone already: its row says nothing of it rather than fail the rollout
            log.warning("sandbox.image_unknown", sandbox=sid[:12], error=str(e))
            return ""

    async def list_owned(self) -> list[Owned]:
        out = []
        for c in await self.engine.containers({POOL: self.pool}):
            labels = c.get("Labels") or {}
            out.append(
                Owned(
                    id=c["Id"],
                    owner=labels.get(OWNER, ""),
                    lease=labels.get(LEASE, ""),
                    pool=self.pool,
                    expires=float(labels.get(EXPIRES) or 0),
                    running=self._running(c),
                )
            )
        return out

    def _running(self, c: dict[str, Any]) -> bool:
        """Whether a listed container may still be in use. One created and never started is, for a moment (its
        worker starts it at once); one still not started ``orphan_after_s`` after its creation lost its worker
        between the two calls (SIGKILLed) and has no keeper to end it: ended, so a reaper removes it."""
        state = c.get("State")
        if state == "created" and self.expiring:
            return time.time() - float(c.get("Created") or 0) < self.orphan_after_s
        return state in ("running", "paused", "restarting", "created", None)

    async def aclose(self) -> None:
        try:
            await self.forks.close()  # after its worker removed what it held: the snapshots it made go too
        finally:
            await self.engine.close()


class EngineProcess:
    """A background command: an exec instance read for as long as it runs (``Background``). Its stream is watched
    as an exec's is (``Engine.watched``): a quiet command on a live engine runs on (the engine answers its pings),
    but an engine that stops answering ends the read within ``STALL_S + PING_S`` with ``failure`` set
    (``sandbox_unavailable``), instead of a stream that waits, silent, until the lease ends."""

    def __init__(self, engine: Engine, cid: str, argv: list[str], max_output: int) -> None:
        self.engine, self.cid, self.argv = engine, cid, argv
        self.out = Capture(max_output)
        self.done = anyio.Event()
        self.eid = ""
        self.exit_code: int | None = None
        self.failure: Failure | None = None  # its engine stopped answering while it ran: what its caller is told
        self._started = time.monotonic()
        self._ended: float | None = None

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        running = False

        def started() -> None:
            nonlocal running
            running = True
            task_status.started()

        try:
            self.eid = await self.engine.exec_create(self.cid, self.argv)
            command = self.argv[4] if self.argv[:1] == ["timeout"] and len(self.argv) > 4 else self.argv[0]
            async with self.engine.watched(f"the background process {command!r}"):
                async for stream, chunk in self.engine.exec_stream(self.eid, None, started):
                    self.out.add(stream, chunk)
            self.exit_code = (await self.engine.exec_info(self.eid)).get("ExitCode")
        except EngineError as e:
            if not running:
                raise _gone(e, self.cid) from e
            self.failure = _unavailable(e)
        except Exception:  # its container went (the stream broke): it ended with it, exit code unknown
            if not running:
                raise
        finally:
            self._ended = time.monotonic()
            self.done.set()

    def result(self) -> ExecResult:
        end = self._ended if self._ended is not None else time.monotonic()
        return ExecResult(
            exit_code=self.exit_code,
            stdout=bytes(self.out.kept[1]),
            stderr=bytes(self.out.kept[2]),
            truncated=self.out.truncated,
            duration_s=end - self._started,
        )

    async def kill(self) -> None:
        if self.eid and not self.done.is_set():
            await self.engine.kill_exec(self.eid, group=True)


def _unavailable(e: EngineError) -> Failure | None:
    """A stopped or frozen engine's failure: the runtime's own finding, the pool unavailable (no sandbox at fault)."""
    if not isinstance(e, EngineUnavailable):
        return None
    return observed(Failure("sandbox_unavailable", str(e), retryable=True))


def _gone(e: EngineError, sid: str) -> Failure:
    if (unavailable := _unavailable(e)) is not None:
        return unavailable
    if e.status in (404, 409):  # removed (reaped), or no longer running (e.g. killed with its pids)
        return Failure("tool_error", f"sandbox {sid[:12]} is gone: {e}")
    return Failure("tool_error", f"the engine failed: {e}", retryable=True)
