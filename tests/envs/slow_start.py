"""An agent whose ``setup`` takes as long as the test wants (tests/e2e/test_slow_steps.py): it marks that it
started, then waits for a file the test writes once it has seen ``run`` name the wait; then plays agents.simple."""

from __future__ import annotations

from pathlib import Path

import anyio

from agents import simple
from gym_runtime.agent import AgentContext, Outcome
from gym_runtime.config import AgentConfig


async def setup(config: AgentConfig) -> None:
    here = Path(config.options["dir"])
    (here / "started").touch()
    while not (here / "go").exists():
        await anyio.sleep(0.05)


async def run(ctx: AgentContext) -> Outcome:
    return await simple.run(ctx)
