"""Each role's replicas as Ray actors on a Ray cluster (``gym-runtime start CONFIG --ray ADDRESS``).

Every actor asks Ray for what its role's ``ray.roles`` entry says (``num_cpus``, ``num_gpus``, ``memory_mb``,
custom ``resources``) and holds one worker process (``actors.WorkerProcess``). Ray places them, restarts a dead
one (``ray.max_restarts``), and, with an autoscaler, adds the nodes that pending actors ask for. Ray leaves an
actor that no node can hold pending without a word: here one is a line within ``ray.placement_timeout_s``
naming what it asked for and what the nodes offer.

Where the bus is (``ray.nats``): ``config``, the config's ``nats`` or ``--nats``, a server outside Ray that
outlives the Ray cluster, its actors and their nodes; ``head``, nats-server in an actor pinned to the head node,
its store on the head's disk (``ray.store_dir``): Ray restarts it there on the same port and store, so a
restart of it or of any worker loses no stored task or result; the head node's loss ends it with the cluster.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from gym_runtime.config import Config, RayRole
from gym_runtime.errors import UserError
from gym_runtime.observability import logs
from gym_runtime.ops.credentials import ClientAuth
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.ops.security import POOL_ROLES
from gym_runtime.placement.actors import NotReady, WorkerProcess
from gym_runtime.service.supervisor import child_argv

__all__ = ["PlacementError", "Replica", "RolePools", "head_nats"]

log = logs.get("gym.placement")

READY_TIMEOUT_S = 120.0  # a placed actor's worker: ready within this (a hosted environment's first start is slow)
HEAD = "node:__internal_head__"  # the resource only the head node has


class PlacementError(UserError):
    """A role's actor could not be placed or its worker not started: one line; ``code`` 2 for a user's mistake
    (what no node offers, a config the worker refused), else 1."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Replica:
    """One actor of a role (``spec``: ROLE.NAME)."""

    spec: str
    handle: Any
    index: int
    pid: int | None = None  # its worker process, once ready
    node: str | None = None


def ask(role: RayRole) -> dict[str, float]:
    """What one actor of ``role`` asks Ray for, in Ray's resource names (for the lines, and for autoscaler
    requests)."""
    out = {"CPU": role.num_cpus, "GPU": role.num_gpus, **role.resources}
    if role.memory_mb:
        out["memory"] = role.memory_mb * 1024 * 1024
    return {k: v for k, v in out.items() if v}


def _fits(asked: dict[str, float], offered: dict[str, float]) -> bool:
    return all(offered.get(k, 0.0) >= v for k, v in asked.items())


def _offers(*, free: bool = False) -> str:
    """What the alive nodes offer (``free``: the cluster's free resources now), for a line (memory in MiB)."""
    parts = []
    offered = [n["Resources"] for n in ray.nodes() if n.get("Alive")] if not free else [ray.available_resources()]
    for node in offered:
        if node:
            res = {k: v for k, v in node.items() if not k.startswith("node:") and "object_store" not in k}
            if "memory" in res:
                res["memory_mb"] = int(res.pop("memory") / 2**20)
            parts.append("{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(res.items())) + "}")
    return "; ".join(parts) or "no alive node"


def fits_a_node(role: RayRole) -> bool:
    """Some alive node offers all that one actor of ``role`` asks (busy or not)."""
    return any(_fits(ask(role), n["Resources"]) for n in ray.nodes() if n.get("Alive"))


def not_placed(spec: str, role: RayRole, timeout_s: float) -> PlacementError:
    """The line for an actor of ``spec`` that Ray did not place within ``timeout_s``."""
    asked = ask(role)
    shown = ", ".join(f"{k}: {v:g}" for k, v in asked.items() if k != "memory")
    if role.memory_mb:
        shown += f", memory_mb: {role.memory_mb}"
    if not fits_a_node(role):
        return PlacementError(
            f"ray.roles.{spec} asks each actor for {{{shown}}}, which no node of the Ray cluster offers (nodes: "
            f"{_offers()}); add a node that does (ray start --resources ...) or change ray.roles.{spec}"
        )
    return PlacementError(
        f"ray.roles.{spec}: an actor asking for {{{shown}}} was not placed within ray.placement_timeout_s "
        f"({timeout_s:g} s): the nodes that offer it are full (nodes: {_offers(free=True)})",
        1,
    )


