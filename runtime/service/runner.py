"""Composition: start the workers a config names, and run one batch end to end.

``serve`` is what ``gym-runtime start`` runs (long-lived workers that drain on
SIGTERM); ``run_batch`` is ``gym-runtime run`` minus the embedded server:
workers + publish + collect in one process, sharing one NATS connection.
"""

from __future__ import annotations

import functools
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import anyio
import msgspec
from anyio.abc import TaskGroup

from gym_runtime.config import Config, ResolvedConfig, redact
from gym_runtime.config.fingerprints import grader_identity
from gym_runtime.data.batches import Manifest, new_manifest
from gym_runtime.data.collector import Collector, CollectStats
from gym_runtime.data.inputs import Plan, validate
from gym_runtime.data.reverify import (
    ReverifyReport,
    load_tasks,
    reverify_file,
    validate_rollouts,
)
from gym_runtime.data.routing import check_agent_flag
from gym_runtime.data.sidecars import write_batch_sidecars
from gym_runtime.errors import ConfigError, UserError, did_you_mean, in_entry, nearest
from gym_runtime.observability import logs
from gym_runtime.observability.progress import Heartbeat
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.resource import check_requires, check_seed_once, config_resource_class, load_resource_class
from gym_runtime.service.batches import check_live_workers, check_model_endpoints, publish_batch, refuse_unusable
from gym_runtime.service.budget import BudgetedPublish, HeldInCollector
from gym_runtime.service.outage import Nudge, stop_when_out
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.connect import server_list, wait_reachable
from gym_runtime.transport.jetstream import ensure_streams, watch_queues
from gym_runtime.workers.agent_worker import AgentWorker
from gym_runtime.workers.base import Worker
from gym_runtime.workers.control import cancel_batch
from gym_runtime.workers.model_worker import ModelWorker
from gym_runtime.workers.resource_worker import ResourceWorker
from gym_runtime.workers.sandbox_worker import SandboxWorker

log = logs.get("gym.runner")

SECTIONS = (
    "sandboxes",
    "models",
    "resources",
    "agents",
)  # the config sections that hold workers (not the bus roles of ops.security); sandboxes first: ready before use
BUS_ROLE = {"models": "model", "resources": "resource", "agents": "agent", "sandboxes": "sandbox"}  # section -> role

T = TypeVar("T")


def pool_key(section: str, name: str) -> str:
    """The ``open_buses`` entry of one config entry: ``agent.NAME`` (its pool's connection, or the role's)."""
    return f"{BUS_ROLE[section]}.{name}"


def selected(config: Config | ResolvedConfig, only: list[str] | None) -> list[tuple[str, str]]:
    """(role, name) pairs to start; ``only`` holds ``role.name`` or ``role`` entries."""
    pairs = [(role, name) for role in SECTIONS for name in getattr(config, role)]
    if not only:
        return pairs
    out: list[tuple[str, str]] = []
    for spec in only:
        role, _, name = spec.partition(".")
        if role not in SECTIONS:
            near = nearest(role, SECTIONS)
            also = f"; did you mean --only {near}.{name}?" if near and name else ""
            raise UserError(f"--only {spec!r}: role must be one of {', '.join(SECTIONS)}{also}")
        names = getattr(config, role)
        if name and name not in names:
            entry = "sandbox pool" if role == "sandboxes" else role[:-1]
            have = ", ".join(f"{role}.{n}" for n in names) or f"none: the config has no {role}"
            raise UserError(
                f"--only {spec!r}: no {entry} named {name!r} in the config{did_you_mean(name, names)} "
                f"(its {role}: {have})"
            )
        out.extend((role, n) for n in ([name] if name else names))
    return out


def batch_pairs(config: ResolvedConfig, plan: Plan) -> list[tuple[str, str]]:
    """The workers a batch needs: every model, resource and sandbox pool, and only the agents its rows go to
    (nothing calls an agent, so one no row names would only cost its start: a hosted one's is seconds of CPU)."""
    return [(role, name) for role, name in selected(config, None) if role != "agents" or name in plan.agents]


