"""The author's side of the fleet: ``async with ctx.sandbox(image=...) as box`` and ``box.exec(...)``.

Every call travels over the bus: ``create`` to the pool's queue group (whichever worker has room), then
``exec``/``write``/``read``/``close`` to the worker that holds the container, as resource sessions are pinned. A
rollout's sandboxes share one lease (a random secret, and its deadline): every call carries it and names this
connection's caller, and the worker serves a sandbox to nobody else (``sandboxes.leases``: an id alone, as a
checkpoint names it, is no key). ``Sandboxes.close_all`` ends them when the rollout ends, whatever way. While it
holds any, the holder says it is alive to their workers every ``renew_s`` (``renew``); one that dies leaves them
under their lease for the pool's ``lease_grace_s``, where a resumed attempt of the same rollout reattaches to them
(``Sandboxes.reattach``: same containers, files intact), then to the pool's reaper. No author touches Docker or
NATS. A sandbox's CPU time comes back with its close (``cpu_s``, where its backend counts it): an agent's rollout
closes its lease before its row is built, so the row has it all.

Output as it comes: ``box.exec(cmd, on_output=cb)`` calls ``cb("stdout" | "stderr", data)`` (a function or a
coroutine function) with each part while the command runs, in order, then returns the ``ExecResult`` as
without it; the parts are what the worker kept (each stream capped by the pool's ``max_output``), so they are
bounded too. Background processes: ``proc = await box.spawn(cmd)``, then ``proc.poll()``, ``proc.wait()``,
``proc.kill()``; they die with the sandbox.

Admission: a pool with no room (every worker at its capacity or the pool at its ``max_live``) takes no
create: nobody answers it (full workers are not subscribed) or a worker answers ``full``. If a worker of
the pool answers ``present``, the pool is full rather than gone, and the create waits for a lease,
asking again with a jittered backoff. The whole acquisition (waiting for a lease, then the create) is
summed in ``waited_s``; ``on_acquire`` pauses the holder's clock for it (an agent's rollout does not
count it against its ``timeout_s``: its clock starts again once it holds the sandbox).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import random
import shlex
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Literal, Unpack

import anyio
import msgspec

from gym_runtime.errors import Failure, observed
from gym_runtime.messages import (
    COMMAND_HEAD,
    HeldSandboxes,
    SandboxCall,
    SandboxCommand,
    SandboxHandle,
    SandboxReply,
    SandboxSpec,
)
from gym_runtime.sandboxes.leases import new_lease
from gym_runtime.sandboxes.spec import ExecResult, SandboxAsk
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.rpc import NoResponders
from gym_runtime.transport.subjects import Subjects

CREATE_TIMEOUT_S = 300.0  # a cold create on a loaded engine
OP_SLACK_S = 60.0  # beyond an exec's own timeout: the engine's start and teardown
ABSENT_BACKOFF_S = (0.1, 0.2, 0.5, 1.0, 2.0)  # waits between creates while the pool has no worker
FULL_BACKOFF_S = (0.02, 0.05, 0.1, 0.2, 0.4)  # waits (jittered) between creates while the pool is full
PRESENT_TIMEOUT_S = 5.0
STREAMS = {1: "stdout", 2: "stderr"}
# an author's ``on_output``: called with "stdout" or "stderr" and a part of that stream, as it is produced
OnOutput = Callable[[str, bytes], Awaitable[None] | None]
LEASE_SLACK_S = 60.0  # a lease asked after a wait ends this much later still (the create's own time)
CLOSE_PATIENCE_S = 60.0  # a close lost to a reconnect (worker_lost) is asked again this long
CLOSE_ABSENT_S = 5.0  # a close nobody answers is asked again this long (its worker subscribing again)
CLOSE_BACKOFF_S = (0.1, 0.25, 0.5, 1.0, 2.0)  # waits between those asks
ATTACH_TIMEOUT_S = 30.0  # a resumed attempt's ask to take up a sandbox its rollout held


class Sandbox:
    """One sandbox (a container on one sandbox worker). Close it, or let its rollout's end do so."""

    def __init__(self, owner: Sandboxes, sid: str, address: str, spec: SandboxSpec, by: str = "") -> None:
        self._owner, self.id, self._address, self.spec = owner, sid, address, spec
        self._by = by  # its worker's process, as it said (a call it leaves silent names it before any keepalive)
        self.closed = False

    def handle(self) -> SandboxHandle:
        """What a checkpoint keeps of it (a resumed attempt reattaches by it)."""
        return SandboxHandle(pool=self._owner.pool, sandbox=self.id, address=self._address, spec=self.spec)

    async def _op(
        self, call: SandboxCall, timeout: float, on_output: Callable[[tuple[int, bytes]], None] | None = None
    ) -> SandboxReply:
        """One operation on the worker that holds this sandbox, in a span of its own (the rollout's child)."""
        if self.closed:
            raise Failure("tool_error", f"sandbox {self.id[:12]} is closed")
        bus = self._owner._bus
        with bus.telemetry.span(f"sandbox.{call.op}", attributes=self._attributes()) as span:
            reply: SandboxReply = await bus.request(
                Subjects.sandbox_op(self._address, call.op, bus.caller),
                call,
                timeout=timeout,
                op=f"sandbox.{call.op}",
                on_output=None if on_output is None else lambda stream, data: on_output((stream, data)),
                by=self._by,
            )
            if call.op == "exec":
                span.set_attributes(
                    {
                        "gym.sandbox.exit_code": -1 if reply.exit_code is None else reply.exit_code,
                        "gym.sandbox.timed_out": reply.timed_out,
                        "gym.sandbox.truncated": reply.truncated,
                    }
                )
            elif call.op in ("write", "read"):
                span.set_attribute("gym.sandbox.bytes", len(call.data if call.op == "write" else reply.data))
        return reply

    def _attributes(self) -> dict[str, Any]:
        return {"gym.sandbox.pool": self._owner.pool, "gym.sandbox.id": self.id[:12]}

    async def exec(
        self,
        cmd: str | list[str],
        *,
        timeout_s: float | None = None,
        on_output: OnOutput | None = None,
        id: str = "",
    ) -> ExecResult:
        """Run ``cmd`` (a string: through ``sh -c``) in ``/work``; stdout and stderr each capped by the pool's
        ``max_output``; past ``timeout_s`` (default: the sandbox's) it is killed (``exit_code`` None).
        ``on_output``: given each part of the output as the command produces it (see the module's doc).
        ``id``: a tool call's id, the same on every attempt of its turn (``Trajectory.call_id``): the sandbox runs
        it once, and answers it again with that run's result (a replayed one streams nothing)."""
        call = SandboxCall(
            op="exec",
            sandbox=self.id,
            lease=self._owner.lease,
            argv=_argv(cmd),
            timeout_s=timeout_s,
            stream=bool(on_output),
            id=id,
        )
        timeout = (timeout_s or self._owner.exec_timeout_s) + OP_SLACK_S
        started = time.monotonic()
        r = await (self._op(call, timeout) if on_output is None else self._streamed(call, timeout, on_output))
        self._owner._exec_s += max(0.0, r.duration_s) if math.isfinite(r.duration_s) else 0.0
        self._owner.commands.append(_command(call.argv, r, time.monotonic() - started))
        return _result(r)

    async def _streamed(self, call: SandboxCall, timeout: float, on_output: OnOutput) -> SandboxReply:
        """An exec whose parts are queued as they arrive and handed on here: a slow callback never holds up
        the bus (the queue is bounded by the worker's cap)."""
        send, parts = anyio.create_memory_object_stream[tuple[int, bytes]](math.inf)
        failed: list[Exception] = []

        async def hand_on() -> None:
            async with parts:
                async for stream, data in parts:
                    try:
                        out = on_output(STREAMS[stream], data)
                        if inspect.isawaitable(out):
                            await out
                    except Exception as e:  # the author's error ends the call: raised as it is, not grouped
                        failed.append(e)
                        tg.cancel_scope.cancel()
                        return

        def put(part: tuple[int, bytes]) -> None:
            with contextlib.suppress(anyio.BrokenResourceError):  # the callback failed: the call is ending
                send.send_nowait(part)

        async with anyio.create_task_group() as tg:
            tg.start_soon(hand_on)
            with send:  # the parts all came before the reply: closing it ends hand_on after the last
                r = await self._op(call, timeout, on_output=put)
        if failed:
            raise failed[0]
        return r

    async def spawn(self, cmd: str | list[str]) -> Process:
        """Start ``cmd`` in the background (a server, a long build): it runs until it ends, is killed, or the
        sandbox closes. Its stdout and stderr are each capped by the pool's ``max_output``."""
        call = SandboxCall(op="spawn", sandbox=self.id, lease=self._owner.lease, argv=_argv(cmd))
        r = await self._op(call, CREATE_TIMEOUT_S)
        return Process(self, r.process)

    async def write(self, path: str, data: bytes | str) -> None:
        """Write a file (a relative path: under ``/work``), its directories made as needed."""
        body = data.encode() if isinstance(data, str) else bytes(data)
        call = SandboxCall(op="write", sandbox=self.id, lease=self._owner.lease, path=path, data=body)
        await self._op(call, CREATE_TIMEOUT_S)

    async def read(self, path: str) -> bytes:
        """A file's bytes (at most the pool's ``max_output``: a larger file is an error)."""
        call = SandboxCall(op="read", sandbox=self.id, lease=self._owner.lease, path=path)
        return (await self._op(call, CREATE_TIMEOUT_S)).data

    async def restart(self) -> None:
        """End every process in the sandbox, whatever started it (``spawn``, a command's ``setsid`` or double
        fork, a fork loop), and keep its files: the image's file system as it was left (a ``rootfs: writable``
        pool's); a read-only pool's tmpfs paths (``/work``, ``/tmp``, ``/root``) start empty again. What a verify
        in the policy's own sandbox does first, so nothing the policy started is left to touch it."""
        await self._op(SandboxCall(op="restart", sandbox=self.id, lease=self._owner.lease), CREATE_TIMEOUT_S)

    async def fork(
        self, n: int = 1, *, into: list[Sandboxes] | None = None, park: bool = False, batch: str = ""
    ) -> list[Sandbox]:
        """``n`` new sandboxes with this one's files as they are now (what each backend copies: docs/sandboxes.md),
        each under its own lease: ``into``'s (one ``Sandboxes`` per copy, of this pool and bus: a rollout's, whose
        end closes it), else a fresh one each (the caller closes them). A write in one is never seen by another,
        nor by this one. They count against the pool's quota: past it, ``sandbox_unavailable`` at once.
        ``park``: the copies are kept unused until their lease's deadline (``into``'s), then removed by their
        worker (a branch point's copy, ``sandboxes.kept``): their holder need not renew or close them; ``batch``:
        theirs go when it is purged."""
        owner = self._owner
        holders = into if into is not None else [owner.sibling() for _ in range(n)]
        if len(holders) != n or not n:
            raise ValueError(f"fork({n}) needs n >= 1 and one Sandboxes per copy in into (got {len(holders)})")
        if any(h.pool != owner.pool or h._bus is not owner._bus for h in holders):
            raise ValueError("fork: every Sandboxes in into must be of this sandbox's pool and bus")
        if park:  # kept until the copies' own deadline, not the parent's
            expires = max(h.deadline for h in holders)
        else:
            expires = owner.deadline + LEASE_SLACK_S if owner.deadline else 0.0
        call = SandboxCall(
            op="fork",
            sandbox=self.id,
            lease=owner.lease,
            leases=[h.lease for h in holders],
            expires=expires,
            park=park,
            batch=batch if park else "",
        )
        reply = await self._op(call, CREATE_TIMEOUT_S)
        boxes = []
        for holder, sid in zip(holders, reply.forked, strict=True):
            box = Sandbox(holder, sid, reply.address, self.spec, reply.by)
            holder._hold(box, reply)
            boxes.append(box)
        return boxes

    async def close(self) -> None:
        if self.closed:
            return
        copying = self._owner.copying
        if copying is not None and not copying.done():  # its copy for branching is being made: not closed under it
            await asyncio.wait([copying])
        self.closed = True
        self._owner._forget(self.id)
        with self._owner._bus.telemetry.span("sandbox.close", attributes=self._attributes()):
            reply = await self._closing()
        if reply is not None and reply.cpu_s is not None:  # what the sandbox used, read by its worker as it removed it
            self._owner._cpu_s += max(0.0, reply.cpu_s) if math.isfinite(reply.cpu_s) else 0.0

    async def _closing(self) -> SandboxReply | None:
        """The close's answer, asked again while a reconnect loses it: after a server restart mid-rollout, the
        rollouts given back close their sandboxes as soon as this side is connected again, often before the
        sandbox's worker has subscribed again (no responders: seen in tests/e2e/test_lease_release.py), and a
        close sent while the server was down fails at the reconnect (``worker_lost``). So a given-back rollout's
        lease ends within seconds, not at the pool's ``idle_ttl_s``. None: no answer (its worker is gone: the
        reaper and the idle timeout remove what is left)."""
        bus, call = self._owner._bus, SandboxCall(op="close", sandbox=self.id, lease=self._owner.lease)
        started, absent, tries = time.monotonic(), 0.0, 0
        while True:
            try:
                reply: SandboxReply = await bus.request(
                    Subjects.sandbox_op(self._address, "close", bus.caller), call, timeout=60, op="sandbox.close"
                )
                return reply
            except NoResponders:  # its worker is gone, or not subscribed again yet after a reconnect
                absent = absent or time.monotonic()
                if time.monotonic() - absent > CLOSE_ABSENT_S:
                    return None
            except Failure as e:  # lost to a reconnect (the bus down meanwhile): asked again, for a while
                if e.info.error_class != "worker_lost" or time.monotonic() - started > CLOSE_PATIENCE_S:
                    return None
                absent = 0.0
            except Exception:  # the bus closing: the pool's idle timeout and reaper remove what is left
                return None
            await anyio.sleep(CLOSE_BACKOFF_S[min(tries, len(CLOSE_BACKOFF_S) - 1)])
            tries += 1

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if not self._owner.kept_for_retry(exc[1]):
            await self.close()


