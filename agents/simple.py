"""The simple agent: NeMo Gym's ``simple_agent`` loop.

seed a session → loop { model call → run its tool calls in order, appending
``function_call_output`` items } until the model answers without tool calls (a
message, or only reasoning: NeMo Gym marks that rollout incomplete but ends it too), the
output hit ``max_output_tokens``, or ``max_steps`` model calls were made → verify.

Differences from NeMo Gym, on purpose: a tool call with invalid JSON arguments,
an unknown tool or arguments that fail the schema is answered with an error
``function_call_output`` the model can read (NeMo Gym raises on invalid JSON);
``usage`` is summed over every model call of the rollout (NeMo Gym keeps the
last call's).
"""

from __future__ import annotations

from gym_runtime.agent import AgentContext, Outcome, Trajectory
from gym_runtime.errors import Failure
from gym_runtime.messages import FunctionCall, ItemError, create_params


async def run(ctx: AgentContext) -> Outcome:
    try:
        params = create_params(ctx.row.get("responses_create_params"))
    except ItemError as e:
        raise Failure("invalid_task", str(e)) from None
    max_steps = ctx.config.max_steps
    trajectory = Trajectory(params)
    async with await ctx.open_session() as session:
        # a redelivered attempt takes up its checkpoint: the last turn's calls still to run, or None
        resumed = await trajectory.resume(ctx, session)
        while True:
            resp = resumed or await trajectory.generate(ctx)
            resumed = None
            if trajectory.hit_token_limit(resp):
                break
            calls = [o for o in resp.output if isinstance(o, FunctionCall)]
            done = False
            for i, call in enumerate(calls):  # whatever its name, a call reaches only a tool of the resource
                reply = await trajectory.call(ctx, session, call, i, last=i == len(calls) - 1)
                done = done or reply.done
            if not calls or done:  # an answer, a turn with no message (reasoning only: NeMo Gym ends there too),
                break  # or a tool's output ended the episode (the turn's other calls were answered first)
            if max_steps and trajectory.steps >= max_steps:
                break
            trajectory.answered(ctx)
        response = trajectory.response()
        verdict = await session.verify(ctx.row, response)
    return Outcome(response=response, verdict=verdict)
