"""Runs rollouts: pulls tasks of one agent from ``{ns}.task.{agent}``, one per free slot.

A task is acked only after its result (row or failure) is stored in the result
stream. Retryable failures (a resource worker that vanished, a model replica
that returned 5xx) are nak'd with backoff and redelivered; after ``max_attempts``
such failures the task becomes a failure row instead of being dropped. A worker
that died holding a task (killed, node lost) costs it no attempt: those losses
have a budget of their own (``max_worker_losses``), so only a task that kills
every worker that takes it ends as a ``worker_lost`` row.
"""

from __future__ import annotations

import asyncio
import functools
import os
import socket
import sys
import time
import uuid
from importlib.metadata import PackageNotFoundError, version
from types import ModuleType
from typing import Any

import anyio
import msgspec
from opentelemetry.trace import SpanKind, StatusCode

from gym_runtime.agent import AgentContext, AgentFn, Outcome
from gym_runtime.config import ResolvedConfig
from gym_runtime.config.fingerprints import grader_identity
from gym_runtime.data.rowkeys import DEFAULT_REWARD_BOUND, bounded_reward, own_fields, policy_prompt
from gym_runtime.errors import Failure, StorageFull, UserError, in_entry
from gym_runtime.messages import (
    AttemptRetried,
    AttemptStart,
    Cost,
    ErrorInfo,
    Provenance,
    RolloutResult,
    RolloutTask,
    SandboxCommand,
    TimeSplit,
    VerifyReply,
    counted_ms,
)
from gym_runtime.observability import logs
from gym_runtime.rollout.branch import branch_point
from gym_runtime.rollout.checkpoint import Checkpointer, checkpoints_kv
from gym_runtime.rollout.state import Models, Rollout
from gym_runtime.transport.affinity import Affinity
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.delivery import Delivery
from gym_runtime.transport.interface import Puller
from gym_runtime.transport.jetstream import result_msg_id, task_id_slots
from gym_runtime.transport.model_calls import direct_patience
from gym_runtime.transport.pull import ACK_WAIT_S
from gym_runtime.transport.rpc import ON_PAUSE
from gym_runtime.workers.attempts import AttemptRecords
from gym_runtime.workers.base import drain_puller, serve_pulled
from gym_runtime.workers.control import ControlView
from gym_runtime.workers.generation_cut import cuttable_models
from gym_runtime.workers.guest_agent import GuestAgent, is_lost
from gym_runtime.workers.waits import Rollouts, Running

log = logs.get("gym.agent")

NAK_BACKOFF_S = (0.2, 1.0, 5.0)


def agent_fn(module: ModuleType) -> AgentFn:
    fn = getattr(module, "run", None)
    if fn is None:
        raise UserError(f"agent module {module.__name__} must define `async def run(ctx)`")
    return fn  # type: ignore[no-any-return]


def build_row(
    task: RolloutTask,
    outcome: Outcome,
    *,
    policy_versions: list[int] | None = None,
    cost: Cost | None = None,
    provenance: Provenance | None = None,
    resumed: tuple[int, str] | None = None,
    reward_bound: float = DEFAULT_REWARD_BOUND,
) -> dict[str, Any]:
    """The output row, NeMo Gym's shape: params, response, reward, verifier extras, task fields, ids.

    ``policy_versions`` ([min, max] over the rollout's model calls) is added once a trainer set a version;
    ``cost`` and ``provenance`` are gym-runtime's own keys (docs/rows.md), and so are ``resumed_from_turn`` and
    ``resumed_how`` (``resumed``: an attempt that took up a checkpoint), and ``branch_of`` and ``branch_turn`` (a
    branch's). A field of the environment's or the
    agent's naming a runtime key raises ``Failure("verify_error")`` unless it only echoes it (``rowkeys``), and so
    does a reward that is not finite or beyond ``reward_bound`` (``rowkeys.bounded_reward``).
    """
    src = task.row
    # reported under the agent that ran it (``--agent`` may override the row's agent_ref)
    ref = src.get("agent_ref")
    runtime: dict[str, Any] = {
        # the prompt as the policy saw it: the task's, or the agent's record of it with turns it added
        "responses_create_params": policy_prompt(outcome.fields, src.get("responses_create_params")),
        "response": outcome.response,
        "reward": bounded_reward(outcome.verdict.reward, reward_bound),
    }
    if policy_versions is not None:
        runtime["policy_versions"] = policy_versions
    if cost is not None:
        runtime["cost"] = cost
    if provenance is not None:
        runtime["provenance"] = provenance
    if resumed is not None:
        runtime["resumed_from_turn"], runtime["resumed_how"] = resumed
    if task.branch is not None:  # a branch (``rollout.branch``): its parent rollout and the turn it branched at
        runtime["branch_of"], runtime["branch_turn"] = task.branch.parent(), task.branch.turn
    runtime["_ng_task_index"] = task.task_index
    runtime["_ng_rollout_index"] = task.rollout_index
    runtime["agent_ref"] = {**(ref if isinstance(ref, dict) else {"type": "responses_api_agents"}), "name": task.agent}
    # the runtime's keys are written after the environment's and the agent's fields (``rowkeys``)
    row: dict[str, Any] = {k: runtime[k] for k in ("responses_create_params", "response", "reward")}
    row.update(own_fields(outcome.verdict.fields, runtime, src, who="the environment's verify"))
    row.update(own_fields(outcome.fields, runtime, src, who="the agent"))
    for k, v in src.items():
        if k not in row and k != "agent_ref":
            row[k] = v
    row.update(runtime)
    return row


