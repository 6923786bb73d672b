"""A long rollout whose tools run in the agent's own sandbox (``ctx.sandbox``), not the environment's
(tests/e2e/test_resume_sandboxes.py): the agent module and its environment.

The environment offers ``STEPS`` tools (``tests/envs/long_boxed.task``); the scripted policy, a TEST DOUBLE for
the LLM, calls one a turn. The agent runs each call itself: it bumps a counter file of the call's own in its one
container, under the call's id (``Trajectory.call_id``: a replayed turn's exec is answered once), and answers the
container's hostname and the count. At the end it reads every counter back into the row (``counts``,
``container``). The environment holds nothing: its verify gives reward 1. Option ``fail_at``: the first attempt
fails retryably at that turn, before its calls run (given back; the next attempt resumes).
"""

from __future__ import annotations

import json
from typing import Any

from gym_runtime.agent import AgentContext, Outcome, Trajectory
from gym_runtime.errors import Failure
from gym_runtime.messages import FunctionCall, FunctionCallOutput, Response, create_params
from gym_runtime.resource import Resource, Verdict, tool
from tests.envs.long_boxed import STEPS, step_name


async def run(ctx: AgentContext) -> Outcome:
    trajectory = Trajectory(create_params(ctx.row["responses_create_params"]))
    # opened before the checkpoint is taken up: a resumed attempt is handed the container its rollout held
    async with ctx.sandbox() as box, await ctx.open_session() as session:
        resumed = await trajectory.resume(ctx, session)
        while True:
            resp = resumed or await trajectory.generate(ctx)
            resumed = None
            calls = [o for o in resp.output if isinstance(o, FunctionCall)]
            if not calls:
                break
            fail_at = ctx.config.options.get("fail_at")
            if fail_at is not None and ctx.task_attempt == 1 and trajectory.steps == fail_at:
                raise Failure("model_error", "a 5xx (a test's)", retryable=True)  # given back: the next attempt resumes
            for i, call in enumerate(calls):
                name = call.name
                cmd = f"n=$(cat {name} 2>/dev/null || echo 0); echo $((n+1)) > {name}; hostname; cat {name}"
                r = await box.exec(cmd, id=await trajectory.call_id(ctx, i, call))
                host, count = r.stdout.decode().split()
                out = json.dumps({"container": host, "sandbox": box.id, "count": int(count)})
                trajectory.append(FunctionCallOutput(call_id=call.call_id, output=out))
            trajectory.answered(ctx)
        r = await box.exec("hostname; for f in step_*; do [ -f $f ] && echo $f $(cat $f); done")
        lines = r.stdout.decode().split("\n")
        counts = {k: int(v) for k, v in (line.split() for line in lines[1:] if line.strip())}
        response = trajectory.response()
        verdict = await session.verify(ctx.row, response)
    return Outcome(response=response, verdict=verdict, fields={"counts": counts, "container": lines[0]})


class Idle(Resource):
    """Declares the steps; the agent runs them."""

    async def verify(self, task: dict[str, Any], response: Response) -> Verdict:
        return Verdict(reward=1.0)


def _step_tool(i: int) -> Any:
    async def step(self: Idle) -> str:
        return "run by the agent"

    step.__name__ = step_name(i)
    return tool(step, name=step_name(i), description=f"step {i}")


resource = type("IdleSteps", (Idle,), {"__module__": __name__, **{step_name(i): _step_tool(i) for i in range(STEPS)}})