async def open_buses(
    url: str | list[str],
    roles: list[str],
    *,
    namespace: str,
    telemetry: Telemetry,
    name: str,
    auth: Any = None,
    initial_timeout: float | None = -1.0,
    jetstream: Any = None,
) -> dict[str, Bus]:
    """One connection for every role, or with ``auth`` (secured bus) one per role, each with its own credential.

    So a process running several roles holds exactly the union of their permissions. A ``role.NAME`` entry
    (``pool_key``) gets a connection of its own when the node holds that pool's credential
    (``{role}.{NAME}.creds``), else shares the role's.
    """

    def connect(conn: str, **creds: Any) -> Awaitable[Bus]:
        """A connection named ``conn``; ``creds``: the secured bus's auth, role and pool."""
        return Bus.connect(
            url,
            namespace=namespace,
            telemetry=telemetry,
            name=conn,
            initial_timeout=initial_timeout,
            jetstream=jetstream,
            **creds,
        )

    if auth is None:
        return dict.fromkeys(roles, await connect(name))
    buses: dict[str, Bus] = {}
    try:
        for key in dict.fromkeys(roles):
            role, _, pool = key.partition(".")
            if pool and auth.pool_creds(role, pool) is None:
                continue  # served by the role's connection, opened below
            buses[key] = await connect(f"{name}-{key}", auth=auth, role=role, pool=pool or None)
        for key in dict.fromkeys(roles):
            role = key.partition(".")[0]
            if key not in buses:
                if role not in buses:
                    buses[role] = await connect(f"{name}-{role}", auth=auth, role=role)
                buses[key] = buses[role]
    except BaseException:
        with anyio.CancelScope(shield=True):
            await close_buses(buses)
        raise
    return buses


async def close_buses(buses: dict[str, Bus]) -> None:
    for bus in {id(b): b for b in buses.values()}.values():
        await bus.close()


def make_workers(
    bus: Bus | dict[str, Bus],
    config: ResolvedConfig,
    pairs: list[tuple[str, str]],
    *,
    replicas: int | None = None,
    verdict_said_by_caller: bool = False,
) -> list[Worker]:
    """Build (not start) the workers of ``pairs`` of a resolved config (``resolve_config``: its plugins loaded,
    their option checks passed, its fingerprints computed); ``bus`` may map NATS roles to their own connections
    (``open_buses``). A construction error names the config entry (``models.policy: ...``).
    ``verdict_said_by_caller``: a one-shot command says a dead model endpoint itself (``ModelWorker``'s)."""
    workers: list[Worker] = []
    for role, name in pairs:
        pool = bus[pool_key(role, name)] if isinstance(bus, dict) else bus
        try:
            workers += _make(pool, config, role, name, replicas, verdict_said_by_caller)
        except (ValueError, ImportError) as e:
            text = in_entry(str(e), role, name)
            raise ConfigError(text if text.startswith(f"{role}.{name}") else f"{role}.{name}: {text}") from None
    return workers


def _make(
    bus: Bus, config: ResolvedConfig, role: str, name: str, replicas: int | None, verdict_said_by_caller: bool
) -> list[Worker]:
    if role == "models":
        count = replicas or config.models[name].replicas
        return [ModelWorker(bus, name, config, verdict_said_by_caller=verdict_said_by_caller) for _ in range(count)]
    if role == "resources":
        return [ResourceWorker(bus, name, config) for _ in range(replicas or config.resources[name].replicas)]
    if role == "sandboxes":
        scfg = config.sandboxes[name]
        return [SandboxWorker(bus, name, scfg) for _ in range(replicas or scfg.replicas)]
    return [AgentWorker(bus, name, config) for _ in range(replicas or config.agents[name].replicas)]


async def start_workers(tg: TaskGroup, workers: list[Worker], *, note: Callable[[str], None] | None = None) -> None:
    """Start workers and return once each is subscribed and pulling; ``note`` hears which one a slow start waits
    for (an environment's imports and setup can take a minute: no silent minutes)."""
    for w in workers:
        with Heartbeat(note, f"{starting(w)}: still starting"):
            await tg.start(w.run)


