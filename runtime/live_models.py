"""Live models: a trainer's own model object handed to a model adapter in the same process.

A colocated trainer (TRL's way) generates with the weights it trains: there is no server to sync, a
trainer step *is* the weight update. The runtime loads adapters by name from a config and cannot be given
Python objects, and the plugins contract forbids an adapter from importing the client or a trainer; so the
hand-over goes through this author-API module: the trainer side registers ``(model, tokenizer)`` under a
name, and an adapter entry with ``live: NAME`` (``gym_runtime.models.transformers``) looks it up when it
generates. Only workers in the trainer's own process can see it (``Client(workers=True)`` or a list).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from gym_runtime.errors import ModelError

__all__ = ["LiveModel", "LiveModels", "LIVE_MODELS"]


@dataclass
class LiveModel:
    """A model being trained and its tokenizer; ``lock`` serialises generation with other users of it."""

    model: Any
    tokenizer: Any
    lock: threading.Lock = field(default_factory=threading.Lock)


class LiveModels:
    """Name -> live model, for the adapters of this process."""

    def __init__(self) -> None:
        self._models: dict[str, LiveModel] = {}
        self._lock = threading.Lock()

    def register(self, name: str, model: Any, tokenizer: Any) -> LiveModel:
        """Make ``model`` the one ``live: name`` generates with (a later call replaces it)."""
        with self._lock:
            held = self._models.get(name)
            if held is not None and held.model is model and held.tokenizer is tokenizer:
                return held
            self._models[name] = live = LiveModel(model, tokenizer)
            return live

    def unregister(self, name: str) -> None:
        with self._lock:
            self._models.pop(name, None)

    def get(self, name: str) -> LiveModel:
        """The live model ``name``; a ``ModelError`` naming the fix when none is registered."""
        with self._lock:
            live = self._models.get(name)
        if live is None:
            raise ModelError(
                f"no live model {name!r} in this process: register the trainer's model first "
                f"(gym_runtime.live_models.LIVE_MODELS.register({name!r}, model, tokenizer)), and run the model "
                "worker in the trainer's process (Client(workers=True))"
            )
        return live


# The process's one registry: the hand-over point between a trainer and the adapters it starts in process.
LIVE_MODELS = LiveModels()
