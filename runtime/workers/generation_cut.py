"""A generation stopped at its rollout's deadline (``ModelRequest.cut_at``), so its tokens so far are kept.

The agent's rollout ends at ``timeout_s``: a model call still generating then is cancelled on the agent's side
and its reply, whenever it comes, goes nowhere. An adapter that can stop a generation and hand back what it made
(``InterruptibleAdapter``: ``vllm`` with ``interruptible: true``, ``vllm_engine``) is stopped a little before that
deadline instead, as a pause's ``interrupt`` stops it, and its ids and logprobs so far come back as the call's
answer (``ModelResponse.cut``): the rollout's failure row keeps them (docs/trainer.md, "What the policy produced").
The agent sets the request's ``cut_at`` (``transport.model_calls.cut_at``); this is the model worker's side.
"""

from __future__ import annotations

import asyncio
import time
from types import TracebackType

import msgspec

from gym_runtime.config import ResolvedConfig
from gym_runtime.messages import GenerationProgress
from gym_runtime.model import Partial, interrupt_problem
from gym_runtime.workers.control import Flight


def progress_body(partial: Partial, ranges: list[list[int]]) -> bytes:
    """A generation's tokens so far, as its caller reads them (``GenerationProgress``, msgpack)."""
    return msgspec.msgpack.encode(
        GenerationProgress(
            prompt_token_ids=partial.prompt_token_ids,
            generation_token_ids=partial.generation_token_ids,
            generation_log_probs=partial.generation_log_probs,
            policy_version_ranges=ranges,
            text=partial.text,
        )
    )


def continued(progress: GenerationProgress) -> tuple[Partial, list[list[int]]]:
    """A checkpoint's generation as the call's first ``Partial`` (no adapter state: the adapter takes it up from
    its ids, as a continuation) and its version ranges."""
    partial = Partial(
        prompt_token_ids=list(progress.prompt_token_ids),
        generation_token_ids=list(progress.generation_token_ids),
        generation_log_probs=list(progress.generation_log_probs),
        text=progress.text,
    )
    return partial, [list(r) for r in progress.policy_version_ranges]


def cuttable_models(config: ResolvedConfig) -> frozenset[str]:
    """The config's models whose generations can be cut and keep their tokens (``interrupt_problem`` says none):
    an agent asks only them to (``ModelRequest.cut_at``); any other's call is cancelled at the deadline as before."""
    return frozenset(name for name, cfg in config.models.items() if interrupt_problem(cfg) is None)


class CutClock:
    """The clocks of one model call: at ``cut_at`` it halts the try in flight (mode ``"cut"``) and says so
    (``fired``), so the call's loop answers the try's tokens instead of trying again; every ``progress_s`` of a
    try it halts it (mode ``"progress"``), so the loop sends the tokens so far to the caller and continues them."""

    __slots__ = ("at", "progress_s", "fired", "_flight", "_timer", "_tick")

    def __init__(self, at: float | None, progress_s: float | None = None) -> None:
        self.at = at
        self.progress_s = progress_s if progress_s is not None and progress_s > 0 else None
        self.fired = False
        self._flight: Flight | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._tick: asyncio.TimerHandle | None = None

    def __enter__(self) -> CutClock:
        if self.at is not None:
            self._timer = asyncio.get_running_loop().call_later(max(0.0, self.at - time.time()), self._fire)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.watch(None)
        if self._timer is not None:
            self._timer.cancel()

    def watch(self, flight: Flight | None) -> None:
        """The try now in flight (None: between tries); one that starts past the deadline stops at once."""
        self._flight = flight
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None
        if flight is None:
            return
        if self.fired:
            flight.halt("cut", cancel=False)
        elif self.progress_s is not None:
            self._tick = asyncio.get_running_loop().call_later(self.progress_s, self._progress)

    def progressed(self, flight: Flight) -> bool:
        """Whether ``flight`` was halted for a progress report only (not by a pause, nor by the deadline)."""
        return flight.mode == "progress" and not self.fired

    def _progress(self) -> None:
        self._tick = None
        flight = self._flight
        if flight is not None and not flight.stopped:  # a pause's halt stands
            flight.halt("progress", cancel=False)

    def _fire(self) -> None:
        self.fired = True
        if self._flight is not None:
            self._flight.halt("cut", cancel=False)
