"""verl 0.9.1 choosing its prompts by the runtime's task sampler (issue 79), in both of its trainers.

verl 0.9.1 has no curriculum sampler setting: both trainers (v1's ``trainer_base`` and the legacy ``ray_trainer``)
build their train sampler with ``create_rl_sampler(config.data, dataset)``, a random or sequential one, and take no
class from the config (the legacy trainer's ``train_sampler=`` argument is reached only from a script of one's
own). What both do take from the config is the dataset class (``data.custom_cls``). So ``GymTaskDataset`` is verl's
``RLHFDataset`` whose ``__getitem__`` hands the dataloader the next position the ``TaskSampler`` picked (a batch of
distinct tasks at a time) instead of the one asked for; each prompt is still the row's own (the sample verl builds
is the picked row's, whole), and the validation set (the same class, built from ``data.val_files``) is read as
verl's.

The outcomes reach the sampler in the trainer's process: each ``GymAgentLoop`` output carries its task's key and
outcome (``extra_fields``: ``gym_task``, ``gym_outcome``), and the two places that already see a generated batch
there (``GymAgentLoopManager`` in the legacy trainer, ``GymReplayBuffer`` in v1) call ``observe_batch``, which
counts them and returns the sampler's metrics (``gym_runtime/sampler/*``) for the step's log. The dataloader must
run in that process (``data.dataloader_num_workers: 0``: a worker process would pick from a copy that never sees an
outcome). The statistics live in that process's memory: not shared with other trainers nor kept across a restart
(verl's checkpoint does not carry them), unlike ``TaskSampler.open``'s.

With ``skip_below``, the run ends when no task of the set can teach (``trainers.exhausted``; ``gym_sampler:
{stop_when_exhausted: false}`` goes on at the floor's exploration), each trainer as its loop allows. The legacy
trainer iterates ``for epoch: for batch in train_dataloader`` and returns when its epochs are done: the dataset ends
the dataloader (``StopIteration`` at the next batch's first read, torch's end of data), so the epoch ends before
that batch is generated and each later epoch ends at once. v1 refetches once on ``StopIteration`` and fails on a
second, so there the dataset never ends: ``GymReplayBuffer``, which counts each step's outcomes, brings the
trainer's ``total_training_steps`` (the bound its loop checks before each step) down to the step that exhausted
the set. verl hands its replay buffer the trainer's ``_add_prompts_to_generate``: that method's trainer is the one.
Neither saves a checkpoint or validates at that end (verl does both only at the last step it planned, and at
``save_freq``/``test_freq``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from verl.utils.dataset.rl_dataset import RLHFDataset

from gym_runtime.client.sampler import TaskSampler, sampler_config
from gym_runtime.data.sampling import task_key
from gym_runtime.errors import ClientError
from gym_runtime.trainers.exhausted import say_stopped, stops

__all__ = ["GymTaskDataset", "active", "end_at_step", "observe_batch"]

_ACTIVE: list[GymTaskDataset] = []  # the train dataset with a sampler in this process (the last one built)
_BY_STEPS: list[Any] = []  # v1's trainer, when its replay buffer is ours: the run ends by its steps, not the data


def active() -> TaskSampler | None:
    """The sampler the train ``GymTaskDataset`` of this process picks by (None: no such dataset here)."""
    return _ACTIVE[-1].sampler if _ACTIVE else None


def ends_by_steps(trainer: Any) -> None:
    """v1: ``trainer`` (None: not known) ends the run by its steps (``end_at_step``); the dataset never ends."""
    _BY_STEPS[:] = [trainer]


def end_at_step(step: int) -> None:
    """v1, after a step's outcomes were counted: the set exhausted, the trainer's run ends after ``step``."""
    dataset = _ACTIVE[-1] if _ACTIVE else None
    trainer = _BY_STEPS[-1] if _BY_STEPS else None
    if dataset is None or trainer is None or not dataset.stops or dataset.said_stop:
        return
    assert dataset.sampler is not None
    if dataset.sampler.exhausted and isinstance(getattr(trainer, "total_training_steps", None), int):
        dataset.said_stop = True
        trainer.total_training_steps = min(trainer.total_training_steps, step)
        say_stopped(dataset.sampler, "verl_v1", step=step)


def gym_row(extra_info: Any) -> dict[str, Any]:
    """The task row a verl sample carries (``extra_info.gym_row``: a dict or JSON), as ``GymAgentLoop`` reads it."""
    row = (extra_info or {}).get("gym_row") if isinstance(extra_info, Mapping) else None
    if isinstance(row, str):
        row = json.loads(row)
    if not isinstance(row, dict):
        raise ClientError("GymTaskDataset: each sample needs extra_info.gym_row: the task row (dict or JSON)")
    return row


class GymTaskDataset(RLHFDataset):
    """verl's dataset whose training reads follow the ``TaskSampler`` (``data.gym_sampler``: ``SamplerConfig``'s
    knobs; ``score: uniform``, the default, leaves verl's order alone)."""

    def __init__(self, data_files: Any, tokenizer: Any, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(data_files, tokenizer, config, *args, **kwargs)
        self.sampler: TaskSampler | None = None
        self.stops = False  # the run ends when no task can teach (with skip_below; stop_when_exhausted: false, not)
        self.said_stop = False
        self._queue: list[int] = []
        files = [data_files] if isinstance(data_files, str) else list(data_files)
        train = config.get("train_files")
        if files != (
            [train] if isinstance(train, str) else list(train or [])
        ):  # the validation set: read as verl reads it
            return
        knobs = dict(config.get("gym_sampler") or {})
        stop_when_exhausted = knobs.pop("stop_when_exhausted", True)
        if not isinstance(stop_when_exhausted, bool):
            raise ClientError(f"data.gym_sampler.stop_when_exhausted: {stop_when_exhausted!r}: give true or false")
        cfg = sampler_config(knobs)
        if cfg.score == "uniform":
            return
        workers = config.get("dataloader_num_workers", 0)
        if workers:
            raise ClientError(
                f"data.dataloader_num_workers: {workers} with GymTaskDataset: give 0 (its picks and the outcomes "
                "meet in the trainer's process; a worker process would pick from a copy that sees none)"
            )
        rows = [gym_row(info) for info in self.dataframe["extra_info"]]
        self.batch = int(config.get("gen_batch_size") or config.get("train_batch_size") or 1)
        self.sampler = TaskSampler(rows, cfg, None, seed=int(config.get("seed") or 0))
        self.stops = stops(self.sampler, stop_when_exhausted)
        _ACTIVE[:] = [self]

    def __getitem__(self, item: int) -> Any:
        if self.sampler is None:
            return super().__getitem__(item)
        if not self._queue:  # a batch's worth of distinct tasks, picked when the dataloader reaches it
            if self.stops and not _BY_STEPS and self.sampler.exhausted:
                if not self.said_stop:
                    self.said_stop = True
                    say_stopped(self.sampler, "verl", picks=self.sampler.clock)
                raise StopIteration  # torch's end of data: verl's epoch ends before the batch is generated
            self._queue = self.sampler.pick(self.batch)
        return super().__getitem__(self._queue.pop(0))


def observe_batch(fields: Mapping[str, Any], sampler: TaskSampler | None = None) -> dict[str, float]:
    """Count a generated batch's outcomes (``GymAgentLoop``'s ``gym_task`` and ``gym_outcome`` of each sample,
    grouped by task) into ``sampler`` (by default this process's ``active()``), and return its metrics since the
    last call; ``{}`` with no sampler or no such fields (another agent loop's samples)."""
    sampler = sampler if sampler is not None else active()
    if sampler is None:
        return {}
    groups: dict[str, list[dict[str, Any]]] = {}
    for key, row in zip(fields.get("gym_task", []), fields.get("gym_outcome", []), strict=False):
        if isinstance(key, str) and isinstance(row, dict):
            groups.setdefault(key, []).append(row)
    for key, rows in groups.items():
        if key in sampler.position:
            sampler.saw(sampler.position[key], rows)
    return sampler.metrics()


def sample_fields(row: Mapping[str, Any], result: Mapping[str, Any]) -> dict[str, Any]:
    """What a ``GymAgentLoop`` output carries for the sampler: its task's key and what ``observe`` reads of its
    final row (reward or failure, and cost)."""
    keep = ("reward", "error_class", "failure_attribution", "cost")
    return {"gym_task": task_key(row), "gym_outcome": {k: result[k] for k in keep if k in result}}
