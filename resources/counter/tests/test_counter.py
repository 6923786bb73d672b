"""counter against NeMo Gym's recorded example_session_state_mgmt rollouts."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from gym_runtime.messages import Response
from gym_runtime.resource import ToolArgumentsError
from gym_runtime.resources.counter import Counter
from tests.differential import (
    COMPAT,
    example_rollouts,
    new_session,
    recorded_response,
    reverify_rollouts,
)

ENV_DIR = Path(__file__).resolve().parents[1]
NEMO = COMPAT / "nemo_gym" / "example_session_state_mgmt"
ROW = {"initial_count": 3, "expected_count": 6}


def empty_response() -> Response:
    return Response(id="r", created_at=0.0)


async def test_recorded_rollouts_replayed_in_a_seeded_session_reverify_to_recorded_reward() -> None:
    pairs = example_rollouts(ENV_DIR, NEMO)
    sessions = await reverify_rollouts(Counter, pairs)
    for i, ((task, rollout), (inst, replayed)) in enumerate(zip(pairs, sessions)):
        assert replayed == 3, f"rollout {i}"
        assert inst.count == task["expected_count"], f"rollout {i}"
        assert rollout["reward"] == 1.0, f"rollout {i}"


async def test_verify_reads_session_state_not_the_response_text() -> None:
    """The recorded answers state the right count, but without the tool calls the session disagrees."""
    for i, (task, rollout) in enumerate(example_rollouts(ENV_DIR, NEMO)):
        inst = await new_session(Counter, row=task)
        assert await inst.verify(task, recorded_response(rollout["response"])) == 0.0, f"rollout {i}"


async def test_tool_outputs_and_reward() -> None:
    inst = await new_session(Counter, row=ROW)
    assert await inst.call_tool("get_counter_value", "") == '{"count": 3}'
    assert await inst.call_tool("increment_counter", '{"count": 1}') == '{"success": true}'
    assert await inst.verify(ROW, empty_response()) == 0.0
    assert await inst.call_tool("increment_counter", '{"count": 2}') == '{"success": true}'
    assert await inst.call_tool("get_counter_value", "{}") == '{"count": 6}'
    assert await inst.verify(ROW, empty_response()) == 1.0
    assert await inst.call_tool("increment_counter", '{"count": -10}') == '{"success": true}'
    assert await inst.call_tool("get_counter_value", "{}") == '{"count": -4}'


async def test_two_sessions_keep_separate_state() -> None:
    a = await new_session(Counter, row={"initial_count": 3})
    b = await new_session(Counter, row={"initial_count": 100})
    await a.call_tool("increment_counter", '{"count": 5}')
    assert await a.call_tool("get_counter_value", "{}") == '{"count": 8}'
    assert await b.call_tool("get_counter_value", "{}") == '{"count": 100}'
    await b.call_tool("increment_counter", '{"count": 1}')
    assert await a.call_tool("get_counter_value", "{}") == '{"count": 8}'
    assert await a.verify({"expected_count": 8}, empty_response()) == 1.0
    assert await b.verify({"expected_count": 8}, empty_response()) == 0.0


async def test_unseeded_session_verifies_to_zero_and_counts_from_zero() -> None:
    inst = await new_session(Counter, seed=False)
    assert await inst.verify({"expected_count": 0}, empty_response()) == 0.0
    assert await inst.call_tool("increment_counter", '{"count": 2}') == '{"success": true}'
    assert await inst.call_tool("get_counter_value", "{}") == '{"count": 2}'
    assert await inst.verify({"expected_count": 2}, empty_response()) == 1.0


@pytest.mark.parametrize("row", [{}, {"initial_count": "3"}, {"initial_count": True}, {"initial_count": 1.5}])
async def test_seed_refuses_a_row_without_an_integer_initial_count(row: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="task row needs an integer 'initial_count'"):
        await new_session(Counter, row=row)


async def test_verify_refuses_a_row_without_an_integer_expected_count() -> None:
    inst = await new_session(Counter, row=ROW)
    with pytest.raises(ValueError, match="task row needs an integer 'expected_count'"):
        await inst.verify({"initial_count": 3}, empty_response())


@pytest.mark.parametrize(
    ("name", "arguments", "message"),
    [
        ("increment_counter", '{"count": 1', "'increment_counter' are not valid JSON"),
        (
            "decrement_counter",
            '{"count": 1}',
            "unknown tool 'decrement_counter'; available tools: get_counter_value, increment_counter",
        ),
        ("increment_counter", '{"count": "three"}', "do not match the schema of 'increment_counter'"),
        (
            "increment_counter",
            '{"count": 1.5}',
            "count: Input should be a valid integer, got a number with a fractional part",
        ),
        ("increment_counter", "{}", "count: Field required"),
        ("increment_counter", "[1]", "must be a JSON object"),
    ],
)
async def test_bad_tool_arguments_are_refused_with_a_reason(name: str, arguments: str, message: str) -> None:
    inst = await new_session(Counter, row=ROW)
    with pytest.raises(ToolArgumentsError, match=re.escape(message)):
        await inst.call_tool(name, arguments)
    assert inst.count == 3  # a refused call changes nothing


async def test_arguments_follow_nemo_gym_pydantic_semantics() -> None:
    """NeMo Gym validates with pydantic: extra keys are ignored and "3" is coerced to 3."""
    inst = await new_session(Counter, row=ROW)
    assert await inst.call_tool("increment_counter", '{"count": "2", "note": "extra"}') == '{"success": true}'
    assert await inst.call_tool("get_counter_value", '{"count": 1}') == '{"count": 5}'
