"""Kept for trainers' code: ``SyncClient`` under its old path (the client's package is ``gym_runtime.client``;
this module moved to ``gym_runtime.client.sync``). New code imports ``from gym_runtime import SyncClient``."""

from gym_runtime.client import sync
from gym_runtime.client.sync import *  # noqa: F403 (the module's public names: one list, sync.__all__)

__all__ = sync.__all__