class AgentWorker:
    """agents.NAME of a resolved config: its module (a hosted NeMo Gym agent's: ``gym_runtime.nemo_gym.hosting.agent``)
    and the fingerprints it checks tasks against come from the config, loaded and computed once."""

    def __init__(self, bus: Bus, name: str, config: ResolvedConfig) -> None:
        self.bus = bus
        self.name = name
        view = config.agent(name)  # what this worker takes of the config, read once
        self.cfg = cfg = view.entry
        self.config = config
        module = view.module
        self.guest: GuestAgent | None = None
        if cfg.hosted:  # a NeMo Gym agent server's own code, in this worker's built environment
            if cfg.isolation == "process":
                raise UserError(f"agents.{name}: a hosted NeMo Gym agent runs in its own child process; drop isolation")
            res = config.resources.get(cfg.resource or "")
            host = module.hosted_agent(name, cfg, list(config.models), resource_hosted=res is not None and res.hosted)
            self.fn: AgentFn = host.run
            self.run_group: Any = host.run_group  # a group task's K repeats: K concurrent /run calls
            self.setup: Any = host.setup
            self.teardown: Any = host.stop  # its lifespan left on its loop when the worker stops
        else:
            self.fn = agent_fn(module)
            self.run_group = getattr(module, "run_group", None)  # group tasks (group_repeats)
            self.setup = getattr(module, "setup", None)  # once per worker, before the first task (e.g. load an env)
            self.teardown = None
            # where its code runs: a guest process (workers.guest_agent; the bus stays here) or this one
            isolation = cfg.isolation or getattr(module, "isolation", "none")
            if isolation not in ("process", "none"):
                raise UserError(f"agent module {cfg.agent}: isolation must be 'process' or 'none', not {isolation!r}")
            built = getattr(module, "verifiers_version", None)  # its package needs verifiers' own built environment
            if built and isolation != "process":
                raise UserError(
                    f"agents.{name}: {cfg.agent} runs in verifiers {built}'s own environment; drop isolation"
                )
            if isolation == "process":
                # verifiers' own environment, built now if the cache lacks it (config.hosting: resolve_config loads
                # it by name for such an agent, so workers import nothing from hosting)
                on = config.hosting.ensure_verifiers(built) if built and config.hosting else None
                python, env = (on.python, on.environ) if on else (sys.executable, None)
                self.guest = GuestAgent(name, cfg, groups=self.run_group is not None, python=python, env=env)
                self.fn, self.run_group, self.setup = self.guest.run, self.guest.run_group, None  # setup: in the guest
        self.worker_id = uuid.uuid4().hex[:12]
        self.node, self.pid = socket.gethostname(), os.getpid()  # where its attempts ran (their records)
        self.puller: Puller | None = None
        self.completed = 0
        self.failed = 0
        self.retried = 0
        self.busy_s = 0.0  # summed time from task delivery to result stored (mean rollout latency)
        self.skipped = 0  # tasks dropped without running (batch cancelled, or stale policy version)
        self.fingerprint = view.fingerprint
        self.fields = view.fields  # what discovery announces of its entry
        self.parts = view.parts  # rows' provenance.parts
        self._model_fps = view.model_fingerprints
        self._concurrency = {m: c.concurrency for m, c in config.models.items()}  # a GPU-hour's share (pricing)
        self.pricing = config.pricing
        self.reward_bound = config.reward_bound
        self.runtime_version = _runtime_version()
        self._model_patience = {m: direct_patience(c.ack_wait_s, bus.timings) for m, c in config.models.items()}
        self.control = ControlView(bus, on_cancel=self._stop_batch)
        self._running: dict[str, set[anyio.CancelScope]] = {}  # batch -> its rollouts running here
        self._scope_class: type[anyio.CancelScope] | None = None  # the event loop's (``_cancellable``)
        self.records = AttemptRecords(bus, name)
        self.rollouts = Rollouts(bus.subjects, bus.timings.keepalive_s)  # where each waits (``why``)
        self._checkpoint_ttl_s = config.jetstream.checkpoint_ttl_s
        # what its rollouts' model calls need of each model: timeout, fingerprint, patience on a direct call,
        # whether the policy's generations stop at the deadline, tokens kept; and the replica of each rollout's last
        # turn, for the models whose replicas hold a prefix cache (``ModelConfig.routed_load``)
        self._models = Models(
            self._model_timeout,
            self._model_fps.get,
            self._model_patience.get,
            cuttable_models(config),
            Affinity.of({m: c.routed_load() for m, c in config.models.items()}),
        )

    def _model_timeout(self, model: str) -> float:
        m = self.config.models.get(model)
        if m is None:
            return 120.0 + ACK_WAIT_S
        # room for the adapter's own retries and one redelivery of a lost request
        return m.options.call_budget_s() + m.ack_wait_s + 5.0

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        if self.guest is not None:  # its guest first (the module's setup runs there), kept until the worker stops
            async with anyio.create_task_group() as tg:
                await tg.start(self.guest.run_guest)
                try:
                    await self._serve(task_status)
                finally:
                    tg.cancel_scope.cancel()
            return
        if self.setup is not None:
            try:
                await self.setup(self.cfg)
            except UserError as e:  # the module names its key as agents.*.options...: name this entry
                raise UserError(in_entry(str(e), "agents", self.name)) from None
        try:
            await self._serve(task_status)
        finally:
            if self.teardown is not None:
                with anyio.CancelScope(shield=True):
                    await self.teardown()

    async def _serve(self, task_status: anyio.abc.TaskStatus[None]) -> None:
        async with anyio.create_task_group() as tg:
            await self.control.start(tg)
            await self.bus.ensure_results_stream(self.name)  # its own: results are stored there before a task is acked
            await self.bus.ensure_attempts_stream()  # each attempt's record of itself (explain)
            # its rollouts' checkpoints (resume at the last turn), under ``off`` too: a task may ask to keep its own
            # (``keep_checkpoints_s``) or branch another's
            await self._checkpoints_bucket()
            tg.start_soon(self.records.run)
            self.puller = await self.bus.work_queue(
                "task",
                self.name,
                slots=self.cfg.concurrency,
                ack_wait=self.cfg.ack_wait_s,
                handle=self._handle,
            )
            try:
                await serve_pulled(
                    self,
                    self.puller,
                    role="agent",
                    task_status=task_status,
                    log=log,
                    slots=self.cfg.concurrency,
                )
            finally:
                tg.cancel_scope.cancel()

    async def _checkpoints_bucket(self) -> None:
        """Make sure of the checkpoints bucket once. A secured server provisioned by an older version has none
        and this role may not make it: said once; rollouts then run without checkpoints (they start over)."""
        try:
            await checkpoints_kv(self.bus, self._checkpoint_ttl_s)
        except Exception as e:  # noqa: BLE001 - resuming is lost, never a rollout
            log.warning(
                "checkpoint.no_bucket",
                bucket=self.bus.subjects.checkpoints_bucket,
                error=f"{type(e).__name__}: {e}",
                then="rollouts start over when their worker dies: provision the server with this version",
            )

    def stats(self) -> dict[str, Any]:
        p = self.puller
        done = self.completed
        return {
            "in_flight": p.busy if p else 0,
            "slots": self.cfg.concurrency,
            "model": self.cfg.model,  # which model its rollouts call (a batch stops when it is out: ``outage``)
            "completed": done,
            "failed": self.failed,
            "retried": self.retried,
            "skipped": self.skipped,
            "mean_rollout_ms": round(1000 * self.busy_s / done, 2) if done else None,
        }

    def waits(self) -> dict[str, Any]:
        """Where each rollout running here waits now (``gym-runtime why``), read only when asked."""
        lost = getattr(self.puller, "lost", None)  # a bus in memory has no peers to lose
        return self.rollouts.report(self.bus.calls_in_flight(), self.bus.went_silent, lost, f"agents.{self.name}")

    async def drain(self) -> None:
        await drain_puller(self.puller)

    async def _handle(self, msg: Delivery) -> None:
        started = time.perf_counter()
        parent = self.bus.telemetry.extract(msg.headers)
        attempt = msg.attempt
        try:
            task = await self.bus.decode(msg)
            if not isinstance(task, RolloutTask):
                raise TypeError(f"expected a rollout task, got {type(task).__name__}")
        except Exception as e:  # a poison message: nothing to retry; its batch gets a failure row if it names one
            await self._undecodable(msg, e)
            return
        tel = self.bus.telemetry
        attrs = (  # without an exporter no span is made: none is built
            {
                "messaging.system": "nats",
                "messaging.destination.name": msg.subject,
                "gym.batch": task.batch,
                "gym.task_index": task.task_index,
                "gym.rollout_index": task.rollout_index,
                "gym.attempt": attempt,
            }
            if tel.recording
            else None
        )
        meters = tel.meters
        if meters.enabled:
            stored = msg.enqueued_at  # when JetStream stored the task
            if stored is not None:
                meters.stage_time("queue_wait", self.name, max(0.0, time.time() - stored))
        with tel.span(f"process {msg.subject}", kind=SpanKind.CONSUMER, parent=parent, attributes=attrs):
            with tel.span("rollout", attributes=attrs) as span:
                trace_id, _ = tel.current_ids()
                with logs.bound(
                    batch=task.batch, task_index=task.task_index, rollout_index=task.rollout_index, trace_id=trace_id
                ):
                    ran = await self._run_task(task, attempt, msg)
                    if ran is None:
                        self.retried += 1
                        return  # nak'd for redelivery
                    results, checkpoints = ran
                    took = time.perf_counter() - started
                    for result in results:
                        self._account(result, took, attempt, span, meters)
                    if self.puller is not None:
                        await self.puller.release(msg)  # the next task starts while this one is stored
                    for result in results:
                        await self._store(task, result)
                    # its row (or failure row) is stored: its checkpoint goes, unless kept for branching (its TTL's)
                    if checkpoints is not None and not task.keep_checkpoints_s:
                        await checkpoints.remove()
                    await msg.ack()
                    self.completed += len(results)
                    self.busy_s += (time.perf_counter() - started) * len(results)

    async def _undecodable(self, msg: Delivery, e: Exception) -> None:
        """A task whose body cannot be read (tampered, expired, malformed): a failure row for each repeat
        its message id names (``task_msg_id``: a slot, or a group's), so ``collect`` finishes;
        a message without one is dropped."""
        slots = task_id_slots((msg.headers or {}).get("Nats-Msg-Id", ""))
        error_class = e.info.error_class if isinstance(e, Failure) else "invalid_task"
        if slots is not None:
            log.warning("task.undecodable", subject=msg.subject, error=str(e), then="failure row")
            batch, task_index, first, repeats = slots
            for i in range(first, first + repeats):
                result = RolloutResult(
                    batch=batch,
                    task_index=task_index,
                    rollout_index=i,
                    agent=self.name,
                    error=ErrorInfo(error_class=error_class, message=f"the task cannot be read: {e}"),
                    attempts=msg.attempt,
                )
                await self.bus.js_publish(
                    self.bus.subjects.result(self.name, batch),
                    result,
                    msg_id=result_msg_id(batch, task_index, i, msg.attempt),
                )
                self.failed += 1
            await msg.ack()
        else:
            log.error("task.undecodable", subject=msg.subject, error=str(e), then="dropped")
            await msg.term()

    def _account(self, result: RolloutResult, took: float, attempt: int, span: Any, meters: Any) -> None:
        if meters.enabled:
            cost = result.cost if result.error is not None else result.row.get("cost")  # type: ignore[union-attr]
            meters.rollout_cost(self.name, cost, failed=result.error is not None)
        if result.error is not None:
            self.failed += 1
            span.set_status(StatusCode.ERROR, result.error.message)
            skipped = result.error.error_class in ("cancelled", "stale")  # the trainer asked
            if not skipped:
                meters.rollout_failed(self.name, took, result.error.error_class)
            if result.error.error_class in ("storage_full", "config_mismatch", "model_error"):  # a cause shared: once
                self.bus.warn_limited("rollout.failed", result.error.message, subject=self.name)
                return
            (log.info if skipped else log.warning)(
                "rollout.skipped" if skipped else "rollout.failed",
                error_class=result.error.error_class,
                error=result.error.message,
                attempt=attempt,
            )
        else:
            reward = result.row["reward"]  # type: ignore[index]
            reward = float(reward) if isinstance(reward, (int, float)) else None
            if reward is not None:
                span.set_attribute("gym.reward", reward)
            meters.rollout_done(self.name, took, reward)
            log.debug("rollout.done", agent=self.name, reward=reward, ms=round(1000 * took, 1), attempt=attempt)

    async def _run_task(
        self, task: RolloutTask, attempt: int, msg: Delivery
    ) -> tuple[list[RolloutResult], Checkpointer | None] | None:
        """The task's results (one per repeat it carries: several for a group task) and its checkpoints (removed
        once they are stored), or None when nak'd.

        Its steps: skipped (``_skip_reason``), started (``_started``: the attempts that failed so far, the
        attempt's record), refused after too many lost workers, run (``_attempt``), given back for another
        attempt (``_retry_delay``: the retry rule), its lease ended (the one ``_release``), then its rows."""
        size = max(task.group, 1)
        skip = await self._skip_reason(task)
        if skip is not None:
            self.skipped += size
            return _failures(task, attempt, skip), await self._checkpoints(task, attempt, forget=True)
        key = self.bus.subjects.failed_key(task.agent, task.batch, task.task_index, task.rollout_index)
        failed = await self._started(task, attempt, key)
        lost = attempt - 1 - failed
        if lost > self.cfg.max_worker_losses:
            return _failures(task, attempt, self._lost_too_often(lost)), await self._checkpoints(task, attempt, True)
        ctx = AgentContext.on_bus(self.bus, task, self.cfg, self._models, deadline=time.time() + self.cfg.timeout_s)
        room = ctx.rollout
        room.attempt = attempt
        if (box := await self._checkpoints(task, attempt)) is not None:
            room.checkpoints = box
            room.sandboxes.defer_close = True  # given back, its sandboxes may be left to its next attempt
            room.resumed = await box.read() if attempt > 1 else None
        retrying = False
        try:
            ended = await self._branched(ctx, task, size) if task.branch else await self._attempt(ctx, task, size)
            if isinstance(ended, Failure) and (delay := await self._retry_delay(ended, failed, key)) is not None:
                retrying = True
                self._given_back(task, attempt, ended.info, room)
                await msg.nak(delay=delay)
                return None
        finally:  # the rollout ended, whichever way: so does its sandboxes' lease, before its rows are built
            # (each sandbox's CPU is read as it is removed, so the row's cost has it); given back with a checkpoint
            # naming them, they are left for the pool's lease_grace_s: its next attempt reattaches to them
            if retrying and box is not None and box.written and room.sandboxes.held():
                room.sandboxes.let_go()
            else:
                await _release(room)
            if (affinity := self._models.affinity) is not None:
                affinity.ended(room.rollout_key)  # its replicas hold one rollout fewer of ours
            if failed and not retrying:  # finished: its count of failed attempts is not needed again
                await self.control.count_failed(key, 0)
            if box is not None:  # a nak'd attempt's writes stored before the next attempt reads them
                await box.settled()
        if isinstance(ended, Failure):
            costs = self._failure_costs(room, task)
            failures = _failures(task, attempt, ended.info, costs, room.ledger.calls.log, room.sandboxes.commands, room)
            return failures, box
        return self._results(room, task, attempt, ended), box

    async def _branched(self, ctx: AgentContext, task: RolloutTask, size: int) -> list[Outcome] | Failure:
        """A branch's attempt (``rollout.branch``): from its branch point (its own checkpoint where an earlier
        attempt wrote one), else the ``Failure`` saying why it cannot branch."""
        room = ctx.rollout
        if room.resumed is None:
            try:
                room.resumed = await branch_point(self.bus, task)
            except Failure as e:
                return e
            room.branching = True
        ended = await self._attempt(ctx, task, size)
        if room.branching and room.resumed_how != "branched" and not isinstance(ended, Failure):
            return Failure("invalid_task", f"branch: agent {self.cfg.agent} does not take up checkpoints (resume)")
        return ended

    async def _checkpoints(self, task: RolloutTask, attempt: int, forget: bool = False) -> Checkpointer | None:
        """The rollout's checkpoints (None: its agent writes none, or a group task: its repeats run as one);
        ``forget``: a task ended before it ran (its row deletes what an earlier attempt wrote). A rollout kept
        for branching (``keep_checkpoints_s``) is checkpointed every turn, whatever its agent's mode."""
        keep = task.keep_checkpoints_s
        if (self.cfg.checkpoint == "off" and not keep) or task.group > 1 or (forget and attempt == 1):
            return None
        key = self.bus.subjects.checkpoint_key(task.agent, task.batch, task.task_index, task.rollout_index)
        every = self.cfg.checkpoint == "every_turn" or keep > 0
        box = Checkpointer(self.bus, key, "every_turn" if every else "auto", keep)
        box.written = forget  # an earlier attempt's may be there
        return box

    async def _started(self, task: RolloutTask, attempt: int, key: str) -> int:
        """The attempts of this task that failed so far; the attempt's start recorded.

        JetStream counts deliveries; the attempts that failed by the rollout's own doing are counted by us
        (only when one failed, so a first delivery reads nothing): every other earlier delivery was a lost
        worker (killed, node gone, hung past ack_wait), charged to a budget of its own, not to max_attempts."""
        failed = await self.control.failed_attempts(key) if attempt > 1 else 0
        start = AttemptStart(
            task_index=task.task_index,
            rollout_index=task.rollout_index,
            group=task.group,
            attempt=attempt,
            failed=failed,
            worker=self.worker_id,
            node=self.node,
            pid=self.pid,
            at=time.time(),
        )
        await self.records.started(task.batch, start)  # stored before the attempt's first model call
        return failed

    def _lost_too_often(self, lost: int) -> ErrorInfo:
        return ErrorInfo(
            error_class="worker_lost",
            message=(
                f"the workers running this task were lost {lost} times (max_worker_losses="
                f"{self.cfg.max_worker_losses}): killed, out of memory, or hung past ack_wait"
            ),
        )

    async def _attempt(self, ctx: AgentContext, task: RolloutTask, size: int) -> list[Outcome] | Failure:
        """Run the agent once under its clock (``timeout_s``, paused while sandboxes are acquired) and its
        batch's cancel: its outcomes, or the ``Failure`` that ended it (a crash is an ``internal`` one)."""
        timeout_s, room, live = self.cfg.timeout_s, ctx.rollout, self.rollouts.live
        paused: _Paused | None = None
        if room.resumed is not None:  # a resumed attempt gets the rest of the rollout's timeout_s (never more)
            timeout_s = max(0.0, timeout_s - room.resumed.elapsed_s)
            room.deadline = time.monotonic() + timeout_s
        try:
            async with asyncio.timeout(timeout_s) as clock:  # asyncio's own: cheaper than anyio's
                # acquiring a sandbox (waiting for a lease, the create) does not count against timeout_s
                room.sandboxes.on_acquire = paused = _Paused(room, clock)
                live[paused] = Running(task, room.attempt)
                if room.resumed is not None:  # restarted from turn 0 after all: the whole timeout_s again
                    room.on_restart = functools.partial(_fresh_clock, room, clock, self.cfg.timeout_s)
                # and so does an environment's, inside a call this rollout made (its handler says so)
                pausing = ON_PAUSE.set(paused.in_call)
                stopped = self._cancellable(task.batch)
                try:
                    with stopped:
                        outcomes = await self._outcomes(ctx, task, size)
                finally:
                    self._ended(task.batch, stopped)
                    ON_PAUSE.reset(pausing)
        except TimeoutError:
            return Failure("timeout", f"rollout exceeded timeout_s={self.cfg.timeout_s:g}")
        except Failure as e:
            return e
        except Exception as e:
            log.error("rollout.crashed", error=repr(e), exc_info=e)
            return Failure("internal", f"{type(e).__name__}: {e}")
        finally:
            live.pop(paused, None)
        if stopped.cancelled_caught:
            self.skipped += size
            return Failure("cancelled", f"batch {task.batch} was cancelled while it ran")
        return outcomes

    async def _retry_delay(self, e: Failure, failed: int, key: str) -> float | None:
        """The retry rule: the delay before the task runs again, or None when this failure is its last.

        A guest killed for another rollout's fault is a lost worker, not a failed attempt (``is_lost``); a
        retryable failure runs again while ``max_attempts`` allows, counted (``count_failed``) before its nak."""
        if is_lost(e):
            log.info("rollout.lost", error=e.info.message, then="runs again")
            return NAK_BACKOFF_S[0]
        if e.info.retryable and failed + 1 < self.cfg.max_attempts:
            delay = NAK_BACKOFF_S[min(failed, len(NAK_BACKOFF_S) - 1)]
            log.info("rollout.retry", error=e.info.message, attempt=failed + 1, delay_s=delay)
            await self.control.count_failed(key, failed + 1)
            return delay
        return None

    def _results(
        self, room: Rollout[Any], task: RolloutTask, attempt: int, outcomes: list[Outcome]
    ) -> list[RolloutResult]:
        """A row for each repeat; a group's calls are one ledger: its first repeat's row carries the agent's side."""
        results = []
        first, spent = task.rollout_index, None
        for i, outcome in zip(range(first, first + len(outcomes)), outcomes, strict=True):
            each = msgspec.structs.replace(task, rollout_index=i, group=0) if len(outcomes) > 1 else task
            cost, prov = self._ledger(room, attempt, outcome.verdict, whole=i == first)
            spent = cost if i == first else spent
            try:
                how = room.resumed_how  # a branch's row names its parent instead (``branch_of``)
                resumed = (room.resumed_from_turn, how) if how is not None and how != "branched" else None
                row = build_row(
                    each,
                    outcome,
                    policy_versions=room.ledger.policy_versions,
                    cost=cost,
                    provenance=prov,
                    resumed=resumed,
                    reward_bound=self.reward_bound,
                )
            except Failure as e:  # a field that would replace one of the runtime's row keys, a reward past its bound
                costs = self._failure_costs(room, task, spent)
                return _failures(task, attempt, e.info, costs, room.ledger.calls.log, None, room)
            results.append(
                _result(
                    task,
                    i,
                    attempt,
                    row=row,
                    answer_field=outcome.verdict.answer_field,
                    calls=room.ledger.calls.log if i == first and room.ledger.calls.log else None,
                    calls_from=room.ledger.from_ if i == first else None,
                    commands=room.sandboxes.commands if i == first and room.sandboxes.commands else None,
                )
            )
        self._sandbox_wait(room, results)
        return results

    def _sandbox_wait(self, room: Rollout[Any], results: list[RolloutResult]) -> None:
        """The time its sandboxes (its own, and its environment's) waited for a lease (not counted against
        timeout_s), on its rows and under the pool waited for: the agent's own, else its environment's."""
        box = room.sandboxes.on_acquire
        if not (room.sandboxes.asked or (isinstance(box, _Paused) and box.waits_in_calls)):
            return
        waited = room.sandboxes.waited_s + (box.waited_in_calls if isinstance(box, _Paused) else 0.0)
        for r in results:
            r.row["sandbox_wait_s"] = round(waited, 3)  # type: ignore[index]
        env = self.config.resources.get(self.cfg.resource or "")
        pool = room.sandboxes.pool or (env.sandbox if env is not None else "")
        self.bus.telemetry.meters.sandbox_waited(pool, waited)

    def _cancellable(self, batch: str) -> anyio.CancelScope:
        """The scope of a rollout of ``batch`` that stops when the trainer cancels the batch (``BatchHandle.cancel``),
        run under it and then handed to ``_ended`` (two calls, where a context manager's were seven a rollout).
        Made by the event loop's own scope class, found once: ``anyio.CancelScope()`` asks which loop runs at each
        call (10 k of the 28 k instructions a rollout's scope cost, ``tests/bench/instructions.py``)."""
        make = self._scope_class
        if make is None:
            make = self._scope_class = type(anyio.CancelScope())
        scope = make()
        self._running.setdefault(batch, set()).add(scope)
        if self.control.known_cancelled(batch):  # cancelled between the start check and now
            scope.cancel()
        return scope

    def _ended(self, batch: str, scope: anyio.CancelScope) -> None:
        running = self._running.get(batch)
        if running is not None:
            running.discard(scope)
            if not running:
                del self._running[batch]

    def _stop_batch(self, batch: str) -> None:
        for scope in self._running.get(batch, ()):
            scope.cancel()

    def _given_back(self, task: RolloutTask, attempt: int, info: ErrorInfo, room: Rollout[Any]) -> None:
        """An attempt nak'd for another: its record says why, with the calls it made."""
        retried = AttemptRetried(
            task_index=task.task_index,
            rollout_index=task.rollout_index,
            group=task.group,
            attempt=attempt,
            worker=self.worker_id,
            error=info,
            calls=room.ledger.calls.log,
            at=time.time(),
        )
        self.records.add(task.batch, retried)

    async def _outcomes(self, ctx: AgentContext, task: RolloutTask, size: int) -> list[Outcome]:
        if task.group > 1:
            if self.run_group is None:
                raise Failure("invalid_task", f"agent {self.cfg.agent} cannot run group tasks (no run_group)")
            outcomes = list(await self.run_group(ctx, size))
            if len(outcomes) != size:
                raise Failure("internal", f"run_group returned {len(outcomes)} outcomes for {size} repeats")
            return outcomes
        return [await self.fn(ctx)]

    def _failure_costs(self, room: Rollout[Any], task: RolloutTask, whole: Cost | None = None) -> list[Cost | None]:
        """A failed attempt's cost on each repeat's row: a single rollout's all; a group task's, each repeat's own
        calls (its agent said which were whose: ``in_repeat``) and, on its first, the calls made outside any
        repeat and its sandboxes' time (their sum is what the attempt used). A group whose agent did not say: all
        on its first row (``whole`` where the caller has it already), as a successful group's rows carry it."""
        size = max(task.group, 1)
        if size == 1 or not any(k is not None for k in room.ledger.repeats):
            return [whole if whole is not None else self._spent(room), *([None] * (size - 1))]
        costs: list[Cost | None] = []
        for j in range(size):
            cost = Cost()
            for key in (j, None) if j == 0 else (j,):
                if (turns := room.ledger.repeats.get(key)) is not None:
                    cost.merge(turns.cost)
            costs.append(self._spent(room, cost, sandboxes=j == 0))
        return costs

    def _spent(self, room: Rollout[Any], cost: Cost | None = None, *, sandboxes: bool = True) -> Cost | None:
        """What a rollout used (``cost``: a part of it; its sandboxes' time and the estimate added); None when it
        used nothing."""
        cost = room.ledger.cost if cost is None else cost
        if sandboxes and room.sandboxes.asked:  # (added to its environment's, merged from the verdict)
            cost.sandbox_ms += counted_ms(room.sandboxes.exec_s)
            cost.sandbox_cpu_ms += counted_ms(room.sandboxes.cpu_s)
        if not cost.models and not cost.tool_ms and not cost.sandbox_ms and not cost.sandbox_cpu_ms:
            return None
        if self.pricing is not None:
            cost.estimated_cost = self.pricing.estimate(cost, self._concurrency)
            cost.currency = self.pricing.currency
        return cost

    def _ledger(
        self, room: Rollout[Any], attempt: int, verdict: VerifyReply, *, whole: bool
    ) -> tuple[Cost | None, Provenance]:
        """A row's ``cost`` and ``provenance``: the agent's calls (``whole``: all of them; a group's later repeats
        none, its first carries them) plus the verifying session's own model calls (judges)."""
        served = verdict.served
        if whole:
            room.ledger.cost.merge(served.cost if served else None)
            cost = self._spent(room)
        elif served is not None and served.cost is not None:
            cost = msgspec.structs.replace(served.cost)
            if self.pricing is not None:
                cost.estimated_cost = self.pricing.estimate(cost, self._concurrency)
        else:
            cost = None
        workers = {"agent": [self.worker_id]}
        if served is not None and served.worker:
            workers["resource"] = [served.worker]
        if room.ledger.model_workers:
            workers["model"] = room.ledger.model_workers
        # the agent's sandboxes' images, then those of the environment's session, each (name, id) once
        ran = dict.fromkeys(
            zip([i or f"{room.sandboxes.pool}:default" for i in room.sandboxes.images], room.sandboxes.image_ids)
        )
        if served is not None:
            ran.update(dict.fromkeys(zip(served.images, served.image_ids)))
        prov = Provenance(
            runtime=self.runtime_version,
            config=self.fingerprint,
            parts=self.parts,
            env=served.code or None if served else None,
            grader=grader_identity(self._model_fps, served.cost if served else None),
            turns=room.ledger.turns,
            images=[name for name, _ in ran],
            image_ids=short_ids([content for _, content in ran]),
            attempt=attempt,
            workers=workers,
        )
        return cost, prov

    async def _skip_reason(self, task: RolloutTask) -> ErrorInfo | None:
        """Why a task must not run: another config's task, its batch was cancelled, or it is stale."""
        if task.fingerprint and task.fingerprint != self.fingerprint:
            return ErrorInfo(
                error_class="config_mismatch",
                message=(
                    f"agent worker {self.worker_id} was started with another config for {self.name!r} than the "
                    f"batch was published with (fingerprint {self.fingerprint}, the task's {task.fingerprint}): "
                    "start the workers and publish with the same config and --set values (`publish` names the "
                    "keys that differ), or give each experiment its own `namespace`"
                ),
            )
        if task.cancelled or await self.control.is_cancelled(task.batch):
            return ErrorInfo(error_class="cancelled", message=f"batch {task.batch} was cancelled before this task ran")
        if task.max_staleness is not None and task.policy_version is not None:
            current = await self.control.version(self.cfg.model)
            if current is not None and current - task.policy_version > task.max_staleness:
                return ErrorInfo(
                    error_class="stale",
                    message=(
                        f"policy version {current} is more than max_staleness={task.max_staleness} ahead of the "
                        f"task's {task.policy_version}; dropped without running"
                    ),
                )
        return None

    async def _store(self, task: RolloutTask, result: RolloutResult) -> None:
        """Store the result; one a full stream refuses (its body needs the blob stream) is stored as a
        ``storage_full`` failure row instead (without its input when that is what does not fit).

        Its id names its slot and attempt, with a part no other pool can predict (``result_msg_id``): a row
        another pool stored first under a guessed id cannot make this one a duplicate. A redelivered task
        stores its row under its new attempt; readers keep a slot's result over any later row of it.
        """
        subject = self.bus.subjects.result(self.name, task.batch)
        msg_id = result_msg_id(result.batch, result.task_index, result.rollout_index, result.attempts)
        try:
            await self.bus.js_publish(subject, result, msg_id=msg_id)
            return
        except StorageFull as e:
            self.bus.warn_limited("result.not_stored", e.info.message, subject=subject)
            info = e.info
        self.failed += result.error is None
        failed = msgspec.structs.replace(result, row=None, error=info, answer_field=None, input_row=task.row)
        try:
            await self.bus.js_publish(subject, failed, msg_id=msg_id)
        except StorageFull:
            try:
                await self.bus.js_publish(subject, msgspec.structs.replace(failed, input_row=None), msg_id=msg_id)
            except StorageFull as e:
                # this agent's own results stream is full: nothing of its pool is stored until its batches are
                # purged; the task is acked (running it again would be refused again) and the batch's reader
                # writes the slot's storage_full row. Other agents' streams are untouched.
                self.bus.warn_limited("result.not_stored", e.info.message, subject=subject)


