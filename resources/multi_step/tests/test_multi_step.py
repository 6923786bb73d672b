"""multi_step against NeMo Gym's recorded example_multi_step rollouts."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from gym_runtime.messages import FunctionCall, Response
from gym_runtime.resource import ToolArgumentsError, Verdict
from gym_runtime.resources.multi_step import MultiStep
from tests.differential import (
    COMPAT,
    ROLLOUT_KEYS,
    differential_cases,
    example_rollouts,
    new_session,
    read_jsonl,
    recorded_response,
    reverify_rollouts,
    split_verdict,
)

ENV_DIR = Path(__file__).resolve().parents[1]
NEMO = COMPAT / "nemo_gym" / "example_multi_step"
TASK = {
    "id": 0,
    "expected_synonyms": ["Blazing", "Warm"],
    "expected_synonym_values": [711, 407],
    "minefield_label": "Hot",
    "minefield_label_value": 299,
}


def calls(*arguments: str, name: str = "extract_synonym_values") -> Response:
    """A response whose output is one function call per argument string."""
    items = [FunctionCall(name=name, arguments=a, call_id=f"c{i}") for i, a in enumerate(arguments)]
    return Response(id="r", created_at=0.0, output=list(items))


async def verdict(response: Response, task: dict[str, Any] = TASK) -> Verdict:
    out = await (await new_session(MultiStep, row=task)).verify(task, response)
    assert isinstance(out, Verdict)
    return out


def metrics(reward: float, parsed: list[int], overlap: float, minefield: bool, order_failure: bool) -> dict[str, Any]:
    """The fields verify reports beside ``reward``."""
    return {
        "parsed_synonym_values": parsed,
        "accuracy": reward == 1.0,
        "set_overlap": overlap,
        "original_term_minefield_hit": minefield,
        "order_instruction_following_failure": order_failure,
    }


async def test_recorded_rollouts_reverify_to_recorded_reward_and_fields() -> None:
    pairs = example_rollouts(ENV_DIR, NEMO)
    for i, (_, replayed) in enumerate(await reverify_rollouts(MultiStep, pairs)):
        assert replayed >= 3, f"rollout {i}"
    for _, rollout in pairs:
        assert set(rollout) - set(ROLLOUT_KEYS) == set(metrics(0.0, [], 0.0, False, False))


@pytest.mark.parametrize(
    ("extracted", "reward", "overlap", "minefield", "order_failure"),
    [
        ([711, 407], 1.0, 1.0, False, False),
        ([407, 711], 0.0, 1.0, False, True),  # right values, wrong order
        ([711, 407, 407], 0.0, 1.0, False, True),  # a duplicate is not accurate either
        ([299, 711], 0.0, 0.5, True, False),  # the term's own value: the minefield
        ([711, 407, 299], 0.0, 1.0, True, True),
        ([], 0.0, 0.0, False, False),
    ],
)
async def test_verify_metrics(
    extracted: list[int], reward: float, overlap: float, minefield: bool, order_failure: bool
) -> None:
    v = await verdict(calls(json.dumps({"synonym_values": extracted})))
    assert (v.reward, v.fields) == (reward, metrics(reward, extracted, overlap, minefield, order_failure))


async def test_last_extract_call_counts() -> None:
    v = await verdict(calls('{"synonym_values": [711, 407]}', '{"synonym_values": [407]}'))
    assert (v.reward, v.fields["parsed_synonym_values"], v.fields["set_overlap"]) == (0.0, [407], 0.5)
    v = await verdict(calls('{"synonym_values": [407]}', '{"synonym_values": [711, 407]}'))
    assert v.reward == 1.0


# NeMo Gym's verify reads the last extract call with json.loads(arguments)["synonym_values"] and compares with
# Python's ==, set() and `in`; its response model reports parsed_synonym_values as pydantic List[int] (lax).
# Each case: the arguments of the last call -> what that gives (reward, parsed, set_overlap, minefield hit,
# order failure), or None where NeMo Gym's verify raises (no reward at all: a failed rollout there, a
# verify_error failure row here).
LAX_AND_MALFORMED = [
    ('{"synonym_values": [711.0, 407.0]}', (1.0, [711, 407], 1.0, False, False)),  # 711.0 == 711
    ('{"synonym_values": ["711", "407"]}', (0.0, [711, 407], 0.0, False, False)),  # "711" != 711; reported as int
    ('{"synonym_values": [" 711 ", "+407"]}', (0.0, [711, 407], 0.0, False, False)),
    ('{"synonym_values": [711, 407], "note": "x"}', (1.0, [711, 407], 1.0, False, False)),  # extra keys ignored
    ('{"synonym_values": [true, 407]}', (0.0, [1, 407], 0.5, False, False)),
    ('{"synonym_values": ["Hot", 711]}', None),  # the label is a hit there, but "Hot" is no List[int]: it raises
    ('{"synonym_values": [711, 407]', None),  # not JSON
    ('{"values": [711, 407]}', None),  # no synonym_values
    ('{"synonym_values": 711}', None),  # set(711) fails
    ('{"synonym_values": [711.5]}', None),  # not an integer for List[int]
    ('{"synonym_values": [[711]]}', None),  # unhashable
    ('["synonym_values"]', None),
]


@pytest.mark.parametrize(("arguments", "expected"), LAX_AND_MALFORMED)
async def test_lax_and_malformed_extract_arguments_give_nemo_gyms_reward(arguments: str, expected: Any) -> None:
    response = calls('{"synonym_values": [711, 407]}', arguments)  # only the last call counts
    if expected is None:
        with pytest.raises(ValueError, match="extract_synonym_values"):
            await verdict(response)
        return
    v = await verdict(response)
    assert (v.reward, v.fields) == (expected[0], metrics(*expected))


async def test_differential_cases_reproduce_nemo_gyms_reward_and_fields() -> None:
    cases = differential_cases("example_multi_step")
    assert len(cases) >= 19
    for row, case in cases:
        task = {k: v for k, v in row.items() if k != "response"}
        reward, fields = split_verdict(await verdict(recorded_response(row["response"]), task))
        assert reward == case["expected_reward"], case["case"]
        assert json.dumps(fields, sort_keys=True) == json.dumps(case["expected_fields"], sort_keys=True), case["case"]


async def test_no_extract_call_scores_zero() -> None:
    v = await verdict(calls('{"synonym": "Blazing"}', name="get_synonym_value"))
    assert (v.reward, v.fields["parsed_synonym_values"], v.fields["set_overlap"]) == (0.0, [], 0.0)


@pytest.mark.parametrize(
    ("task", "message"),
    [
        ({**TASK, "expected_synonym_values": []}, "expected_synonym_values is empty"),
        ({k: v for k, v in TASK.items() if k != "minefield_label_value"}, "minefield_label_value"),
        ({**TASK, "expected_synonym_values": "711"}, "expected_synonym_values"),
    ],
)
async def test_verify_refuses_an_invalid_task_row(task: dict[str, Any], message: str) -> None:
    inst = await new_session(MultiStep, row=task)
    with pytest.raises(ValueError, match=f"task row: .*{message}"):
        await inst.verify(task, calls('{"synonym_values": [711]}'))


async def test_tool_outputs() -> None:
    inst = await new_session(MultiStep, row=TASK)
    assert await inst.call_tool("get_synonym_value", '{"synonym": "Blazing"}') == '{"synonym_value": 711}'
    assert await inst.call_tool("get_synonym_value", '{"synonym": ""}') == '{"synonym_value": 0}'
    assert await inst.call_tool("extract_synonym_values", '{"synonym_values": []}') == '{"success": true}'


def test_tool_schemas_match_the_dataset_tools() -> None:
    row = read_jsonl(ENV_DIR / "data" / "example.jsonl")[0]
    ours = {t["name"]: t for t in MultiStep.tool_definitions()}
    assert set(ours) == {t["name"] for t in row["responses_create_params"]["tools"]}
    for theirs in row["responses_create_params"]["tools"]:
        mine = ours[theirs["name"]]
        assert theirs["description"].startswith(mine["description"])
        assert mine["parameters"]["required"] == theirs["parameters"]["required"]
        for prop, schema in theirs["parameters"]["properties"].items():
            for key in ("type", "items"):
                assert mine["parameters"]["properties"][prop].get(key) == schema.get(key)


@pytest.mark.parametrize(
    ("name", "arguments", "message"),
    [
        ("get_synonym_value", "{synonym: Warm}", "'get_synonym_value' are not valid JSON"),
        ("get_value", "{}", "unknown tool 'get_value'; available tools: extract_synonym_values, get_synonym_value"),
        ("get_synonym_value", '{"synonym": ["Warm"]}', "do not match the schema of 'get_synonym_value'"),
        (
            "extract_synonym_values",
            '{"synonym_values": [1, "two"]}',
            "synonym_values.1: Input should be a valid integer",
        ),
        ("extract_synonym_values", '{"synonym_values": 711}', "synonym_values: Input should be a valid list"),
    ],
)
async def test_bad_tool_arguments_are_refused_with_a_reason(name: str, arguments: str, message: str) -> None:
    inst = await new_session(MultiStep, row=TASK)
    with pytest.raises(ToolArgumentsError, match=re.escape(message)):
        await inst.call_tool(name, arguments)