@dataclass
class RolePools:
    """The actors of every selected role. ``passthrough``: the worker's flags (``--set``, ``--log-level``, ...);
    ``url``: the bus, in the worker's argv only when the user gave it (a URL in the config may hold
    credentials: the worker reads it from the config itself); ``auth``: a secured bus's credentials on this
    (the operator's) node, of which each actor is handed only its entry's (``ClientAuth.entry_files``)."""

    configs: list[str]
    cfg: Config
    url: str | None
    passthrough: list[str]
    metrics_port: int | None = None
    drain_timeout_s: float = 90.0
    auth: ClientAuth | None = None
    replicas: dict[tuple[str, str], list[Replica]] = field(default_factory=dict)
    _index: itertools.count[int] = field(default_factory=itertools.count)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def role(self, role: str, name: str) -> RayRole:
        return self.cfg.ray.roles.get(f"{role}.{name}") or RayRole()

    def _new(self, role: str, name: str) -> Replica:
        spec, r = f"{role}.{name}", self.role(role, name)
        index = next(self._index)
        extra = [] if self.metrics_port is None else ["--metrics-port", str(self.metrics_port + index)]
        argv = child_argv(self.configs, self.url, spec, self.passthrough + extra)
        env = {k: v for k in ("PYTHONPATH",) if (v := os.environ.get(k))}
        options: dict[str, Any] = {
            "num_cpus": r.num_cpus,
            "num_gpus": r.num_gpus,
            "max_restarts": self.cfg.ray.max_restarts,
            "max_task_retries": 0,
            "max_concurrency": 4,  # stop may come while ready waits
        }
        if r.resources:
            options["resources"] = dict(r.resources)
        if r.memory_mb:
            options["memory"] = r.memory_mb * 1024 * 1024
        creds = self.auth.entry_files(POOL_ROLES[role], name) if self.auth is not None else None
        handle = ray.remote(**options)(WorkerProcess).remote(argv, os.getcwd(), env, creds)
        return Replica(spec, handle, index)

    def add(self, role: str, name: str, k: int) -> list[Replica]:
        """``k`` more actors of ``role.name``, returned once each worker is ready."""
        return self.start({(role, name): k})[role, name]

    def start(self, counts: dict[tuple[str, str], int]) -> dict[tuple[str, str], list[Replica]]:
        """``counts`` more actors of each role, all asked of Ray at once, returned once every worker is ready
        (``PlacementError`` for the first that is not placed in time, or whose worker does not start: every actor
        of this call is stopped then). Placement is checked first for every role, so a pool no node can hold is
        said within ``placement_timeout_s`` whatever the others' workers wait for."""
        new = {key: [self._new(*key) for _ in range(k)] for key, k in counts.items()}
        try:
            deadline = time.monotonic() + self.cfg.ray.placement_timeout_s
            placed = {id(r): r.handle.node.remote() for rs in new.values() for r in rs}
            for (role, name), replicas in new.items():
                for r in replicas:
                    r.node = self._placed(role, name, placed[id(r)], deadline)
            ready = {id(r): r.handle.ready.remote(READY_TIMEOUT_S) for rs in new.values() for r in rs}
            for (role, name), replicas in new.items():
                for r in replicas:
                    r.pid = self._ready(role, name, ready[id(r)])
        except BaseException:
            self._stop([r for rs in new.values() for r in rs], 5.0)
            raise
        with self._lock:
            for key, replicas in new.items():
                self.replicas.setdefault(key, []).extend(replicas)
        return new

    def _placed(self, role: str, name: str, ref: Any, deadline: float) -> str:
        """The node an actor runs on once it is up. Past ``deadline``: a line at once when no node offers what it
        asks (Ray would keep it pending), else a wait for a busy node or a slow start, up to ``READY_TIMEOUT_S``."""
        timeout = self.cfg.ray.placement_timeout_s
        try:
            return str(ray.get(ref, timeout=max(0.1, deadline - time.monotonic())))
        except GetTimeoutError:
            if not fits_a_node(self.role(role, name)):
                raise not_placed(f"{role}.{name}", self.role(role, name), timeout) from None
        try:
            return str(ray.get(ref, timeout=READY_TIMEOUT_S))
        except GetTimeoutError:
            raise not_placed(f"{role}.{name}", self.role(role, name), timeout + READY_TIMEOUT_S) from None

    def _ready(self, role: str, name: str, ref: Any) -> int:
        try:
            return int(ray.get(ref))
        except (NotReady, ray.exceptions.RayError) as e:  # the actor's NotReady comes as Ray's error, with it as cause
            cause = getattr(e, "cause", e)
            line, code = (
                (str(cause), cause.code) if isinstance(cause, NotReady) else (str(e).strip().splitlines()[-1], 1)
            )
            raise PlacementError(
                f"worker {role}.{name} (a Ray actor) did not start: {line}", 2 if code == 2 else 1
            ) from None

    def remove(self, role: str, name: str, k: int) -> list[Replica]:
        """Drain and remove ``k`` of ``role.name``'s actors (the newest first)."""
        with self._lock:
            have = self.replicas.get((role, name), [])
            gone, self.replicas[role, name] = have[len(have) - k :] if k else [], have[: len(have) - k]
        self._stop(gone, self.drain_timeout_s)
        return gone

    def _stop(self, replicas: list[Replica], drain_timeout_s: float) -> None:
        """Drain them all at once (each worker on SIGTERM), then end the actors (not restarted)."""
        refs = [r.handle.stop.remote(drain_timeout_s) for r in replicas if r.node is not None]  # placed ones
        for ref in refs:
            try:
                ray.get(ref, timeout=drain_timeout_s + 10)
            except (RayActorError, GetTimeoutError, ray.exceptions.RayTaskError):
                pass  # already gone (its node lost): its tasks are redelivered
        for r in replicas:
            ray.kill(r.handle, no_restart=True)

    def count(self, role: str, name: str) -> int:
        with self._lock:
            return len(self.replicas.get((role, name), []))

    def close(self) -> None:
        with self._lock:
            everyone = [r for rs in self.replicas.values() for r in rs]
            self.replicas.clear()
        self._stop(everyone, self.drain_timeout_s)


