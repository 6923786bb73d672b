"""The trainer's client: submit rows, get each verified rollout back as it finishes, steer the policy.

A trainer keeps one ``Client`` for its whole run: it connects to a cluster (or starts an embedded
NATS server and the config's workers in this process) once, and every ``submit`` only publishes
tasks and reads results — no worker restarts between steps. Rows are exactly those ``collect``
writes (failures as its failure rows); nothing is printed unless the caller configures logging.

    async with Client("resources/weather/config.yaml") as client:
        await client.set_policy_version(3)
        batch = await client.submit(rows, repeats=4, max_staleness=1)
        async for group in batch.groups():   # all repeats of one task, in completion order
            ...

``SyncClient`` is the same API for synchronous trainers (an event loop in a helper thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import msgspec
from anyio.abc import TaskGroup

from gym_runtime.admission import GROUP_STALENESS, Admission, Budget, StalenessWindow, Work, parse_budget
from gym_runtime.config import Config, ResolvedConfig, load_config, resolve_config, resolve_models
from gym_runtime.data.batches import Manifest, Owners, new_manifest, put_manifest
from gym_runtime.data.collector import budget_results, failure_row
from gym_runtime.data.inputs import check_row, publish_rows, publish_task, row_tasks
from gym_runtime.data.intake import Intake, replaces
from gym_runtime.data.reader import BatchReader
from gym_runtime.data.validation import check_before_publish
from gym_runtime.errors import AuthError, ClientError, InputError, PublishTimeout, RolloutFailed
from gym_runtime.messages import RolloutResult, RolloutTask, RowCheck
from gym_runtime.model import PAUSE_MODES, interrupt_problem
from gym_runtime.observability import logs
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.ops.credentials import ClientAuth
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.service.runner import drain, make_workers, selected, start_workers
from gym_runtime.service.supervisor import StartProcess
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.connect import unanswered
from gym_runtime.transport.discovery import discover
from gym_runtime.transport.jetstream import ensure_kept_stream, ensure_streams, task_msg_id
from gym_runtime.transport.rpc import JS_PUBLISH_RETRY_S, Timings
from gym_runtime.workers import control

__all__ = ["BatchHandle", "Client"]

log = logs.get("gym.client")
CLUSTER_CHECK_S = 5.0  # how often a client looks for workers of another config that started after it


def _result_row(res: RolloutResult) -> tuple[dict[str, Any], bool]:
    if res.error is None and res.row is not None:
        return res.row, True
    return failure_row(res), False


@dataclass
class _Held:
    """Tasks of a batch not started yet: admitted together (one repeat, a group task, or a whole group)."""

    handle: BatchHandle
    work: Work
    tasks: list[RolloutTask]
    redone: bool = False  # stamped with a later version than it was submitted under


class BatchHandle:
    """One submitted batch: async-iterate rows in completion order, ``groups()``, ``gather()``, ``cancel()``.

    Iteration ends when every task×repeat has a row (or failure row: ``lost`` for a slot whose task left the
    queue without a result), or at once after ``cancel()``. Only the owning agent's results count (the
    manifest's owners, as ``collect`` checks them). Each slot is yielded once; in the rare case that a later
    attempt's row replaces a failure row already yielded (a worker lost after storing it), ``gather()``
    returns the replacement, as ``collect`` writes it.
    """

    def __init__(self, client: Client, manifest: Manifest) -> None:
        self.client = client
        self.batch = manifest.batch
        self.tasks = manifest.tasks
        self.repeats = manifest.repeats
        self.expected = manifest.expected
        self.cancelled = False
        self._rows: dict[int, tuple[dict[str, Any], bool, int]] = {}  # slot -> (row, ok, attempt)
        self._send, self._recv = anyio.create_memory_object_stream[dict[str, Any]](math.inf)
        self._reader = BatchReader.of(client.bus, manifest, self._take, self._empty, name="client")
        self._finished = anyio.Event()
        self._manifest = manifest
        self.admitted = False  # started by admission (``submit(batch_size=...)``)
        self.delivered = 0  # rows handed to the trainer
        self.consumed_rows = 0  # of those, reported with ``consumed``
        self.started = 0  # rollouts admitted (published)
        self.held = 0  # rollouts waiting for admission
        self.redone = 0  # rollouts submitted again under a newer version before they started (never run stale)
        self.budget: Budget | None = None  # ``submit(budget=...)``: what this batch may spend
        self.admission: Admission | None = None  # the gates its held tasks pass (the window, its budget)
        self.budget_stopped = 0  # rollouts its budget held back: ``budget`` failure rows, never started
        self.held_from = -1  # the first of them

    @property
    def done(self) -> bool:
        return self._finished.is_set()

    @property
    def refused(self) -> int:
        """Stored results of this batch that were not its owners' (or named no slot of it): dropped."""
        return self._reader.intake.refused

    def _empty(self) -> list[int]:
        return [] if self.cancelled else [s for s in range(self.expected) if s not in self._rows]

    def _take(self, res: RolloutResult, slot: int) -> None:
        if self.cancelled:
            return  # late: iteration has ended
        held = self._rows.get(slot)
        if held is not None:
            if replaces(held[1], held[2], res):
                self._rows[slot] = (*_result_row(res), res.attempts)
            return
        row, ok = _result_row(res)
        self._rows[slot] = (row, ok, res.attempts)
        if self.budget is not None and res.attempts:  # a stored result (a budget's own rows have no attempt)
            self.budget.done(res)
            self.client._wake_admission()
        self._send.send_nowait(row)
        if len(self._rows) >= self.expected:
            self._finish()

    def _finish(self) -> None:
        if not self._finished.is_set():
            self._finished.set()
            self._send.close()
            self._reader.stop()

    def __aiter__(self) -> BatchHandle:
        return self

    async def __anext__(self) -> dict[str, Any]:
        try:
            row = await self._recv.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None
        self.delivered += 1
        return row

    async def consumed(self, n: int) -> None:
        """The trainer used (or dropped) ``n`` more rows of this batch, failure rows included.

        With ``submit(batch_size=...)`` this is what lets more rollouts start (``gym_runtime.admission``);
        without, it is only counted."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ClientError(f"consumed(n) takes a count of rows >= 0, got {n!r}")
        if self.consumed_rows + n > self.delivered:
            raise ClientError(
                f"consumed({n}) on batch {self.batch}: only {self.delivered} rows were delivered and "
                f"{self.consumed_rows} reported consumed already"
            )
        self.consumed_rows += n
        if self.admitted and not self.cancelled:
            await self.client._consumed(n)

    async def groups(self) -> AsyncIterator[list[dict[str, Any]]]:
        """Each task's rows (all its repeats, in rollout order) as soon as the last one is in."""
        pending: dict[int, list[dict[str, Any]]] = {}
        async for row in self:
            group = pending.setdefault(int(row["_ng_task_index"]), [])
            group.append(row)
            if len(group) == self.repeats:
                del pending[int(row["_ng_task_index"])]
                yield sorted(group, key=lambda r: r["_ng_rollout_index"])

    async def gather(self) -> list[dict[str, Any]]:
        """Wait for the whole batch; every row received, in ``aabbcc`` order (as ``collect`` writes)."""
        async for _ in self:
            pass
        return [self._rows[s][0] for s in sorted(self._rows)]

    async def cancel(self) -> None:
        """Tasks of this batch not yet started are never run; iteration ends now."""
        self.cancelled = True
        await control.cancel_batch(self.client.bus, self.batch)
        self._finish()
        if self.admitted:  # its rollouts not consumed yet will not be: room for other batches
            await self.client._consumed(0, released=self.started - self.consumed_rows)
        elif self.held:  # held by its budget alone: published marked cancelled, as the window's are
            await self.client._admit()


