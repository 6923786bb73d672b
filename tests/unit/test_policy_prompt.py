"""An agent records the prompt its policy saw (a multi-turn agent appends the user simulator's opening turn):
taken only as the task's own params with turns added after them; anything else is not the runtime's key to give."""

from __future__ import annotations

import pytest

from gym_runtime.data.rowkeys import own_fields, policy_prompt
from gym_runtime.errors import Failure

TASK = {"input": [{"role": "user", "content": "Let's play."}], "tools": [{"type": "function", "name": "tick"}]}
OPENED = {**TASK, "input": [*TASK["input"], {"role": "user", "content": "You have 3 turns."}]}


def test_turns_appended_after_the_tasks_input_are_the_prompt_the_policy_saw() -> None:
    assert policy_prompt({"responses_create_params": OPENED}, TASK) == OPENED
    as_text = {**TASK, "input": "Let's play."}
    assert policy_prompt({"responses_create_params": OPENED}, as_text) == OPENED  # a string input is one user turn
    assert policy_prompt({}, TASK) is TASK


@pytest.mark.parametrize(
    "forged",
    [
        {**OPENED, "tools": []},  # another key changed
        {**TASK, "input": [{"role": "user", "content": "Another task."}]},  # the task's turns replaced
        {**TASK, "input": OPENED["input"][1:]},  # the task's turns dropped
        "not params",
    ],
)
def test_anything_else_stays_the_tasks_and_the_agent_field_is_refused(forged: object) -> None:
    runtime = {"responses_create_params": policy_prompt({"responses_create_params": forged}, TASK)}
    assert runtime["responses_create_params"] is TASK
    with pytest.raises(Failure, match="responses_create_params"):
        own_fields({"responses_create_params": forged}, runtime, {"responses_create_params": TASK}, who="the agent")
