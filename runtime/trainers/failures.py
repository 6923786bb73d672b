"""How the trainer adapters treat a failure row: one policy for TRL (sync and async) and verl (docs/trainer.md,
"Failures in training").

Every failure row says who caused it (``failure_attribution``, the runtime's rule: ``data.attribution``):

* ``policy`` (it stalled, overran ``timeout_s``): **scored**, like a wrong answer. The member keeps its real tokens
  (the row's partial ``response``: mask 1 on what the policy generated) and gets ``policy_failure_reward``, so a
  stall costs what a wrong answer costs. Hiding it (the old ``mask``/``drop``) made stalling an escape hatch.
* ``environment`` or ``infrastructure``: **retried** as a fresh task (``retries`` rounds, on top of the agent
  worker's own ``max_attempts`` and redelivery), then **excluded**: never a reward-0 pad in the group's mean and
  std (a sandbox that died is not a wrong answer). TRL: reward ``None`` (unscorable, advantage 0); the async
  worker: left out of the group's statistics and of the samples; verl: ``response_mask`` 0, which the
  ``gym_grpo`` advantage estimator reads as the flag.
* bounded: more than ``max_excluded`` of a call's (a step's) rollouts excluded is a systematic fault, one
  ``ClientError`` line naming the tasks and the classes.
"""

from __future__ import annotations

import difflib
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from gym_runtime.data.attribution import attribute
from gym_runtime.data.rowkeys import DEFAULT_REWARD_BOUND
from gym_runtime.errors import ClientError
from gym_runtime.trainers.rows import components

__all__ = ["FailurePolicy", "Kind", "Tally", "advantages", "has_tokens", "kind", "reward_of", "std"]

Kind = Literal["scored", "policy", "excluded"]


class _Named(msgspec.StructMeta):
    """``FailurePolicy(...)`` with a field it does not have: one line with the nearest field, not a bare
    ``TypeError`` (a Struct cannot define ``__init__``: its class's call is where the names are seen)."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        fields = cls.__struct_fields__
        if args:
            raise ClientError(f"{cls.__name__} takes its fields by name, e.g. {cls.__name__}(retries=1)")
        for key in kwargs:
            if key not in fields:
                near = difflib.get_close_matches(key, fields, n=1, cutoff=0.6)
                fix = f"did you mean {near[0]!r}? " if near else ""
                raise ClientError(f"{cls.__name__} has no field {key!r}; {fix}its fields are {', '.join(fields)}")
        return super().__call__(**kwargs)


class FailurePolicy(msgspec.Struct, kw_only=True, frozen=True, metaclass=_Named):
    """What the trainer adapters do with failure rows (the same object for all three)."""

    policy_failure_reward: float = 0.0  # a policy failure's reward (its tokens trained on, mask 1)
    retries: int = 2  # rounds of running an environment or infrastructure failure again, each a new task
    max_excluded: float = 0.25  # the share of a call's (a step's) rollouts that may end excluded; more raises
    # TRL's sync adapter only: replace a group with an excluded member by the next row's group (off: the group keeps
    # its own prompt). TRL's prompts are fixed before rollout_func runs: its logs and other reward functions see
    # the dropped row's prompt text; the refill's own columns reach them as extra fields
    refill: bool = False

    def __post_init__(self) -> None:
        for name, kinds, what in (
            ("retries", int, "a whole number"),
            ("max_excluded", (int, float), "a number"),
            ("policy_failure_reward", (int, float), "a number"),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, kinds):
                raise ClientError(f"FailurePolicy: {name} is {what}, got {value!r}")
        if not isinstance(self.refill, bool):
            raise ClientError(f"FailurePolicy: refill is True or False, got {self.refill!r}")
        if self.retries < 0:
            raise ClientError(f"FailurePolicy: retries is >= 0, got {self.retries}")
        if not 0.0 <= self.max_excluded <= 1.0:
            raise ClientError(f"FailurePolicy: max_excluded is a share from 0 to 1, got {self.max_excluded}")
        r = self.policy_failure_reward
        if not (math.isfinite(r) and abs(r) <= DEFAULT_REWARD_BOUND):
            raise ClientError(f"FailurePolicy: policy_failure_reward is a finite reward within 1e6, got {r}")


def has_tokens(row: dict[str, Any]) -> bool:
    """The row's response holds a generation with token ids (a scored row, or a partial trajectory)."""
    response = row.get("response")
    output = response.get("output") if isinstance(response, dict) else None
    return isinstance(output, list) and any(isinstance(i, dict) and "generation_token_ids" in i for i in output)