class Client:
    """Async client; use ``async with Client(config) as client``.

    ``nats``: a URL (or list) of a running cluster, ``"embedded"`` to start a server here, or None
    for the config's ``nats``. ``workers``: start the config's workers in this process (``True``), as
    child processes (``"processes"``: ``gym-runtime start``, one per replica; config given as a path),
    not at all (``False``: they run elsewhere), or only some in-process (``["models.policy"]``).
    ``publish_retry_s``: how long a publish the server does not acknowledge (an overloaded server) is sent
    again, with the same message id (stored once); past it, ``submit`` and ``run`` raise ``PublishTimeout``.
    """

    def __init__(
        self,
        config: ResolvedConfig | str | Path,
        *,
        nats: str | list[str] | None = None,
        auth_dir: str | Path | None = None,
        workers: bool | str | list[str] = True,
        replicas: int | None = None,
        telemetry: Telemetry | None = None,
        check_fingerprints: bool = True,
        publish_retry_s: float = JS_PUBLISH_RETRY_S,
    ) -> None:
        if not publish_retry_s > 0:
            raise ClientError(f"publish_retry_s must be > 0 (seconds), got {publish_retry_s!r}")
        # A path is resolved here: the fingerprints hash the adapters' parsed options; workers started in this
        # process need their agents' option checks too (a client that only submits imports no agent module).
        in_process = workers is True or isinstance(workers, list)
        if isinstance(config, Config):
            raise ClientError("Client takes a config file's path or resolve_config(load_config(...)), not a Config")
        if isinstance(config, ResolvedConfig):
            if in_process and not config.plugins:
                raise ClientError("workers in this process need resolve_config(config), not resolve_models(config)")
            self.config = config
        else:
            resolve = resolve_config if in_process else resolve_models
            self.config = resolve(load_config(config))
        self.config_path = None if isinstance(config, ResolvedConfig) else str(Path(config).resolve())
        if workers == "processes" and self.config_path is None:
            raise ClientError('workers="processes" needs the config as a path (the child processes load it)')
        self._children: StartProcess | None = None  # workers="processes"
        self.url = nats if nats is not None else self.config.config.nats
        self.auth_dir = auth_dir
        self.workers_spec = workers
        self.replicas = replicas
        self.telemetry = telemetry or Telemetry()
        self.check_fingerprints = check_fingerprints
        self.publish_retry_s = publish_retry_s
        self.policy_version: int | None = None
        self.workers: list[Any] = []
        self._server: EmbeddedServer | None = None
        self._bus: Bus | None = None
        self._tg: TaskGroup | None = None
        # pending run() calls: index -> (its answer, the agent that runs it)
        self._runs: dict[int, tuple[asyncio.Future[tuple[dict[str, Any], bool]], str]] = {}
        self._run_batch = f"run-{uuid.uuid4().hex[:12]}"
        self._run_seq = 0
        self._run_reader: BatchReader | None = None
        self._run_lock = anyio.Lock()
        self._fps = self.config.fingerprints
        self._mismatch: ClientError | None = None  # what the last cluster check found (``_watch_cluster``)
        # admission by staleness (``submit(batch_size=...)``): one window over every open batch, its held tasks
        self._window: StalenessWindow | None = None
        self._admission: Admission | None = None
        self._held: deque[_Held] = deque()
        self._admit_lock = anyio.Lock()

    @property
    def bus(self) -> Bus:
        if self._bus is None:
            raise ClientError("the client is not started: use `async with Client(...) as client`")
        return self._bus

    # ---------------------------------------------------------------------------- life cycle

    async def __aenter__(self) -> Client:
        logs.library_mode()
        url = self.url
        if url == "embedded":
            self._server = EmbeddedServer(sync=self.config.jetstream.sync)
            url = self._server.start()
        try:
            kw = self._auth_kwargs()
            self._bus = await Bus.connect(  # the config's jetstream: settings for the streams it creates
                url,
                namespace=self.config.namespace,
                telemetry=self.telemetry,
                name="gym-client",
                jetstream=self.config.jetstream,
                timings=Timings(store_retry_s=self.publish_retry_s),
                **kw,
            )
            await ensure_streams(self._bus, self.config.agents)  # and each agent's results stream
            self._tg = anyio.create_task_group()
            await self._tg.__aenter__()
            if self.workers_spec == "processes":
                assert self.config_path is not None
                self._children = await StartProcess.open(
                    self.config_path, url, auth_dir=self.auth_dir, replicas=self.replicas
                )
            elif self.workers_spec:
                only = None if self.workers_spec is True else list(self.workers_spec)
                self.workers = make_workers(self._bus, self.config, selected(self.config, only), replicas=self.replicas)
                await start_workers(self._tg, self.workers)
            if self.check_fingerprints:
                await self.check_cluster()
                self._tg.start_soon(self._watch_cluster)
            models = self.policy_models()
            if models:
                self.policy_version = await control.read_version(self._bus, models[0])
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        for fut, _ in self._runs.values():
            if not fut.done():
                fut.cancel()
        if self.workers:
            with anyio.CancelScope(shield=True):
                await drain(self.workers, timeout=5.0)
        if self._tg is not None:  # exited here, outside any other scope (cancel scopes nest strictly)
            tg, self._tg = self._tg, None
            tg.cancel_scope.cancel()
            with contextlib.suppress(Exception):
                await tg.__aexit__(None, None, None)
        with anyio.CancelScope(shield=True):
            if self._children is not None:
                await self._children.close()
                self._children = None
            if self._bus is not None:
                await self._bus.close()
                self._bus = None
            if self._server is not None:
                self._server.stop()
                self._server = None

    def _auth_kwargs(self) -> dict[str, Any]:
        """Credentials for ``Bus.connect`` from ``auth_dir``.

        In-process workers share the client's connection, so it then needs the ``admin`` role; a
        client alone is a ``publisher``.
        """
        if self.auth_dir is None:
            return {}
        try:
            auth = ClientAuth.resolve(str(self.auth_dir))
        except AuthError as e:  # the directory is not a trust directory
            raise ClientError(str(e)) from None
        in_process = bool(self.workers_spec) and self.workers_spec != "processes"
        return {"auth": auth, "role": "admin" if in_process else "publisher"}

    async def check_cluster(self) -> None:
        """Raise ``ClientError`` if a live worker of this namespace serves another config's entry,
        naming the config keys that differ."""
        problems = control.mismatches(self.config, await discover(self.bus, wait_s=0.3))
        if problems:
            raise ClientError(
                f"namespace {self.config.namespace!r} has live workers started with another config than this "
                "client's: "
                + "; ".join(problems)
                + ". Start the workers with this config (and --set values), or give each experiment its own "
                "`namespace`."
            )

    async def _watch_cluster(self) -> None:
        """Workers that start after the client are checked too: the next ``submit``/``run`` raises what a
        check finds (a worker of another config would fail every task it takes)."""
        while self._mismatch is None:
            await anyio.sleep(CLUSTER_CHECK_S)
            try:
                await self.check_cluster()
            except ClientError as e:
                self._mismatch = e
            except Exception as e:  # a reconnecting bus: the next round tries again
                log.debug("client.cluster_check", error=str(e))

    def _raise_mismatch(self) -> None:
        if self._mismatch is not None:
            raise self._mismatch

    # ---------------------------------------------------------------------------- policy

    def policy_models(self) -> list[str]:
        """The models the config's agents call (the policy), sorted."""
        return sorted({a.model for a in self.config.agents.values()})

    def _models(self, model: str | None) -> list[str]:
        if model is None:
            return self.policy_models()
        if model not in self.config.models:
            raise ClientError(f"no model named {model!r} in the config ({', '.join(self.config.models)})")
        return [model]

    async def set_policy_version(self, version: int, *, model: str | None = None) -> None:
        """Make ``version`` current (KV + announcement); versions only go up."""
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ClientError(f"a policy version is a non-negative integer, got {version!r}")
        for m in self._models(model):
            current = await control.read_version(self.bus, m)
            if current is not None and version < current:
                raise ClientError(f"policy version must not go down: {m!r} is at {current}, got {version}")
            await control.publish_version(self.bus, m, version)
        self.policy_version = version
        if self._window is not None:
            self._window.updated(version)
            await self._admit()

    async def pause(self, *, model: str | None = None, mode: str = "drain", timeout: float = 60.0) -> int:
        """Hold new calls of the model(s); returns once every live replica has none in flight.

        ``mode``: ``drain`` waits for the calls in flight; ``interrupt`` stops them at once, keeping their
        tokens, and they continue under the next policy after ``resume()`` (adapters with token ids:
        ``vllm`` with ``interruptible: true``, ``vllm_engine``); ``abort`` stops them and makes them
        again after ``resume()``. Either way a model call through ``ctx`` still returns one response.
        Returns the number of replicas that acknowledged.
        """
        if mode not in PAUSE_MODES:
            raise ClientError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        models = self._models(model)
        if mode == "interrupt":
            for m in models:
                problem = interrupt_problem(self.config.models[m])
                if problem is not None:
                    raise ClientError(f"models.{m}: cannot pause with mode='interrupt': {problem}")
        acked = 0
        for m in models:
            live = {
                str(w["worker"])
                for w in await discover(self.bus, wait_s=0.5)
                if w.get("role") == "model" and w.get("name") == m
            }
            await control.set_paused(self.bus, m, True)
            replies = await control.send_pause(self.bus, m, live, timeout=timeout, mode=mode)
            got = {getattr(r, "worker", None) for r in replies}
            missing = live - got
            if missing:
                raise ClientError(
                    f"model {m!r}: replicas {sorted(missing)} did not acknowledge the pause within {timeout:g}s"
                )
            acked += len(got)
        return acked

    async def resume(self, *, model: str | None = None) -> None:
        for m in self._models(model):
            await control.set_paused(self.bus, m, False)
            await control.send_resume(self.bus, m)

    # ---------------------------------------------------------------------------- work

    def _check_rows(self, rows: list[Any], agent: str | None, *, any_tools: bool = False) -> dict[str, RowCheck]:
        """The checks ``gym-runtime validate`` makes (``ClientError`` naming the first rows that fail); the
        agents whose rows their resource workers check at seed time (environments not importable here)."""
        agents = list(self.config.agents)
        if not agents:
            raise ClientError("the config names no agents")
        problems = []
        for i, row in enumerate(rows):
            try:
                check_row(row, agents, agent)
            except ValueError as e:
                problems.append(f"row {i}: {e}")
        checks: dict[str, RowCheck] = {}
        if not problems:
            try:
                checks = check_before_publish(
                    self.config.config, ((f"row {i}", r) for i, r in enumerate(rows)), agent=agent, any_tools=any_tools
                )
            except InputError as e:
                problems = e.problems
        if problems:
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise ClientError("invalid rows, nothing was submitted: " + "; ".join(problems[:5]) + more)
        return checks

    def _task_fields(
        self, policy_version: int | None, max_staleness: int | None, checks: dict[str, RowCheck] | None = None
    ) -> Any:
        def fields(agent: str) -> dict[str, Any]:
            return {
                "policy_version": policy_version,
                "max_staleness": max_staleness,
                "fingerprint": self._fps.get(("agent", agent)),
                "check": (checks or {}).get(agent),
            }

        return fields

    def _version_for(self, policy_version: int | None, max_staleness: int | None) -> int | None:
        version = self.policy_version if policy_version is None else policy_version
        if max_staleness is not None:
            if version is None:
                raise ClientError("max_staleness needs a policy version: call set_policy_version() first")
            if max_staleness < 0:
                raise ClientError(f"max_staleness must be >= 0, got {max_staleness}")
        return version

    async def submit(
        self,
        rows: Iterable[dict[str, Any]],
        *,
        repeats: int = 1,
        policy_version: int | None = None,
        max_staleness: int | None = None,
        agent: str | None = None,
        batch: str | None = None,
        any_tools: bool = False,
        batch_size: int | None = None,
        group_staleness: str = "member",
        budget: float | str | None = None,
    ) -> BatchHandle:
        """Publish rows × ``repeats`` as one batch; returns its handle at once.

        Rows are checked as ``gym-runtime validate`` checks them (task fields, tools of the environment;
        ``any_tools=True`` lets rows offer tools the environment does not have: answer channels); a bad row
        is a ``ClientError`` and nothing is published.

        ``policy_version`` defaults to the current one; with ``max_staleness=S`` a task that has not
        started when the current version is more than S past its own is dropped (a ``stale`` row).

        ``batch_size=B`` (with ``max_staleness``) bounds what starts instead: the trainer consumes B rows per
        policy version and says so with ``consumed(n)`` on the handle, and a rollout starts only when it will
        be consumed within S versions of its submit, across every open batch (AReaL's rule:
        ``gym_runtime.admission``). A task that could not start in time is submitted again under the current
        version before it runs; ``group_staleness``: ``member`` (each repeat on its own: only the members that
        did not start in time are redone) or ``group`` (a task's repeats start together, or are redone together).

        ``budget``: what this batch may spend, money (``2.50``, in ``pricing.currency``: needs a ``pricing``
        section) or tokens (``"200000tokens"``). A task starts only while the spent plus what is in flight
        (each rollout in flight at the mean cost of those finished; one at a time until the first finishes)
        stays within it (``gym_runtime.admission.Budget``); once spent, the rest are never started and their
        rows are ``budget`` failure rows (``handle.budget_stopped`` counts them).
        """
        self._raise_mismatch()
        gate = self._budget(budget)
        rows = list(rows)
        if repeats < 1:
            raise ClientError("repeats must be at least 1")
        if not rows:
            raise ClientError("no rows to submit")
        checks = self._check_rows(rows, agent, any_tools=any_tools)
        version = self._version_for(policy_version, max_staleness)
        if batch_size is not None:
            self._check_admission(rows, repeats, max_staleness, batch_size, group_staleness, agent)
        agents = list(self.config.agents)
        owners = Owners()
        for row in rows:
            owners.add(check_row(row, agents, agent))
        manifest = new_manifest(
            batch or uuid.uuid4().hex[:12],
            owners,
            repeats=repeats,
            input_path="(gym_runtime.Client)",
            max_republish=self.config.jetstream.max_republish,
            models=self.config.model_table(),
        )
        handle = BatchHandle(self, manifest)
        with self._acked("submit", f"batch {handle.batch}'s manifest"):
            await put_manifest(self.bus, manifest)
        await handle._reader.open()
        assert self._tg is not None
        self._tg.start_soon(handle._reader.run)
        layout: dict[str, Any] = {  # the tasks the rows make, held back by admission or published at once
            "batch": handle.batch,
            "agents": agents,
            "agent": agent,
            "repeats": repeats,
            "task_fields": self._task_fields(version, max_staleness, checks),
            "grouped": lambda a: self.config.agents[a].group_repeats,
        }
        if batch_size is not None or gate is not None:
            handle.budget = gate
            tasks = list(row_tasks(rows, **layout))
            await self._hold(handle, tasks, batch_size, by_group=group_staleness == "group")
            return handle
        with self._acked("submit", f"batch {handle.batch}'s tasks"):
            await publish_rows(self.bus, rows, **layout, keep=manifest.max_republish > 0)
            await put_manifest(self.bus, msgspec.structs.replace(manifest, published=True))  # collect may settle it
        return handle

    @contextlib.contextmanager
    def _acked(self, call: str, what: str) -> Iterator[None]:
        """Publishes of ``what`` for ``call``: a publish the server left unacknowledged past the budget (the bus
        sent it again until then) is one ``PublishTimeout``, not nats-py's TimeoutError (in a group or not)."""
        try:
            yield
        except BaseException as e:
            lost = unanswered(e) or (isinstance(e, BaseExceptionGroup) and e.subgroup(unanswered) is not None)
            if not lost:
                raise
            raise PublishTimeout(
                f"{call}: the NATS server did not acknowledge the {what} within {self.publish_retry_s:g} s (the "
                "publish was sent again with the same message id until then, so it is stored at most once); the "
                "server is overloaded or unreachable: retry once it answers, or give Client(publish_retry_s=...) "
                "more time"
            ) from None

    # ---------------------------------------------------------------------------- admission

    def _budget(self, budget: float | str | None) -> Budget | None:
        """``submit(budget=...)`` as a gate; each mistake one ``ClientError``."""
        if budget is None:
            return None
        try:
            gate = parse_budget(budget)
        except ValueError as e:
            raise ClientError(str(e)) from None
        if not gate.tokens and self.config.pricing is None:
            raise ClientError(
                f"budget={budget!r} is an amount of money, but the config has no `pricing` section to estimate "
                "costs with: add one, or give the budget in tokens (budget='200000tokens')"
            )
        return gate

    def _wake_admission(self) -> None:
        """A budgeted batch's result came: held tasks may start now (or be held back for good)."""
        if self._tg is not None:
            self._tg.start_soon(self._admit)

    def _check_admission(
        self,
        rows: list[dict[str, Any]],
        repeats: int,
        max_staleness: int | None,
        batch_size: int,
        group_staleness: str,
        agent: str | None,
    ) -> None:
        """``submit``'s admission arguments, each mistake one ``ClientError``."""
        if max_staleness is None:
            raise ClientError("batch_size bounds rollouts by staleness: give max_staleness too")
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ClientError(
                f"batch_size (the rollouts the trainer consumes per policy version) must be >= 1, got {batch_size!r}"
            )
        if group_staleness not in GROUP_STALENESS:
            raise ClientError(f"group_staleness must be one of {', '.join(GROUP_STALENESS)}, got {group_staleness!r}")
        window = self._window
        if window is not None and window.batch_size != batch_size and (window.outstanding or self._held):
            raise ClientError(
                f"batch_size={batch_size}, but open batches were submitted with batch_size={window.batch_size}: "
                "one trainer consumes one batch size"
            )
        whole = group_staleness == "group" or any(
            self.config.agents[check_row(r, list(self.config.agents), agent)].group_repeats for r in rows
        )
        if whole and batch_size % repeats:
            raise ClientError(
                f"a task's {repeats} repeats start together: batch_size={batch_size} must be a multiple of them "
                "(the trainer consumes whole groups), or use group_staleness='member'"
            )

    async def _hold(
        self, handle: BatchHandle, tasks: list[RolloutTask], batch_size: int | None, *, by_group: bool
    ) -> None:
        """Queue a batch's tasks for admission (one unit each, or each task's repeats as one), then admit."""
        if batch_size is not None and (self._window is None or self._window.batch_size != batch_size):
            assert self.policy_version is not None  # max_staleness needs one (``_version_for``)
            self._window = StalenessWindow(batch_size, self.policy_version)
            self._admission = Admission(self._window)
        gates = ([self._window] if batch_size is not None and self._window is not None else []) + (
            [handle.budget] if handle.budget is not None else []
        )
        handle.admission = Admission(*gates)
        await ensure_streams(self.bus)
        if self.config.jetstream.max_republish > 0:
            await ensure_kept_stream(self.bus)
        handle.admitted = batch_size is not None  # in the staleness window (what ``consumed`` reports to)
        for t in tasks:
            units = max(t.group, 1)
            last = self._held[-1] if self._held else None
            if by_group and last is not None and last.handle is handle and last.tasks[0].task_index == t.task_index:
                last.tasks.append(t)
                last.work.units += units
            else:
                self._held.append(_Held(handle, Work(units, t.policy_version, t.max_staleness, t.agent), [t]))
            handle.held += units
        await self._admit()

    async def _consumed(self, n: int, *, released: int = 0) -> None:
        if self._window is not None:
            self._window.consumed(n)
            self._window.released(released)
            await self._admit()

    async def _admit(self) -> None:
        """Publish the held tasks their batch's gates have room for (the staleness window, its budget), in submit
        order; a task that can no longer start within its staleness bound is stamped with the current version
        first (redone, never run stale); a batch whose budget is spent gets ``budget`` rows for the rest."""
        window = self._window
        async with self._admit_lock:
            out: list[RolloutTask] = []
            touched: dict[str, BatchHandle] = {}
            if any(h.handle.cancelled for h in self._held):
                # a cancelled batch's held tasks are published all the same, outside the window: a worker
                # turns each into its ``cancelled`` row without running it, so the batch still ends with one
                # row per slot (a collector would wait on them forever)
                for held in [h for h in self._held if h.handle.cancelled]:
                    held.handle.held -= held.work.units
                    touched[held.handle.batch] = held.handle
                    out.extend(msgspec.structs.replace(t, cancelled=True) for t in held.tasks)
                self._held = deque(h for h in self._held if not h.handle.cancelled)
            while self._held:
                held = self._held[0]
                handle = held.handle
                windowed = window is not None and window in (handle.admission.gates if handle.admission else ())
                if windowed and window is not None and window.expired(held.work):
                    held.work.version = window.version
                    held.tasks = [msgspec.structs.replace(t, policy_version=window.version) for t in held.tasks]
                    held.redone = True
                assert handle.admission is not None
                if not handle.admission.admit(held.work):
                    budget = handle.budget
                    spent = budget is not None and not budget.in_flight and budget.room(held.work) < held.work.units
                    if not spent:
                        break  # no room yet (window, or a budget's results in flight): what follows waits, in order
                    self._held.popleft()  # spent: this task and the batch's others never start
                    self._budget_stop(held)
                    touched[handle.batch] = handle
                    continue
                self._held.popleft()
                held.handle.held -= held.work.units
                held.handle.started += held.work.units
                held.handle.redone += held.work.units if held.redone else 0
                touched[held.handle.batch] = held.handle
                out.extend(held.tasks)
            keep = self.config.jetstream.max_republish > 0
            with self._acked("admission", "held tasks"):
                async with anyio.create_task_group() as tg:
                    for task in out:
                        tg.start_soon(partial(publish_task, self.bus, task, keep=keep))
                for handle in touched.values():
                    if handle.held == 0:  # all that will be is published: lost slots may be settled
                        held_from = handle.held_from if handle.budget_stopped else -1
                        manifest = msgspec.structs.replace(handle._manifest, published=True, held_from=held_from)
                        await put_manifest(self.bus, manifest)
        if self._admission is not None:
            self._admission.changed()

    def _budget_stop(self, held: _Held) -> None:
        """``held``'s batch spent its budget: its tasks get ``budget`` failure rows, never started."""
        handle, budget = held.handle, held.handle.budget
        assert budget is not None
        spent = f"{budget.spent:,.0f} tokens" if budget.tokens else f"{budget.spent:.4f}"
        message = f"not started: the batch's budget was spent ({spent} of {budget.limit:g})"
        if budget.refused:
            message = f"not started: {budget.refused} ({spent} of {budget.limit:g} spent)"
        handle.held -= held.work.units
        for task in held.tasks:
            for slot, res in budget_results(task, handle.repeats, message):
                handle.budget_stopped += 1
                handle.held_from = min(handle.held_from, slot) if handle.held_from >= 0 else slot
                handle._take(res, slot)

    async def run(
        self,
        row: dict[str, Any],
        *,
        agent: str | None = None,
        policy_version: int | None = None,
        max_staleness: int | None = None,
        any_tools: bool = False,
    ) -> dict[str, Any]:
        """One rollout, awaited (what the gateway's ``/run`` does); raises ``RolloutFailed`` on a failure row.

        The row is checked as ``submit`` checks rows (a ``ClientError``, nothing published).

        All ``run`` calls of a client share one open-ended batch and one result reader, so a call
        costs one task publish and one result message.
        """
        self._raise_mismatch()
        checks = self._check_rows([row], agent, any_tools=any_tools)
        name = check_row(row, list(self.config.agents), agent)
        version = self._version_for(policy_version, max_staleness)
        if self._run_reader is None:
            async with self._run_lock:
                if self._run_reader is None:
                    intake = Intake(self.bus, self._run_batch, repeats=1, tasks=None, allows=self._run_owned)
                    agents = list(self.config.agents)
                    reader = BatchReader(self.bus, intake, self._take_run, name="client", agents=agents)
                    await reader.open()
                    assert self._tg is not None
                    self._tg.start_soon(reader.run)
                    self._run_reader = reader
        index = self._run_seq
        self._run_seq += 1
        fut: asyncio.Future[tuple[dict[str, Any], bool]] = asyncio.get_running_loop().create_future()
        self._runs[index] = (fut, name)
        try:
            task = RolloutTask(
                batch=self._run_batch,
                task_index=index,
                rollout_index=0,
                agent=name,
                row=row,
                **self._task_fields(version, max_staleness, checks)(name),
            )
            with self._acked("run", "task"):
                await self.bus.js_publish(
                    self.bus.subjects.task(name, self._run_batch), task, msg_id=task_msg_id(self._run_batch, index, 0)
                )
            out, ok = await fut
        finally:
            self._runs.pop(index, None)
        if not ok:
            raise RolloutFailed(out)
        return out

    def _run_owned(self, index: int, agent: str) -> bool:
        """Whether ``agent`` ran the pending ``run`` call ``index`` (its results are the only ones taken)."""
        pending = self._runs.get(index)
        return pending is not None and pending[1] == agent

    def _take_run(self, res: RolloutResult, index: int) -> None:
        fut = self._runs[index][0]  # pending: the intake checked it
        if not fut.done():
            fut.set_result(_result_row(res))


# ------------------------------------------------------------------------------------ sync facade
