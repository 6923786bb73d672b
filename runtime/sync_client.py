"""Deprecated, removed in gym-runtime 0.2.0 (``gym_runtime.moved.REMOVED_IN``): ``SyncClient`` under its old path
(the module moved to ``gym_runtime.client.sync``). Importing it warns once. New code imports
``from gym_runtime import SyncClient``."""

from gym_runtime.client import sync
from gym_runtime.client.sync import *  # noqa: F403 (the module's public names: one list, sync.__all__)
from gym_runtime.moved import warn

__all__ = sync.__all__

warn(__name__, "gym_runtime.client.sync (or `from gym_runtime import SyncClient`)")