def attribution_of(row: dict[str, Any]) -> str:
    """A failure row's attribution: the runtime's, else (a row of an older writer) by its class alone."""
    given = row.get("failure_attribution")
    return given if given in ("policy", "environment", "infrastructure") else attribute(str(row.get("error_class")))


def kind(row: dict[str, Any]) -> Kind:
    """How a trainer treats ``row``: a result is scored, a policy failure is scored as one, the rest excluded."""
    if "error_class" not in row:
        return "scored"
    return "policy" if attribution_of(row) == "policy" else "excluded"


def reward_of(row: dict[str, Any], policy: FailurePolicy) -> float | None:
    """The reward a trainer receives for ``row``: the verifier's, ``policy_failure_reward``, or None (excluded)."""
    k = kind(row)
    if k == "scored":
        return components(row)["reward"]
    return policy.policy_failure_reward if k == "policy" else None


def _scaled(rewards: Sequence[float | None]) -> tuple[list[tuple[int, float]], float, float, float]:
    """The finite rewards (with their positions) divided by their largest magnitude, that magnitude, and their
    mean and standard deviation as scaled: no square of a large reward is ever taken."""
    kept = [(i, float(r)) for i, r in enumerate(rewards) if r is not None and math.isfinite(float(r))]
    if not kept:
        return [], 1.0, 0.0, 0.0
    top = max(abs(r) for _, r in kept) or 1.0
    scaled = [(i, r / top) for i, r in kept]
    mean = math.fsum(x for _, x in scaled) / len(scaled)
    std = math.sqrt(math.fsum((x - mean) ** 2 for _, x in scaled) / len(scaled))
    return scaled, top, mean, std


def std(rewards: Sequence[float | None]) -> float:
    """The standard deviation of the rewards that are not None (or not finite), computed without overflow."""
    _, top, _, s = _scaled(rewards)
    return top * s


def advantages(rewards: Sequence[float | None], *, by_std: bool = True) -> list[float]:
    """Group-relative advantages over the members that are not None (the excluded get 0 and are out of the mean
    and std): ``(r - mean) / (std + 1e-8)`` (``by_std`` False: ``r - mean``). Computed on rewards divided by their
    largest magnitude first, so no finite reward overflows (``(1e200 - mean) ** 2`` did); a non-finite one is
    excluded."""
    scaled, top, mean, s = _scaled(rewards)
    out = [0.0] * len(rewards)
    for i, x in scaled:
        out[i] = (x - mean) / (s + 1e-8) if by_std else (x - mean) * top
    return out