def starting(w: Worker) -> str:
    """The entry a worker serves and what its start does, as a progress line names it."""
    if isinstance(w, AgentWorker):
        where = " in its guest process" if w.guest is not None else ""
        return f"agents.{w.name} (loading {w.cfg.agent or w.cfg.nemo_gym} and its environment{where})"
    if isinstance(w, ResourceWorker):
        return f"resources.{w.name} (loading {w.cfg.server or w.cfg.nemo_gym} and its environment)"
    if isinstance(w, ModelWorker):
        return f"models.{w.name} (asking its endpoint whether it serves the model)"
    if isinstance(w, SandboxWorker):
        return f"sandboxes.{w.name} (reaching its backend, warming its pool)"
    return f"worker {type(w).__name__}"


DRAIN_OFFLINE_S = 2.0  # a drain whose server has been gone this long stops waiting (``drain``)


async def drain(workers: list[Worker], timeout: float = 60.0, *, online: Callable[[], bool] | None = None) -> None:
    """Stop taking new work everywhere; give in-flight work up to ``timeout`` to finish.

    With ``online`` (is the bus connected?): once the server has been gone for ``DRAIN_OFFLINE_S``, stop
    waiting. In-flight work can then neither finish nor be handed back, and nothing of it is lost: its
    tasks were never acknowledged, so the store delivers them again to whoever serves next. A whole job
    cancelled by its scheduler stops its servers together with its workers: waiting on would only run
    into the scheduler's SIGKILL.
    """

    async def drains(scope: anyio.CancelScope) -> None:
        async with anyio.create_task_group() as each:
            for w in workers:
                each.start_soon(w.drain)
        scope.cancel()

    async def server_gone(scope: anyio.CancelScope) -> None:
        assert online is not None
        since: float | None = None
        while True:
            await anyio.sleep(0.2)
            if online():
                since = None
            elif since is None:
                since = time.monotonic()
            elif time.monotonic() - since >= DRAIN_OFFLINE_S:
                log.warning("workers.drain_stopped", reason="the NATS server is gone", then="unacked tasks redelivered")
                scope.cancel()
                return

    with anyio.move_on_after(timeout):
        async with anyio.create_task_group() as tg:
            tg.start_soon(drains, tg.cancel_scope)
            if online is not None:
                tg.start_soon(server_gone, tg.cancel_scope)


def check_resources(config: ResolvedConfig, pairs: list[tuple[str, str]]) -> None:
    """What can be known without the server, said before waiting for it: a resource module that does not
    import (a typo) or lacks its verifier package would otherwise say nothing until the server answers."""
    for role, name in pairs:
        if role == "resources" and not config.resources[name].hosted:  # a hosted one: its environment's check
            where, rcfg = f"resources.{name}.server", config.resources[name]
            cls = load_resource_class(rcfg.server, where)
            check_requires(cls, where)
            if rcfg.seed_once:
                check_seed_once(cls, rcfg.isolation or cls.isolation, f"resources.{name}.seed_once")


async def wait_for_server(url: str | list[str]) -> int | None:
    """Wait until a server of ``url`` accepts connections (logging ``nats.unreachable`` with the reason once);
    returns the signal that ended the wait instead, if any (SIGTERM/SIGINT), or None once it is reachable.
    A process pool waits here, once, before its children start."""
    stopped: list[int] = []
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        await unless_signalled(signals, stopped, lambda: wait_reachable(server_list(url), None))
    return stopped[0] if stopped else None


async def unless_signalled(
    signals: AsyncIterator[int], stopped: list[int], wait: Callable[[], Awaitable[T]]
) -> T | None:
    """``wait()``, given up at once when a signal arrives (recorded in ``stopped``; None returned then)."""
    result: list[T] = []
    async with anyio.create_task_group() as tg:

        async def on_signal() -> None:
            async for signum in signals:
                stopped.append(signum)
                tg.cancel_scope.cancel()
                return

        tg.start_soon(on_signal)
        result.append(await wait())
        tg.cancel_scope.cancel()
    return result[0] if result else None


