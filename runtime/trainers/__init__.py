"""Adapters that let a trainer learn from gym-runtime's rows (public API: ``gym_runtime.trainers.trl``).

The test and recipe rigs that lived here moved to ``gym_runtime.rigs``; their old paths
(``gym_runtime.trainers.tiny_policy``, ``gym_runtime.trainers.trl_cpu``) warn once and are removed in 0.2.0
(``gym_runtime.moved.REMOVED_IN``)."""

from gym_runtime.moved import MovedModules

_finder = MovedModules(__name__, {"tiny_policy": "gym_runtime.rigs.tiny_policy", "trl_cpu": "gym_runtime.rigs.trl_cpu"})
_finder.install()
__getattr__ = _finder.getattr
