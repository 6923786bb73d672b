"""Whether TRL's asynchronous trainer can use what the rollout worker makes: one line, not minutes of silence.

Two ways a run of ``AsyncGRPOTrainer`` fed by ``GymRolloutWorker`` never trains, both silent from TRL's side:

* **A sample longer than ``token_budget``** fits no packed row, and TRL drops it (one warning of its logger, which a
  script without logging set up may not show). Every sample of a recipe can be over (the prompts alone, with a real
  tokenizer), so nothing ever reaches a step. Said once, with the length to raise ``token_budget`` to.
* **A step that cannot fill.** The worker's admission lets ``batch_size × (max_staleness + 1)`` rollouts start per
  policy version; the trainer packs samples into ``token_budget`` rows and closes a micro-batch only when the next
  sample does not fit. When a step takes more samples than the window lets start, the trainer waits for samples and
  the window waits for a step: nothing can move. Seen from the trainer's health check (TRL calls it while its queue
  is empty) as: no group running, every group in flight held by admission, for ``STUCK_S``. Raised as one line naming
  ``batch_size`` to raise (TRL's own check would end it only after ``heartbeat_stale_after_s``, 300 s by default).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from gym_runtime.errors import ClientError

__all__ = ["StepFill"]

# stdlib logging, not the runtime's structlog events (silent in a library unless configured): with no handler set up,
# Python prints a warning's message alone on stderr, which is the one line a trainer script's user sees
log = logging.getLogger(__name__)

STUCK_S = 10.0  # the trainer waiting and every group held this long: no sample can come before a step


class StepFill:
    """What the worker handed the trainer since its last step, the longest sample, and the stuck check."""

    def __init__(self, *, batch_size: int, max_staleness: int, token_budget: int | None) -> None:
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        self.token_budget = token_budget
        self.handed = 0  # samples handed to the trainer since its policy version last moved
        self.longest_said = 0  # the longest over-budget sample said so far (a longer one is said again)
        self.over_budget = 0  # samples TRL drops as longer than token_budget
        self._stuck_since: float | None = None

    def handing(self, lengths: Iterable[int]) -> None:
        """A group's samples, about to go on the rollout buffer: ``lengths`` in tokens."""
        lengths = list(lengths)
        self.handed += len(lengths)
        self._stuck_since = None
        budget = self.token_budget
        if budget is None:
            return
        over = [n for n in lengths if n > budget]
        self.over_budget += len(over)
        if over and max(over) > self.longest_said:
            self.longest_said = max(over)
            log.warning(
                "gym-runtime: a rollout sample of %d tokens is longer than token_budget=%d, so TRL drops it (it fits "
                "no packed row; %d so far): raise AsyncGRPOConfig(token_budget=...) and GymRolloutWorker("
                "token_budget=...) to at least %d, or shorten the rollouts (the model entry's max_new_tokens, the "
                "agent's max_steps)",
                self.longest_said,
                budget,
                self.over_budget,
                self.longest_said,
            )

    def stepped(self) -> None:
        """The trainer's policy version moved: a new window of rollouts."""
        self.handed = 0
        self._stuck_since = None

    def check(self, running: Iterable[Any], *, now: float | None = None) -> None:
        """From the trainer's health check (it waits on an empty queue): ``running``, the groups in flight (their
        ``BatchHandle``s). Raises once every one of them has been held by admission, none started, for ``STUCK_S``."""
        handles = list(running)
        held = bool(handles) and all(h.held and h.delivered == 0 and not h.cancelled for h in handles)
        now = time.monotonic() if now is None else now
        if not held:
            self._stuck_since = None
            return
        if self._stuck_since is None:
            self._stuck_since = now
            return
        if now - self._stuck_since < STUCK_S:
            return
        window = self.batch_size * (self.max_staleness + 1)
        line = (
            f"a training step needs more samples than the rollout worker may start per policy version: the trainer "
            f"took all {self.handed} handed to it since its last step and waits for more, while admission holds the "
            f"next groups until it steps (batch_size={self.batch_size} x (max_staleness {self.max_staleness} + 1) = "
            f"{window} rollouts per version); raise GymRolloutWorker(batch_size=...), e.g. to {2 * self.batch_size}, "
            "or lower AsyncGRPOConfig(token_budget=...) so a micro-batch packs fewer samples"
        )
        log.warning("gym-runtime: %s", line)
        raise ClientError(line)
