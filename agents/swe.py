"""The SWE agent: mini-swe-agent's loop over a ``bash`` tool, for ``resources.swe``.

seed a session (its environment holds the repository at the task's base
commit) → loop { model call → run its ``bash`` calls in order } until

* the model submits: a command whose first line is
  ``echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` (mini-swe-agent's convention;
  the command still runs, so its output is in the trajectory; later calls of
  that turn are answered "Not run" so every call has an output),
* the model answers without a tool call,
* the output hit ``max_output_tokens``,
* ``max_steps`` model calls were made (the step limit; NeMo Gym's default is 250), or
* the time limit passed: ``options.time_limit_s`` (default: ``timeout_s`` minus
  ``options.grading_reserve_s``, so grading still fits in the rollout's time)

→ verify: the resource grades the repository's final diff (the answer) with the
task's tests. Rows from SWE-Gym carry no prompt (``input: []``): the agent then
writes one from ``problem_statement`` and offers the ``bash`` tool itself; a row
with its own ``input`` and ``tools`` is sent as it is. Extra fields:
``exit_status`` (``submitted``, ``answered``, ``step_limit``, ``time_limit``,
``max_output_tokens``) and ``steps``.
"""

from __future__ import annotations

import time

import msgspec

from gym_runtime.agent import AgentContext, Outcome, Trajectory
from gym_runtime.errors import Failure
from gym_runtime.messages import (
    FunctionCall,
    FunctionCallOutput,
    Item,
    ItemError,
    Message,
    create_params,
    parse_items,
)
from gym_runtime.resources.swe import SWE

SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
DEFAULT_STEPS = 250

SYSTEM = (
    "You are a software engineer working in a repository through a bash tool. Each command runs in a new "
    "shell in the repository's root; its return code and output come back to you. Make the smallest change "
    "that resolves the issue, check it, and do not edit the tests. When you are done, run exactly "
    f"`{SUBMIT}`: the repository's diff at that moment is your answer."
)


def _prompt(row: dict) -> list[Item]:
    statement = row.get("problem_statement")
    if not isinstance(statement, str) or not statement.strip():
        raise Failure("invalid_task", "a SWE row needs responses_create_params.input or a problem_statement")
    return parse_items(
        [
            {"role": "system", "content": SYSTEM},
            {
                "role": "user",
                "content": f"Resolve this issue in the repository:\n\n<issue>\n{statement.strip()}\n</issue>",
            },
        ]
    )


def is_submit(call: FunctionCall) -> bool:
    try:
        command = msgspec.json.decode(call.arguments or b"{}").get("command", "")
    except (msgspec.DecodeError, AttributeError):
        return False
    return isinstance(command, str) and command.lstrip().split("\n", 1)[0].strip() == SUBMIT


async def run(ctx: AgentContext) -> Outcome:
    try:
        params = create_params(ctx.row.get("responses_create_params") or {"input": []})
    except ItemError as e:
        raise Failure("invalid_task", str(e)) from None
    if not params.input:
        params.input = _prompt(ctx.row)
    if not params.tools:
        params.tools = SWE.tool_definitions()
    opts = ctx.config.options
    max_steps = ctx.config.max_steps or DEFAULT_STEPS
    reserve = float(opts.get("grading_reserve_s", min(600.0, ctx.config.timeout_s / 4)))
    time_limit = float(opts.get("time_limit_s", max(1.0, ctx.config.timeout_s - reserve)))
    started = time.monotonic()
    trajectory = Trajectory(params)
    exit_status = "step_limit"
    async with await ctx.open_session() as session:
        while True:
            resp = await trajectory.generate(ctx)
            if trajectory.hit_token_limit(resp):
                exit_status = "max_output_tokens"
                break
            calls = [o for o in resp.output if isinstance(o, FunctionCall)]
            submitted = False
            for call in calls:
                if submitted:  # later calls of the submitting turn are answered, not run
                    trajectory.append(
                        FunctionCallOutput(call_id=call.call_id, output="Not run: the task was submitted.")
                    )
                    continue
                reply = await session.call(call.name, call.arguments, timeout=max(30.0, ctx.remaining()))
                trajectory.append(FunctionCallOutput(call_id=call.call_id, output=reply.output))
                submitted = call.name == "bash" and is_submit(call)
            if submitted:
                exit_status = "submitted"
                break
            if not calls and any(isinstance(o, Message) and o.role == "assistant" for o in resp.output):
                exit_status = "answered"
                break
            if trajectory.steps >= max_steps:
                exit_status = "step_limit"
                break
            if time.monotonic() - started >= time_limit:
                exit_status = "time_limit"
                break
        response = trajectory.response()
        verdict = await session.verify(ctx.row, response, timeout=max(30.0, ctx.remaining()))
    return Outcome(response=response, verdict=verdict, fields={"exit_status": exit_status, "steps": trajectory.steps})
