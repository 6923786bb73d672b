"""Who caused a failure: the rule behind every failure row's ``failure_attribution`` (docs/trainer.md's table).

A trainer treats the three kinds differently (``trainers.failures``): a ``policy`` failure is scored like a wrong
answer (its tokens trained on), an ``environment`` or ``infrastructure`` one is retried and then kept out of the
group's statistics. So the rule is the runtime's, from the failure class and the attempt's own figures, never
from anything an environment or agent wrote (``error_class`` and ``failure_attribution`` are runtime row keys).

Most classes name their cause. A ``timeout`` does not: it is split by where the attempt's time went
(``TimeSplit``): the policy's own (generating, and the tools and commands it asked to run), the model calls'
waits (queues, a model server that did not answer: the infrastructure's), and the rest (the environment's seed
and verify, the agent's code). The largest share decides; a tie goes to the policy: charging the policy for a
slow machine costs one sample scored as wrong, while excusing a stall the policy chose is an escape hatch it can
learn (stall on hard tasks, never be scored on them).
"""

from __future__ import annotations

from gym_runtime.data.error_classes import CLASSES, Attribution
from gym_runtime.messages import ErrorClass, RolloutResult, TimeSplit

__all__ = ["ATTRIBUTIONS", "BY_CLASS", "Attribution", "attribute", "attribution_text", "timeout_shares"]

ATTRIBUTIONS: tuple[Attribution, ...] = ("policy", "environment", "infrastructure")

# Every ErrorClass but ``timeout`` (split by its time): the class names its cause (``error_classes.CLASSES``, whose
# comments say why). The docs' table is this one.
BY_CLASS: dict[ErrorClass, Attribution] = {c: r.attribution for c, r in CLASSES.items() if r.attribution is not None}
_BY_NAME: dict[str, Attribution] = {str(k): v for k, v in BY_CLASS.items()}  # any string: a newer class too


def timeout_shares(split: TimeSplit) -> dict[Attribution, int]:
    """A timed-out attempt's ms by who spent them."""
    policy = split.generating_ms + split.tools_ms
    rest = max(0, split.total_ms - policy - split.model_wait_ms)
    return {"policy": policy, "infrastructure": split.model_wait_ms, "environment": rest}


def attribute(error_class: str, split: TimeSplit | None = None) -> Attribution:
    """The cause of a failure of ``error_class``: ``BY_CLASS``, a timeout by ``timeout_shares`` (largest share;
    ties and a timeout without figures go to the policy). An unknown class (a newer writer's) is the
    infrastructure's: nothing the policy did is known."""
    if error_class == "timeout":
        if split is None:
            return "policy"
        shares = timeout_shares(split)
        top = max(shares.values())
        return "policy" if shares["policy"] == top else max(shares, key=lambda k: shares[k])
    return _BY_NAME.get(error_class, "infrastructure")


def attribution_text(res: RolloutResult) -> str:
    """A failure's attribution as ``explain`` says it: who, the timeout's split that decided it, what was kept."""
    error_class = res.error.error_class if res.error else "internal"
    out: str = attribute(error_class, res.time_split)
    if error_class == "timeout" and res.time_split is not None:
        shares = timeout_shares(res.time_split)
        split = ", ".join(f"{k} {v / 1000:.1f} s" for k, v in shares.items())
        out += f" (the attempt's {res.time_split.total_ms / 1000:.1f} s: {split})"
    elif error_class == "timeout":
        out += " (a timeout without figures: the policy's)"
    else:
        out += f" (by its class, {error_class})"
    if res.partial is not None:
        out += f"; its trajectory so far kept ({len(res.partial.output)} items)"
    return out