class Process:
    """A command running in the background of a sandbox (``box.spawn``)."""

    def __init__(self, box: Sandbox, pid: str) -> None:
        self.box, self.id = box, pid

    async def _ask(self, op: Literal["poll", "wait", "kill"], timeout_s: float | None = None) -> ExecResult:
        call = SandboxCall(
            op=op, sandbox=self.box.id, lease=self.box._owner.lease, process=self.id, timeout_s=timeout_s
        )
        timeout = (timeout_s or self.box._owner.exec_timeout_s) + OP_SLACK_S
        return _result(await self.box._op(call, timeout))

    async def poll(self) -> ExecResult:
        """Its output so far; ``exit_code`` None while it runs."""
        return await self._ask("poll")

    async def wait(self, *, timeout_s: float | None = None) -> ExecResult:
        """Its end, waited for at most ``timeout_s`` (default: the sandbox's; the pool's ``timeout_s`` caps
        it). Still running then: ``timed_out`` True and ``exit_code`` None, and it runs on (``kill`` it)."""
        return await self._ask("wait", timeout_s)

    async def kill(self) -> ExecResult:
        """Kill it and every process it started; its end (``exit_code`` 137: killed)."""
        return await self._ask("kill")


def _argv(cmd: str | list[str]) -> list[str]:
    return ["sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)


def _command(argv: list[str], r: SandboxReply, took_s: float) -> SandboxCommand:
    """What the attempt's record keeps of a command: ``sh -c CMD`` as CMD, its time (the backend's, else the
    call's as seen here), the output's size and head."""
    shown = argv[2] if len(argv) == 3 and argv[:2] == ["sh", "-c"] else shlex.join(argv)
    head = (r.stdout[:COMMAND_HEAD] + r.stderr[: max(0, COMMAND_HEAD - len(r.stdout))]).decode("utf-8", "replace")
    return SandboxCommand(
        command=shown,
        exit_code=r.exit_code,
        ms=round(1000 * (r.duration_s or took_s)),
        output_bytes=len(r.stdout) + len(r.stderr),
        head=head[:COMMAND_HEAD],
    )


def _result(r: SandboxReply) -> ExecResult:
    """An exec's reply as its author sees it (``SandboxReply.of_exec`` the other way: ``EXEC_FIELDS``)."""
    return ExecResult(**{f: getattr(r, f) for f in ExecResult.__struct_fields__})


class _Opening:
    """``async with sandboxes.sandbox(...) as box`` (or ``box = await sandboxes.sandbox(...)``)."""

    def __init__(self, owner: Sandboxes, spec: SandboxSpec) -> None:
        self._owner, self._spec = owner, spec
        self._box: Any = None

    def __await__(self) -> Any:
        return self._owner.create(self._spec).__await__()

    async def __aenter__(self) -> Sandbox:
        self._box = await self._owner.create(self._spec)
        return self._box

    async def __aexit__(self, *exc: object) -> None:
        if not self._owner.kept_for_retry(exc[1]):
            await self._box.close()


class _Waiting:
    """One acquisition's wait for a full pool: a lease released anywhere in it (a worker's count of ended leases
    changed) starts the wait again; none for the pool's ``lease_wait_s`` ends it as ``sandbox_unavailable`` (a
    pool whose workers are stuck, or whose quota believes peers that are not there)."""

    __slots__ = ("pool", "since", "released")

    def __init__(self, pool: str) -> None:
        self.pool = pool
        self.since = time.monotonic()
        self.released: dict[str, int] = {}

    def saw(self, full: SandboxReply) -> None:
        now = time.monotonic()
        if self.released.setdefault(full.address, full.released) != full.released:
            self.released[full.address] = full.released
            self.since = now
        if full.lease_wait_s and now - self.since > full.lease_wait_s:
            raise observed(  # the runtime's finding: environment code that passes it on does not make it its own
                Failure(
                    "sandbox_unavailable",
                    f"sandbox pool {self.pool!r} released no lease for lease_wait_s={full.lease_wait_s:g}: its "
                    "workers are full and none of their sandboxes ended (see `gym-runtime status`)",
                )
            )


class Sandboxes:
    """The sandboxes of one lease (a rollout, or an environment's session) in one pool. ``lease``: the secret every
    call proves (``sandboxes.leases``); None, a fresh one, drawn when first read (a rollout that opens no sandbox
    draws none), ``bound`` said before it (a resumed attempt's is the one its checkpoint kept)."""

    def __init__(
        self,
        bus: Bus | None,
        pool: str,
        *,
        lease: str | None = None,
        bound: str = "",
        deadline: float = 0.0,
        where: str = "",
        exec_timeout_s: float = 600.0,
        absent_grace_s: float = 30.0,
    ) -> None:
        self._bus: Any = bus
        self.pool = pool
        self._lease = lease  # a resumed attempt's: the one its checkpoint kept; None: drawn when first read
        self._bound = bound
        self.deadline = deadline  # unix time the lease ends (0: the pool's max_lease_s)
        self.where = where  # the config key that names the pool (for the error when there is none)
        self.rollout = ""  # the rollout key it serves, where its holder knows it (a branch point's copies: their batch)
        self.copying: asyncio.Future[Any] | None = None  # copies of its sandboxes being made (``sandboxes.kept``)
        self.exec_timeout_s = exec_timeout_s
        self.absent_grace_s = absent_grace_s
        self._open: dict[str, Sandbox] = {}
        # what the lease used, as the sandbox workers answered it: read-only to the code that holds the lease
        # (``asked``, ``exec_s``, ``cpu_s``, ``images``, ``image_ids``), since a row's cost and provenance come from it
        self._asked = 0  # sandboxes created for this lease
        self.waited_s = 0.0  # summed time from asking for a sandbox to holding it (a lease's wait + the create)
        self._exec_s = 0.0  # summed wall time of its execs (the rollout's cost)
        self._cpu_s = 0.0  # summed CPU time of its closed sandboxes, where their backend counts it (the cost too)
        self._images: list[str] = []  # the image each sandbox was asked for ("": the pool's default; provenance)
        self._image_ids: list[str] = []  # beside each, the content id of the image it ran ("": the backend has none)
        self.commands: list[SandboxCommand] = []  # each exec, in order (the attempt's record: RolloutResult.commands)
        # called with None when an acquisition starts, then with its seconds when it ends (however it ends)
        self.on_acquire: Callable[[float | None], None] | None = None
        # the holder's renewals (``renew``) while it holds any sandbox: every ``renew_s``, as its workers asked
        self.renew_s = 0.0
        self._renewing: asyncio.Task[None] | None = None
        # a resumed attempt's: the sandboxes its rollout held at the checkpoint (``take_up``), whether they were all
        # reattached (``reattach``: None, not asked yet), and those not yet handed to a create that asks again
        self._resumable: list[SandboxHandle] | None = None
        self._reattached: bool | None = None
        self._reattaching: asyncio.Lock | None = None
        self._adoptable: list[Sandbox] = []
        # a branch's: the copies kept at its branch point, forked into this lease at its first create (``branch_from``)
        self._kept: HeldSandboxes | None = None
        # a rollout that writes checkpoints: a sandbox whose ``async with`` a retryable failure leaves stays open for
        # the worker to end or leave to the next attempt (``let_go``), which resumes from the checkpoint
        self.defer_close = False

    def sibling(self) -> Sandboxes:
        """A new lease in the same pool, with this one's deadline and limits (a fork's copy's, by default)."""
        return Sandboxes(
            self._bus,
            self.pool,
            deadline=self.deadline,
            where=self.where,
            exec_timeout_s=self.exec_timeout_s,
            absent_grace_s=self.absent_grace_s,
        )

    @property
    def lease(self) -> str:
        """The secret every operation proves: random (``new_lease``), ``bound`` and a colon before it where one was
        given, drawn once, on first use."""
        if self._lease is None:
            self._lease = f"{self._bound}:{new_lease()}" if self._bound else new_lease()
        return self._lease

    @lease.setter
    def lease(self, lease: str) -> None:
        self._lease = lease

    @property
    def bound(self) -> str:
        """What the lease is bound to (said before its secret), "" for none."""
        return self._bound

    @property
    def asked(self) -> int:
        return self._asked

    @property
    def exec_s(self) -> float:
        return self._exec_s

    @property
    def cpu_s(self) -> float:
        return self._cpu_s

    @property
    def images(self) -> tuple[str, ...]:
        return tuple(self._images)

    @property
    def image_ids(self) -> tuple[str, ...]:
        return tuple(self._image_ids)

    def sandbox(self, image: str | None = None, **ask: Unpack[SandboxAsk]) -> _Opening:
        """A sandbox of the pool (``async with``, or awaited); ``restartable``: ``restart`` may be asked of it."""
        unknown = sorted(ask.keys() - SandboxAsk.__annotations__.keys())
        if unknown:  # what a keyword the signature lacked raised: a SandboxSpec field no author may set (network)
            raise TypeError(f"sandbox() got an unexpected keyword argument {unknown[0]!r}")
        env = ask.pop("env", None) or {}
        spec = msgspec.structs.replace(SandboxSpec(image=image, env=env), **ask)
        return _Opening(self, spec)

    async def create(self, spec: SandboxSpec) -> Sandbox:
        if not self.pool or self._bus is None:
            where = self.where or "the entry"
            raise Failure("tool_error", f"no sandbox pool: set {where}.sandbox to a sandboxes entry")
        if self._resumable is not None:
            await self.reattach()
        if self._kept is not None:
            kept, self._kept = self._kept, None
            await self.fork_kept(kept)
        adopted = next((b for b in self._adoptable if b.spec == spec), None)
        if adopted is not None:  # the container this rollout held before its worker died, files and all
            self._adoptable.remove(adopted)
            return adopted
        tel = self._bus.telemetry
        attrs = {"gym.sandbox.pool": self.pool, "gym.sandbox.image": spec.image or ""}
        with tel.span("sandbox.acquire", attributes=attrs) as span:  # the wait for a lease and the create
            if self.on_acquire is not None:
                self.on_acquire(None)
            started = time.monotonic()
            try:
                reply = await self._acquire(spec, started)
            finally:
                took = time.monotonic() - started
                self.waited_s += took
                if self.deadline:  # the lease ends that much later too (acquiring is not the holder's time)
                    self.deadline += took
                if self.on_acquire is not None:
                    self.on_acquire(took)
            span.set_attributes({"gym.sandbox.id": reply.sandbox[:12], "gym.sandbox.warm": reply.warm})
            span.set_attribute("gym.sandbox.wait_s", round(took, 6))
        box = Sandbox(self, reply.sandbox, reply.address, spec, reply.by)
        self._hold(box, reply)
        return box

    def _hold(self, box: Sandbox, reply: SandboxReply) -> None:
        """``box`` is this lease's now (made, or reattached): counted, and renewed while held."""
        self._asked += 1
        ran = (box.spec.image or "", reply.image)
        if ran not in zip(self._images, self._image_ids, strict=True):
            self._images.append(ran[0])
            self._image_ids.append(ran[1])
        self._open[box.id] = box
        if box.spec.timeout_s:
            self.exec_timeout_s = box.spec.timeout_s
        if reply.renew_s > 0:
            self.renew_s = reply.renew_s if not self.renew_s else min(self.renew_s, reply.renew_s)
            if self._renewing is None:
                self._renewing = asyncio.ensure_future(self._renew())

    def _forget(self, sid: str) -> None:
        """``sid`` is closed: no longer held, renewed or handed to a create."""
        box = self._open.pop(sid, None)
        if box in self._adoptable:
            self._adoptable.remove(box)
        if not self._open and self._renewing is not None:
            self._renewing.cancel()
            self._renewing = None

    async def _renew(self) -> None:
        """Say this holder is alive to the workers of its sandboxes (one publish each, every ``renew_s``): the
        pool keeps a sandbox whose holder fell silent only for its ``lease_grace_s``."""
        while self._open:
            await asyncio.sleep(self.renew_s)
            for box in list(self._open.values()):
                call = SandboxCall(op="renew", sandbox=box.id, lease=self.lease)
                try:
                    await self._bus.publish(Subjects.sandbox_op(box._address, "renew", self._bus.caller), call)
                except Exception:  # noqa: BLE001 - disconnected meanwhile: the next round says it again
                    pass

    def kept_for_retry(self, exc: object) -> bool:
        """Whether a sandbox's ``async with`` left by ``exc`` keeps it open (``defer_close``): a retryable failure
        of a rollout that writes checkpoints; its worker ends the lease, or leaves it to the next attempt."""
        return self.defer_close and isinstance(exc, Failure) and exc.info.retryable

    def let_go(self) -> None:
        """The attempt ends without ending its lease (given back for another attempt, which resumes from its
        checkpoint): no more renewals, so the pool keeps its sandboxes for ``lease_grace_s``, for that attempt
        to reattach to, then removes them."""
        if self._renewing is not None:
            self._renewing.cancel()
            self._renewing = None
        self._open.clear()
        self._adoptable = []

    def handles(self) -> list[SandboxHandle]:
        """The sandboxes of this lease still open, as a checkpoint keeps them."""
        return [box.handle() for box in self._open.values()] if self._open else []

    def take_up(self, handles: list[SandboxHandle], lease: str | None = None) -> None:
        """A resumed attempt: the sandboxes its rollout held at its checkpoint, reattached at its first create or
        its ``reattach``, whichever comes first, under ``lease`` (the one the checkpoint kept; None: this one's)."""
        if self._reattached is None and self._resumable is None:
            self._resumable = [h for h in handles if h.pool == self.pool]
            if lease:
                self.lease = lease

    def branch_from(self, kept: HeldSandboxes) -> None:
        """A branch: the copies its rollout's parent kept at the branch point (``sandboxes.kept``), forked into this
        lease at its first create (``fork_kept``)."""
        self._kept = kept

    async def fork_kept(self, kept: HeldSandboxes) -> None:
        """A branch's own sandboxes: a fork of each copy ``kept`` at its branch point (proving their lease) into this
        lease, each handed to the first create that asks for its spec (as reattached ones are). A pool with no room
        for them is ``sandbox_unavailable`` at once (never waited on); a copy gone (its keep ended) is
        ``invalid_task``."""
        parked = Sandboxes(self._bus, self.pool, lease=kept.lease, where=self.where)
        forked: list[Sandbox] = []
        for h in kept.sandboxes:
            if h.pool != self.pool:
                continue  # not this lease's pool: nothing here can hold it
            try:
                forked += await Sandbox(parked, h.sandbox, h.address, h.spec).fork(1, into=[self])
            except Failure as e:
                if e.info.error_class == "sandbox_unavailable":
                    raise
                raise Failure(
                    "invalid_task",
                    f"branch: the copy of sandbox {h.sandbox[:12]} kept at the branch point cannot be forked "
                    f"({e.info.message}): it is kept keep_checkpoints_s from its turn, at most its pool's max_lease_s",
                ) from None
        self.adopt(forked)

    def adopt(self, boxes: list[Sandbox]) -> None:
        """``boxes`` (this lease's already, e.g. forks of a task's template) are handed to the first creates that
        ask for their specs, as reattached ones are: an environment that opens its sandbox in ``restore`` or
        later finds its files there."""
        self._adoptable.extend(boxes)

    async def reattach(self) -> bool:
        """Take up every sandbox ``take_up`` named, at the worker that holds it under this lease (``attach``): each
        is handed to the first create that asks for its spec again, with its files. All or none: where one is gone
        (its worker died, or ``lease_grace_s`` passed), those taken up are closed and False is returned (the
        rollout starts over, in fresh ones)."""
        if self._reattached is None:
            if self._reattaching is None:
                self._reattaching = asyncio.Lock()
            async with self._reattaching:
                if self._reattached is None:
                    handles, self._resumable = self._resumable or [], None
                    self._reattached = await self._attach_all(handles)
        return self._reattached

    async def _attach_all(self, handles: list[SandboxHandle]) -> bool:
        expires = self.deadline + LEASE_SLACK_S if self.deadline else 0.0
        boxes: list[Sandbox] = []
        for h in handles:
            call = SandboxCall(op="attach", sandbox=h.sandbox, lease=self.lease, expires=expires)
            try:
                reply: SandboxReply = await self._bus.request(
                    Subjects.sandbox_op(h.address, "attach", self._bus.caller),
                    call,
                    timeout=ATTACH_TIMEOUT_S,
                    op="sandbox.attach",
                )
            except Exception:  # noqa: BLE001 - its worker is gone, or no longer holds it: none is reattached
                for box in boxes:
                    await box.close()
                return False
            box = Sandbox(self, h.sandbox, h.address, h.spec, reply.by)
            self._hold(box, reply)
            boxes.append(box)
        self._adoptable = boxes
        return True

    async def drop_reattached(self) -> None:
        """The rollout starts over after all: the sandboxes reattached and not handed out yet are closed (a
        create makes fresh ones), and none is reattached later."""
        self._resumable, self._reattached = None, bool(self._reattached)
        for box in list(self._adoptable):
            await box.close()

    async def _acquire(self, spec: SandboxSpec, started: float) -> SandboxReply:
        """A create that some worker took; a full pool is waited on (until it releases no lease for its
        ``lease_wait_s``: ``_Waiting``), an absent one for ``absent_grace_s``."""
        subjects = self._bus.subjects
        give_up, waits, fulls = time.monotonic() + self.absent_grace_s, 0, 0
        waiting = _Waiting(self.pool)
        key = uuid.uuid4().hex  # each try of this create names it: a worker that made it answers with that one
        while True:  # a pool restarting has no worker for a moment: wait for one, as a session's seed does
            expires = self.deadline + (time.monotonic() - started) + LEASE_SLACK_S if self.deadline else 0.0
            call = SandboxCall(op="create", spec=spec, lease=self.lease, expires=expires, key=key, renews=True)
            try:
                reply: SandboxReply = await self._bus.request(
                    subjects.sandbox_create(self.pool, self._bus.caller),
                    call,
                    timeout=CREATE_TIMEOUT_S,
                    op="sandbox.create",
                )
                if not reply.full:
                    return reply
                waiting.saw(reply)
            except NoResponders:
                present = await self._present()
                if present is None:
                    delay = ABSENT_BACKOFF_S[min(waits, len(ABSENT_BACKOFF_S) - 1)]
                    if time.monotonic() + delay > give_up:
                        raise
                    waits += 1
                    await anyio.sleep(delay)
                    continue
                if present.full:
                    waiting.saw(present)
            except Failure as e:
                # the create was lost (a worker closed its gate with it in flight, or died creating): ask again
                if e.info.error_class != "worker_lost":
                    raise
                continue
            # the pool is there and full: wait for a lease (jittered, so waiters do not ask in step)
            delay = FULL_BACKOFF_S[min(fulls, len(FULL_BACKOFF_S) - 1)] * random.uniform(0.5, 1.5)
            fulls += 1
            give_up = time.monotonic() + self.absent_grace_s  # a full pool is not an absent one
            await anyio.sleep(delay)

    async def _present(self) -> SandboxReply | None:
        """A worker's answer that the pool has one (full or not); None: no worker answered."""
        try:
            reply: SandboxReply = await self._bus.request(
                self._bus.subjects.sandbox_present(self.pool),
                SandboxCall(op="present"),
                timeout=PRESENT_TIMEOUT_S,
                op="sandbox.present",
            )
        except Exception:  # no responders, or no answer in time: no worker to wait for
            return None
        return reply

    def held(self) -> list[Sandbox]:
        """The sandboxes of this lease still open, oldest first."""
        return list(self._open.values())

    async def close_all(self) -> None:
        """End the lease: remove every sandbox still open (the rollout ended, whichever way), at once: a close
        that waits for its worker (``Sandbox._closing``) holds up no other."""
        boxes = list(self._open.values())
        if len(boxes) <= 1:  # most rollouts hold none or one: no task group (one is ~1% of a rollout's instructions)
            if boxes:
                await boxes[0].close()
            return
        async with anyio.create_task_group() as tg:
            for box in boxes:
                tg.start_soon(box.close)

    @staticmethod
    def deadline_in(seconds: float) -> float:
        return time.time() + max(0.0, seconds)
