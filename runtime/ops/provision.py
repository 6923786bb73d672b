"""Provisioning a secured server: as admin, create what every other role may only use.

Under ``server --secure`` no role but admin may create streams, consumers' streams, KV buckets or
the blob store, so the server's launcher runs :func:`provision` once per namespace after it starts,
with the run's ``jetstream:`` settings (replicas, retention, size limits).

A single server provisions before it reports itself started. A cluster node cannot: replicated
streams need their peers, and those are started one after another (``Provisioner`` provisions in
the background until enough nodes are up; every node tries, the first to succeed wins, the others
find the streams there).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import anyio

from gym_runtime.config import JetStreamConfig
from gym_runtime.data import batches
from gym_runtime.data.sampler_store import sampler_kv
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.ops.credentials import ClientAuth
from gym_runtime.rollout.checkpoint import checkpoints_kv
from gym_runtime.service.loop import run_async
from gym_runtime.transport import jetstream
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.subjects import BLOB_ROLES
from gym_runtime.workers import control


async def provision(
    url: str | list[str],
    auth: ClientAuth,
    namespaces: list[str],
    *,
    settings: JetStreamConfig | None = None,
    timeout: float | None = 30.0,
    waiting: Callable[[str], None] | None = None,
    agents: list[str] | None = None,
) -> None:
    """As admin, create each namespace's streams, batch, control and sampler KV buckets and blob store (idempotent).

    ``settings``: the run's ``jetstream:`` block (None: one replica, the default limits). ``agents``: the
    config's agents, each given a results stream of its own (None: no config, one stream for every agent's,
    as there are no agent pools to keep apart). Retries for
    ``timeout`` seconds (a cluster's JetStream needs a meta leader first), or with ``timeout=None``
    until it succeeds, also through setup errors (3 replicas while only two nodes are up), telling
    ``waiting`` why each time it waits.
    """
    deadline = None if timeout is None else anyio.current_time() + timeout
    while True:
        try:
            bus = await Bus.connect(
                url, namespace=namespaces[0], telemetry=Telemetry(), name="gym-provision", auth=auth, role="admin"
            )
            try:
                for ns in namespaces:
                    b = Bus(bus.nc, namespace=ns, telemetry=bus.telemetry)
                    b.jetstream_config = settings
                    await jetstream.ensure_streams(b)
                    await jetstream.provision_results(b, agents)  # a stream per agent (None: one shared)
                    await batches._kv(b)  # the manifest bucket, created on first use
                    await control.control_kv(b)  # the trainer's policy versions, pauses, cancelled batches
                    await sampler_kv(b)  # the task sampler's statistics (the publisher's)
                    # rollouts' checkpoints (resume at the last turn), aged out by the run's checkpoint_ttl_s
                    await checkpoints_kv(b, (settings or JetStreamConfig()).checkpoint_ttl_s)
                    await jetstream.ensure_kept_stream(b)  # each published task's body until its batch is purged
                    await jetstream.ensure_attempts_stream(b)  # each attempt's record of itself (explain)
                    for role in BLOB_ROLES:  # a stream per role; the last: clients take it for "provisioned"
                        await jetstream.ensure_blob_stream(b, role)
                return
            finally:
                with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                    await bus.close()
        except Exception as e:
            final = isinstance(e, jetstream.JetStreamSetupError) and deadline is not None  # one server: it stays
            if final or deadline is not None and anyio.current_time() >= deadline:
                raise
            if waiting is not None:
                waiting(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
            await anyio.sleep(1.0)


def provision_blocking(
    url: str,
    auth_dir: str | Path,
    namespaces: list[str],
    *,
    settings: JetStreamConfig | None = None,
    timeout: float = 30.0,
    agents: list[str] | None = None,
) -> None:
    """``provision`` from synchronous code, in a thread of its own (the caller may be inside an event loop)."""
    errors: list[BaseException] = []
    auth = ClientAuth(Path(auth_dir))

    def go() -> None:
        try:
            run_async(lambda: provision(url, auth, namespaces, settings=settings, timeout=timeout, agents=agents))
        except BaseException as e:  # re-raised in the caller's thread
            errors.append(e)

    t = threading.Thread(target=go, name="gym-provision")
    t.start()
    t.join()
    if errors:
        raise errors[0]


class Provisioner:
    """``provision`` in a background thread, until it succeeds or ``stop()``: a cluster node's provisioning.

    ``done`` is set once the namespaces are provisioned; ``waiting_for`` says why it is not yet.
    """

    def __init__(
        self,
        url: str,
        auth_dir: str | Path,
        namespaces: list[str],
        settings: JetStreamConfig | None,
        agents: list[str] | None = None,
    ) -> None:
        self.url, self.auth_dir, self.namespaces, self.settings = url, Path(auth_dir), namespaces, settings
        self.agents = agents
        self.done = threading.Event()
        self.waiting_for: str | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gym-provision", daemon=True)

    def start(self) -> Provisioner:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _said(self, why: str) -> None:
        self.waiting_for = why

    def _run(self) -> None:
        async def go() -> None:
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    while not self._stopped.is_set():
                        await anyio.sleep(0.1)
                    tg.cancel_scope.cancel()

                tg.start_soon(watch)
                auth = ClientAuth(self.auth_dir)
                await provision(
                    self.url,
                    auth,
                    self.namespaces,
                    settings=self.settings,
                    timeout=None,
                    waiting=self._said,
                    agents=self.agents,
                )
                self.waiting_for = None
                self.done.set()
                tg.cancel_scope.cancel()

        run_async(go)
