"""Deprecated, removed in gym-runtime 0.2.0 (``gym_runtime.moved.REMOVED_IN``): a rollout's checkpoints under their
old path (the module moved into the rollout's room, ``gym_runtime.rollout.checkpoint``). Importing it warns once."""

from gym_runtime.moved import warn
from gym_runtime.rollout import checkpoint
from gym_runtime.rollout.checkpoint import *  # noqa: F403 (the module's public names: one list, checkpoint.__all__)

__all__ = checkpoint.__all__

warn(__name__, "gym_runtime.rollout.checkpoint")