async def serve(
    config: ResolvedConfig,
    url: str | list[str],
    *,
    only: list[str] | None,
    telemetry: Telemetry,
    replicas: int | None = None,
    ready: Callable[[], None] | None = None,
    auth: Any = None,
    signal_receiver: Callable[..., AbstractContextManager[AsyncIterator[int]]] = anyio.open_signal_receiver,
    note: Callable[[str], None] | None = None,
    verdict_said_by_caller: bool = False,
) -> int | None:
    """Run workers until SIGTERM/SIGINT, then drain and return the signal that stopped them.
    (``signal_receiver``: where the signals come from, when the workers are not on the main thread.)

    A signal while the workers still wait for their server stops the wait at once (nothing to drain):
    a scheduler's SIGTERM, or Ctrl-C on a worker node whose server is not up, is acted on then too."""
    pairs = selected(config, only)
    check_resources(config, pairs)
    stopped: list[int] = []
    with signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        # workers may start before the server: wait for it as long as it takes, or until a signal
        buses = await unless_signalled(
            signals,
            stopped,
            lambda: open_buses(
                url,
                [pool_key(r, n) for r, n in pairs],
                namespace=config.namespace,
                telemetry=telemetry,
                name="gym-workers",
                auth=auth,
                initial_timeout=None,
                jetstream=config.jetstream,
            ),
        )
        if stopped or buses is None:
            log.info("workers.stopped", before="ready")
            return stopped[0] if stopped else None
        try:
            # a refused stream set-up is one clear error, before any worker starts
            await ensure_streams(next(iter(buses.values())), [n for r, n in pairs if r == "agents"])
            workers = make_workers(
                buses, config, pairs, replicas=replicas, verdict_said_by_caller=verdict_said_by_caller
            )
            async with anyio.create_task_group() as tg:
                await start_workers(tg, workers, note=note)
                if telemetry.meters.enabled:
                    tg.start_soon(watch_queues, next(iter(buses.values())), telemetry.meters)
                log.info(
                    "workers.ready",
                    workers=len(workers),
                    roles=sorted({f"{r}.{n}" for r, n in selected(config, only)}),
                )
                if ready:  # only now: a SIGTERM right after "ready" must drain, not kill
                    ready()
                async for signum in signals:
                    stopped.append(signum)
                    log.info("workers.draining")
                    for b in buses.values():
                        b.stopping = True
                    await drain(workers, online=lambda: any(b.nc.is_connected for b in buses.values()))
                    log.info("workers.stopped")
                    break
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await close_buses(buses)
    return stopped[0] if stopped else None


@dataclass
class RunResult:
    batch: str
    tasks: int
    stats: CollectStats
    ready_s: float
    elapsed_s: float
    stopped: str | None = None  # why the batch was stopped before its end (``stop_when_out_of_service``)


@dataclass(frozen=True)
class RunHooks:
    """What a run tells its caller as it goes, each optional: ``on_progress(done, expected)`` and
    ``on_result(ok, reward)`` (a progress display), ``note``: where a slow worker start is named
    (``start_workers``)."""

    on_progress: Callable[[int, int], None] | None = None
    on_result: Callable[[bool, float | None], None] | None = None
    note: Callable[[str], None] | None = None


