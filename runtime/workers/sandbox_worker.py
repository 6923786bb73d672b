"""Hosts a pool's sandboxes on the bus: the fourth worker role (``gym-runtime start --only sandboxes.NAME``).

``{ns}.sbx.{pool}.create.{caller}`` (queue group) starts a container here and answers with this worker's address;
``{address}.{op}.{caller}`` (exec, write, read, close, ...) reach it, so a sandbox is pinned to the worker that
holds it, as a resource session is. Every operation proves the sandbox's lease and comes from the caller that
created it (the caller is in the subject, which a secured server checks; ``sandboxes.leases``); anything else is
answered as an id nobody holds is, so an id read from a checkpoint is no key to the sandbox. If this worker dies,
calls to its address get "no responders" at once (the rollout fails retryably and is redelivered with fresh
sandboxes) and its containers are reaped by the pool's other or next worker (``sandboxes.reaper``). A sandbox's
lease ends when its holder closes it, at the lease's end, after ``idle_ttl_s`` unused, or ``lease_grace_s`` after
its holder fell silent: a holder says it is alive every ``renew_s`` (``renew``), so one SIGKILLed leaves its
sandboxes for that grace, in which a resumed attempt of its rollout reattaches to them by their lease (``attach``),
files and all. An exec carrying an id (``SandboxCall.id``: a rollout's tool call, the same on every attempt of its
turn) is run once per sandbox.

Scheduling (docs/sandboxes.md, "Scheduling"): a worker is subscribed to the create subject only while it
has room (placement by free capacity: a full worker takes no create); its room is ``capacity`` and its
share of the pool's ``max_live``, warm containers included. A create that finds no room anywhere is
answered ``full`` or by no one, and the author's side waits for a lease (``sandboxes.client``).
``warm`` idle containers of the default spec (and ``warm_images`` of other images) are kept ready; a create
that matches one takes it (used once, removed at its end) and the pool refills in the background.

Background processes (``spawn``) are read here for as long as they run, at most ``MAX_PROCESSES`` per
sandbox, each output capped as an exec's is; they die with their sandbox. A streamed exec's output goes to its
caller as it comes (``sandboxes.forward``).
"""

from __future__ import annotations

import time
import uuid
from contextlib import AbstractContextManager, ExitStack
from typing import Any

import anyio
import msgspec
from opentelemetry import trace
from opentelemetry.trace import Span

from gym_runtime.config import SandboxConfig
from gym_runtime.errors import ConfigError, Failure, observed
from gym_runtime.messages import SandboxCall, SandboxReply, SandboxSpec
from gym_runtime.observability import logs
from gym_runtime.sandboxes.backend import Backend, Background, Resolved, unsupported
from gym_runtime.sandboxes.daytona import DaytonaBackend
from gym_runtime.sandboxes.engine_api import EngineBackend, renew_every
from gym_runtime.sandboxes.engine_http import Engine, EngineError, engine_fix, engine_socket
from gym_runtime.sandboxes.forward import Forward
from gym_runtime.sandboxes.images import base_here
from gym_runtime.sandboxes.leases import lease_tag, proves
from gym_runtime.sandboxes.process import ProcessBackend
from gym_runtime.sandboxes.reaper import BEACON_S, DEAD_AFTER_S, Peers, Reaper, beacons
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.delivery import Delivery
from gym_runtime.transport.discovery import register
from gym_runtime.transport.headers import sent_as_control
from gym_runtime.transport.rpc import process_tag
from gym_runtime.transport.subjects import Subjects
from gym_runtime.transport.tasks import Whole
from gym_runtime.workers.tool_replies import ToolReplies

log = logs.get("gym.sandbox")

WARM_LEASE = "warm"  # the lease label of a warm container (its real lease is kept by the worker that holds it)
REFILL_AT_ONCE = 4  # warm containers created concurrently while refilling
MAX_PROCESSES = 16  # background processes a sandbox may have (running, or ended and not yet waited for)
KILL_WAIT_S = 10.0  # how long a kill waits for the process's end to be read
CPU_READ_S = 10.0  # how long a release waits for the sandbox's CPU count (the engine's stats)
RENEW_AT_ONCE = 8  # containers renewed concurrently (one engine call each)
GATE_S = 0.5  # how often the create subscription is re-judged even when nothing here changed (peers' load)
RENEW_MAX_S = 30.0  # a holder says it is alive at least this often (a quarter of lease_grace_s, when shorter)
SETTLE_S = 120.0  # a stopping worker waits this long at most for the creates, forks and removals under way


class Held(msgspec.Struct, kw_only=True):
    lease: str  # the secret every operation on it proves (``sandboxes.leases``); never logged
    caller: str = ""  # who created it (``subjects.caller_of``, from the create's subject): the only one served
    expires: float  # unix time
    used: float  # time.monotonic() of the last operation's end
    busy: int = 0  # operations running now (a long exec is not idleness)
    restartable: bool = False  # opened so (``SandboxSpec.restartable``): ``restart`` is refused otherwise
    key: str = ""  # the create's key (``SandboxCall.key``): a try of the same create gets this sandbox
    image: str = ""  # its image's content id, as the create answered it
    heard: float = 0.0  # time.monotonic() its holder last said it is alive (``renew``); 0: it never did
    spec: Resolved | None = None  # what it was made as (a fork's copies are made so too)
    parked: bool = False  # a fork's parked copy (``SandboxCall.park``): it ends at ``expires`` (or its batch's purge)
    batch: str = ""  # a parked copy's: the batch of the rollout it was kept for