class NatsOnHead:
    """nats-server in an actor on the head node, its store on the head's disk (``ray.nats: head``)."""

    def __init__(self, port: int, store_dir: str) -> None:
        Path(store_dir).mkdir(parents=True, exist_ok=True)
        host = ray.util.get_node_ip_address()  # the address the cluster's nodes reach this one on, no other
        self.server = EmbeddedServer(port=port, host=host, store_dir=store_dir, log_file=f"{store_dir}/nats.log")
        self.server.start()
        self.url = f"nats://{host}:{port}"

    def address(self) -> str:
        return self.url

    def stop(self) -> None:
        self.server.stop()


def head_nats(cfg: Config) -> tuple[Any, str]:
    """Start the head node's NATS actor (on the store a previous one kept, if any): (handle, URL)."""
    store = cfg.ray.store_dir or str(Path.home() / ".cache/gym-runtime/ray-nats" / cfg.namespace)
    options: dict[str, Any] = {"num_cpus": 0, "resources": {HEAD: 0.001}, "max_restarts": cfg.ray.max_restarts}
    actor: Any = ray.remote(**options | {"max_concurrency": 2})(NatsOnHead)
    handle = actor.options(name=f"gym-runtime-nats-{cfg.namespace}").remote(cfg.ray.nats_port, store)
    try:
        url = str(ray.get(handle.address.remote(), timeout=cfg.ray.placement_timeout_s))
    except GetTimeoutError:
        raise PlacementError(
            f"ray.nats: head: nats-server was not up on the head node within {cfg.ray.placement_timeout_s:g} s"
        ) from None
    except ray.exceptions.RayTaskError as e:
        raise PlacementError(f"ray.nats: head: nats-server did not start: {str(e).strip().splitlines()[-1]}") from None
    print(f"nats on the Ray head node: {url} (store {store})", file=sys.stderr, flush=True)
    return handle, url
