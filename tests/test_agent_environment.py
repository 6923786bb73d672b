"""``gym_runtime.testing.AgentEnvironment``: one agent's rollout against one environment in this process, with a
scripted policy (a TEST DOUBLE for the LLM) and no bus, worker or nats-server (issue 64 item 6)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gym_runtime import Failure, Response, UserError
from gym_runtime.agent import AgentContext, Outcome
from gym_runtime.messages import FunctionCallOutput, VerifyReply, create_params, output_text
from gym_runtime.resource import Resource, tool
from gym_runtime.resources.counter import Counter
from gym_runtime.testing import AgentEnvironment, ScriptedPolicy, text_response, tool_calls_response
from tests.helpers import REPO

ROW = json.loads((REPO / "resources" / "counter" / "data" / "example.jsonl").read_text().splitlines()[0])


def _outputs(params: Any) -> list[str]:
    return [i.output for i in params.input if isinstance(i, FunctionCallOutput)]


async def test_the_simple_agent_runs_a_rollout_on_the_counter_in_process() -> None:
    """The tools change the session's state and verify grades it; the policy sees each tool's output."""
    policy = ScriptedPolicy(
        [
            tool_calls_response(("increment_counter", {"count": 1}), ("increment_counter", {"count": 2})),
            tool_calls_response(("get_counter_value", {})),
            text_response("The count is 6."),
        ]
    )
    env = AgentEnvironment(Counter, policy=policy, agent="agents.simple")
    outcome = await env.run(ROW)
    assert outcome.verdict.reward == 1.0  # initial 3, +1, +2: the state the tools left
    assert len(policy.calls) == 3 and "6" in _outputs(policy.calls[2])[-1]
    assert env.contexts[0].turns == ["policy"] * 3
    again = await AgentEnvironment(Counter, policy=ScriptedPolicy([text_response("6")])).run(ROW)
    assert again.verdict.reward == 0.0  # claiming the count without the tools scores nothing


class Flaky(Resource):
    @tool
    async def explode(self, n: int) -> str:
        raise RuntimeError(f"tool bug {n}")

    async def verify(self, task: dict[str, Any], response: Response) -> float:
        raise ValueError("cannot grade")


async def test_a_tool_bug_is_shown_to_the_model_and_a_verify_bug_fails_the_rollout() -> None:
    """As a resource worker answers them: the model reads the tool's error; a verifier that raises is a
    ``verify_error`` failure, never a reward."""
    row = {"responses_create_params": {"input": "go", "tools": [{"type": "function", "name": "explode"}]}}
    policy = ScriptedPolicy([tool_calls_response(("explode", {"n": 7})), text_response("done")])
    with pytest.raises(Failure) as e:
        await AgentEnvironment(Flaky, policy=policy).run(row)
    assert e.value.info.error_class == "verify_error" and "cannot grade" in e.value.info.message
    assert "Error: tool 'explode' failed: RuntimeError: tool bug 7" in _outputs(policy.calls[1])


async def test_a_row_the_environment_refuses_is_one_error_before_any_turn() -> None:
    policy = ScriptedPolicy([])
    with pytest.raises(UserError, match="Counter: missing task field .initial_count."):
        await AgentEnvironment(Counter, policy=policy).run({"responses_create_params": {"input": "add 1"}})
    assert policy.calls == []


async def test_an_agent_function_and_its_options_run_as_given() -> None:
    """Any ``run(ctx)``: here one that reads its options and asks the policy once, with no session."""

    async def echo(ctx: AgentContext) -> Outcome:
        reply = await ctx.generate(create_params(ctx.row["responses_create_params"]))
        return Outcome(response=reply, verdict=VerifyReply(reward=ctx.config.options["reward"]))

    outcome = await AgentEnvironment(
        None, policy=ScriptedPolicy(lambda params: text_response("hi")), agent=echo, config={"options": {"reward": 0.5}}
    ).run({"responses_create_params": {"input": "hello"}})
    assert outcome.verdict.reward == 0.5 and output_text(outcome.response.output) == "hi"
