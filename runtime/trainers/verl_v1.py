"""verl 0.9.1's v1 trainer (``trainer.use_v1: true``, its default): the failure policy's counts in each training
step's logged metrics, through the replay buffer verl lets a user plug in.

Under v1, verl's ``AgentLoopWorkerTQ`` actors run ``GymAgentLoop`` unchanged and put each output, its
``extra_fields`` too, into TransferQueue; a training step takes its batch from the replay buffer's ``sample``,
whose second value joins the step's logged metrics (``PPOTrainer._step_once``: ``metrics.update(...)``). That is
the one place a v1 step takes figures of its generation: no agent loop manager's timing reaches them. So
``GymReplayBuffer`` (sync trainer) and ``GymReplayBufferAsync`` (``colocate_async``, ``separate_async``) are verl's
own samplers plus, for the batch they hand the step, ``failure_metrics`` of its samples' ``gym_tally`` as
``training/gym_runtime/<count>/total`` (``total``: verl's ``MetricsAggregator`` sums such a name over a step's
``parameter_sync_step`` samples, where it would average a bare count), and the failure bound (``check_bound``: more
than the loops' ``max_excluded`` excluded is one ``ClientError`` line). The class must match the trainer mode
(verl builds whichever the config names): the other one is one ``ClientError`` line naming it. verl's config names
it::

    trainer:
      v1:
        sampler:
          custom_sampler: {path: "pkg://gym_runtime.trainers.verl_v1", name: GymReplayBuffer}

Validation needs nothing: v1's ``_validate`` reads each sample's ``extra_fields["reward_extra_info"]`` into its
validation metrics as the legacy trainer does. This module imports TransferQueue (verl's ``verl-core`` extra), which
v1 needs anyway; ``gym_runtime.trainers.verl`` does not.
"""

from __future__ import annotations

from typing import Any, ClassVar

import transfer_queue as tq
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync

from gym_runtime.errors import ClientError
from gym_runtime.trainers.verl import check_bound, failure_metrics
from gym_runtime.trainers.verl_tasks import end_at_step, ends_by_steps, observe_batch

__all__ = ["GymReplayBuffer", "GymReplayBufferAsync", "step_metrics"]

# the fields of a GymAgentLoop output the counts and the bound read (verl's TransferQueue stores extra_fields whole)
_FIELDS = ("gym_tally", "gym_max_excluded", "gym_task", "gym_outcome")


def step_metrics(batch: Any) -> dict[str, float]:
    """The counts of a sampled batch (verl's ``KVBatchMeta``: its keys in TransferQueue) as a v1 step logs them,
    after the bound: ``training/gym_runtime/excluded/total``... (``validation/`` for the ``val`` partition). A sample
    of another agent loop carries no ``gym_tally`` and counts nothing."""
    if not batch.keys:
        return {}
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["extra_fields"])
    fields: dict[str, list[Any]] = {key: [] for key in _FIELDS}
    for value in data["extra_fields"]:
        extra = getattr(value, "data", value)  # as verl's replay buffer reads them (NonTensorData or a dict)
        if isinstance(extra, dict) and "gym_tally" in extra:
            for key in _FIELDS:
                fields[key].append(extra.get(key))
    if not fields["gym_tally"]:
        return {}
    check_bound(fields)
    prefix = "training" if batch.partition_id == "train" else "validation"
    out = {f"{prefix}/{key}/total": value for key, value in failure_metrics(fields).items()}
    if batch.partition_id == "train":  # the task sampler's outcomes (GymTaskDataset), and its metrics
        out.update({f"training/{key}": value for key, value in observe_batch(fields).items()})
    return out


class _FailureCounts:
    """What both samplers add to verl's: the trainer mode checked (verl builds whichever class the config names, in
    any mode), and ``step_metrics`` of each sampled batch beside verl's own metrics."""

    sync: ClassVar[bool]

    def __init__(self, trainer_mode: str, *args: Any, **kwargs: Any) -> None:
        if (trainer_mode == "sync") != self.sync:
            name = "GymReplayBuffer" if trainer_mode == "sync" else "GymReplayBufferAsync"
            raise ClientError(
                f"trainer.v1.trainer_mode: {trainer_mode} needs trainer.v1.sampler.custom_sampler.name: {name} "
                "(gym_runtime.trainers.verl_v1)"
            )
        verl_buffer: Any = super()  # verl's ReplayBuffer or ReplayBufferAsync, after this class in the MRO
        verl_buffer.__init__(trainer_mode, *args, **kwargs)
        # the trainer (its _add_prompts_to_generate's): with the task sampler, the run ends by its steps (verl_tasks)
        ends_by_steps(getattr(kwargs.get("refill_fn"), "__self__", None))

    def sample(self, global_steps: int, partition_id: str, batch_size: int) -> tuple[Any, dict[str, Any]]:
        verl_buffer: Any = super()
        batch, metrics = verl_buffer.sample(global_steps=global_steps, partition_id=partition_id, batch_size=batch_size)
        counted = step_metrics(batch)  # the step's outcomes counted into the task sampler
        if partition_id == "train":
            end_at_step(global_steps)  # nothing left to teach: this step is the run's last
        return batch, {**metrics, **counted}


class GymReplayBuffer(_FailureCounts, ReplayBuffer):
    """verl's sync replay buffer, its sampled batch's failure counts in the step's metrics (``step_metrics``)."""

    sync = True


class GymReplayBufferAsync(_FailureCounts, ReplayBufferAsync):
    """verl's async replay buffer (``colocate_async``, ``separate_async``), its sampled batch's failure counts in the
    step's metrics (``step_metrics``)."""

    sync = False
