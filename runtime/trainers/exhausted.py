"""A training run ended when the task sampler has nothing left to teach (issue 79): one rule for every adapter.

With the sampler's ``skip_below``, a set whose every task was solved, or failed, every time lately is *exhausted*
(``TaskSampler.exhausted``): each next group would have no reward spread, so no advantage and no gradient, for its
whole generation's cost. The adapters end the run there, each as its trainer allows: TRL's (``TRLRollouts`` and the
async ``GymRolloutWorker``) at the end of the step that exhausted the set (``stop_callback``), verl's through
``GymTaskDataset`` and ``GymReplayBuffer`` (``trainers.verl_tasks``). Each says so in one ``trainer.stopped`` line
naming the sampler's run; each has an opt-out that goes on at the floor's exploration instead.
"""

from __future__ import annotations

from typing import Any

from gym_runtime.client.sampler import TaskSampler
from gym_runtime.observability import logs

__all__ = ["say_stopped", "stop_callback", "stops"]

log = logs.get("gym.trainers")


def stops(sampler: TaskSampler | None, wanted: bool) -> bool:
    """Whether a run with ``sampler`` ends on exhaustion: asked for, and the sampler can be exhausted at all."""
    return bool(wanted and sampler is not None and sampler.config.score != "uniform" and sampler.config.skip_below > 0)


def say_stopped(sampler: TaskSampler, trainer: str, **where: Any) -> None:
    """The one ``trainer.stopped`` line: which run, which trainer, where, and why."""
    log.warning(
        "trainer.stopped",
        run=sampler.config.run,
        trainer=trainer,
        **where,
        why="sampler exhausted: no task of the set can teach (each solved or failed every time lately)",
    )


def stop_callback(sampler: TaskSampler, trainer: str) -> Any:
    """A transformers ``TrainerCallback`` ending training at the end of a step after which the set is exhausted:
    the next step's groups, none with spread, would give no gradient for their generation's cost."""
    from transformers import TrainerCallback

    class StopWhenExhausted(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            if sampler.exhausted and not control.should_training_stop:
                say_stopped(sampler, trainer, step=state.global_step)
                control.should_training_stop = True
            return control

    return StopWhenExhausted()
