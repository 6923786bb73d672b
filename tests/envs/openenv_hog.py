"""An OpenEnv environment whose sync ``step`` can hold the GIL for minutes, for tests/e2e/test_isolation.py.

Reset with ``hog_kb`` and the first step runs a quadratic regex (``gil_hog.hog``) on that many KB, in the
thread OpenEnv's in-process steps run in: ``step_timeout_s`` cannot stop a thread, and the GIL it holds
stops every other thread of its process. Otherwise one step ends the episode with reward 1.0.
"""

from __future__ import annotations

import uuid
from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

from tests.envs.gil_hog import hog


class HogAction(Action):
    delta: int


class HogObservation(Observation):
    total: int = 0


class HogEnv(Environment[HogAction, HogObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=uuid.uuid4().hex, step_count=0)
        self.hog_kb = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> HogObservation:
        self._state = State(episode_id=episode_id or uuid.uuid4().hex, step_count=0)
        self.hog_kb = int(kwargs.get("hog_kb", 0))
        return HogObservation(total=0)

    def step(self, action: HogAction, timeout_s: float | None = None, **kwargs: Any) -> HogObservation:
        if self.hog_kb:
            hog(self.hog_kb)
        self._state.step_count += 1
        return HogObservation(total=action.delta, done=True, reward=1.0)

    @property
    def state(self) -> State:
        return self._state
