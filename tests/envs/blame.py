"""An environment that raises a failure of any class where its row says, or crashes its own process on a tool's
input: who is blamed is the runtime's finding (tests/test_blame.py, tests/e2e/test_failure_rows.py).

``raise_in`` (``seed``, ``tool``, ``verify``) raises ``Failure(raise_class)`` there, environment code naming a
class of its choice. ``judge_in`` makes that step ask the model ``judge`` (``tests.envs.broken_model``: it always
fails) and pass its failure on: a failure the runtime saw itself. ``crash(how)`` with ``how == "die"`` kills its
own process (SIGKILL), once ``hold``'s file (the row's ``holding``) exists when the row names one, touching the row's
``release`` first: a tool call whose input crashes its guest (``isolation: process``). ``hold`` touches ``holding``
and waits until ``release`` exists: a call of another session in flight in the same guest when it dies, served on
its retry. ``crash_verify`` makes a verify kill its own process when the policy's answer says "die".
"""

from __future__ import annotations

import os
import signal
from typing import Any, Literal

import anyio

from gym_runtime.errors import Failure
from gym_runtime.messages import Response, create_params, output_text
from gym_runtime.resource import Resource, tool


class Blame(Resource):
    def __init__(self) -> None:
        self.task: dict[str, Any] = {}

    async def _step(self, where: str) -> None:
        if self.task.get("raise_in") == where:
            raise Failure(self.task["raise_class"], f"the environment's {where} says so")
        if self.task.get("judge_in") == where:  # the judge's failure passed on as it came
            await self.models.generate(create_params({"input": "grade"}), model="judge")

    async def seed(self, task: dict[str, Any]) -> None:
        self.task = task
        await self._step("seed")

    @tool
    async def act(self) -> str:
        """Act once."""
        await self._step("tool")
        return "acted"

    @tool
    async def crash(self, how: Literal["die", "live"]) -> str:
        """Crash the environment's process when asked to."""
        holding = self.task.get("holding")
        while how == "die" and holding and not os.path.exists(holding):  # another session's call in flight first
            await anyio.sleep(0.01)
        if how == "die":
            if self.task.get("release"):  # what the session lost with it finds once retried (no await between)
                open(self.task["release"], "a").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return "alive"

    @tool
    async def hold(self) -> str:
        """Hold until released."""
        open(self.task["holding"], "a").close()
        while not os.path.exists(self.task["release"]):
            await anyio.sleep(0.01)
        return "released"

    async def verify(self, task: dict[str, Any], response: Response) -> float:
        if task.get("crash_verify") and "die" in output_text(response.output):  # the policy's answer kills it
            os.kill(os.getpid(), signal.SIGKILL)
        await self._step("verify")
        return 1.0


resource = Blame