class _Paused:
    """A rollout's clock stopped while it acquires sandboxes (several at once: while any is acquiring), then
    moved on by the time that took."""

    def __init__(self, room: Rollout[Any], clock: asyncio.Timeout) -> None:
        self.room, self.clock = room, clock
        self.acquiring = 0
        self.end: float | None = None  # the rollout's end before the pause (the loop's clock)
        self.since = 0.0  # when the pause began (time.monotonic)
        self.waits_in_calls = 0  # an environment's acquisitions inside this rollout's calls
        self.waited_in_calls = 0.0  # and their seconds

    def __call__(self, took: float | None) -> None:
        if took is None:  # an acquisition starts: no timeout while any is out
            if self.acquiring == 0:
                self.end, self.since = self.clock.when(), time.monotonic()
                self.clock.reschedule(None)
            self.acquiring += 1
            return
        self.acquiring -= 1
        if self.acquiring == 0:
            paused = time.monotonic() - self.since
            if self.end is not None:
                self.clock.reschedule(self.end + paused)
            self.room.deadline += paused

    def in_call(self, took: float | None) -> None:
        """An environment's acquisition inside a call of this rollout (``ON_PAUSE``): the same pause."""
        if took is None:
            self.waits_in_calls += 1
        else:
            self.waited_in_calls += took
        self(took)