async def run_batch(
    config: ResolvedConfig,
    url: str | list[str],
    *,
    input_path: str | Path,
    out: str | Path,
    telemetry: Telemetry,
    agent: str | None = None,
    repeats: int = 1,
    limit: int | None = None,
    batch: str | None = None,
    hooks: RunHooks = RunHooks(),
    auth: Any = None,
    plan: Plan | None = None,
    start_local_workers: bool = True,
    elsewhere: frozenset[tuple[str, str]] = frozenset(),
    check_workers: bool = True,
    budget: BudgetedPublish | None = None,
) -> RunResult:
    """Start workers, publish, collect; everything over NATS. Bad input fails before any work.

    ``plan``: the input already validated (``inputs.validate``) with these arguments; ``elsewhere``:
    (role, name) workers that run in child processes of their own (hosted NeMo Gym servers); ``check_workers``:
    look for live workers of another config before publishing (not needed on a server this run started);
    ``budget``: tasks start only while it has room, the rest get ``budget`` failure rows (``service.budget``)."""
    t0 = time.perf_counter()
    if not config.agents:
        raise UserError("the config names no agents")
    # fail fast, before connecting
    plan = plan or validate(input_path, list(config.agents), agent=agent, limit=limit)
    batch = batch or uuid.uuid4().hex[:12]
    pairs = [p for p in batch_pairs(config, plan) if p not in elsewhere] if start_local_workers else []
    buses = await open_buses(
        url,
        ["publisher", *(pool_key(r, n) for r, n in pairs)],
        namespace=config.namespace,
        telemetry=telemetry,
        name="gym-run",
        auth=auth,
        jetstream=config.jetstream,
    )
    bus = buses["publisher"]
    try:
        await _preflight(bus, config, plan, pairs, check_workers=check_workers, local=start_local_workers)
        async with anyio.create_task_group() as tg:
            workers = await _start_local(tg, buses, config, pairs, telemetry, hooks.note)
            ready_s = time.perf_counter() - t0
            manifest = new_manifest(batch, plan.owners, repeats=repeats, input_path=str(Path(input_path).resolve()))
            log.info("batch.start", batch=batch, rows=plan.count, repeats=repeats, expected=manifest.expected,
                     agents=plan.agents, out=str(out))  # fmt: skip
            failed = Nudge()  # a failure row: the watch on the bus looks at the models at once
            collector = Collector(
                bus,
                manifest,
                out,
                on_progress=hooks.on_progress,
                on_result=failed.on_failure(hooks.on_result),
                on_stored=budget.stored if budget is not None else None,
                keep_attempts=True,
            )
            publish = functools.partial(
                publish_batch,
                bus,
                config,
                input_path,
                agent=agent,
                repeats=repeats,
                limit=limit,
                batch=batch,
                plan=plan,
                check_workers=False,  # checked above
                gate=HeldInCollector(budget, collector) if budget is not None else None,
            )
            stopped: list[str] = []
            models = [w for w in workers if isinstance(w, ModelWorker)]
            if models:
                tg.start_soon(stop_when_out_of_service, bus, batch, models, stopped)
            elif not start_local_workers:  # in worker children: their status answers say it (``outage``)
                tg.start_soon(_stop_when_out_on_bus, bus, batch, stopped, failed)
            stats = await _publish_and_collect(tg, collector, publish)
            await write_batch_sidecars(bus, batch, out, collector.attempts, config=redact(config.config))
            await drain(workers, timeout=5.0)
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await close_buses(buses)
    elapsed = time.perf_counter() - t0
    log.info("batch.end", batch=batch, rows=stats.rows, failed=stats.failures, mean_reward=stats.mean_reward,
             elapsed_s=round(elapsed, 3), out=str(out))  # fmt: skip
    return RunResult(
        batch=batch,
        tasks=manifest.expected,
        stats=stats,
        ready_s=ready_s,
        elapsed_s=elapsed,
        stopped=stopped[0] if stopped else None,
    )


async def stop_when_out_of_service(bus: Bus, batch: str, models: list[ModelWorker], stopped: list[str]) -> None:
    """Cancel the batch once a model of this run has no endpoint in service (``ModelWorker.out_of_service``):
    its tasks not started end as ``cancelled`` rows, so every row still comes once, rather than each rollout
    failing in turn on endpoints that are out. Why is put in ``stopped``, for the command's one line."""
    async with anyio.create_task_group() as tg:

        async def watch(w: ModelWorker) -> None:
            await w.went_out.wait()
            if not stopped:
                stopped.append(f"model {w.name!r}: {w.out_of_service}")
                log.warning("batch.stopped", batch=batch, model=w.name, cause=w.out_of_service)
                await cancel_batch(bus, batch)
            tg.cancel_scope.cancel()

        for w in models:
            tg.start_soon(watch, w)


async def _stop_when_out_on_bus(bus: Bus, batch: str, stopped: list[str], nudge: Nudge) -> None:
    out = await stop_when_out(bus, batch, nudge=nudge)
    stopped.append(f"model {out.model!r}: {out.cause}")


