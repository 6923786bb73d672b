"""math_advanced_calculations against NeMo Gym's differential cases and recorded rollouts."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from gym_runtime.messages import FunctionCall, FunctionCallOutput, Response, parse_items
from gym_runtime.resource import ToolArgumentsError
from gym_runtime.resources.math_advanced_calculations import (
    MathAdvancedCalculations,
    solution_of,
)
from gym_runtime.testing import new_session, read_jsonl, recorded_response, replay_rollouts
from tests.differential import compat_dir, differential_cases

ENV_DIR = Path(__file__).resolve().parents[1]


def outputs(*values: str) -> Response:
    items: list[Any] = []
    for i, v in enumerate(values):
        items += [
            FunctionCall(name="add", arguments="{}", call_id=f"c{i}"),
            FunctionCallOutput(call_id=f"c{i}", output=v),
        ]
    return Response(id="r", created_at=0.0, output=items)


async def test_differential_cases_reproduce_nemo_gym_rewards() -> None:
    cases = differential_cases("math_advanced_calculations")
    assert len(cases) >= 15
    for task, case in cases:
        inst = await new_session(MathAdvancedCalculations)
        reward = await inst.verify(task, recorded_response(task["response"]))
        assert isinstance(reward, float)
        assert reward == case["expected_reward"], case["case"]
        assert case["expected_fields"] == {}, "NeMo Gym's verify adds no fields here"


async def test_differential_trajectories_replayed_through_our_tools_give_the_recorded_values() -> None:
    """Our calculators reproduce every output NeMo Gym's tools gave (where the case did not tamper with it)."""
    checked = 0
    for _, case in differential_cases("math_advanced_calculations"):
        response = recorded_response(case["response"])
        recorded = {i.call_id: i.output for i in response.output if isinstance(i, FunctionCallOutput)}
        inst = await new_session(MathAdvancedCalculations)
        for item in response.output:
            if not isinstance(item, FunctionCall) or item.call_id not in recorded:
                continue
            theirs = solution_of(recorded[item.call_id])
            if theirs is None or "off by" in case["case"] or "real cosine" in case["case"] or "as ints" in case["case"]:
                continue  # hand-edited outputs in these cases
            assert solution_of(await inst.call_tool(item.name, item.arguments)) == theirs, case["case"]
            checked += 1
    assert checked >= 20


async def test_recorded_rollouts_tool_outputs_are_reproduced_exactly() -> None:
    """NeMo Gym's recorded rollouts (other tasks, no ground truth): every tool output matches bit for bit."""
    rollouts = compat_dir("nemo_gym", "math_advanced_calculations", "example_rollouts.jsonl")
    assert await replay_rollouts(MathAdvancedCalculations, rollouts) >= 5


@pytest.mark.parametrize(
    ("name", "arguments", "value"),
    [
        ("add", '{"a": 2, "b": 3}', 6.2),
        ("subtract", '{"a": 9.0, "b": 9.0}', -3.0),
        ("multiply", '{"a": 3.0, "b": 2.0}', 6.6000000000000005),
        ("divide", '{"a": 1, "b": 1}', 0.5),
        ("power", '{"a": 2, "b": 10}', 4096.0),
        ("log", '{"a": 100, "base": 8.5}', 2.0),
        ("sin", '{"radians": 0}', 1.0),
        ("cos", '{"radians": 0}', 0.0),
        ("pi", "{}", math.e),
        ("negate", '{"a": 7}', 7.0),
        ("return_constant", '{"a": -1.5}', -1.5),
        ("add", '{"a": "2", "b": true}', 4.2),  # pydantic-style lax coercion
        ("add", '{"a": 2, "b": 3, "c": 9}', 6.2),  # keys the request model does not know are dropped
        ("add", '{"a": 2, "b": 3, "base": null}', 6.2),  # nulls are dropped
    ],
)
async def test_calculators(name: str, arguments: str, value: float) -> None:
    out = json.loads(await (await new_session(MathAdvancedCalculations)).call_tool(name, arguments))
    assert out == {"solution": pytest.approx(value, rel=0, abs=1e-12)}