def _fresh_clock(room: Rollout[Any], clock: asyncio.Timeout, timeout_s: float) -> None:
    """A resumed attempt that restarts gets the whole ``timeout_s`` from now."""
    clock.reschedule(asyncio.get_running_loop().time() + timeout_s)
    room.deadline = time.monotonic() + timeout_s


def _runtime_version() -> str:
    try:
        return version("gym-runtime")
    except PackageNotFoundError:  # a source tree that is not installed
        return "0.0.0"


def short_ids(ids: list[str]) -> list[str]:
    """Image content ids as rows keep them: ``sha256:`` less, 12 hex digits (``Provenance.image_ids``); none when
    no sandbox had one (the process backend, a provider's snapshots)."""
    if not any(ids):
        return []
    return [i.removeprefix("sha256:")[:12] for i in ids]


async def _release(room: Rollout[Any]) -> None:
    """End the rollout's lease: before its row is built (each sandbox's CPU is read as it is removed, so the
    row's cost has it) and in the rollout's ``finally``, whichever way it ended. A shielded cancel scope only
    where a sandbox is held: on every rollout it cost ~30 k instructions (tests/bench/instructions.py)."""
    if room.sandboxes.held():
        with anyio.CancelScope(shield=True):
            await room.copied()  # a turn's copies still being made (kept for branching) first
            await room.sandboxes.close_all()


