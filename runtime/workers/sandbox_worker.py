"""Hosts a pool's sandboxes on the bus: the fourth worker role (``gym-runtime start --only sandboxes.NAME``).

``{ns}.sbx.{pool}.create`` (queue group) starts a container here and answers with this worker's address;
``{address}.exec|write|read|close`` reach it, so a sandbox is pinned to the worker that holds it, as a
resource session is. If this worker dies, calls to its address get "no responders" at once (the rollout
fails retryably and is redelivered with fresh sandboxes) and its containers are reaped by the pool's
other or next worker (``sandboxes.reaper``). A sandbox's lease ends when its holder closes it, at the
lease's end, or after ``idle_ttl_s`` unused.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import anyio
import msgspec

from gym_runtime.config import SandboxConfig
from gym_runtime.errors import ConfigError, Failure
from gym_runtime.messages import SandboxCall, SandboxReply, SandboxSpec
from gym_runtime.observability import logs
from gym_runtime.sandboxes.backend import Backend, Resolved
from gym_runtime.sandboxes.daytona import DaytonaBackend
from gym_runtime.sandboxes.engine_api import EngineBackend
from gym_runtime.sandboxes.engine_http import Engine, EngineError, socket_of
from gym_runtime.sandboxes.images import ensure_base
from gym_runtime.sandboxes.process import ProcessBackend
from gym_runtime.sandboxes.reaper import DEAD_AFTER_S, Peers, Reaper, beacons
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.delivery import Delivery
from gym_runtime.transport.discovery import register
from gym_runtime.transport.subjects import Subjects

log = logs.get("gym.sandbox")

PODMAN_SOCKET = "/run/podman/podman.sock"


class Held(msgspec.Struct, kw_only=True):
    lease: str
    expires: float  # unix time
    used: float  # time.monotonic() of the last operation's end
    busy: int = 0  # operations running now (a long exec is not idleness)


def engine_socket(cfg: SandboxConfig, where: str) -> str:
    if cfg.engine:
        return socket_of(cfg.engine)
    if cfg.backend == "docker":
        host = os.environ.get("DOCKER_HOST", "")
        if not host:
            raise ConfigError(f"{where}.engine: not set and DOCKER_HOST is empty: name the Docker engine's socket")
        return socket_of(host)
    return socket_of(os.environ.get("CONTAINER_HOST", "") or PODMAN_SOCKET)


async def open_backend(cfg: SandboxConfig, pool: str, namespace: str) -> tuple[Backend, str]:
    """The pool's backend and its default image's name (``base``: built and imported where missing); a
    missing engine or image is one line naming it. Its containers are labelled ``{namespace}.{pool}``: the
    reaper of one namespace's pool never judges another's (two clusters on one engine need distinct ones)."""
    where = f"sandboxes.{pool}"
    if cfg.backend == "process":
        return ProcessBackend(pool=pool), cfg.image
    if cfg.backend == "daytona":  # a hosted provider: its images (snapshots) are its own to check
        return DaytonaBackend(cfg.engine, pool=f"{namespace}.{pool}", where=where), cfg.image
    engine = Engine(engine_socket(cfg, where))
    await engine.__aenter__()
    try:
        try:
            await engine.ping()
        except EngineError as e:
            raise ConfigError(f"{where}: the {cfg.backend} engine does not answer: {e}") from None
        image = await ensure_base(engine) if cfg.image == "base" else cfg.image
        for ref in [image, *cfg.images]:
            if not await engine.image_exists(ref):
                raise ConfigError(f"{where}: image {ref!r} is not in the {cfg.backend} engine (build or load it first)")
    except BaseException:
        await engine.close()
        raise
    return EngineBackend(engine, name=cfg.backend, pool=f"{namespace}.{pool}"), image


class SandboxWorker:
    def __init__(self, bus: Bus, name: str, cfg: SandboxConfig) -> None:
        self.bus = bus
        self.name = name
        self.cfg = cfg
        self.worker_id = uuid.uuid4().hex[:12]
        self.address = bus.subjects.sandbox_worker(name, self.worker_id)
        self.held: dict[str, Held] = {}
        self.created = 0
        self.peers = Peers(self.worker_id)
        self.backend: Backend | None = None
        self.reaper: Reaper | None = None
        self.image = cfg.image
        self._subs: list[Any] = []

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        self.backend, self.image = await open_backend(self.cfg, self.name, self.bus.ns)
        self.reaper = Reaper(self.backend, self.peers)
        try:
            async with anyio.create_task_group() as tg:
                s = self.bus.subjects
                tg.start_soon(beacons, self.bus, s.live("sandbox", self.name), self.peers)
                self._subs = [
                    await self.bus.serve(
                        tg,
                        s.sandbox_create(self.name),
                        self._create,
                        queue=s.sandbox_group(self.name),
                        default_error="tool_error",
                    ),
                    await self.bus.serve(
                        tg, Subjects.session_op(self.address, "*"), self._op, default_error="tool_error"
                    ),
                ]
                await self.bus.flush()
                tg.start_soon(self._reap_loop)
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
                for sub in self._subs:  # no call reaches a backend that is closing
                    try:
                        await sub.unsubscribe()
                    except Exception:
                        pass
                for sid in list(self.held):  # a stopped worker's sandboxes can no longer be reached
                    await self._remove(sid)
                await self.backend.aclose()
                log.info("sandbox.stopped", sandbox=self.name, worker=self.worker_id, created=self.created)

    def stats(self) -> dict[str, Any]:
        return {
            "sandboxes": len(self.held),
            "capacity": self.cfg.capacity,
            "created": self.created,
            "reaped": self.reaper.reaped if self.reaper else 0,
        }

    async def drain(self) -> None:
        """Take no new sandboxes; the ones held are served until their leases end."""
        if self._subs:
            await self._subs[0].unsubscribe()

    # ------------------------------------------------------------------ operations

    def resolve(self, spec: SandboxSpec) -> Resolved:
        """The spec with the pool's defaults; anything past the pool's limits is refused (one line)."""
        lim, where = self.cfg.limits, f"sandboxes.{self.name}"
        if spec.network:
            raise Failure("tool_error", f"{where}: sandboxes have no network here (network=True was asked)")
        image = spec.image or self.image
        if spec.image and spec.image != self.cfg.image and self.cfg.images and spec.image not in self.cfg.images:
            raise Failure("tool_error", f"{where}: image {spec.image!r} is not one of the pool's images")
        asked = {"cpu": spec.cpu, "memory_mb": spec.memory_mb, "pids": spec.pids, "disk_mb": spec.disk_mb}
        asked["timeout_s"] = spec.timeout_s
        out: dict[str, Any] = {}
        for key, value in asked.items():
            most = getattr(lim, key)
            if value is not None and (value <= 0 or value > most):
                raise Failure("tool_error", f"{where}: {key}={value} is past the pool's limit ({most})")
            out[key] = most if value is None else value
        return Resolved(image=image, max_output=lim.max_output, env=dict(spec.env), **out)

    async def _create(self, req: SandboxCall, msg: Delivery) -> SandboxReply:
        if req.op != "create" or req.spec is None:
            raise Failure("internal", f"expected a create, got {req.op}")
        spec = self.resolve(req.spec)
        if len(self.held) >= self.cfg.capacity:
            raise Failure("tool_error", f"sandboxes.{self.name}: this worker holds its capacity", retryable=True)
        assert self.backend is not None
        now = time.time()
        expires = min(req.expires or now + self.cfg.max_lease_s, now + self.cfg.max_lease_s)
        # counted before the engine answers, so concurrent creates cannot pass the capacity
        sid_tmp = f"creating-{uuid.uuid4().hex}"
        self.held[sid_tmp] = Held(lease=req.lease, expires=expires, used=time.monotonic(), busy=1)
        try:
            sid = await self.backend.create(spec, owner=self.worker_id, lease=req.lease, expires=expires)
        finally:
            self.held.pop(sid_tmp, None)
        self.held[sid] = Held(lease=req.lease, expires=expires, used=time.monotonic())
        self.created += 1
        return SandboxReply(sandbox=sid, address=self.address)

    async def _op(self, req: SandboxCall, msg: Delivery) -> SandboxReply:
        held = self.held.get(req.sandbox)
        if held is None:
            if req.op == "close":  # closed already (idle, reaped): done all the same
                return SandboxReply(sandbox=req.sandbox)
            raise Failure("tool_error", f"sandbox {req.sandbox[:12]} is not held by worker {self.worker_id}")
        assert self.backend is not None
        if req.op == "close":
            await self._remove(req.sandbox)
            return SandboxReply(sandbox=req.sandbox)
        held.busy += 1
        try:
            if req.op == "exec":
                lim = self.cfg.limits
                timeout = min(req.timeout_s or lim.timeout_s, lim.timeout_s)
                r = await self.backend.exec(req.sandbox, req.argv, timeout_s=timeout, max_output=lim.max_output)
                return SandboxReply(
                    sandbox=req.sandbox,
                    exit_code=r.exit_code,
                    stdout=r.stdout,
                    stderr=r.stderr,
                    truncated=r.truncated,
                    timed_out=r.timed_out,
                    duration_s=r.duration_s,
                )
            if req.op == "write":
                await self.backend.write(req.sandbox, req.path, req.data)
                return SandboxReply(sandbox=req.sandbox)
            if req.op == "read":
                data = await self.backend.read(req.sandbox, req.path, max_bytes=self.cfg.limits.max_output)
                return SandboxReply(sandbox=req.sandbox, data=data)
            raise Failure("internal", f"unexpected sandbox operation {req.op!r}")
        finally:
            held.busy -= 1
            held.used = time.monotonic()

    async def _remove(self, sid: str) -> None:
        self.held.pop(sid, None)
        if self.backend is not None and not sid.startswith("creating-"):
            try:
                await self.backend.close(sid)
            except Exception as e:  # the reaper tries again
                log.warning("sandbox.remove_failed", sandbox=sid[:12], error=repr(e))

    async def _reap_loop(self) -> None:
        """Listen first (a live peer is heard before anything is judged), then sweep on a timer: dead workers'
        containers and ended leases (``Reaper``), and this worker's own sandboxes idle past ``idle_ttl_s``."""
        await anyio.sleep(DEAD_AFTER_S)
        assert self.reaper is not None
        while True:
            try:
                for sid in await self.reaper.sweep():
                    self.held.pop(sid, None)
                idle_since = time.monotonic() - self.cfg.idle_ttl_s
                for sid, h in list(self.held.items()):
                    if h.busy == 0 and h.used < idle_since:
                        log.info("sandbox.idle", sandbox=sid[:12], lease=h.lease)
                        await self._remove(sid)
                        self.reaper.reaped += 1
            except Exception as e:  # the engine hiccuped: the next sweep tries again
                log.warning("sandbox.sweep_failed", error=repr(e))
            await anyio.sleep(self.cfg.reap_interval_s)
