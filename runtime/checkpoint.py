"""Moved: a rollout's checkpoints are the rollout's room's (``gym_runtime.rollout.checkpoint``). This old path
warns once and is removed in 0.2."""

import warnings

from gym_runtime.rollout.checkpoint import *  # noqa: F403
from gym_runtime.rollout.checkpoint import AUTO_S, AUTO_TURNS, GENERATING_S, Checkpointer, Mode, checkpoints_kv

warnings.warn(
    "gym_runtime.checkpoint moved to gym_runtime.rollout.checkpoint (the old path is removed in 0.2)",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["AUTO_S", "AUTO_TURNS", "GENERATING_S", "Checkpointer", "Mode", "checkpoints_kv"]
