"""Deprecated, removed in gym-runtime 0.2.0 (``gym_runtime.moved.REMOVED_IN``): the graded-program jail's names
under their old path and old names (the package is ``gym_runtime.jail``, its classes ``Jail*``).

An environment written against ``from gym_runtime.sandbox import SandboxRunner, Limits`` keeps working until
then: importing this module warns once, and so does the first use of each old ``Sandbox*`` name, which is the
jail's class itself (``SandboxError is JailError``), so an ``except`` of either catches both. New code imports
``gym_runtime.jail`` (the container fleet is ``gym_runtime.sandboxes``, a different thing).
"""

from gym_runtime import jail
from gym_runtime.jail import *  # noqa: F403 (the jail's public names, whichever they are: one list, the jail's)
from gym_runtime.moved import moved_names, warn

# The names before the jail had its own (issue 64): aliases, not subclasses, served by ``__getattr__`` (each
# warns on its first use).
OLD_NAMES = {
    "SandboxBodyTooLarge": (jail.JailBodyTooLarge, "gym_runtime.jail.JailBodyTooLarge"),
    "SandboxCgroup": (jail.cgroups.JailCgroup, "gym_runtime.jail.cgroups.JailCgroup"),
    "SandboxError": (jail.JailError, "gym_runtime.jail.JailError"),
    "SandboxExited": (jail.JailExited, "gym_runtime.jail.JailExited"),
    "SandboxRunner": (jail.JailRunner, "gym_runtime.jail.JailRunner"),
    "SandboxSession": (jail.JailSession, "gym_runtime.jail.JailSession"),
    "SandboxTimeout": (jail.JailTimeout, "gym_runtime.jail.JailTimeout"),
}
__getattr__ = moved_names(__name__, OLD_NAMES)
__all__ = [*jail.__all__, *OLD_NAMES]

warn(__name__, "gym_runtime.jail (its classes are Jail*: SandboxRunner is JailRunner, ...)")