def _result(task: RolloutTask, i: int, attempt: int, **fields: Any) -> RolloutResult:
    """Repeat ``i`` of ``task``, from its attempt ``attempt``: its identity, and ``fields`` (its row, or its error)."""
    return RolloutResult(
        batch=task.batch, task_index=task.task_index, rollout_index=i, agent=task.agent, attempts=attempt, **fields
    )


def _failures(
    task: RolloutTask,
    attempt: int,
    info: ErrorInfo,
    costs: list[Cost | None] | None = None,
    calls: list[list[int]] | None = None,
    commands: list[SandboxCommand] | None = None,
    room: Rollout[Any] | None = None,
) -> list[RolloutResult]:
    """A failure row for each repeat the task carries (a module function: a closure per rollout was a
    function, its cells and their tuple kept alive for the whole rollout); ``costs``: each repeat's cost
    (``AgentWorker._failure_costs``); ``calls`` and ``commands``: the attempt's, on the first repeat's row. An
    attempt that ran (``room``) adds, on every repeat's row, where its time went (``time_split``: its failure
    attribution) and the policy's trajectory so far with its policy versions (``partial``): a group task's, each
    repeat's own where its agent said which calls were whose (``in_repeat``), else none."""
    split = _time_split(room) if room is not None else None
    ledger = room.ledger if room is not None else None
    first = task.rollout_index
    return [
        _result(
            task,
            i,
            attempt,
            error=info,
            input_row=task.row,
            cost=costs[i - first] if costs else None,
            calls=calls or None if i == first else None,
            commands=commands or None if i == first else None,
            time_split=split,
            partial=ledger.partial(None if task.group <= 1 else i - first) if ledger is not None else None,
            policy_versions=ledger.versions(None if task.group <= 1 else i - first) if ledger is not None else None,
            branch=task.branch,
        )
        for i in range(first, first + max(task.group, 1))
    ]


def _time_split(room: Rollout[Any]) -> TimeSplit:
    """Where an attempt's time went (``data.attribution``): its model calls' generation (the model workers'
    ``call_ms``) and the rest of their round trips, its tool calls and its own sandboxes' commands."""
    ledger, boxes = room.ledger, room.sandboxes
    total = max(0, ledger.calls.ms() - counted_ms(boxes.waited_s))  # a lease's wait stops the clock
    generating = sum(m.call_ms for m in ledger.cost.models.values())
    waits = max(0, sum(c[1] for c in ledger.calls.log if len(c) == 4) - generating)
    if room.generating_since is not None:  # the policy's call the failure cut: generating or queued, no one can
        generating += counted_ms(time.perf_counter() - room.generating_since)  # tell; the policy's (docs/trainer.md)
    tools = ledger.cost.tool_ms + counted_ms(boxes.exec_s)
    return TimeSplit(total_ms=total, generating_ms=generating, model_wait_ms=waits, tools_ms=tools)
