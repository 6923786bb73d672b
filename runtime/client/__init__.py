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

``SyncClient`` is the same API for synchronous trainers (an event loop in a helper thread: ``client.sync``).
The package's other modules hold the client's other jobs: ``batch`` (a submitted batch's handle),
``admission`` (what ``submit`` holds back by staleness and budget), ``control`` (the policy version, pause and
resume).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable, Coroutine, Iterable, Iterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
from anyio.abc import TaskGroup

from gym_runtime.client import control as model_control
from gym_runtime.client.admission import Admitter
from gym_runtime.client.batch import BatchHandle, result_row
from gym_runtime.config import Config, ResolvedConfig, load_config, resolve_config, resolve_models
from gym_runtime.data.batches import new_manifest, put_manifest
from gym_runtime.data.inputs import publish_rows, row_tasks
from gym_runtime.data.intake import Intake
from gym_runtime.data.reader import BatchReader
from gym_runtime.data.rowkeys import is_runtime_key
from gym_runtime.data.validation import CheckedRows, check_before_publish
from gym_runtime.errors import AuthError, ClientError, InputError, PublishTimeout, RolloutFailed, UserError
from gym_runtime.messages import BranchPoint, RolloutResult, RolloutTask, RowCheck
from gym_runtime.observability import logs
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.ops.credentials import ClientAuth
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.plugins import config_path
from gym_runtime.rollout.branch import kept_s, parse_point
from gym_runtime.service.runner import drain, make_workers, selected, start_workers
from gym_runtime.service.supervisor import StartProcess
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.connect import unanswered
from gym_runtime.transport.discovery import discover
from gym_runtime.transport.jetstream import ensure_streams, task_msg_id
from gym_runtime.transport.rpc import JS_PUBLISH_RETRY_S, Timings
from gym_runtime.workers import control

__all__ = ["BatchHandle", "Client"]


log = logs.get("gym.client")
CLUSTER_CHECK_S = 5.0  # how often a client looks for workers of another config that started after it


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
        else:  # a path, or a bundled environment's name, as `run` takes them (a wrong one names the bundled)
            config = config_path(str(config))
            resolve = resolve_config if in_process else resolve_models
            self.config = resolve(load_config(config))
        self.config_path = None if isinstance(config, ResolvedConfig) else str(Path(config).resolve())
        if workers == "processes" and self.config_path is None:
            raise ClientError('workers="processes" needs the config as a path (the child processes load it)')
        self._children: StartProcess | None = None  # workers="processes"
        self.url = nats if nats is not None else self.config.nats
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
        # what submit(batch_size=..., budget=...) holds back: one staleness window over every open batch, budgets
        self._admitter = Admitter(self.config, bus=lambda: self.bus, spawn=self._spawn, acked=self._acked)

    @property
    def bus(self) -> Bus:
        if self._bus is None:
            raise ClientError("the client is not started: use `async with Client(...) as client`")
        return self._bus

    def _spawn(self, fn: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run ``fn`` in the client's task group (while it is open)."""
        if self._tg is not None:
            self._tg.start_soon(fn)

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
        problems = self.config.mismatches(await discover(self.bus, wait_s=0.3))
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
        return model_control.policy_models(self.config)

    async def set_policy_version(self, version: int, *, model: str | None = None) -> None:
        """Make ``version`` current (KV + announcement); versions only go up."""
        await model_control.set_version(self.bus, self.config, version, model)
        self.policy_version = version
        await self._admitter.updated(version)

    async def pause(self, *, model: str | None = None, mode: str = "drain", timeout: float = 60.0) -> int:
        """Hold new calls of the model(s); returns once every live replica has none in flight.

        ``mode``: ``drain`` waits for the calls in flight; ``interrupt`` stops them at once, keeping their
        tokens, and they continue under the next policy after ``resume()`` (adapters with token ids:
        ``vllm`` with ``interruptible: true``, ``vllm_engine``); ``abort`` stops them and makes them
        again after ``resume()``. Either way a model call through ``ctx`` still returns one response.
        Returns the number of replicas that acknowledged.
        """
        return await model_control.pause(self.bus, self.config, model, mode, timeout)

    async def resume(self, *, model: str | None = None) -> None:
        await model_control.resume(self.bus, self.config, model)

    # ---------------------------------------------------------------------------- work

    def _check_rows(self, rows: list[Any], agent: str | None, *, any_tools: bool = False) -> CheckedRows:
        """The checks ``gym-runtime validate`` makes, each row checked once (``ClientError`` naming the first rows
        that fail): each row's route, reused to lay out its tasks, and the agents whose rows their resource
        workers check at seed time (environments not importable here)."""
        if not self.config.agents:
            raise ClientError("the config names no agents")
        try:
            return check_before_publish(
                self.config.config, ((f"row {i}", r) for i, r in enumerate(rows)), agent=agent, any_tools=any_tools
            )
        except InputError as e:
            more = f" (and {len(e.problems) - 5} more)" if len(e.problems) > 5 else ""
            raise ClientError("invalid rows, nothing was submitted: " + "; ".join(e.problems[:5]) + more) from None
        except UserError as e:  # ``agent`` names no agent of the config
            raise ClientError(str(e)) from None

    def _task_fields(
        self,
        policy_version: int | None,
        max_staleness: int | None,
        checks: dict[str, RowCheck] | None = None,
        branch: BranchPoint | None = None,
        keep_s: float = 0.0,
    ) -> Any:
        def fields(agent: str) -> dict[str, Any]:
            return {
                "policy_version": policy_version,
                "max_staleness": max_staleness,
                "fingerprint": self._fps.get(("agent", agent)),
                "check": (checks or {}).get(agent),
                "branch": branch,
                "keep_checkpoints_s": keep_s,
            }

        return fields

    def _kept_s(self, keep_checkpoints_s: float | None) -> float:
        try:
            return kept_s(keep_checkpoints_s, self.config.jetstream.checkpoint_ttl_s)
        except ValueError as e:
            raise ClientError(str(e)) from None

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
        keep_checkpoints_s: float | None = None,
        _branch: BranchPoint | None = None,
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

        ``keep_checkpoints_s``: keep each rollout's checkpoint, a part per turn, this long from each write (not
        deleted with its row), so ``branch`` may branch it at any turn that made tool calls.
        """
        self._raise_mismatch()
        keep_s = self._kept_s(keep_checkpoints_s)
        gate = self._admitter.budget(budget)
        rows = list(rows)
        if repeats < 1:
            raise ClientError("repeats must be at least 1")
        if not rows:
            raise ClientError("no rows to submit")
        checked = self._check_rows(rows, agent, any_tools=any_tools)  # once: each row's route, reused below
        version = self._version_for(policy_version, max_staleness)
        if batch_size is not None:
            self._admitter.check(checked.routes, repeats, max_staleness, batch_size, group_staleness)
        manifest = new_manifest(
            batch or uuid.uuid4().hex[:12],
            checked.owners(),
            repeats=repeats,
            input_path="(gym_runtime.Client)",
            max_republish=self.config.jetstream.max_republish,
            models=self.config.model_table(),
        )
        a = self._admitter
        handle = BatchHandle(self.bus, manifest, woken=a.woken, consumed=a.consumed, admit=a.admit)
        with self._acked("submit", f"batch {handle.batch}'s manifest"):
            await put_manifest(self.bus, manifest)
        await handle._reader.open()
        assert self._tg is not None
        self._tg.start_soon(handle._reader.run)
        layout: dict[str, Any] = {  # the tasks the rows make, held back by admission or published at once
            "batch": handle.batch,
            "agents": list(self.config.agents),
            "agent": agent,
            "routes": checked.routes,
            "repeats": repeats,
            "task_fields": self._task_fields(version, max_staleness, checked.seed_checks, _branch, keep_s),
            # a branch point's continuations run each on its own (a group task writes no checkpoint to branch)
            "grouped": lambda a: _branch is None and self.config.agents[a].group_repeats,
        }
        if batch_size is not None or gate is not None:
            handle.budget = gate
            tasks = list(row_tasks(rows, **layout))
            by_group = group_staleness == "group"
            await a.hold(handle, tasks, batch_size, by_group=by_group, policy_version=self.policy_version)
            return handle
        with self._acked("submit", f"batch {handle.batch}'s tasks"):
            await publish_rows(self.bus, rows, **layout, keep=manifest.max_republish > 0)
            await put_manifest(self.bus, msgspec.structs.replace(manifest, published=True))  # collect may settle it
        return handle

    async def branch(
        self,
        row: dict[str, Any],
        *,
        parent: str,
        turn: int,
        m: int,
        agent: str | None = None,
        batch: str | None = None,
        any_tools: bool = False,
        keep_checkpoints_s: float | None = None,
        policy_version: int | None = None,
        max_staleness: int | None = None,
    ) -> BatchHandle:
        """Branch rollout ``parent`` (``"batch:task_index:rollout_index"``, as a branch's row spells it in
        ``branch_of``) at model turn ``turn`` into ``m`` continuations: one batch of one task, ``row`` (the parent's
        input row; a finished parent's row does too, the runtime's keys but its prompt and ``agent_ref`` dropped),
        its ``m`` rows one group.

        Each continuation takes the parent's trajectory up to that turn (the same items and token ids), a session
        of its own restored from the environment's snapshot kept there, and samples its own turns from it; its row
        names ``branch_of`` and ``branch_turn``. The parent must have been submitted with ``keep_checkpoints_s``
        (finished or still running) and be run by the same agent pool: a branch point that cannot be taken up
        (none kept, expired, another pool's, an environment that cannot snapshot) is each row's ``invalid_task``
        failure naming why. ``keep_checkpoints_s`` keeps the branches' own checkpoints, to branch them again.
        """
        try:
            point = parse_point(parent, turn)
        except ValueError as e:
            raise ClientError(str(e)) from None
        if m < 1:
            raise ClientError(f"m must be at least 1 (the continuations to run), got {m}")
        kept = ("responses_create_params", "agent_ref")  # its prompt, and the agent that ran it (its route)
        task_row = {k: v for k, v in row.items() if k in kept or not is_runtime_key(k)}
        return await self.submit(
            [task_row],
            repeats=m,
            agent=agent,
            batch=batch,
            any_tools=any_tools,
            keep_checkpoints_s=keep_checkpoints_s,
            policy_version=policy_version,
            max_staleness=max_staleness,
            _branch=point,
        )

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
        checked = self._check_rows([row], agent, any_tools=any_tools)
        name = checked.routes[0]
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
                **self._task_fields(version, max_staleness, checked.seed_checks)(name),
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
            fut.set_result(result_row(res))