@dataclass
class Tally:
    """What the failure policy did (per call or step, and in all): counts by kind, attribution and class, and the
    excluded rollouts' tasks (for the systematic-failure line)."""

    rollouts: int = 0
    policy_failures: int = 0  # scored as a policy failure
    retried: int = 0  # environment or infrastructure failures run again
    excluded: int = 0  # still failing after the retries: out of the group's statistics
    refilled_groups: int = 0
    by_attribution: Counter[str] = field(default_factory=Counter)  # every failure row received
    by_class: Counter[str] = field(default_factory=Counter)
    excluded_tasks: Counter[str] = field(default_factory=Counter)  # "dataset row 3 (verify_error)": count

    def saw(self, row: dict[str, Any]) -> Kind:
        """Count one row received (a retry's too); its kind."""
        k = kind(row)
        if k != "scored":
            self.by_attribution[attribution_of(row)] += 1
            self.by_class[str(row.get("error_class"))] += 1
        return k

    def ended(self, row: dict[str, Any], k: Kind, task: str | None = None) -> None:
        """Count one rollout as it ends up in the batch; ``task`` names it for the systematic-failure line (the
        trainer's dataset row; else the batch's task index)."""
        self.rollouts += 1
        if k == "policy":
            self.policy_failures += 1
        elif k == "excluded":
            self.excluded += 1
            name = task or f"task {row.get('_ng_task_index')}"
            self.excluded_tasks[f"{name} ({row.get('error_class')})"] += 1

    def plain(self) -> dict[str, Any]:
        """As plain data (a verl sample's ``gym_tally``, carried through verl's batch); ``of_plain`` reads it."""
        return {
            "rollouts": self.rollouts,
            "policy_failures": self.policy_failures,
            "retried": self.retried,
            "excluded": self.excluded,
            "refilled_groups": self.refilled_groups,
            "by_attribution": dict(self.by_attribution),
            "by_class": dict(self.by_class),
            "excluded_tasks": dict(self.excluded_tasks),
        }

    @classmethod
    def of_plain(cls, data: dict[str, Any]) -> Tally:
        def count(key: str) -> int:
            value = data.get(key)
            return int(value) if isinstance(value, (int, float)) else 0

        def counter(key: str) -> Counter[str]:
            value = data.get(key)
            return Counter({str(k): int(n) for k, n in value.items()}) if isinstance(value, dict) else Counter()

        return cls(
            rollouts=count("rollouts"),
            policy_failures=count("policy_failures"),
            retried=count("retried"),
            excluded=count("excluded"),
            refilled_groups=count("refilled_groups"),
            by_attribution=counter("by_attribution"),
            by_class=counter("by_class"),
            excluded_tasks=counter("excluded_tasks"),
        )

    def add(self, other: Tally) -> None:
        for name in ("rollouts", "policy_failures", "retried", "excluded", "refilled_groups"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.by_attribution.update(other.by_attribution)
        self.by_class.update(other.by_class)
        self.excluded_tasks.update(other.excluded_tasks)

    def metrics(self) -> dict[str, float]:
        """As a trainer logs them (``gym_runtime/...``): TRL averages each over its logging steps."""
        out = {
            "gym_runtime/rollouts": float(self.rollouts),
            "gym_runtime/policy_failures": float(self.policy_failures),
            "gym_runtime/retried": float(self.retried),
            "gym_runtime/excluded": float(self.excluded),
            "gym_runtime/refilled_groups": float(self.refilled_groups),
        }
        for who in ("policy", "environment", "infrastructure"):
            out[f"gym_runtime/failed/{who}"] = float(self.by_attribution.get(who, 0))
        for cls, n in sorted(self.by_class.items()):
            out[f"gym_runtime/failed/{cls}"] = float(n)
        return out

    def check(self, policy: FailurePolicy, where: str) -> None:
        """More than ``max_excluded`` of the rollouts excluded: one ``ClientError`` line naming tasks and classes."""
        if self.rollouts and self.excluded > policy.max_excluded * self.rollouts:
            tasks = ", ".join(f"{t} x{n}" if n > 1 else t for t, n in sorted(self.excluded_tasks.items())[:8])
            more = len(self.excluded_tasks) - 8
            classes = ", ".join(f"{c} {n}" for c, n in sorted(self.by_class.items()))
            raise ClientError(
                f"{where}: {self.excluded} of {self.rollouts} rollouts still failed after {policy.retries} retries "
                f"(more than max_excluded={policy.max_excluded:g}: a systematic failure, not one bad rollout); "
                f"classes: {classes}; {tasks}{f' and {more} more tasks' if more > 0 else ''} (the rows' `error` says "
                "why; gym-runtime explain)"
            )
