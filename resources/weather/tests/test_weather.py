"""weather against NeMo Gym's recorded example_single_tool_call rollouts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gym_runtime.messages import Response, parse_items
from gym_runtime.resource import ToolArgumentsError
from gym_runtime.resources.weather import Weather
from tests.differential import (
    COMPAT,
    example_rollouts,
    new_session,
    read_jsonl,
    reverify_rollouts,
)

ENV_DIR = Path(__file__).resolve().parents[1]
NEMO = COMPAT / "nemo_gym" / "example_single_tool_call"


async def test_recorded_rollouts_reverify_to_recorded_reward_and_fields() -> None:
    sessions = await reverify_rollouts(Weather, example_rollouts(ENV_DIR, NEMO))
    assert sum(replayed for _, replayed in sessions) == 3  # three of the five recorded rollouts call get_weather


async def test_reward_is_one_even_without_a_tool_call() -> None:
    """Matches the recorded data: rollouts that only asked for the city scored 1.0."""
    inst = await new_session(Weather)
    response = Response(id="r", created_at=0.0, output=parse_items([{"role": "assistant", "content": "Which city?"}]))
    assert await inst.verify({}, response) == 1.0


async def test_tool_output_shape() -> None:
    inst = await new_session(Weather)
    out = await inst.call_tool("get_weather", '{"city": "Paris"}')
    assert out == '{"city": "Paris", "weather_description": "The weather in Paris is cold."}'


def test_tool_schema_matches_the_dataset_tools() -> None:
    row = read_jsonl(ENV_DIR / "data" / "example.jsonl")[0]
    ours = {t["name"]: t for t in Weather.tool_definitions()}
    for theirs in row["responses_create_params"]["tools"]:
        mine = ours[theirs["name"]]["parameters"]
        assert mine["required"] == theirs["parameters"]["required"]
        assert mine["additionalProperties"] is False
        for prop, schema in theirs["parameters"]["properties"].items():
            assert mine["properties"][prop]["type"] == schema["type"]
    assert set(ours) == {t["name"] for t in row["responses_create_params"]["tools"]}


@pytest.mark.parametrize(
    ("name", "arguments", "message"),
    [
        ("get_weather", '{"city": ', "'get_weather' are not valid JSON"),
        ("get_forecast", '{"city": "SF"}', "unknown tool 'get_forecast'; available tools: get_weather"),
        ("get_weather", '{"city": 42}', "do not match the schema of 'get_weather'"),
        ("get_weather", "{}", "city: Field required"),
        ("get_weather", '{"city": null}', "city: Input should be a valid string"),
    ],
)
async def test_bad_tool_arguments_are_refused_with_a_reason(name: str, arguments: str, message: str) -> None:
    inst = await new_session(Weather)
    with pytest.raises(ToolArgumentsError, match=re.escape(message)):
        await inst.call_tool(name, arguments)
