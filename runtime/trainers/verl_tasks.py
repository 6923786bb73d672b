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
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from verl.utils.dataset.rl_dataset import RLHFDataset

from gym_runtime.client.sampler import TaskSampler, sampler_config
from gym_runtime.data.sampling import task_key
from gym_runtime.errors import ClientError

__all__ = ["GymTaskDataset", "active", "observe_batch"]

_ACTIVE: list[TaskSampler] = []  # the train dataset's sampler in this process (the last one built)


def active() -> TaskSampler | None:
    """The sampler the train ``GymTaskDataset`` of this process picks by (None: no such dataset here)."""
    return _ACTIVE[-1] if _ACTIVE else None


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
        self._queue: list[int] = []
        files = [data_files] if isinstance(data_files, str) else list(data_files)
        train = config.get("train_files")
        if files != (
            [train] if isinstance(train, str) else list(train or [])
        ):  # the validation set: read as verl reads it
            return
        cfg = sampler_config(dict(config.get("gym_sampler") or {}))
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
        _ACTIVE[:] = [self.sampler]

    def __getitem__(self, item: int) -> Any:
        if self.sampler is None:
            return super().__getitem__(item)
        if not self._queue:  # a batch's worth of distinct tasks, picked when the dataloader reaches it
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
