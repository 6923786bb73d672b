"""``gym-runtime start CONFIG --ray ADDRESS`` and its Python form, ``OnRay``: a config's roles as Ray actors.

Connects to the Ray cluster (``ray.init(address)``; ``auto``: the one this node belongs to), starts the bus where
``ray.nats`` says, places every selected role's replicas (``pools``) and, when some role is elastic, runs the
scaler until it is told to stop; then every worker drains and the actors end. Restarts are Ray's
(``ray.max_restarts``): ``start``'s own supervisor is not used under Ray, so nothing is restarted twice.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import TracebackType
from typing import Any

import anyio
import ray

from gym_runtime.config import Config, load_config
from gym_runtime.errors import UserError
from gym_runtime.observability import logs
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.ops.credentials import ClientAuth
from gym_runtime.ops.security import POOL_ROLES
from gym_runtime.placement.pools import Replica, RolePools, head_nats
from gym_runtime.placement.ray_reach import reach, refused
from gym_runtime.placement.scaler import Scaler
from gym_runtime.service.loop import run_async
from gym_runtime.service.runner import selected
from gym_runtime.transport.bus import Bus

__all__ = ["OnRay", "serve_on_ray"]

log = logs.get("gym.placement")


class OnRay:
    """The config's workers as Ray actors while inside ``with``::

        with OnRay("env/config.yaml", address="auto") as placed:
            ...  # publish batches (Client, publish/collect) on placed.url

    ``only``: ``ROLE`` or ``ROLE.NAME`` entries (default every role); ``nats``: the bus URL (default the config's,
    or the head node's actor under ``ray.nats: head``); ``passthrough``: more worker flags (``--log-level``...);
    ``auth``: a ``server --secure`` bus's credentials, on this node only: each actor is handed its entry's pool
    credential or its role's and nothing else (never ``admin.creds``), the scaler here connects with the
    publisher's, whose grants hold the work queues' counts it scales on (``admin.creds`` serves too).
    """

    def __init__(
        self,
        config: str | list[str],
        *,
        address: str = "auto",
        nats: str | None = None,
        overrides: list[str] | None = None,
        only: list[str] | None = None,
        passthrough: list[str] | None = None,
        metrics_port: int | None = None,
        drain_timeout_s: float = 90.0,
        cfg: Config | None = None,
        auth: ClientAuth | None = None,
    ) -> None:
        self.configs = [config] if isinstance(config, str) else list(config)
        self.cfg = cfg or load_config(list(self.configs), overrides)
        self.address = address
        self.pairs = selected(self.cfg, only)
        if auth is not None and self.cfg.ray.nats == "head" and not nats:
            raise UserError(
                "ray.nats: head runs nats-server without --secure: for a secured bus run `gym-runtime server "
                "--secure DIR` yourself and set ray.nats: config (its URL in --nats or the config's nats)"
            )
        self.auth = auth
        elastic = [k for r, n in self.pairs if (k := self.cfg.ray.roles.get(f"{r}.{n}")) and k.elastic]
        if auth is not None and elastic:
            auth.creds("publisher")  # the scaler's, checked now: a missing file is one line, not a dead scaler
        if auth is not None:  # each entry's own credential (its actors get nothing else), checked now too
            for role, name in self.pairs:
                auth.own(POOL_ROLES[role], name)
        self._nats, self._nats_handle = nats, None
        overrides_flags = [x for o in overrides or [] for x in ("--set", o)]
        self._passthrough = overrides_flags + (passthrough or ["--log-level", "warning"])
        self._metrics_port, self._drain_timeout_s = metrics_port, drain_timeout_s
        self._inited = False
        self._stop = threading.Event()
        self._scaler_thread: threading.Thread | None = None
        self._scaler_connected = threading.Event()  # its first connection made or refused (``_scaler_error``)
        self._scaler_error: Exception | None = None
        self._placed = threading.Event()  # every role's first actors are placed: the scaler takes over
        self.scaler: Scaler | None = None
        self.pools: RolePools | None = None
        self.url: str | list[str] = ""

    def __enter__(self) -> OnRay:
        if not ray.is_initialized():
            reach(self.address)  # a dead address, a head that wants a token: one line, in seconds
            try:
                ray.init(address=self.address, log_to_driver=False, logging_level=logging.ERROR)
            except ConnectionError as e:
                raise refused(self.address, e) from None
            self._inited = True
        try:
            self._open()
        except BaseException:
            self.close()
            raise
        return self

    def _open(self) -> None:
        cfg = self.cfg
        if cfg.ray.nats == "head" and not self._nats:
            self._nats_handle, self._nats = head_nats(cfg)
        url = self._nats or cfg.nats
        if url == "embedded":
            raise UserError(
                "start --ray needs a bus every node reaches: give --nats URL, a `nats:` URL in the config, "
                "or ray.nats: head (nats-server on the Ray head node)"
            )
        self.url = url
        self.pools = RolePools(
            self.configs,
            cfg,
            self._nats,
            self._passthrough,
            metrics_port=self._metrics_port,
            drain_timeout_s=self._drain_timeout_s,
            auth=self.auth,
        )
        self.scaler = Scaler(cfg, self.pools)
        if any(self.pools.role(r, n).elastic for r, n in self.pairs):  # its bus first: a refusal before any actor
            self._scaler_thread = threading.Thread(target=self._scale, daemon=True, name="gym-ray-scaler")
            self._scaler_thread.start()
            self._scaler_connected.wait()
            if self._scaler_error is not None:  # its bus refused it (credentials, TLS): a line now, not a quiet pool
                who = f"as publisher, {self.auth.creds('publisher')}" if self.auth is not None else "no credentials"
                raise UserError(f"the scaler ({who}): {self._scaler_error}")
        self.pools.start({(r, n): self.scaler.bounds(r, n)[0] for r, n in self.pairs})
        self._placed.set()

    def _scale(self) -> None:
        """The scaler's own event loop (the Ray calls it makes block: each in a worker thread of it)."""

        async def main() -> None:
            assert self.scaler is not None
            try:
                bus = await Bus.connect(
                    self.url,
                    namespace=self.cfg.namespace,
                    telemetry=Telemetry(),
                    name="gym-scaler",
                    auth=self.auth,
                    role="publisher" if self.auth is not None else None,
                )
            except Exception as e:
                self._scaler_error = e
                return
            finally:
                self._scaler_connected.set()
            try:
                while not self._placed.is_set():  # the roles' first actors, placed by ``_open``
                    if self._stop.is_set():
                        return
                    await anyio.sleep(0.1)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self.scaler.run, bus, self.pairs)
                    while not self._stop.is_set():
                        await anyio.sleep(0.1)
                    tg.cancel_scope.cancel()
            finally:
                with anyio.CancelScope(shield=True):
                    await bus.close()

        try:
            run_async(main)
        except Exception as e:  # said once; the placed actors keep serving at their size
            log.warning("scaler.stopped", reason=repr(e))

    @property
    def actors(self) -> list[Replica]:
        """Every placed actor now."""
        assert self.pools is not None
        return [r for rs in self.pools.replicas.values() for r in rs]

    def close(self) -> None:
        """Stop the scaler, drain every worker, end the actors (and the head's NATS: its store stays)."""
        self._stop.set()
        if self._scaler_thread is not None:
            self._scaler_thread.join(timeout=30)
        if self.pools is not None:
            self.pools.close()
        if self._nats_handle is not None:
            try:
                ray.get(self._nats_handle.stop.remote(), timeout=15)
            finally:
                ray.kill(self._nats_handle, no_restart=True)
        if self._inited:
            ray.shutdown()
            self._inited = False

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def serve_on_ray(placed: OnRay, *, ready: Any = None) -> int:
    """``start --ray``: place, say ready, serve until SIGTERM (0) or SIGINT (130), then drain. The handlers are
    set once Ray is up (``ray.init`` sets its own, which would end the process without a drain)."""
    got: list[int] = []
    done = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        got.append(signum)
        done.set()

    with placed:
        old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            if ready is not None:
                ready(len(placed.actors))
            done.wait()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
    return 130 if signal.SIGINT in got else 0
