"""Kept for plugins: the graded-program jail's names under their old path (the package is ``gym_runtime.jail``).

An environment written against ``from gym_runtime.sandbox import SandboxRunner, Limits`` keeps working; new
code imports ``gym_runtime.jail`` (the container fleet is ``gym_runtime.sandboxes``, a different thing).
"""

from gym_runtime import jail
from gym_runtime.jail import *  # noqa: F403 (the jail's public names, whichever they are: one list, the jail's)

__all__ = jail.__all__
