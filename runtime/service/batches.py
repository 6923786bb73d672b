"""Publish a batch and collect it: what ``gym-runtime publish`` and ``collect`` run, apart from the workers.

Neither command starts a worker, so neither imports one (the workers and the environments' guests are a
tenth of a CPU-second of each command's start-up; ``tests/bench/cli_startup.py``). ``run_batch`` in
``runner`` composes these with the workers it starts.
"""

from __future__ import annotations

import contextlib
import functools
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec

from gym_runtime.config import ResolvedConfig
from gym_runtime.data.batches import Manifest, get_manifest, new_manifest, other_namespaces, put_manifest
from gym_runtime.data.collector import Collector, CollectStats
from gym_runtime.data.inputs import Gate, Plan, Watermark, publish_tasks, validate
from gym_runtime.data.sidecars import write_batch_sidecars
from gym_runtime.errors import ConfigError, UserError
from gym_runtime.messages import BranchPoint, RolloutTask
from gym_runtime.observability import logs
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.discovery import discover
from gym_runtime.transport.jetstream import ensure_streams

log = logs.get("gym.runner")  # the name these lines had in runner: log readers filter on it


MARK_EVERY_S = 0.5  # how often a publish records how far it got in the manifest
DISCOVERY_WAIT_S = 0.3  # how long a publish gathers the live workers' answers (they answer in ~1 ms)
ENDPOINTS_WAIT_S = 10.0  # the longest a run waits for its worker processes' models to answer (they are ready)


async def check_live_workers(bus: Bus, config: ResolvedConfig, agents: list[str]) -> None:
    """Refuse to publish to workers started with another config (each would fail every task it takes as
    ``config_mismatch``): one line naming the keys that differ. With no worker of ``agents`` yet the tasks
    wait in the queue; say so once."""
    workers = await discover(bus, wait_s=DISCOVERY_WAIT_S)
    problems = config.mismatches(workers)
    if problems:
        raise ConfigError(
            f"namespace {config.namespace!r} has live workers started with another config than this one: "
            + "; ".join(problems)
            + ". Publish with the config (and --set values) the workers were started with, or restart them with "
            "this one; two experiments need a `namespace` each. Nothing was published."
        )
    _refuse_unusable(workers, _models(config, agents))
    serving = {str(w.get("name")) for w in workers if w.get("role") == "agent"}
    waiting = [a for a in agents if a not in serving]
    if waiting:
        log.warning(
            "batch.no_workers",
            agents=waiting,
            detail="no live worker serves these agents yet: their tasks wait in the queue until one starts",
        )


async def check_model_endpoints(bus: Bus, config: ResolvedConfig, agents: list[str]) -> None:
    """Refuse a batch whose models' workers, started in other processes (``run``'s worker children), found their
    endpoints dead or not serving the model: one line, nothing published (the check each model worker makes at
    start, read through discovery once every model has answered)."""
    models = _models(config, agents)

    def answered(workers: list[dict[str, Any]]) -> bool:
        return models <= {w.get("name") for w in workers if w.get("role") == "model"}

    _refuse_unusable(await discover(bus, wait_s=ENDPOINTS_WAIT_S, until=answered), models)


def _models(config: ResolvedConfig, agents: list[str]) -> set[str]:
    return {config.agents[a].model for a in agents if a in config.agents}


def _refuse_unusable(workers: list[dict[str, Any]], models: set[str]) -> None:
    refuse_unusable(
        [
            (str(w.get("name")), str(w.get("worker")), w.get("endpoint_problem"))
            for w in workers
            if w.get("role") == "model" and w.get("name") in models
        ],
        ids=True,  # workers elsewhere: which ones found it (a base_url may resolve only on some nodes)
    )


def refuse_unusable(verdicts: list[tuple[str, str, str | None]], *, ids: bool = False) -> None:
    """One line for the model workers (name, worker id, problem) whose endpoint cannot serve: each model's cause
    once, however many of its workers found it, with the config keys to check."""
    causes: dict[tuple[str, str], list[str]] = {}
    for name, worker, problem in verdicts:
        if problem:
            causes.setdefault((name, problem), []).append(worker)
    if not causes:
        return
    said = []
    for (name, problem), found in causes.items():
        by = f" (worker{'s' if len(found) > 1 else ''} {', '.join(found)})" if ids else ""
        said.append(f"model {name!r}{by}: {problem}")
    keys = ", ".join(dict.fromkeys(f"models.{name}.base_url and models.{name}.model" for name, _ in causes))
    raise ConfigError(
        "; ".join(said) + f". Nothing was published: check {keys} (is the server up, does it serve that model?)"
    )


def _same_batch(a: Manifest, b: Manifest) -> bool:
    """The same publish: the same input, rows, repeats and agents (else a re-publish starts over)."""
    return (a.input, a.repeats, a.expected, a.owners) == (b.input, b.repeats, b.expected, b.owners)


class _HeldFrom:
    """A gate that records where it first held a task back, in publish order (the manifest's ``held_from``)."""

    def __init__(self, gate: Gate, repeats: int) -> None:
        self.gate, self.repeats = gate, repeats
        self.first = -1

    async def admit(self, task: RolloutTask, stored: bool) -> bool:
        return await self.gate.admit(task, stored)

    def held(self, task: RolloutTask) -> None:
        if self.first < 0:
            self.first = task.task_index * self.repeats + (0 if task.group else task.rollout_index)
        self.gate.held(task)


