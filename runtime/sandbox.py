"""Kept for plugins: the graded-program jail's names under their old path and old names (the package is
``gym_runtime.jail``, its classes ``Jail*``).

An environment written against ``from gym_runtime.sandbox import SandboxRunner, Limits`` keeps working: each
old ``Sandbox*`` name is the jail's class itself (``SandboxError is JailError``), so an ``except`` of either
catches both. New code imports ``gym_runtime.jail`` (the container fleet is ``gym_runtime.sandboxes``, a
different thing).
"""

from gym_runtime import jail
from gym_runtime.jail import *  # noqa: F403 (the jail's public names, whichever they are: one list, the jail's)

# The names before the jail had its own (issue 64): aliases, not subclasses.
SandboxBodyTooLarge = jail.JailBodyTooLarge
SandboxCgroup = jail.cgroups.JailCgroup
SandboxError = jail.JailError
SandboxExited = jail.JailExited
SandboxRunner = jail.JailRunner
SandboxSession = jail.JailSession
SandboxTimeout = jail.JailTimeout

__all__ = [
    *jail.__all__,
    "SandboxBodyTooLarge",
    "SandboxCgroup",
    "SandboxError",
    "SandboxExited",
    "SandboxRunner",
    "SandboxSession",
    "SandboxTimeout",
]
