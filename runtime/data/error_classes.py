"""One record per failure class (``ErrorClass``): whose it is, what NeMo Gym calls it, whether another attempt may
help, where it happens, and whether environment code may raise it as its own.

The rule: every reader of a failure's class reads this table (``data.attribution`` for ``failure_attribution``,
``gateway.episodes`` for NeMo Gym's ``EpisodeFailure``, the resource worker for what environment code raised), and
a test holds it complete and equal to the docs' tables (docs/trainer.md, docs/nemo-gym.md). Two tables kept apart
drifted: the gateway's lacked ``sandbox_unavailable``, so NeMo Gym was told that failure was terminal and of no kind.

Environment code (``seed``, a tool, ``verify``) may raise only the classes marked ``environment``, which name the
environment's own failure; any other class it raises (``timeout``, ``worker_lost``, ``model_error``,
``cancelled``...) is recast as its own (``tool_error``, ``verify_error``), message kept. Only what the runtime saw
itself (a clock, a lost worker or guest, a model's answer: ``errors.Failure.observed``) keeps such a class: who is
blamed for a failure is the runtime's finding, never a class the environment chose, or a hostile verifier could
turn correct answers into failures charged to the policy or kept out of training.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from gym_runtime.errors import Failure
from gym_runtime.messages import ErrorClass

__all__ = ["CLASSES", "Attribution", "ClassRecord", "Stage", "as_environments"]

Attribution = Literal["policy", "environment", "infrastructure"]
Stage = Literal["admission", "seed", "agent", "verification", "cleanup"]  # NeMo Gym's failure stages


class ClassRecord(NamedTuple):
    """What one ``ErrorClass`` means to each reader."""

    attribution: Attribution | None  # whose failure (None: split by the attempt's time, ``attribution.attribute``)
    kind: str  # NeMo Gym's failure kind (``nemo_gym/failure_kinds.py``; ``gym_runtime:<class>`` where none fits)
    terminal: bool  # another attempt would fail the same way (NeMo Gym's collector does not retry it)
    stage: Stage | None  # where in an episode it happens (None: anywhere)
    environment: bool = False  # environment code may raise it as its own (any other class it raises is recast)


_ADMISSION: Stage = "admission"
CLASSES: dict[ErrorClass, ClassRecord] = {
    # the rollout's clock ran out: split by where its time went (docs/trainer.md)
    "timeout": ClassRecord(None, "agent_timeout", False, "agent"),
    # the model server answered an error (down, overloaded, refused the request)
    "model_error": ClassRecord("infrastructure", "agent_run_error", False, "agent"),
    # a tool's session could not be served (not a tool's exception: that is shown to the model)
    "tool_error": ClassRecord("environment", "agent_run_error", False, "agent", environment=True),
    # the verifier raised, or answered what no row may hold (a runtime key, a reward past reward_bound)
    "verify_error": ClassRecord("environment", "verifier_error", False, "verification", environment=True),
    # the worker or its guest died (killed, out of memory, node gone)
    "worker_lost": ClassRecord("infrastructure", "session_lost", False, None),
    # the task row cannot be run (the data's, or the environment's refusal of it)
    "invalid_task": ClassRecord("environment", "agent_request_failed", True, "seed", environment=True),
    # the agent's own code crashed (the harness, not the policy's answer)
    "internal": ClassRecord("environment", "agent_run_error", True, "agent"),
    # workers and publisher run different configs
    "config_mismatch": ClassRecord("infrastructure", "gym_runtime:config_mismatch", True, _ADMISSION),
    # the trainer cancelled the batch: never trained on
    "cancelled": ClassRecord("infrastructure", "cancelled", False, _ADMISSION),
    # the batch's budget ran out before it started
    "budget": ClassRecord("infrastructure", "gym_runtime:budget", False, _ADMISSION),
    # the policy moved on past max_staleness before it started
    "stale": ClassRecord("infrastructure", "gym_runtime:stale", False, _ADMISSION),
    # no free slot (never in a row)
    "busy": ClassRecord("infrastructure", "gym_runtime:busy", False, _ADMISSION),
    # a stored body or result was tampered with or lost
    "integrity": ClassRecord("infrastructure", "persistence_failed", False, None),
    # no result was stored and nothing runs it any more
    "lost": ClassRecord("infrastructure", "kill_shaped", False, None),
    # an older name of lost
    "terminated": ClassRecord("infrastructure", "kill_shaped", False, None),
    # a stream was at its size limit
    "storage_full": ClassRecord("infrastructure", "persistence_failed", False, None),
    # no sandbox lease within lease_wait_s (a seed, a tool or the agent's own ctx.sandbox may wait for one)
    "sandbox_unavailable": ClassRecord("infrastructure", "provider_unavailable", False, None),
    # the policy's input (a tool call's arguments, its answer to verify) killed the environment's guest process on
    # its attempt and again on the one retry it cost (the same rollout and input): the policy's, scored
    # (``workers.crashes``)
    "input_crash": ClassRecord("policy", "gym_runtime:input_crash", True, "agent"),
}


def as_environments(e: Failure, own: ErrorClass, where: str) -> Failure:
    """A failure out of environment code at ``where`` (``seed``, ``tool 'x'``, ``verify``): ``e`` itself when the
    runtime saw it (``observed``) or its class is one the environment may raise, else the environment's ``own``
    class naming the one it raised, its message and retryability kept."""
    record = CLASSES.get(e.info.error_class)
    if e.observed or (record is not None and record.environment):
        return e
    message = f"{where} raised a {e.info.error_class} of its own: {e.info.message}"
    return Failure(own, message, retryable=e.info.retryable)