async def _drain(sub: Any) -> None:
    """Unsubscribe, still handling what was delivered (nats-py's ``unsubscribe`` drops it: lost requests)."""
    try:
        await sub.drain()
    except Exception:
        pass


async def open_backend(cfg: SandboxConfig, pool: str, namespace: str) -> tuple[Backend, str]:
    """The pool's backend and its default image's name (``base``: built and imported where missing); a
    missing engine or image is one line naming it. Its containers are labelled ``{namespace}.{pool}``: the
    reaper of one namespace's pool never judges another's (two clusters on one engine need distinct ones)."""
    where = f"sandboxes.{pool}"
    if cfg.backend == "process":
        return ProcessBackend(pool=pool), cfg.image
    if cfg.backend == "daytona":  # a hosted provider: its images (snapshots) are its own to check
        return DaytonaBackend(cfg.engine, pool=f"{namespace}.{pool}", where=where), cfg.image
    engine = Engine(engine_socket(cfg.backend, cfg.engine, where))
    await engine.__aenter__()
    try:
        try:
            await engine.ping()
        except EngineError as e:
            raise ConfigError(
                f"{where}: the {cfg.backend} engine does not answer: {e}; {engine_fix(cfg.backend, where)}"
            ) from None
        image = await base_here(engine, where, cfg.backend) if cfg.image == "base" else cfg.image
        for ref in [image, *cfg.images, *cfg.warm_images]:
            if not await engine.image_exists(ref):
                raise ConfigError(f"{where}: image {ref!r} is not in the {cfg.backend} engine (build or load it first)")
    except BaseException:
        await engine.close()
        raise
    backend = EngineBackend(
        engine,
        name=cfg.backend,
        pool=f"{namespace}.{pool}",
        writable=cfg.rootfs == "writable",
        orphan_after_s=cfg.orphan_after_s,
        warm_max_s=2 * cfg.max_lease_s,  # a warm one is handed out younger than max_lease_s (``_take_warm``)
    )
    return backend, image