@pytest.mark.parametrize(
    ("name", "arguments", "detail"),
    [
        ("divide", '{"a": 1, "b": 0}', "float division by zero"),
        ("log", '{"a": 0, "base": 2}', "math domain error"),
        ("add", '{"a": 1}', "add() missing 1 required positional argument: 'b'"),
        ("add", '{"a": 1, "b": 2, "radians": 1}', "add() got an unexpected keyword argument 'radians'"),
        ("pi", '{"a": 1}', "pi() got an unexpected keyword argument 'a'"),
        ("sqrt", '{"a": 4}', "Function not found"),
    ],
)
async def test_failures_answer_with_a_detail_like_nemo_gyms_error_body(name: str, arguments: str, detail: str) -> None:
    out = await (await new_session(MathAdvancedCalculations)).call_tool(name, arguments)
    assert json.loads(out) == {"detail": detail}
    assert solution_of(out) is None


async def test_complex_and_non_finite_results() -> None:
    inst = await new_session(MathAdvancedCalculations)
    assert "complex" in json.loads(await inst.call_tool("power", '{"a": -8, "b": -1.5}'))["detail"]
    assert json.loads(await inst.call_tool("power", '{"a": 10, "b": 400}')) == {
        "detail": "(34, 'Numerical result out of range')"
    }
    assert json.loads(await inst.call_tool("multiply", '{"a": 1e308, "b": 10}')) == {"solution": None}


@pytest.mark.parametrize("arguments", ['{"a": 1', "[1, 2]", '{"a": "one", "b": 2}'])
async def test_unreadable_arguments_are_refused(arguments: str) -> None:
    with pytest.raises(ToolArgumentsError):
        await (await new_session(MathAdvancedCalculations)).call_tool("add", arguments)


@pytest.mark.parametrize(
    ("ground_truth", "produced", "reward"),
    [
        ("[6.2, 0.5]", ['{"solution": 0.5}', '{"solution": 6.2}'], 1.0),  # any order
        ("[6.2, 6.2]", ['{"solution": 6.2}'], 1.0),  # duplicates need not repeat
        ("[6.2]", ['{"solution": 6.2}', '{"solution": 1.0}'], 1.0),  # extra outputs are fine
        ("[6.2]", ['{"solution": 6.200000000001}'], 0.0),  # exact equality
        ("[3]", ['{"solution": "3.0"}'], 1.0),  # float() of a numeric string; int vs float equal
        ("[3.0]", ['{"value": 3.0}', "Internal Server Error", '{"solution": null}'], 0.0),
        ("[]", [], 1.0),
        ("[1.0]", [], 0.0),
    ],
)
async def test_verify_semantics(ground_truth: str, produced: list[str], reward: float) -> None:
    assert (
        await (await new_session(MathAdvancedCalculations)).verify({"ground_truth": ground_truth}, outputs(*produced))
        == reward
    )


async def test_verify_reads_tool_outputs_not_the_final_text() -> None:
    response = Response(id="r", created_at=0.0, output=parse_items([{"role": "assistant", "content": "6.2"}]))
    assert await (await new_session(MathAdvancedCalculations)).verify({"ground_truth": "[6.2]"}, response) == 0.0


@pytest.mark.parametrize("ground_truth", [[6.2], None])
async def test_ground_truth_must_be_a_json_string(ground_truth: Any) -> None:
    """NeMo Gym's verify fails on a non-string ground truth (json.loads of a list); so does ours."""
    with pytest.raises(ValueError, match="ground_truth"):
        await (await new_session(MathAdvancedCalculations)).verify(
            {"ground_truth": ground_truth}, outputs('{"solution": 6.2}')
        )


def test_tool_schemas_match_the_dataset_tools() -> None:
    row = read_jsonl(ENV_DIR / "data" / "example.jsonl")[0]
    ours = {t["name"]: t for t in MathAdvancedCalculations.tool_definitions()}
    theirs = {t["name"]: t for t in row["responses_create_params"]["tools"]}
    assert set(ours) == set(theirs)
    for name, t in theirs.items():
        assert ours[name]["description"] == t["description"]
        assert ours[name]["parameters"]["required"] == t["parameters"]["required"]
        assert {p: s["type"] for p, s in ours[name]["parameters"]["properties"].items()} == {
            p: s["type"] for p, s in t["parameters"]["properties"].items()
        }
