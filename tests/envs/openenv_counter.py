"""A small environment written against OpenEnv's ``Environment`` API, for tests/e2e/test_openenv.py.

Two steps add to a running total; the second step ends the episode and pays 1.0 for a total
of exactly 5, 0.5 for one off, else 0.0 (the reward depends on the state across steps).
Special deltas misbehave: 99 raises, 77 hangs (a sync step that blocks), 55 returns a
reward that is not a number.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

TARGET = 5


class CountAction(Action):
    """Add delta to the running sum."""

    delta: int


class CountObservation(Observation):
    total: int = 0


class CountEnv(Environment[CountAction, CountObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=uuid.uuid4().hex, step_count=0)
        self.total = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> CountObservation:
        self._state = State(episode_id=episode_id or uuid.uuid4().hex, step_count=0)
        self.total = int(kwargs.get("start", 0))
        return CountObservation(total=self.total)

    def step(self, action: CountAction, timeout_s: float | None = None, **kwargs: Any) -> CountObservation:
        if action.delta == 99:
            raise RuntimeError("step exploded")
        if action.delta == 77:  # past the tests' step_timeout_s (2 s); short, since OpenEnv's own server holds
            time.sleep(4)  # the hung session (one of its max_concurrent_envs) until the step returns
        self.total += action.delta
        self._state.step_count += 1
        done = self._state.step_count >= 2
        if action.delta == 55:
            return CountObservation.model_construct(total=self.total, done=True, reward="lots", metadata={})
        reward = 0.0
        if done:
            reward = 1.0 if self.total == TARGET else 0.5 if abs(self.total - TARGET) == 1 else 0.0
        return CountObservation(total=self.total, done=done, reward=reward)

    @property
    def state(self) -> State:
        return self._state


class SayAction(Action):
    """Say something."""

    text: str


class SayObservation(Observation):
    heard: str = ""


class SayEnv(Environment[SayAction, SayObservation, State]):
    """One step: pays 1.0 for saying exactly the target number in words (an action of one string field)."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=uuid.uuid4().hex, step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> SayObservation:
        return SayObservation()

    def step(self, action: SayAction, timeout_s: float | None = None, **kwargs: Any) -> SayObservation:
        self._state.step_count += 1
        return SayObservation(heard=action.text, done=True, reward=1.0 if action.text.strip() == "five" else 0.0)

    @property
    def state(self) -> State:
        return self._state


class UnannotatedEnv(CountEnv):
    """The counter with a ``step`` whose action has no type annotation (the action class must be named)."""

    def step(self, action, timeout_s=None, **kwargs):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN201
        return super().step(action, timeout_s, **kwargs)


ENVS = {"counter": (CountEnv, CountAction, CountObservation), "say": (SayEnv, SayAction, SayObservation)}


def serve(port: int, env: str = "counter", max_concurrent_envs: int = 64) -> None:
    """OpenEnv's own server for one of these environments (its FastAPI app under uvicorn) on loopback;
    ``max_concurrent_envs=1`` is the default of OpenEnv's server template."""
    import uvicorn
    from openenv.core.env_server.http_server import create_app

    env_cls, action_cls, obs_cls = ENVS[env]
    app = create_app(env_cls, action_cls, obs_cls, env_name=env, max_concurrent_envs=max_concurrent_envs)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    import sys

    serve(int(sys.argv[1]), *sys.argv[2:3], *[int(a) for a in sys.argv[3:4]])
