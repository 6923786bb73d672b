"""An agent whose ``setup`` finds a mistake in its options, named as plugins name their keys (``agents.*.``): the
worker names the entry (tests/test_setup_errors.py)."""

from __future__ import annotations

from gym_runtime.agent import AgentContext, Outcome
from gym_runtime.config import AgentConfig
from gym_runtime.errors import UserError


async def setup(config: AgentConfig) -> None:
    raise UserError(f"agents.*.options.env: cannot load {config.options.get('env')!r}")


async def run(ctx: AgentContext) -> Outcome:
    raise AssertionError("never started")
