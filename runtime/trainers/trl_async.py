"""TRL's asynchronous GRPO (``trl.experimental.async_grpo.AsyncGRPOTrainer``) fed by gym-runtime.

``GymRolloutWorker`` is its ``rollout_worker`` (``RolloutWorkerProtocol``): a producer on the client's event loop
keeps ``groups_in_flight`` groups running, each one row's ``num_generations`` rollouts submitted as a batch of its
own, and turns each finished group into ``RolloutSample``s (the whole sequence's ids, a completion mask that is 0
on the prompt and on tool and template tokens, the sampling policy's logprobs, the group-normalised advantage of
the environment's reward, the policy version that made it) on ``rollout_buffer``. Staleness is the trainer's
``max_staleness``, kept by the client's admission (``submit(max_staleness=S, batch_size=B)``: a group starts only
when it will be used within S versions; a group handed to the trainer is reported consumed); a group still running
when the trainer's version moves more than S past the one it was submitted at is cancelled in flight (its
running rollouts stop: ``BatchHandle.cancel``) and never reaches the buffer. Failure rows follow the failure policy
(``trainers.failures.FailurePolicy``, the same as the sync adapter's): a policy failure is a sample like any other
(its real tokens, ``policy_failure_reward``); an environment or infrastructure failure is run again (new tasks,
``retries`` rounds) and then left out: no sample, and not in the group's mean and std. More than ``max_excluded`` of
a step's rollouts (``batch_size``) excluded stops the worker with one ``ClientError`` line (TRL's ``check_health``
raises it); the counts reach TRL's logs through ``metrics_queue`` (``gym_runtime/*``), once per group.

``GymWeightTransfer`` is its ``weight_transfer`` (``WeightTransferProtocol``) for a policy served by the
``transformers`` adapter in this process: the rollout model is a copy of the trainer's (so generation never sees
half-stepped weights), registered as the ``live`` model; ``pause`` is the client's pause (``drain`` by default, or
``abort``), ``send_weights`` copies the trainer's tensors into the copy, ``resume`` stamps the next policy version
(``set_policy_version``) and lets held calls go. Its versions count as the trainer's ``model_version`` does.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc

from gym_runtime.client import BatchHandle
from gym_runtime.client.sampler import TaskSampler
from gym_runtime.client.sync import SyncClient
from gym_runtime.data.sampling import task_key
from gym_runtime.errors import ClientError
from gym_runtime.live_models import LIVE_MODELS
from gym_runtime.observability import logs
from gym_runtime.rigs import trl_cpu
from gym_runtime.trainers.arguments import checked, count, failure_policy
from gym_runtime.trainers.exhausted import stop_callback, stops
from gym_runtime.trainers.failures import FailurePolicy, Kind, Tally, advantages, has_tokens, reward_of, std
from gym_runtime.trainers.rows import RowIndex, check_agent, sequence
from gym_runtime.trainers.step_fill import StepFill
from gym_runtime.trainers.train_rows import TrainRowsWriter
from gym_runtime.trainers.waiting import StepWait, WaitPolicy, explain, log_line, wait_policy

__all__ = ["AsyncCounts", "GymRolloutWorker", "GymWeightTransfer"]

log = logs.get("gym.trainers.trl_async")


@dataclass
class AsyncCounts:
    groups: int = 0  # handed to the trainer
    failed_groups: int = 0  # left with no sample: every member excluded (or scored but without tokens)
    stale_groups: int = 0  # finished too old to use: dropped
    cancelled_groups: int = 0  # cancelled in flight (too stale to use)


def _starting_trainer(worker: Any) -> Any:
    """The trainer that is starting ``worker`` (TRL's protocol hands the worker no trainer: its train-begin callback,
    which holds the trainer as ``_trainer``, calls ``start``), or None (started some other way)."""
    frame = sys._getframe(1)
    for _ in range(12):  # (TRL's callback is two frames up; a worker started by hand finds none)
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        try:
            for candidate in (owner, getattr(owner, "_trainer", None)):
                if candidate is not None and getattr(candidate, "rollout_worker", None) is worker:
                    return candidate
        except Exception:  # an object whose attributes cannot be read: not the trainer
            pass
        frame = frame.f_back  # type: ignore[assignment]
    return None


class GymRolloutWorker:
    """TRL's ``RolloutWorkerProtocol`` over a ``SyncClient``: ``rollout_buffer`` and ``metrics_queue`` are
    ``queue.Queue``s; ``sample`` is TRL's ``RolloutSample`` class (``trl.experimental.async_grpo``); ``waits``
    (``trainers.waiting.WaitPolicy``): the trainer's wait for samples, counted from the last one handed over, said
    in one line after ``say_after_s`` and failed with it at ``bound_s`` (TRL's ``check_health`` raises it). With a
    ``sampler`` whose ``skip_below`` is set, the trainer that starts the worker ends its run at the end of the step
    after which no task can teach (one ``trainer.stopped`` line naming the sampler's run; ``stop_when_exhausted=False``:
    it goes on at the floor's exploration); the worker generates until then, so that step can fill."""

    @checked
    def __init__(
        self,
        client: SyncClient,
        rows: Sequence[dict[str, Any]],
        *,
        sample: Any,
        num_generations: int,
        max_staleness: int,
        batch_size: int,
        agent: str | None = None,
        groups_in_flight: int = 4,
        failures: FailurePolicy | None = None,
        rows_path: str | None = None,
        token_budget: int | None = None,
        sampler: TaskSampler | None = None,
        waits: WaitPolicy | None = None,
        stop_when_exhausted: bool = True,
    ) -> None:
        for name, value, least in (
            ("num_generations", num_generations, 1),
            ("groups_in_flight", groups_in_flight, 1),
            ("max_staleness", max_staleness, 0),
            ("batch_size", batch_size, 1),
            ("token_budget", 1 if token_budget is None else token_budget, 1),
        ):
            count(name, value, least)
        failures = failure_policy(failures)
        check_agent(list(client.client.config.agents), agent)
        if trl_cpu.where_needed():  # the recipe's one slip on a machine without CUDA, taken out of its hands
            log.info("trainer.cpu_attention", why="torch has no CUDA: TRL's tree attention in plain torch")
        self.client = client
        self.index = RowIndex(rows)
        self.sample = sample
        self.num_generations = num_generations
        self.max_staleness = max_staleness
        self.batch_size = batch_size
        self.agent = agent
        self.groups_in_flight = groups_in_flight
        self.rollout_buffer: queue.Queue[Any] = queue.Queue()
        self.metrics_queue: queue.Queue[Any] = queue.Queue()
        self.model_version = 0
        self.counts = AsyncCounts()
        self.failures = failures
        self.totals = Tally()  # the failure policy's counts, all groups
        self._step = Tally()  # since the last full step's worth (``batch_size`` rollouts): the bound's window
        # ``token_budget``: the trainer's (AsyncGRPOConfig), to say when TRL would drop a sample as too long
        self.fill = StepFill(batch_size=batch_size, max_staleness=max_staleness, token_budget=token_budget)
        self.last_sample_at = time.monotonic()
        # the trainer's wait for samples (since the last handed over): said and bounded, checked by check_health
        self.watch = StepWait(wait_policy(waits))
        self._running: dict[str, tuple[BatchHandle, int]] = {}  # batch -> (its handle, the version it was submitted at)
        self._stop = threading.Event()
        self._future: Future[Any] | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self.fault: ClientError | None = None  # why the worker stopped (the bound), once
        self._group_id = 0
        # the rows handed over, with the advantage given them (``train_rows``); an excluded member's with reward None
        self.train_rows = TrainRowsWriter(rows_path) if rows_path is not None else None
        if sampler is not None and len(sampler.keys) != len(self.index.rows):
            raise ClientError(f"sampler: made for {len(sampler.keys)} rows, the worker has {len(rows)}")
        self.sampler = sampler  # picks each next group's row and learns from it (None: the rows in turn)
        self.stop_when_exhausted = stop_when_exhausted  # with skip_below: the trainer's run ends when none can teach
        self._stopping: Any = None  # the callback that ends it, once added to the starting trainer

    # ------------------------------------------------------------------------------------------ the protocol

    def start(self) -> None:
        trainer = _starting_trainer(self)
        self._check_trainer(trainer)
        if trainer is not None and self._stopping is None and stops(self.sampler, self.stop_when_exhausted):
            assert self.sampler is not None
            self._stopping = stop_callback(self.sampler, "trl_async")
            trainer.add_callback(self._stopping)  # TRL's step ends check it: the run ends at the exhausting step
        self.last_sample_at = time.monotonic()
        self.watch.restart()
        self._future = self.client.spawn(self._produce)

    def _check_trainer(self, trainer: Any) -> None:
        """The trainer's group size and staleness bound against the worker's: TRL counts a group of its own
        ``num_generations`` where the worker hands over groups of its own, so a mismatch trains on, unsaid."""
        args = getattr(trainer, "args", None)
        for name in ("num_generations", "max_staleness"):
            theirs, ours = getattr(args, name, None), getattr(self, name)
            if isinstance(theirs, int) and theirs != ours:
                raise ClientError(
                    f"AsyncGRPOConfig({name}={theirs}) and GymRolloutWorker({name}={ours}) differ: give both the same "
                    f"{name}"
                )

    def stop(self) -> None:
        self._stop.set()
        if self._future is not None:
            self._future.cancel()
        if self.train_rows is not None:
            self.train_rows.close()

    def update_model_version(self, model_version: int) -> None:
        """The trainer's policy moved on: groups in flight that can no longer be used are cancelled now."""
        self.model_version = model_version
        self.fill.stepped()
        self.client.spawn(self._cancel_stale)

    def check_health(self, stale_after_s: float) -> None:
        self.fill.check(handle for handle, _ in list(self._running.values()))  # a step that cannot fill: one line
        future = self._future
        if future is not None and future.done() and not future.cancelled() and future.exception() is not None:
            raise RuntimeError(f"the gym-runtime rollout worker stopped: {future.exception()}")
        due = self.watch.due()
        stale = time.monotonic() - self.last_sample_at > stale_after_s
        if due is None and not stale:
            return
        said = self._explain()  # what the slowest rollouts wait on (about a second: ``why``'s discovery)
        if due == "fail":
            said = self.watch.failing(said)
            log_line(said)
            raise ClientError(said)
        if stale:  # TRL's own bound (heartbeat_stale_after_s) came first: it says why too
            raise RuntimeError(f"the gym-runtime rollout worker produced nothing for {stale_after_s:g} s: {said}")
        log_line(said)
        self.watch.said()

    def _explain(self) -> str:
        batches = {handle.batch for handle, _ in list(self._running.values())} or None  # None: retries alone run
        bus = self.client.client.bus
        return self.client.spawn(explain, bus, batches, self.watch.waited()).result()

    # ------------------------------------------------------------------------------------------ the producer

    async def _produce(self) -> None:
        room = anyio.Semaphore(self.groups_in_flight)
        order = 0
        async with anyio.create_task_group() as tg:
            self._tg = tg
            while not self._stop.is_set():
                await room.acquire()
                row = self.sampler.pick(1)[0] if self.sampler is not None else order % len(self.index.rows)
                tg.start_soon(self._group, row, room)
                order += 1
        if self.fault is not None:  # the bound: one line, as TRL's check_health shows it
            raise self.fault

    async def _group(self, row: int, room: anyio.Semaphore) -> None:
        try:
            await self._one_group(row)
        except ClientError as e:  # a systematic failure (the bound): the worker stops, saying why once
            self.fault = e
            self._stop.set()
            if self._tg is not None:
                self._tg.cancel_scope.cancel()
        finally:
            room.release()

    async def _one_group(self, row: int) -> None:
        """One group: submitted, gathered, its failures retried, then its samples on the buffer (or counted out)."""
        client = self.client.client
        submitted_at = self.model_version
        handle = await client.submit(
            [self.index.rows[row]],
            repeats=self.num_generations,
            agent=self.agent,
            max_staleness=self.max_staleness,
            batch_size=self.batch_size,
            group_staleness="group",
        )
        self._running[handle.batch] = (handle, submitted_at)
        rows = await handle.gather()
        self._running.pop(handle.batch, None)
        if handle.cancelled:
            self.counts.cancelled_groups += 1
            return
        await handle.consumed(handle.delivered - handle.consumed_rows)  # room for the next groups
        rows, kinds = await self._retried(row, rows)
        if self.sampler is not None:  # the group's final rows, whatever happens to its samples next
            await self.sampler.observe(row, rows)
            self.metrics_queue.put_nowait(self.sampler.metrics())
        made = min((int(r["policy_versions"][0]) for r in rows if r.get("policy_versions")), default=None)
        if made is not None and self.model_version - made > self.max_staleness:
            self.counts.stale_groups += 1
            return
        samples = self._samples(rows, kinds, made if made is not None else self.model_version, row)
        if not samples:
            self.counts.failed_groups += 1
            log.info("trainer.group_left_out", row=row, errors=[r.get("error_class") for r in rows])
            return
        self.fill.handing(len(s.input_ids) for s in samples)
        for s in samples:
            self.rollout_buffer.put_nowait(s)
        self.counts.groups += 1
        self.last_sample_at = time.monotonic()
        self.watch.restart()

    async def _retried(self, row: int, rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Kind]]:
        """The group's rows with its environment and infrastructure failures run again (new tasks, ``retries``
        rounds); counted into the totals, the metrics queue and the bound's window (raises past it)."""
        tally = Tally()
        kinds = [tally.saw(r) for r in rows]
        for _ in range(self.failures.retries):
            slots = [i for i, k in enumerate(kinds) if k == "excluded"]
            if not slots:
                break
            tally.retried += len(slots)
            handle = await self.client.client.submit(
                [self.index.rows[row]],
                repeats=len(slots),
                agent=self.agent,
                max_staleness=self.max_staleness,
                batch_size=self.batch_size,
            )
            again = await handle.gather()
            await handle.consumed(handle.delivered - handle.consumed_rows)
            for i, r in zip(slots, again, strict=True):
                rows[i], kinds[i] = r, tally.saw(r)
        for r, k in zip(rows, kinds, strict=True):
            tally.ended(r, k, f"dataset row {row}")
        self.totals.add(tally)
        self._step.add(tally)
        self.metrics_queue.put_nowait(tally.metrics())  # TRL's log() drains it into its logged metrics
        if self._step.rollouts >= self.batch_size:  # a step's worth: bounded, then a new window
            step, self._step = self._step, Tally()
            step.check(self.failures, "the gym-runtime rollout worker")
        return rows, kinds

    async def _cancel_stale(self) -> None:
        for handle, submitted_at in list(self._running.values()):
            if self.model_version - submitted_at > self.max_staleness and not handle.cancelled:
                log.info("trainer.group_cancelled", batch=handle.batch, submitted_at=submitted_at)
                await handle.cancel()

    def _samples(self, rows: list[dict[str, Any]], kinds: list[Kind], version: int, task: int) -> list[Any]:
        """The group's samples: each scored member and each policy failure with tokens, its advantage over the
        members not excluded (``failures.advantages``: no overflow, no NaN); the excluded are in no statistic."""
        import numpy as np

        rewards = [reward_of(r, self.failures) for r in rows]
        advs = advantages(rewards)
        spread = std(rewards)
        self._group_id += 1
        out = []
        g = self.train_rows.group() if self.train_rows is not None else 0
        key = task_key(self.index.rows[task])  # the sampler's key of the group's dataset row
        for row, k, reward, adv in zip(rows, kinds, rewards, advs, strict=True):
            if self.train_rows is not None:  # every member, an excluded one with reward None
                given = adv if reward is not None else None
                self.train_rows.write(
                    row, step=self.model_version, group=g, reward=reward, advantage=given, total=reward, task=key
                )
            if reward is None or not has_tokens(row):
                continue
            seq = sequence(row)
            params = row.get("responses_create_params") or (row.get("input") or {}).get("responses_create_params")
            messages = (params or {}).get("input") or []
            out.append(
                self.sample(
                    prompt=messages if isinstance(messages, list) else [{"role": "user", "content": str(messages)}],
                    completion=[{"role": "assistant", "content": ""}],
                    input_ids=np.asarray(seq.prompt_ids + seq.completion_ids, dtype=np.int64),
                    completion_mask=np.asarray([0] * len(seq.prompt_ids) + seq.env_mask, dtype=np.int64),
                    old_log_probs=np.asarray([0.0] * len(seq.prompt_ids) + seq.logprobs, dtype=np.float32),
                    advantage=adv,
                    model_version=version,
                    group_id=self._group_id,
                    metrics={"reward": float(reward), "reward_std": spread, "gym_policy_failure": float(k == "policy")},
                    enqueued_at=time.time(),
                )
            )
        if self.train_rows is not None:
            self.train_rows.flush()
        return out


class GymWeightTransfer:
    """TRL's ``WeightTransferProtocol`` onto a rollout copy of the model that the ``transformers`` adapter serves
    as ``live`` (in this process), with the client's pause modes and policy versions."""

    def __init__(
        self, client: SyncClient, rollout_model: Any, tokenizer: Any, *, live: str = "policy", mode: str = "drain"
    ) -> None:
        if mode == "interrupt":
            raise ClientError("GymWeightTransfer pauses with drain or abort (a copy is swapped whole)")
        self.client = client
        self.mode = mode
        self.version = 0
        self.name = live
        self.live = LIVE_MODELS.register(live, rollout_model, tokenizer)
        self.pauses = 0

    def init_weight_transfer(self) -> None:
        """Nothing to set up: the copy is in this process (the worker starts after the first sync)."""

    def pause(self) -> None:
        self.client.pause(mode=self.mode)
        self.pauses += 1

    def send_weights(self, iterator: Iterator[tuple[str, Any]]) -> None:
        import torch

        target = dict(self.live.model.named_parameters())
        with self.live.lock, torch.no_grad():
            for name, tensor in iterator:
                found = [target[n] for n in (name, name.removeprefix("model."), f"model.{name}") if n in target]
                if not found:
                    raise ClientError(f"the rollout model has no parameter {name!r} to receive")
                found[0].copy_(tensor.to(found[0].device, found[0].dtype))
        self.version += 1

    def resume(self) -> None:
        self.client.set_policy_version(self.version)
        self.client.resume()

    def destroy(self) -> None:
        LIVE_MODELS.unregister(self.name)
