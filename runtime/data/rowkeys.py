"""The row keys the runtime writes: an agent's or an environment's fields never replace them.

A trainer learns from ``response``, ``reward`` and ``policy_versions``, and budgets and audits read ``cost`` and
``provenance``; an environment's verify fields and an agent's extras are merged into the same row. Every merge
site (``build_row``, a hosted agent's ``/verify`` answer, a hosted server's verify for another server) writes the
runtime's keys after the merge, and a field naming one of them is ignored when its value is the runtime's own
or the request's (hosted servers echo the request body), else the row is a ``verify_error`` naming the key. A
failure row's keys (``error_class``, ``attempts``, ``failure_attribution``, ``time_split``) are the runtime's too: a
verify that returned ``{"error_class": "timeout"}`` would otherwise take its scored row out of training (``error``
and ``partial`` are NeMo Gym verifiers' extras too: ``SHARED_FAILURE_KEYS``).
The reward itself is bounded (``bounded_reward``): finite, and within the config's ``reward_bound``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import msgspec

from gym_runtime.errors import Failure

RUNTIME_KEYS = frozenset(
    {
        "responses_create_params",
        "response",
        "reward",
        "policy_versions",
        "cost",
        "provenance",
        "agent_ref",
        "_ng_task_index",  # the ids (NeMo Gym's other ``_ng_*`` keys, ``_ng_failure_class``, are a verifier's)
        "_ng_rollout_index",
        # a failure row's (``data.collector.failure_row``): an environment that wrote them could make a scored row a
        # failure, or a failure someone else's (issue 65). Not ``error`` and ``partial``: see SHARED_FAILURE_KEYS
        "error_class",
        "attempts",
        "failure_attribution",  # who caused a failure (``data.attribution``)
        "time_split",  # where a failed attempt's time went (what a timeout's attribution reads)
        "resumed_from_turn",  # an attempt that took up its rollout's checkpoint: at which turn, and how
        "resumed_how",
        "branch_of",  # a branch (``Client.branch``): its parent rollout's key and the turn it branched at
        "branch_turn",
    }
)
# A failure row's keys that NeMo Gym's own verifiers also answer on scored rows, so no merge site may refuse them: the
# SWE servers' (denovo_swe, swe_rebench, swebench_pro, ...) and the judges' ``error`` (None, or why a test run or a
# judge call failed), deepswe's ``partial`` (its partial credit, a float). The runtime writes them only on failure
# rows, and no reader takes either for a failure: a failure is ``error_class``, which the runtime owns.
SHARED_FAILURE_KEYS = frozenset({"error", "partial"})
DEFAULT_REWARD_BOUND = 1e6  # the config's ``reward_bound``: far inside float32 (TRL casts rewards to it)


class TrainFields(msgspec.Struct, kw_only=True):
    """What a trainer adapter adds to a row it handed the trainer, one training row a line (``trainers.train_rows``
    writes them, ``view``'s training pages read them): runtime-owned keys too (``TRAIN_KEYS``). The one spelling
    of the training-rows format."""

    train_step: int | None = None  # the trainer's step, or the policy version, that consumed the row
    train_group: int | str | None = None  # the group's number in the run: its members share it
    train_reward: float | None = None  # the environment reward handed over (None: kept out of the group's figures)
    train_advantage: float | None = None  # read back from the trainer where it computes it (None: it does not say)
    train_total_reward: float | None = None
    train_task: str | None = None  # the task's sampler key (``data.sampling.task_key`` of its dataset row)


TRAIN_KEYS = frozenset(f.encode_name for f in msgspec.structs.fields(TrainFields))
RUNTIME_KEYS = RUNTIME_KEYS | TRAIN_KEYS
_MISSING = object()


def is_runtime_key(key: str) -> bool:
    """A key only the runtime writes."""
    return key in RUNTIME_KEYS


def bounded_reward(value: Any, bound: float = DEFAULT_REWARD_BOUND) -> float:
    """A verifier's reward as a row keeps it: a finite number whose magnitude is at most ``bound`` (the config's
    ``reward_bound``); anything else is ``Failure("verify_error")`` naming the value, so no trainer, aggregate or
    page ever meets an infinite, NaN or float32-overflowing reward."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise Failure("verify_error", f"the reward {value!r} is not a number")
    try:
        reward = float(value)
    except OverflowError:  # an int beyond any float
        raise Failure("verify_error", f"the reward {value} is beyond reward_bound={bound:g}") from None
    if not math.isfinite(reward):
        raise Failure("verify_error", f"the reward {reward!r} is not finite")
    if abs(reward) > bound:
        raise Failure(
            "verify_error", f"the reward {reward!r} is beyond reward_bound={bound:g} (the config's reward_bound key)"
        )
    return reward


def policy_prompt(fields: Mapping[str, Any], task_params: Any) -> Any:
    """The prompt the policy saw, as an agent records it (``responses_create_params``: a multi-turn agent appends
    the user simulator's opening turn): taken only as the task's own params with turns added after its ``input``
    (every other key the task's, its items a prefix), else the task's. A field that is no such extension is left
    for ``own_fields`` to refuse."""
    got = fields.get("responses_create_params", _MISSING)
    if got is _MISSING or not isinstance(got, dict) or not isinstance(task_params, dict):
        return task_params
    if {k: v for k, v in got.items() if k != "input"} != {k: v for k, v in task_params.items() if k != "input"}:
        return task_params
    inp, asked = got.get("input"), task_params.get("input")
    prefix = [{"role": "user", "content": asked}] if isinstance(asked, str) else asked
    if not isinstance(inp, list) or not isinstance(prefix, list) or inp[: len(prefix)] != prefix:
        return task_params
    return got


def own_fields(
    fields: Mapping[str, Any], runtime: Mapping[str, Any], echoed: Mapping[str, Any], *, who: str
) -> dict[str, Any]:
    """``fields`` less the runtime's keys. A runtime key whose value is the runtime's (``runtime``) or the
    request's own (``echoed``: the task row, the posted body) is an echo, dropped; any other value raises
    ``Failure("verify_error")`` naming the key (``who`` set it)."""
    out: dict[str, Any] = {}
    for k, v in fields.items():
        if not is_runtime_key(k):
            out[k] = v
        elif not _equal(v, runtime.get(k, _MISSING)) and not _equal(v, echoed.get(k, _MISSING)):
            raise Failure("verify_error", f"{who} set the row key {k!r}, which only the runtime writes")
    return out


def _equal(value: Any, runtime: Any) -> bool:
    if runtime is _MISSING:
        return False
    if value is runtime:
        return True
    try:  # a Struct (cost, provenance) against its echo as JSON: compared as builtins
        return bool(msgspec.to_builtins(value) == msgspec.to_builtins(runtime))
    except Exception:  # something that has no builtin form is not the runtime's value
        return False