class SandboxWorker:
    def __init__(self, bus: Bus, name: str, cfg: SandboxConfig) -> None:
        self.bus = bus
        self.name = name
        self.cfg = cfg
        self.worker_id = uuid.uuid4().hex[:12]
        self.address = bus.subjects.sandbox_worker(name, self.worker_id)
        self.process = process_tag()  # named in each reply that hands out a sandbox: a call it leaves silent names it
        self.held: dict[str, Held] = {}
        self.making: dict[str, anyio.Event] = {}  # creates under way, by key: a second try waits for the first
        self.replies: dict[str, ToolReplies[SandboxReply]] = {}  # by sandbox: its execs' replies by call id
        self.renew_s = min(RENEW_MAX_S, cfg.lease_grace_s / 4)
        self.procs: dict[str, dict[str, Background]] = {}  # by sandbox, by process id
        self.created = 0
        self.peers = Peers(self.worker_id, capacity=cfg.capacity, replicas=cfg.replicas)
        self.backend: Backend | None = None
        self.reaper: Reaper | None = None
        self.image = cfg.image
        self._subs: list[Any] = []
        self.warm: list[str] = []  # idle warm containers, oldest first
        self.warm_image: dict[str, str] = {}  # a warm container's image
        self.warm_id: dict[str, str] = {}  # a warm container's image's content id (``Backend.image_id``)
        self.warm_born: dict[str, float] = {}  # when a warm container was made (``time.time``)
        self.warming = 0  # warm containers being created
        self.warming_by: dict[str, int] = {}  # by image
        self.removing = 0  # containers being removed (still on the engine)
        self.whole = Whole()  # engine work a stopping worker's cancels must not cut (creates, forks, removals)
        self.warm_hits = 0
        self.full_replies = 0  # creates answered "no room" (the pool's quota or a race with the gate)
        self.released = 0  # leased sandboxes ended here (said to waiters: ``_full``)
        self.warm_spec: Resolved | None = None  # the default spec's warm containers
        self.warm_specs: dict[str, Resolved] = {}  # by image: what a warm container of each is made as
        self.warm_want: dict[str, int] = {}  # by image: how many to keep ready
        self._create_sub: Any = None
        self._changed = anyio.Event()
        self._tg: Any = None
        self.peers.own = self.live

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        self.backend, self.image = await open_backend(self.cfg, self.name, self.bus.ns)
        self.reaper = Reaper(self.backend, self.peers)
        try:
            async with anyio.create_task_group() as tg:
                s = self.bus.subjects
                self._tg = tg
                self.warm_spec = self.resolve(SandboxSpec())
                self._plan_warm()
                tg.start_soon(beacons, self.bus, s.live("sandbox", self.name), self.peers)
                self._subs = [
                    await self.bus.serve(
                        tg, Subjects.sandbox_op(self.address, "*", "*.*"), self._op, default_error="tool_error"
                    ),
                    await self.bus.serve(
                        tg, s.sandbox_present(self.name), self._present, queue=s.sandbox_group(self.name)
                    ),
                    await self.bus.subscribe(s.purged("*"), self._purged),
                ]
                if self.cfg.max_live:  # hear the pool's other workers before taking a share of its quota
                    await anyio.sleep(1.5 * BEACON_S)
                await self._gate()
                await self.bus.flush()
                tg.start_soon(self._gate_loop)
                tg.start_soon(self._reap_loop)
                tg.start_soon(self._renew_loop)
                svc = await register(self.bus, "sandbox", self.name, self.worker_id, self.stats)
                self.bus.telemetry.meters.track("sandbox", self.name, self)
                log.info("sandbox.ready", sandbox=self.name, worker=self.worker_id, backend=self.cfg.backend)
                task_status.started()
                try:
                    await anyio.sleep_forever()
                finally:
                    self.bus.telemetry.meters.untrack(self)
                    with anyio.CancelScope(shield=True):
                        await svc.stop()
        finally:
            with anyio.CancelScope(shield=True):
                for sub in [self._create_sub, *self._subs]:  # no call reaches a backend that is closing
                    try:
                        if sub is not None:
                            await sub.unsubscribe()
                    except Exception:
                        pass
                self._create_sub = None
                await self.whole.settle(SETTLE_S)  # what a cancelled handler started: held, or removed, first
                left = len(self.held)  # leases that had not ended (their holders did not close them)
                for sid in list(self.held):  # a stopped worker's sandboxes can no longer be reached
                    await self._remove(sid)
                for sid in self.warm:
                    await self._remove(sid)
                self.warm.clear()
                await self.backend.aclose()
                log.info("sandbox.stopped", sandbox=self.name, worker=self.worker_id, created=self.created, left=left)

    def _plan_warm(self) -> None:
        """The warm containers to keep, by image: ``warm`` of the default spec, ``warm_images`` of theirs."""
        assert self.warm_spec is not None
        self.warm_specs = {self.warm_spec.image: self.warm_spec}
        self.warm_want = {self.warm_spec.image: self.cfg.warm}
        for image, n in self.cfg.warm_images.items():
            self.warm_specs[image] = self.resolve(SandboxSpec(image=image))
            self.warm_want[image] = self.warm_want.get(image, 0) + n

    def stats(self) -> dict[str, Any]:
        return {
            "sandboxes": len(self.held),
            "warm": len(self.warm),
            "live": self.live(),
            "room": self.room(),
            "capacity": self.cfg.capacity,
            "max_live": self.cfg.max_live,
            "created": self.created,
            "warm_hits": self.warm_hits,
            "full": self.full_replies,
            "reaped": self.reaper.reaped if self.reaper else 0,
        }

    async def drain(self) -> None:
        """Take no new sandboxes; the ones held are served until their leases end."""
        self.cfg = msgspec.structs.replace(self.cfg, warm=0, warm_images={})
        self.warm_want = {}
        self._draining = True
        await self._gate()

    # ------------------------------------------------------------------ admission

    _draining = False

    def live(self) -> int:
        """Containers this worker has on the engine or is creating: leased, warm, and warming."""
        return len(self.held) + len(self.warm) + self.warming + self.removing

    def limit(self) -> int:
        """The most live containers this worker may hold now: its capacity, and its share of ``max_live``."""
        if not self.cfg.max_live:
            return self.cfg.capacity
        return min(self.cfg.capacity, self.peers.share(self.cfg.max_live))

    def room(self) -> int:
        """New containers this worker may start now (the others' load, as last heard, counts too: a worker
        that joins a full pool starts none until leases end)."""
        free = self.limit() - self.live()
        if self.cfg.max_live:
            free = min(free, self.cfg.max_live - self.peers.others_live() - self.live())
        return max(0, free)

    def takes_creates(self) -> bool:
        return not self._draining and (self.room() > 0 or bool(self.warm))

    def changed(self) -> None:
        """Something was taken or freed: re-judge the subscription and the warm pool now."""
        self._changed.set()

    async def _gate(self) -> None:
        """Subscribed to the create subject only while this worker has room (placement by free capacity)."""
        want = self.takes_creates()
        if want and self._create_sub is None:
            s = self.bus.subjects
            self._create_sub = await self.bus.serve(
                self._tg, s.sandbox_create(self.name, "*.*"), self._create, queue=s.sandbox_group(self.name),
                default_error="tool_error",
            )  # fmt: skip
        elif not want and self._create_sub is not None:
            sub, self._create_sub = self._create_sub, None
            self._tg.start_soon(_drain, sub)  # creates already delivered here are answered (full), not dropped

    async def _gate_loop(self) -> None:
        """Keep the subscription and the warm pool in line with this worker's room (and the peers' load)."""
        while True:
            with anyio.move_on_after(GATE_S):
                await self._changed.wait()
            self._changed = anyio.Event()
            try:
                await self._gate()
            except Exception as e:  # disconnected meanwhile: the next turn tries again
                log.warning("sandbox.gate_failed", error=repr(e))
            self._refill()

    def _refill(self) -> None:
        """Start creating the warm containers each image lacks, within this worker's room (at most
        ``REFILL_AT_ONCE`` at a time)."""
        have: dict[str, int] = {}
        for sid in self.warm:
            image = self.warm_image.get(sid, "")
            have[image] = have.get(image, 0) + 1
        room = self.room()
        for image, n in self.warm_want.items():
            want = n - have.get(image, 0) - self.warming_by.get(image, 0)
            want = min(want, room, REFILL_AT_ONCE - self.warming)
            for _ in range(max(0, want)):
                self.warming += 1
                self.warming_by[image] = self.warming_by.get(image, 0) + 1
                room -= 1
                self._tg.start_soon(self._warm_one, image)

    async def _warm_one(self, image: str) -> None:
        """Create one idle container of ``image``'s warm spec; expires 0: only its worker ends its lease."""
        assert self.backend is not None
        spec = self.warm_specs[image]
        try:
            with anyio.CancelScope(shield=True):  # a stopping worker waits for it, then removes it: none leaks
                sid = await self.backend.create(spec, owner=self.worker_id, lease=WARM_LEASE, expires=0.0)
                image_id = await self.backend.image_id(sid)
        except Exception as e:  # the engine refused: the next turn tries again
            log.warning("sandbox.warm_failed", image=image, error=repr(e))
            await anyio.sleep(1.0)
            return
        finally:
            self.warming -= 1
            self.warming_by[image] -= 1
            self.changed()
        self.created += 1
        if self._draining:
            await self._remove(sid)
        else:
            self.warm.append(sid)
            self.warm_image[sid] = image
            self.warm_id[sid] = image_id
            self.warm_born[sid] = time.time()

    def _take_warm(self, spec: Resolved) -> tuple[str, str] | None:
        """The oldest warm container made as ``spec`` and its image's id (None if there is none). One older than
        ``max_lease_s`` is not handed out (its keeper's deadline could come before the lease's end): the reap
        loop removes it."""
        if self.warm_specs.get(spec.image) != spec:
            return None
        for sid in self.warm:
            if self.warm_image.get(sid) == spec.image and not self._warm_aged(sid):
                self._forget_warm(sid)
                return sid, self.warm_id.pop(sid, "")
        return None

    def _warm_aged(self, sid: str) -> bool:
        return time.time() - self.warm_born.get(sid, 0.0) > self.cfg.max_lease_s

    def _forget_warm(self, sid: str) -> None:
        self.warm.remove(sid)
        self.warm_image.pop(sid, None)
        self.warm_born.pop(sid, None)

    def _pop_warm(self) -> str:
        sid = self.warm[0]
        self._forget_warm(sid)
        self.warm_id.pop(sid, None)
        return sid

    async def _present(self, req: SandboxCall, msg: Delivery) -> SandboxReply:
        """The pool has a worker (full or not): a create nobody took waits for a lease, not for a pool."""
        return self._full() if not self.takes_creates() else SandboxReply(address=self.address)

    def _full(self) -> SandboxReply:
        """ "No room here", with what a waiter judges a pool by: this worker's count of ended leases (a waiter
        that sees none change for the pool's ``lease_wait_s`` gives up: ``sandbox_unavailable``)."""
        return SandboxReply(full=True, address=self.address, released=self.released, lease_wait_s=self.cfg.lease_wait_s)

    # ------------------------------------------------------------------ operations

    def resolve(self, spec: SandboxSpec) -> Resolved:
        """The spec with the pool's defaults; anything past the pool's limits is refused (one line)."""
        lim, where = self.cfg.limits, f"sandboxes.{self.name}"
        if spec.network:
            raise Failure("tool_error", f"{where}: sandboxes have no network here (network=True was asked)")
        image = spec.image or self.image
        allowed = spec.image in self.cfg.images or spec.image in self.cfg.warm_images
        if spec.image and spec.image != self.cfg.image and self.cfg.images and not allowed:
            raise Failure("tool_error", f"{where}: image {spec.image!r} is not one of the pool's images")
        asked = {"cpu": spec.cpu, "memory_mb": spec.memory_mb, "pids": spec.pids, "disk_mb": spec.disk_mb}
        asked["timeout_s"] = spec.timeout_s
        out: dict[str, Any] = {}
        for key, value in asked.items():
            most = getattr(lim, key)
            if value is not None and (value <= 0 or value > most):
                raise Failure("tool_error", f"{where}: {key}={value} is past the pool's limit ({most})")
            out[key] = most if value is None else value
        workdir = "/work" if spec.workdir is None else spec.workdir
        return Resolved(
            image=image,
            max_output=lim.max_output,
            env=dict(spec.env),
            workdir=workdir,
            restartable=spec.restartable,
            **out,
        )

    async def _create(self, req: SandboxCall, msg: Delivery) -> SandboxReply:
        if req.op != "create" or req.spec is None:
            raise Failure("internal", f"expected a create, got {req.op}")
        caller = self.bus.subjects.sandbox_caller(msg.subject)
        if not req.key:  # an older caller's: no try of it is recognised
            return await self._make(req, caller)
        while (under_way := self.making.get(req.key)) is not None:
            await under_way.wait()
        made = next(
            ((sid, h) for sid, h in self.held.items() if h.key == req.key and self._serves(h, req, caller)), None
        )
        if made is not None:  # its reply was lost (a reconnect): the same sandbox, not a second one held
            sid, held = made
            held.used = time.monotonic()
            return SandboxReply(
                sandbox=sid, address=self.address, by=self.process, image=held.image, renew_s=self.renew_s
            )
        self.making[req.key] = anyio.Event()
        try:
            return await self._make(req, caller)
        finally:
            self.making.pop(req.key).set()

    async def _make(self, req: SandboxCall, caller: str) -> SandboxReply:
        assert req.spec is not None
        started = time.perf_counter()
        spec = self.resolve(req.spec)
        assert self.backend is not None
        if spec.restartable and not self.backend.capabilities.restart:  # said at the open, not at its verify
            raise unsupported(self.backend.name, "restart", "restart", where=f"sandboxes.{self.name}")
        now = time.time()
        expires = min(req.expires or now + self.cfg.max_lease_s, now + self.cfg.max_lease_s)
        warm = None if self._draining else self._take_warm(spec)
        if warm is not None:  # a warm one: no engine call at all
            sid, image_id = warm
            self.held[sid] = held = Held(
                lease=req.lease, caller=caller, expires=expires, used=time.monotonic(), key=req.key, spec=spec
            )
            held.image, held.heard = image_id, held.used if req.renews else 0.0
            self.warm_hits += 1
            self.changed()  # refill
            self._acquired(started, warm=True)
            trace.get_current_span().set_attributes({"gym.sandbox.id": sid[:12], "gym.sandbox.warm": True})
            return SandboxReply(
                sandbox=sid, address=self.address, by=self.process, warm=True, image=image_id, renew_s=self.renew_s
            )
        if self.room() <= 0 and self.warm and not self._draining:  # make room: an idle warm one goes
            await self._remove(self._pop_warm())
        if self.room() <= 0 or self._draining:
            self.full_replies += 1
            self.changed()  # unsubscribe
            return self._full()
        # counted before the engine answers, so concurrent creates cannot pass the room
        sid_tmp = f"creating-{uuid.uuid4().hex}"
        self.held[sid_tmp] = Held(lease=req.lease, expires=expires, used=time.monotonic(), busy=1)
        self.changed()
        # held (and so removed at stop) even if the worker is stopping: whole, its handler's cancel aside
        sid, image_id = await self.whole.run(self._engine_create, req, spec, caller, expires, sid_tmp)
        self.created += 1
        self._acquired(started, warm=False)
        return SandboxReply(sandbox=sid, address=self.address, by=self.process, image=image_id, renew_s=self.renew_s)

    async def _engine_create(
        self, req: SandboxCall, spec: Resolved, caller: str, expires: float, slot: str
    ) -> tuple[str, str]:
        """A create's engine part, held here once made (``Whole``): the container and its image's id. Its ``slot``
        (counted in ``held`` before the engine answers) goes only when it ends, so that no cancel of its caller
        lets the count dip while the engine is still making it."""
        assert self.backend is not None
        with ExitStack() as stack, self._span("create", image=spec.image) as span:
            stack.callback(self.held.pop, slot, None)
            tag = lease_tag(req.lease)  # the container's label: never the lease itself
            sid = await self.backend.create(spec, owner=self.worker_id, lease=tag, expires=expires)
            held = Held(
                lease=req.lease,
                caller=caller,
                expires=expires,
                used=time.monotonic(),
                restartable=spec.restartable,
                key=req.key,
                spec=spec,
            )
            held.heard = held.used if req.renews else 0.0
            self.held[sid] = held
            span.set_attribute("gym.sandbox.id", sid[:12])
            held.image = image_id = await self.backend.image_id(sid)  # what it runs, whatever its name is later
        return sid, image_id

    def _span(self, op: str, *, sid: str = "", image: str = "") -> AbstractContextManager[Span]:
        """The engine's part of an operation (``sandbox.engine.OP``), a child of the call's CONSUMER span."""
        attrs = {"gym.sandbox.pool": self.name, "gym.sandbox.backend": self.cfg.backend}
        if sid:
            attrs["gym.sandbox.id"] = sid[:12]
        if image:
            attrs["gym.sandbox.image"] = image
        return self.bus.telemetry.span(f"sandbox.engine.{op}", attributes=attrs)

    def _acquired(self, started: float, *, warm: bool) -> None:
        self.bus.telemetry.meters.sandbox_acquired(self.name, time.perf_counter() - started, warm=warm)

    @staticmethod
    def _serves(held: Held, req: SandboxCall, caller: str) -> bool:
        """Whether ``req`` (from ``caller``) proves the lease that holds the sandbox, and comes from the caller that
        created it."""
        return proves(held.lease, req.lease) and held.caller == caller

    async def _op(self, req: SandboxCall, msg: Delivery) -> SandboxReply:
        held = self.held.get(req.sandbox)
        if held is None or not self._serves(held, req, self.bus.subjects.sandbox_caller(msg.subject)):
            # one answer for an id not held here (closed, ended, never made) and for one held under another lease
            # or by another caller: it says nothing of whether the id exists
            raise Failure(
                "tool_error",
                f"sandbox {req.sandbox[:12]} is not held by worker {self.worker_id} under this lease (it ended, "
                "or it is not this lease's)",
            )
        assert self.backend is not None
        if req.op in ("renew", "attach"):  # its holder is alive (a resumed attempt's, for attach)
            held.heard = time.monotonic()
            if req.op == "renew":
                return SandboxReply(sandbox=req.sandbox)
            return self._attach(req, held)
        if req.op == "close":
            with self._span("remove", sid=req.sandbox):
                cpu_s = await self._cpu_s(req.sandbox)
                await self._remove(req.sandbox)
            return SandboxReply(sandbox=req.sandbox, cpu_s=cpu_s)
        held.busy += 1
        try:
            if req.op == "exec" and req.id:  # a rollout's tool call: answered once
                replies = self.replies.get(req.sandbox)
                if replies is None:
                    replies = self.replies[req.sandbox] = ToolReplies()
                return await replies.once(req.id, lambda: self._exec(req))
            if req.op == "exec":
                return await self._exec(req)
            if req.op in ("spawn", "poll", "wait", "kill"):
                return await self._process(req, held)
            if req.op == "restart":
                return await self._restart(req.sandbox, held)
            if req.op == "fork":
                return await self._fork(req, held)
            if req.op == "write":
                with self._span("write", sid=req.sandbox):
                    await self.backend.write(req.sandbox, req.path, req.data)
                return SandboxReply(sandbox=req.sandbox)
            if req.op == "read":
                with self._span("read", sid=req.sandbox):
                    data = await self.backend.read(req.sandbox, req.path, max_bytes=self.cfg.limits.max_output)
                return SandboxReply(sandbox=req.sandbox, data=data)
            raise Failure("internal", f"unexpected sandbox operation {req.op!r}")
        finally:
            held.busy -= 1
            held.used = time.monotonic()

    async def _fork(self, req: SandboxCall, held: Held) -> SandboxReply:
        """Copies of a held sandbox, one per lease the call names, held here for the same caller (each under its
        own lease, limits and expiry; ``Backend.fork``). They count against this worker's room: a fork past it
        is refused at once (``sandbox_unavailable``), never waited on, since the parent holds this worker."""
        assert self.backend is not None
        where, n = f"sandboxes.{self.name}", len(req.leases)
        if not self.backend.capabilities.fork:
            raise unsupported(self.backend.name, "fork", "fork (copies of a sandbox)", where=where)
        if not n or not all(req.leases) or len(set(req.leases)) != n:
            raise Failure("tool_error", f"{where}: a fork names one distinct lease per copy")
        while self.room() < n and self.warm and not self._draining:  # idle warm ones make room
            await self._remove(self._pop_warm())
        if self.room() < n or self._draining or held.spec is None:
            self.full_replies += 1
            raise observed(
                Failure(
                    "sandbox_unavailable",
                    f"{where}: forking sandbox {req.sandbox[:12]} into {n} needs {n} free sandboxes on its worker, "
                    f"which has {self.room()} (capacity {self.cfg.capacity}, max_live {self.cfg.max_live})",
                )
            )
        now = time.time()
        expires = min(req.expires or now + self.cfg.max_lease_s, now + self.cfg.max_lease_s)
        slots = [f"creating-{uuid.uuid4().hex}" for _ in range(n)]  # counted before the engine answers
        for slot in slots:
            self.held[slot] = Held(lease="", expires=expires, used=time.monotonic(), busy=1)
        self.changed()
        kids = await self.whole.run(self._engine_fork, req, held, expires, slots)  # held, and so removed at stop
        self.created += n
        log.info("sandbox.forked", sandbox=req.sandbox[:12], copies=n, lease=lease_tag(held.lease), parked=req.park)
        return SandboxReply(
            sandbox=req.sandbox,
            forked=kids,
            address=self.address,
            by=self.process,
            image=held.image,
            renew_s=self.renew_s,
        )

    async def _engine_fork(self, req: SandboxCall, held: Held, expires: float, slots: list[str]) -> list[str]:
        """A fork's engine part, its copies held here once made (``Whole``); its ``slots`` go when it ends, as a
        create's (``_engine_create``)."""
        assert self.backend is not None and held.spec is not None
        with ExitStack() as stack, self._span("fork", sid=req.sandbox) as span:
            stack.callback(self.changed)
            for slot in slots:
                stack.callback(self.held.pop, slot, None)
            tags = [lease_tag(lease) for lease in req.leases]
            kids = await self.backend.fork(req.sandbox, held.spec, owner=self.worker_id, leases=tags, expires=expires)
            mono = time.monotonic()
            for kid, lease in zip(kids, req.leases, strict=True):
                self.held[kid] = Held(
                    lease=lease,
                    caller=held.caller,
                    expires=expires,
                    used=mono,
                    heard=0.0 if req.park else mono,
                    parked=req.park,
                    batch=req.batch,
                    restartable=held.restartable,
                    image=held.image,  # what the parent's image was: the copies' provenance
                    spec=held.spec,
                )
            span.set_attribute("gym.sandbox.forked", len(kids))
        return kids

    async def _purged(self, msg: Delivery) -> None:
        """A batch was purged (``Subjects.purged``): the copies parked for branching its rollouts go with it."""
        batch = self.bus.subjects.purged_batch(msg.subject)
        if not batch or not sent_as_control(msg.headers):  # a server's answer borrowed into the subject: not a purge
            return
        for sid in [sid for sid, h in self.held.items() if h.parked and h.batch == batch]:
            log.info("sandbox.purged", sandbox=sid[:12], batch=batch)
            await self._remove(sid)

    def _attach(self, req: SandboxCall, held: Held) -> SandboxReply:
        """A resumed attempt of the rollout that holds ``held`` takes it up (the same lease): its lease ends at the
        new attempt's end (at most ``max_lease_s`` from now), and it is used now."""
        now = time.time()
        if req.expires:
            held.expires = max(held.expires, min(req.expires, now + self.cfg.max_lease_s))
        held.used = time.monotonic()
        log.info("sandbox.reattached", sandbox=req.sandbox[:12], lease=lease_tag(held.lease))
        return SandboxReply(
            sandbox=req.sandbox, address=self.address, by=self.process, image=held.image, renew_s=self.renew_s
        )

    async def _cpu_s(self, sid: str) -> float | None:
        """The CPU seconds a sandbox used, read just before its release (its holder's cost); None: unknown."""
        assert self.backend is not None
        try:
            with anyio.fail_after(CPU_READ_S):
                return await self.backend.cpu_s(sid)
        except Exception as e:  # noqa: BLE001 - a count we cannot read is not a reason to keep the sandbox
            log.info("sandbox.cpu_unread", sandbox=sid[:12], error=repr(e))
            return None

    async def _exec(self, req: SandboxCall) -> SandboxReply:
        """A command to its end; asked to stream, its output goes to the caller as it comes (a backend that
        cannot stream sends it whole at the end)."""
        assert self.backend is not None
        lim = self.cfg.limits
        timeout = min(req.timeout_s or lim.timeout_s, lim.timeout_s)
        fwd = Forward(self.bus) if req.stream else None
        streams = fwd is not None and self.backend.capabilities.stream
        with self._span("exec", sid=req.sandbox) as span:
            async with anyio.create_task_group() as tg:
                if fwd is not None:
                    tg.start_soon(fwd.run)
                r = await self.backend.exec(
                    req.sandbox,
                    req.argv,
                    timeout_s=timeout,
                    max_output=lim.max_output,
                    on_output=fwd.add if streams and fwd is not None else None,
                )
                if fwd is not None:
                    if not streams:
                        await fwd.add(1, r.stdout)
                        await fwd.add(2, r.stderr)
                    await fwd.flush()
                tg.cancel_scope.cancel()
            code = -1 if r.exit_code is None else r.exit_code
            span.set_attributes({"gym.sandbox.exit_code": code, "gym.sandbox.timed_out": r.timed_out})
        self.bus.telemetry.meters.sandbox_executed(self.name, r.duration_s)
        return SandboxReply.of_exec(req.sandbox, r)

    async def _process(self, req: SandboxCall, held: Held) -> SandboxReply:
        """A background process: started here (``spawn``), its output so far (``poll``), its end (``wait``,
        at most ``timeout_s``: still running, ``timed_out``), or killed (``kill``). An ended one is forgotten
        once ``wait`` or ``kill`` has returned its result."""
        assert self.backend is not None
        sid, lim = req.sandbox, self.cfg.limits
        procs = self.procs.setdefault(sid, {})
        if req.op == "spawn":
            if not self.backend.capabilities.background:
                raise unsupported(
                    self.backend.name, "background", "background processes", where=f"sandboxes.{self.name}"
                )
            if len(procs) >= MAX_PROCESSES:
                raise Failure(
                    "tool_error",
                    f"sandbox {sid[:12]} has {MAX_PROCESSES} background processes already (an ended one counts "
                    "until its wait() or kill() returns): wait for or kill one first, or start several commands "
                    "as one process (sh -c 'a & b & wait')",
                )
            left = max(1.0, held.expires - time.time())  # it dies at the lease's end at the latest
            started = self.backend.spawn(sid, req.argv, timeout_s=left, max_output=lim.max_output)
            with self._span("spawn", sid=sid):
                await self._tg.start(started.run)
            pid = uuid.uuid4().hex[:12]
            procs[pid] = started
            return SandboxReply(sandbox=sid, process=pid)
        proc = procs.get(req.process)
        if proc is None:
            raise Failure("tool_error", f"no background process {req.process[:12]!r} in sandbox {sid[:12]}")
        if req.op == "wait":
            with anyio.move_on_after(min(req.timeout_s or lim.timeout_s, lim.timeout_s)):
                await proc.done.wait()
        elif req.op == "kill":
            await proc.kill()
            with anyio.move_on_after(KILL_WAIT_S):
                await proc.done.wait()
        if proc.failure is not None:  # its engine stopped answering: said typed, not an output that never ends
            del procs[req.process]
            raise proc.failure
        r = proc.result()
        if req.op != "poll":
            if proc.done.is_set():
                del procs[req.process]
            else:
                r.timed_out = True
        return SandboxReply.of_exec(sid, r)

    async def _restart(self, sid: str, held: Held) -> SandboxReply:
        """Every process of the sandbox ended, its files kept (``box.restart``): its background processes are
        killed and forgotten first, as at its removal. Only one opened restartable (``SandboxSpec.restartable``)."""
        assert self.backend is not None
        if not self.backend.capabilities.restart:
            raise unsupported(self.backend.name, "restart", "restart", where=f"sandboxes.{self.name}")
        if not held.restartable:
            raise Failure(
                "tool_error", f"sandbox {sid[:12]} was not opened restartable: open it with sandbox(restartable=True)"
            )
        for proc in self.procs.pop(sid, {}).values():
            with anyio.move_on_after(KILL_WAIT_S):
                await proc.kill()
        with self._span("restart", sid=sid) as span:
            span.set_attribute("gym.sandbox.ended", await self.backend.restart(sid))
        return SandboxReply(sandbox=sid)

    async def _remove(self, sid: str) -> None:
        """Remove a sandbox; it counts as live until the engine has removed it (the quota is the engine's).
        Its background processes die with it: killed first, so the engine's stop has only the container's own
        processes left (Podman under load once failed to stop a container that still ran one)."""
        if self.held.pop(sid, None) is not None and not sid.startswith("creating-"):
            self.released += 1  # a lease's sandbox ended (closed, idle, expired): room for a waiter
        procs = self.procs.pop(sid, {})
        self.replies.pop(sid, None)
        if self.backend is not None and not sid.startswith("creating-"):
            # counted as removing from the moment it leaves ``held`` (the quota's count never dips before the engine
            # has removed it), then removed whole, whatever cancels this
            self.removing += 1
            await self.whole.run(self._close, sid, procs)
        self.changed()

    async def _close(self, sid: str, procs: dict[str, Background]) -> None:
        """Remove a container counted in ``removing`` (by the caller, before this task starts)."""
        assert self.backend is not None
        try:
            for proc in procs.values():
                with anyio.move_on_after(KILL_WAIT_S):
                    await proc.kill()
            await self.backend.close(sid)
        except Exception as e:  # the reaper tries again
            log.warning("sandbox.remove_failed", sandbox=sid[:12], error=repr(e))
        finally:
            self.removing -= 1

    async def _reap_loop(self) -> None:
        """Listen first (a live peer is heard before anything is judged), then sweep on a timer: dead workers'
        containers and ended leases (``Reaper``), and this worker's own sandboxes idle past ``idle_ttl_s``."""
        await anyio.sleep(DEAD_AFTER_S)
        assert self.reaper is not None
        while True:
            try:
                for sid in await self.reaper.sweep():
                    self.held.pop(sid, None)
                    self.procs.pop(sid, None)
                    self.replies.pop(sid, None)
                    if sid in self.warm:
                        self._forget_warm(sid)
                        self.warm_id.pop(sid, None)
                    self.changed()
                for sid in [w for w in self.warm if self._warm_aged(w)]:  # refilled with fresh ones
                    self._forget_warm(sid)
                    self.warm_id.pop(sid, None)
                    await self._remove(sid)
                sweep_images = getattr(self.backend, "sweep_images", None)  # forks' images left by a dead worker
                if sweep_images is not None:
                    await sweep_images()
                for sid, why, lease in self._ended():
                    log.info(why, sandbox=sid[:12], lease=lease)
                    await self._remove(sid)
                    self.reaper.reaped += 1
            except Exception as e:  # the engine hiccuped: the next sweep tries again
                log.warning("sandbox.sweep_failed", error=repr(e))
            await anyio.sleep(self.cfg.reap_interval_s)

    def _ended(self) -> list[tuple[str, str, str]]:
        """This worker's sandboxes whose lease is over, why, and the lease's tag (``lease_tag``: what a log names):
        its end passed, unused for ``idle_ttl_s``, or its holder silent for ``lease_grace_s`` since it was last
        heard or used (none while an operation runs; a parked copy: only its end)."""
        mono, now = time.monotonic(), time.time()
        idle_since, silent_since = mono - self.cfg.idle_ttl_s, mono - self.cfg.lease_grace_s
        ended = []
        for sid, h in self.held.items():
            if h.busy or sid.startswith("creating-"):
                continue
            if h.expires < now:  # a warm container's label names no lease of its own: its worker ends the one given
                ended.append((sid, "sandbox.lease_ended", lease_tag(h.lease)))
            elif h.parked:  # a copy kept for branching: unused until a branch forks it, ended at its expiry only
                continue
            elif h.used < idle_since:
                ended.append((sid, "sandbox.idle", lease_tag(h.lease)))
            elif h.heard and max(h.heard, h.used) < silent_since:
                ended.append((sid, "sandbox.holder_gone", lease_tag(h.lease)))
        return ended

    async def _renew_loop(self) -> None:
        """Renew every container this worker holds, warm ones included (``Backend.renew``): one it stops renewing
        (this worker SIGKILLed, its node or its bus lost) ends by itself within ``orphan_after_s``."""
        assert self.backend is not None
        backend, limit = self.backend, anyio.CapacityLimiter(RENEW_AT_ONCE)

        async def renew(sid: str) -> None:
            async with limit:
                try:
                    if not await backend.renew(sid):
                        log.info("sandbox.ended_by_itself", sandbox=sid[:12])
                except Exception as e:  # the engine hiccuped: the next round tries again
                    log.warning("sandbox.renew_failed", sandbox=sid[:12], error=repr(e))

        while True:
            async with anyio.create_task_group() as tg:
                for sid in [*self.held, *self.warm]:
                    if not sid.startswith("creating-"):
                        tg.start_soon(renew, sid)
            await anyio.sleep(renew_every(self.cfg.orphan_after_s))
