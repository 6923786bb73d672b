"""A training run's rows on disk: what a trainer adapter handed the trainer, one JSON row a line, appended as the run
goes (``rows_path=`` on ``TRLRollouts``, ``GymRolloutWorker`` and ``GymAgentLoop``), so ``gym-runtime view`` reads
it while it grows.

Each line is the rollout's row as ``collect`` writes it (a failure row as the sidecar has it) plus the keys of
``rowkeys.TrainFields``, the format's one spelling, which ``view`` reads too: ``train_step`` (the trainer's step,
or the policy version, that consumed it), ``train_group`` (the group's number in this run: its members share it),
``train_reward`` (the environment reward the adapter handed over: None for a member kept out of the group's
statistics), ``train_advantage`` and ``train_total_reward`` (read back from the trainer where it computes them
after the rollouts return; None where it does not say), ``train_task`` (the task's key, the one the task sampler
keeps its statistics under: ``view``'s task pages follow a task across steps by it). A line is flushed when
written: a reader sees whole lines only (a torn last line is its to skip).
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import msgspec

from gym_runtime.data.rowkeys import TrainFields

__all__ = ["TrainRowsWriter", "advantages_from_logs"]

_enc = msgspec.json.Encoder()


def _number(v: Any) -> float | None:
    """A finite float, else None (NaN: TRL's mark for an unscorable completion)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


class TrainRowsWriter:
    """Appends training rows to ``path`` (created with its folder; an existing file is continued: a resumed run)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[bytes] | None = self.path.open("ab")
        self.groups = 0  # the next group's number
        self.written = 0
        self._lock = threading.Lock()  # (the async worker writes on the client's loop; the trainer's thread closes)

    def group(self) -> int:
        """A new group's number (the members of one group are written with the same)."""
        self.groups += 1
        return self.groups - 1

    def write(
        self,
        row: dict[str, Any],
        *,
        step: int | None,
        group: int | str,
        reward: float | None,
        advantage: float | None = None,
        total: float | None = None,
        task: str | None = None,
    ) -> None:
        train = TrainFields(
            train_step=step,
            train_group=group,
            train_reward=_number(reward),
            train_advantage=_number(advantage),
            train_total_reward=_number(total),
            train_task=task,
        )
        line = _enc.encode({**row, **msgspec.structs.asdict(train)}) + b"\n"
        with self._lock:
            if self._file is not None:
                self._file.write(line)
                self.written += 1

    def flush(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def advantages_from_logs(trainer: Any, n: int) -> tuple[list[float | None], list[float | None]] | None:
    """The last ``n`` completions' advantages and total rewards as TRL's ``GRPOTrainer`` logged them after scoring
    (``trainer._logs["advantages"]``, and ``_logs["rewards"][name]`` per reward function, summed with
    ``reward_weights`` as TRL sums them; a completion every function left None is None); None when the trainer
    keeps no such logs (another trainer, or a TRL that renamed them)."""
    logs = getattr(trainer, "_logs", None)
    if not isinstance(logs, dict) or "advantages" not in logs or n <= 0:
        return None
    adv = list(logs["advantages"])
    if len(adv) < n:
        return None
    per_func: dict[str, Sequence[Any]] = logs.get("rewards") or {}
    names = list(getattr(trainer, "reward_func_names", per_func.keys()))
    weights = getattr(trainer, "reward_weights", None)
    w = [float(x) for x in weights.tolist()] if weights is not None else [1.0] * len(names)
    totals: list[float | None] = []
    columns = [list(per_func.get(name, []))[-n:] for name in names]
    for i in range(n):
        parts = [(wk, _number(col[i])) for wk, col in zip(w, columns, strict=False) if i < len(col)]
        scored = [wk * v for wk, v in parts if v is not None]
        totals.append(sum(scored) if scored else None)
    return [_number(a) for a in adv[-n:]], totals


class TRLTrainRows:
    """The synchronous TRL adapter's training rows: a call's rows are held until TRL has scored them (it computes
    the advantages after ``rollout_func`` returns), then written with what ``_logs`` says: at TRL's next step end
    (a ``TrainerCallback`` added on the first call), at the next call, or at ``close``. TRL keeps ``_logs`` for one
    generation batch, which is all a held call ever needs."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.writer = TrainRowsWriter(path)
        self._held: list[tuple[dict[str, Any], int | None, int, float | None, str | None]] = []
        self._trainer: Any = None
        self._hooked = False

    def hold(
        self,
        groups: Sequence[Sequence[dict[str, Any]]],
        rewards: Sequence[Any],
        trainer: Any,
        tasks: Sequence[str | None] | None = None,
    ) -> None:
        """One call's rows, group by group in TRL's order, with the reward handed over for each (``tasks``: each
        group's task key)."""
        self.flush()
        step = getattr(getattr(trainer, "state", None), "global_step", None)
        self._trainer = trainer
        k = 0
        for n, members in enumerate(groups):
            g = self.writer.group()
            task = tasks[n] if tasks is not None else None
            for row in members:
                self._held.append((row, step if isinstance(step, int) else None, g, _number(rewards[k]), task))
                k += 1
        if not self._hooked and trainer is not None and hasattr(trainer, "add_callback"):
            self._hooked = True
            trainer.add_callback(_flusher(self))
        if trainer is None:  # no trainer to score them (a bench, a test): written now, with no advantage
            self.flush()

    def flush(self) -> None:
        held, self._held = self._held, []
        if not held:
            return
        back = advantages_from_logs(self._trainer, len(held)) if self._trainer is not None else None
        for i, (row, step, group, reward, task) in enumerate(held):
            adv, total = (back[0][i], back[1][i]) if back is not None else (None, None)
            self.writer.write(row, step=step, group=group, reward=reward, advantage=adv, total=total, task=task)
        self.writer.flush()

    def close(self) -> None:
        self.flush()
        self.writer.close()


def _flusher(rows: TRLTrainRows) -> Any:
    """A ``transformers.TrainerCallback`` that writes the held rows at each step's end and at the end of training
    (after TRL scored them; before it logs, so ``_logs`` still holds them)."""
    from transformers import TrainerCallback

    class Flush(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            rows.flush()

        def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            rows.flush()

    return Flush()
