"""A small OpenEnv environment that exposes MCP tools (``MCPEnvironment`` + FastMCP), for test_openenv.py.

``add(n)`` adds to a tally and returns it; ``submit()`` ends the episode, paying 1.0 for a tally of
exactly 5, 0.5 for one off, else 0.0 (its reward set on the step's observation, as an OpenEnv
environment sets rewards). ``add(13)`` raises inside the tool.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastmcp import FastMCP
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction
from openenv.core.env_server.types import Action, Observation, State

TARGET = 5


class TallyEnv(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        mcp = FastMCP("tally")
        self.total = 0

        @mcp.tool
        def add(n: int) -> int:
            """Add n to the tally; returns the new tally."""
            if n == 13:
                raise ValueError("unlucky number")
            self.total += n
            return self.total

        @mcp.tool
        def submit() -> str:
            """Submit the tally and end the episode."""
            return f"submitted {self.total}"

        super().__init__(mcp)
        self._state = State(episode_id=uuid.uuid4().hex, step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Observation:
        self.total = 0
        self._state = State(episode_id=episode_id or uuid.uuid4().hex, step_count=0)
        return Observation(done=False, reward=0.0)

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(done=False, reward=0.0, metadata={"error": "act through the MCP tools"})

    def _scored(self, action: Action, obs: Observation) -> Observation:
        self._state.step_count += 1
        if isinstance(action, CallToolAction) and action.tool_name == "submit":
            obs.done = True
            obs.reward = 1.0 if self.total == TARGET else 0.5 if abs(self.total - TARGET) == 1 else 0.0
        return obs

    def step(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return self._scored(action, super().step(action, timeout_s=timeout_s, **kwargs))

    async def step_async(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return self._scored(action, await super().step_async(action, timeout_s=timeout_s, **kwargs))

    @property
    def state(self) -> State:
        return self._state


def serve(port: int) -> None:
    """OpenEnv's own server for this environment on loopback."""
    import uvicorn
    from openenv.core.env_server.http_server import create_app
    from openenv.core.env_server.mcp_types import CallToolObservation

    app = create_app(TallyEnv, CallToolAction, CallToolObservation, env_name="tally", max_concurrent_envs=64)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    import sys

    serve(int(sys.argv[1]))