async def _preflight(
    bus: Bus, config: ResolvedConfig, plan: Plan, pairs: list[tuple[str, str]], *, check_workers: bool, local: bool
) -> None:
    """Before any worker of this run starts: the streams, the live workers of another config (only others can
    differ yet), and, where this run's workers are in processes of their own (ready), their models."""
    await ensure_streams(bus, config.agents)
    if check_workers:
        await check_live_workers(bus, config, list(plan.agents) if not pairs else [])
    if not local:
        await check_model_endpoints(bus, config, list(plan.agents))


async def _start_local(
    tg: TaskGroup,
    buses: dict[str, Bus],
    config: ResolvedConfig,
    pairs: list[tuple[str, str]],
    telemetry: Telemetry,
    note: Callable[[str], None] | None,
) -> list[Worker]:
    """This run's own workers, started (and its queues watched where meters are on); none when a model's
    endpoint is unusable: every rollout would fail as model_error, so that is said once and nothing published."""
    workers = make_workers(buses, config, pairs, verdict_said_by_caller=True)  # refused below, in one line
    await start_workers(tg, workers, note=note)
    refuse_unusable([(w.name, w.worker_id, w.endpoint_problem) for w in workers if isinstance(w, ModelWorker)])
    if telemetry.meters.enabled:
        tg.start_soon(watch_queues, next(iter(buses.values())), telemetry.meters)
    return workers


async def _publish_and_collect(
    tg: TaskGroup, collector: Collector, publish: Callable[[], Awaitable[Manifest]]
) -> CollectStats:
    """The batch published while its collector reads it (started first: it sees every row); its stats."""
    result: dict[str, CollectStats] = {}
    collected = anyio.Event()

    async def collect() -> None:
        result["stats"] = await collector.run()
        collected.set()

    tg.start_soon(collect)
    await publish()
    await collected.wait()
    return result["stats"]


def resource_for(config: ResolvedConfig, agent: str | None) -> str:
    """The resource whose verifier re-scores rows: the agent's, or the config's only one."""
    if agent is not None:
        check_agent_flag(agent, config.agents)
        return config.agents[agent].resource
    used = sorted({a.resource for a in config.agents.values() if a.resource}) or sorted(config.resources)
    if len(used) != 1:
        raise UserError(f"the config has several resources ({', '.join(used)}); pass --agent")
    return used[0]


async def reverify_batch(
    config: ResolvedConfig,
    url: str | list[str],
    *,
    input_path: str | Path,
    out: str | Path,
    telemetry: Telemetry,
    agent: str | None = None,
    replicas: int | None = None,
    in_flight: int = 64,
    tasks_path: str | Path | None = None,
    on_row: Callable[[bool, float | None], None] | None = None,
    auth: Any = None,
    local_workers: bool = True,
) -> ReverifyReport:
    """Start the resource's workers here (unless ``local_workers`` is False: a hosted NeMo Gym server's
    run in a child on its built environment) and re-verify every row of a rollouts file through them."""
    resource = resource_for(config, agent)
    validate_rollouts(input_path)  # raises before any work; the CLI counts rows for progress with it
    tasks = load_tasks(tasks_path) if tasks_path else None
    buses = await open_buses(
        url,
        ["publisher", *([pool_key("resources", resource)] if local_workers else [])],
        namespace=config.namespace,
        telemetry=telemetry,
        name="gym-reverify",
        auth=auth,
        jetstream=config.jetstream,
    )
    try:
        async with anyio.create_task_group() as tg:
            if local_workers:
                await start_workers(tg, make_workers(buses, config, [("resources", resource)], replicas=replicas))
            read = config_resource_class(config.resources[resource], f"resources.{resource}.server").task_fields
            fields = tuple(f.name for f in msgspec.structs.fields(read)) if read is not None else ()
            report = await reverify_file(
                buses["publisher"],
                resource,
                input_path,
                out,
                in_flight=in_flight,
                tasks=tasks,
                on_row=on_row,
                task_fields=fields,
                grader=functools.partial(grader_identity, config.model_fingerprints()),
                reward_bound=config.reward_bound,
            )
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await close_buses(buses)
    return report