async def publish_batch(
    bus: Bus,
    config: ResolvedConfig,
    input_path: str | Path,
    *,
    agent: str | None = None,
    repeats: int = 1,
    limit: int | None = None,
    batch: str | None = None,
    plan: Plan | None = None,
    on_sent: Callable[[], None] | None = None,
    check_workers: bool = True,
    gate: Gate | None = None,
    keep_checkpoints_s: float = 0.0,
    branch: BranchPoint | None = None,
) -> Manifest:
    """Validate every row (unless ``plan`` says it was done), check the live workers serve this config
    (``check_workers``), record the manifest, publish rows × repeats.

    ``gate``: a budget's admission (``inputs.Gate``); tasks it holds back are not published, and the batch
    records the first of them (``held_from``): a run of it again goes on from there. ``keep_checkpoints_s`` and
    ``branch``: each task's (``RolloutTask``): kept for branching, or a branch of another rollout (its repeats run
    each on its own)."""
    agents = list(config.agents)
    if not agents:
        raise UserError("the config names no agents")
    if repeats < 1:
        raise UserError("--repeats must be at least 1")
    plan = plan or validate(input_path, agents, agent=agent, limit=limit)
    if check_workers:
        await check_live_workers(bus, config, list(plan.agents))
    manifest = new_manifest(
        batch or uuid.uuid4().hex[:12],
        plan.owners,
        repeats=repeats,
        input_path=str(Path(input_path).resolve()),
        max_republish=config.jetstream.max_republish,
        models=config.model_table(),
    )
    await ensure_streams(bus, agents)  # and each agent's results stream: the one place a publish ensures them
    earlier = await get_manifest(bus, batch) if batch else None
    if earlier is not None and _same_batch(earlier, manifest):  # this publish ran before: on from where it got
        if earlier.published and earlier.held_from < 0:
            log.info("batch.already_published", batch=manifest.batch, expected=manifest.expected)
            return earlier
        manifest = msgspec.structs.replace(manifest, stored=earlier.stored)
    await put_manifest(bus, manifest)
    log.info(
        "batch.publishing",
        batch=manifest.batch,
        expected=manifest.expected,
        agents=manifest.agents,
        skip=manifest.stored,
    )
    fps: dict[str, dict[str, Any]] = {
        a: {
            "fingerprint": config.fingerprints[("agent", a)],
            "keep_checkpoints_s": keep_checkpoints_s,
            "branch": branch,
        }
        for a in agents
    }
    for a, check in plan.seed_checks.items():  # rows this process could not check: their workers will
        fps[a]["check"] = check
    recorded = _HeldFrom(gate, manifest.repeats) if gate is not None else None
    publish = functools.partial(
        publish_tasks,
        bus,
        plan,
        batch=manifest.batch,
        agents=agents,
        repeats=repeats,
        limit=limit,
        on_sent=on_sent,
        task_fields=fps.__getitem__,
        grouped=lambda a: branch is None and config.agents[a].group_repeats,
        keep=manifest.max_republish > 0,  # the bodies a reader publishes again (data.republish)
        gate=recorded,
    )
    manifest = await _checkpointed(bus, manifest, publish)
    # every task that will be is published (a reader may settle lost slots; the held back get budget rows)
    held_from = recorded.first if recorded is not None else -1
    manifest = msgspec.structs.replace(manifest, published=True, held_from=held_from)
    if held_from >= 0:
        log.info("batch.held_back", batch=manifest.batch, rollouts=manifest.expected - held_from, why="budget")
    await put_manifest(bus, manifest)
    log.info("batch.published", batch=manifest.batch, expected=manifest.expected)
    return manifest


async def _checkpointed(bus: Bus, manifest: Manifest, publish: Callable[..., Awaitable[int]]) -> Manifest:
    """``publish(mark=...)`` with the manifest's ``stored`` kept up to date (every ``MARK_EVERY_S`` and at its
    end, whichever way it ended): a publish killed outright, a full stream, Ctrl-C start again at most this far
    back. The manifest as last recorded; the publish's own error raised as it is, not in an exception group."""
    mark = Watermark(start=manifest.stored)

    async def record() -> None:
        nonlocal manifest
        if mark.through() != manifest.stored:
            now = msgspec.structs.replace(manifest, stored=mark.through())
            await put_manifest(bus, now)
            manifest = now

    async def checkpoints() -> None:
        while True:
            await anyio.sleep(MARK_EVERY_S)
            await record()

    failure: Exception | None = None
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(checkpoints)
            try:
                await publish(mark=mark)
            except Exception as e:  # raised as it is below, not inside the task group's exception group
                failure = e
            tg.cancel_scope.cancel()
    finally:  # the next run of this publish starts where this one got
        with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
            await record()
    if failure is not None:
        raise failure
    return manifest


async def collect_batch(
    bus: Bus,
    batch: str,
    out: str | Path,
    *,
    wait_s: float = 60.0,
    on_progress: Callable[[int, int], None] | None = None,
    on_result: Callable[[bool, float | None], None] | None = None,
    max_republish: int | None = None,
    on_note: Callable[[str], None] | None = None,
) -> CollectStats:
    manifest = await get_manifest(bus, batch, wait_s=wait_s)
    if manifest is None:
        waited = f"; waited {wait_s:g}s" if wait_s else " (--wait S waits for a publish still under way)"
        raise UserError(
            f"no batch {batch!r} in namespace {bus.ns!r} (was it published here?{waited}); "
            + await other_namespaces(bus, batch)
        )
    log.info("batch.collecting", batch=batch, expected=manifest.expected, out=str(out))
    collector = Collector(
        bus,
        manifest,
        out,
        on_progress=on_progress,
        on_result=on_result,
        max_republish=max_republish,
        keep_attempts=True,
        on_note=on_note,
    )
    stats = await collector.run()
    await write_batch_sidecars(bus, batch, out, collector.attempts)
    log.info("batch.collected", batch=batch, rows=stats.rows, failed=stats.failures, mean_reward=stats.mean_reward)
    return stats
