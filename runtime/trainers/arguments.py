"""The trainer adapters' arguments checked where the user gives them (the constructor), each mistake one
``ClientError`` naming its fix: not an ``AttributeError`` inside the first step, nor a bare ``TypeError``.

``checked`` wraps an adapter's ``__init__``: an argument it does not take is named with the nearest one it does, or,
for the names of earlier versions, with what replaced them. ``failure_policy`` and ``count`` check the values."""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Concatenate, ParamSpec, TypeVar

from gym_runtime.errors import ClientError
from gym_runtime.trainers.failures import FailurePolicy

__all__ = ["checked", "count", "failure_policy", "nearest"]

P = ParamSpec("P")
S = TypeVar("S")

_POLICY = "failures=FailurePolicy(...) (from gym_runtime.trainers.failures import FailurePolicy)"
# an argument of an earlier version -> what replaced it
RENAMED = {
    "on_failure": f"{_POLICY}: a policy failure is scored, the others retried, then excluded (docs/trainer.md)",
    "failure_policy": _POLICY,
    "failure": _POLICY,
    "retries": f"{_POLICY.replace('(...)', '(retries=N)')}",
    "max_excluded": f"{_POLICY.replace('(...)', '(max_excluded=S)')}",
}


def nearest(name: str, names: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the nearest of ``names``, else ``""``."""
    near = difflib.get_close_matches(name, list(names), n=1, cutoff=0.6)
    return f"; did you mean {near[0]!r}?" if near else ""


def checked(init: Callable[Concatenate[S, P], None]) -> Callable[Concatenate[S, P], None]:
    """``init`` with its arguments bound first: one that does not fit is a ``ClientError`` naming the fix."""
    sig = inspect.signature(init)
    names = [p.name for p in list(sig.parameters.values())[1:] if p.kind is not p.VAR_KEYWORD]

    @functools.wraps(init)
    def wrapper(self: S, *args: P.args, **kwargs: P.kwargs) -> None:
        try:
            sig.bind(self, *args, **kwargs)
        except TypeError as e:
            who = type(self).__name__
            for key in kwargs:
                if key not in names:
                    fix = f": give {RENAMED[key]}" if key in RENAMED else nearest(key, names)
                    raise ClientError(f"{who}() takes no argument {key!r}{fix} (it takes {', '.join(names)})") from None
            raise ClientError(f"{who}(): {e} (it takes {', '.join(names)})") from None
        init(self, *args, **kwargs)

    return wrapper


def failure_policy(value: object) -> FailurePolicy:
    """``failures=``: a ``FailurePolicy`` (None: the default one); a mapping is named as the call to write."""
    if value is None:
        return FailurePolicy()
    if isinstance(value, FailurePolicy):
        return value
    if isinstance(value, Mapping):
        fields = ", ".join(f"{k}={v!r}" for k, v in value.items())
        raise ClientError(
            f"failures={value!r}: give FailurePolicy({fields}), not a {type(value).__name__} "
            "(from gym_runtime.trainers.failures import FailurePolicy)"
        )
    raise ClientError(
        f"failures={value!r}: give a FailurePolicy, e.g. FailurePolicy(retries=1) "
        "(from gym_runtime.trainers.failures import FailurePolicy)"
    )


def count(name: str, value: object, least: int) -> int:
    """An integer argument that must be at least ``least``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ClientError(f"{name}={value!r}: give a whole number >= {least}")
    return value
