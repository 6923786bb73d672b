"""The jail for model-written programs, shared by every environment that runs them.

A jail, not a sandbox: one process (namespaces, seccomp, Landlock, a cgroup) around one graded program on
this host, as nsjail and firejail are; the sandboxes (``gym_runtime.sandboxes``) are the container fleet that
environments lease through the bus. Until this name, the two were ``sandbox/`` and ``sandboxes/``;
``gym_runtime.sandbox`` still re-exports this package's names for plugins that import them from there, with a
warning, until 0.2.0.

``code_gen`` (a program against unit tests) and ``swe``'s local backend (a
repository and a shell) both run untrusted code here; neither imports the other.
The parent side is :class:`JailRunner` (``runner.py``: starts the child, counts
its CPU and wall time from outside, reads its messages with byte caps); the child
side is ``child.py``, run alone as ``python -I child.py --child`` (standard library
only); ``cgroups.py`` gives each sandbox its memory and process budget and counts
its CPU (each run's CPU seconds reach ``CPU_SINK``'s value: a rollout's cost).
``python -m gym_runtime.jail.runner`` prints what this machine offers.
"""

from gym_runtime.jail import runner
from gym_runtime.jail.runner import *  # noqa: F403 (the runner's public names: one list, the runner's)

# what the runner exports for its own launcher and tests (the child's path, its layers, the child's environment)
_INTERNAL = ("CHILD_PY", "Layers", "clean_env")
__all__ = [name for name in runner.__all__ if name not in _INTERNAL]
