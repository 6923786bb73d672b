"""structured_outputs against NeMo Gym's differential cases, plus each mode, format and error type."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gym_runtime.config import load_config
from gym_runtime.messages import (
    FunctionCall,
    Response,
    assistant_message,
    output_text,
)
from gym_runtime.resources.structured_outputs import (
    StructuredOutputs,
    coerce_xml,
    evaluate_object,
    evaluate_text,
    strictify,
    tool_payload,
)
from gym_runtime.testing import read_jsonl, recorded_response, text_response, verify_once
from tests.differential import COMPAT, differential_cases

ENV_DIR = Path(__file__).resolve().parents[1]
NEMO = COMPAT / "nemo_gym" / "structured_outputs"

PERSON = json.dumps(
    {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "email": {"type": ["string", "null"], "format": "email"},
            "tags": {"type": "array", "items": {"type": "string"}},
        },
    }
)
PEOPLE = json.dumps({"type": "array", "items": json.loads(PERSON)})
ADA = {"name": "Ada", "age": 36, "email": None, "tags": ["math"]}


def calls(*pairs: tuple[str, str], error: dict[str, Any] | None = None) -> Response:
    items = [FunctionCall(name=n, arguments=a, call_id=f"c{i}") for i, (n, a) in enumerate(pairs)]
    return Response(id="r", created_at=0.0, output=list(items), error=error)


def tool_call_outcome(row: dict[str, Any], response: Response) -> tuple[float, str | None, str | None]:
    """What verify computes in tool-call mode, in this process."""
    instance, error, message = tool_payload(row, response)
    return (0.0, error, message) if error else evaluate_object(row["schema_str"], instance)


def error_type(outcome: tuple[float, str | None, str | None]) -> str | None:
    assert (outcome[0] == 1.0) == (outcome[1] is None)
    return outcome[1]


# ------------------------------------------------------------------ parity


async def test_differential_cases_reproduce_nemo_gym() -> None:
    cases = differential_cases("structured_outputs")
    assert len(cases) >= 32
    for row, case in cases:
        v = await verify_once(StructuredOutputs, row, recorded_response(row.pop("response")))
        assert v.reward == case["expected_reward"], case["case"]
        assert v.fields["error_type"] == case["expected_fields"]["error_type"], case["case"]
        # error_message compares loosely upstream (library text); ours comes from the same libraries
        assert v.fields["error_message"] == case["expected_fields"]["error_message"], case["case"]


async def test_example_rows_refuse_a_null_payload() -> None:
    for row in read_jsonl(ENV_DIR / "data" / "example.jsonl"):
        key = row["tool_payload_key"]
        assert row["response_mode"] == "tool_call"
        v = await verify_once(
            StructuredOutputs, row, calls((row["tool_name"], json.dumps({key: None} if key else None)))
        )
        assert v.reward == 0.0 and v.fields["error_type"] == "validation_error"


# ------------------------------------------------------------------ text mode


@pytest.mark.parametrize(
    ("schema_type", "text", "expected"),
    [
        ("json", json.dumps(ADA), None),
        ("json", json.dumps({**ADA, "age": 36.0}), None),  # an integral float is an integer
        ("json", json.dumps({**ADA, "age": True}), "validation_error"),
        ("json", json.dumps({**ADA, "email": "not-an-email"}), None),  # format is not enforced
        ("json", json.dumps({k: v for k, v in ADA.items() if k != "tags"}), "validation_error"),  # all required
        ("json", json.dumps({**ADA, "extra": 1}), "validation_error"),
        ("json", "```json\n" + json.dumps(ADA) + "\n```", "parse_error"),
        ("json", "Here it is: " + json.dumps(ADA), "parse_error"),
        ("json", "  \n", "empty_response"),
        ("yaml", "name: Ada\nage: 36\nemail: null\ntags: [math]\n", None),
        ("yaml", "name: [unclosed\n", "parse_error"),
        ("toml", 'name = "Ada"\nage = 36\nemail = "a@b.c"\ntags = ["math"]\n', None),
        ("toml", "name = Ada\n", "parse_error"),
        ("xml", "<name>Ada</name>", "validation_error"),  # the document's root element is the one key
    ],
)
def test_text_formats(schema_type: str, text: str, expected: str | None) -> None:
    assert error_type(evaluate_text(schema_type, PERSON, text)) == expected


def obj(**properties: Any) -> dict[str, Any]:
    """An object schema of these properties: a type's name (or names) or a whole schema each."""
    return {
        "type": "object",
        "properties": {k: v if isinstance(v, dict) else {"type": v} for k, v in properties.items()},
    }


def test_xml_coercion_and_list_unwrapping() -> None:
    schema = json.dumps({"type": "object", "properties": {"person": json.loads(PERSON)}})
    xml = "<person><name>Ada</name><age>36</age><email/><tags><t>math</t><t>poetry</t></tags></person>"
    assert evaluate_text("xml", schema, xml) == (1.0, None, None)  # <email/> is null, which the schema allows
    person = obj(name="string", age="integer", ok="boolean", tags={"type": "array", "items": {}})
    nullable = json.dumps(obj(person=person))
    one = "<person><name/><age>36</age><ok>TRUE</ok><tags><t>math</t></tags></person>"
    assert evaluate_text("xml", nullable, one) == (1.0, None, None)  # empty string, int, bool, one-item list
    assert error_type(evaluate_text("xml", nullable, one, False)) == "validation_error"  # no coercion
    assert coerce_xml({"a": "x"}, {"type": "array", "items": {"type": "integer"}}) == ["x"]
    assert coerce_xml(None, {"type": "array"}) == []
    assert coerce_xml(None, {"type": "integer"}) is None


def test_csv_cells_are_coerced() -> None:
    schema = json.dumps(
        {"type": "array", "items": obj(city="string", pop="integer", capital="boolean", area=["number", "null"])}
    )
    assert evaluate_text("csv", schema, "city,pop,capital,area\nParis,2100000,true,105.4\nLyon,500000,0,\n") == (
        1.0,
        None,
        None,
    )
    assert error_type(evaluate_text("csv", schema, "city,pop,capital,area\nParis,2.1M,true,1\n")) == (
        "validation_error"
    )
    assert error_type(evaluate_text("csv", "[]", "a\n1\n")) == "validation_error"  # a non-object schema


def test_schema_errors() -> None:
    assert evaluate_text("json", "{not json", "{}")[1] == "schema_error"
    outcome = evaluate_text("json", '{"type": "objekt"}', "{}")
    assert outcome[1] == "validation_error" and outcome[2].startswith("SchemaError:")
    assert evaluate_object("{bad", {})[1] == "schema_error"


def test_strictify_walks_objects_but_not_lists() -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": {}}}},
        "anyOf": [{"properties": {"c": {}}}],
    }
    strictify(schema)
    assert schema["required"] == ["a"] and schema["additionalProperties"] is False
    assert schema["properties"]["a"]["required"] == ["b"]
    assert "required" not in schema["anyOf"][0]


def test_answer_text_joins_output_text_parts_of_all_messages() -> None:
    response = text_response('{"name": "Ad', 'a"}', reasoning="{}", refusal="no")
    assert output_text(response.output) == '{"name": "Ada"}'


# ------------------------------------------------------------------ tool-call mode

TOOL_ROW = {
    "schema_str": PERSON,
    "schema_type": "json",
    "response_mode": "tool_call",
    "tool_name": "save",
    "tool_payload_key": "person",
}


@pytest.mark.parametrize(
    ("response", "expected", "message"),
    [
        (calls(("save", json.dumps({"person": ADA}))), None, None),
        (calls(("save", json.dumps({"person": {**ADA, "age": "36"}}))), "validation_error", "ValidationError: '36'"),
        (calls(("save", json.dumps(ADA))), "missing_tool_payload_key", "Missing tool payload key: person"),
        (calls(("save", '{"person": {"name"')), "tool_arguments_parse_error", "JSONDecodeError: "),
        (calls(("store", json.dumps({"person": ADA}))), "wrong_tool_name", "Expected tool 'save', got: store"),
        (
            calls(("save", "{}"), ("save", "{}")),
            "multiple_tool_calls",
            "Expected exactly one function_call, got: save, save",
        ),
        (
            Response(id="r", created_at=0.0, output=[assistant_message(json.dumps(ADA))]),
            "missing_tool_call",
            "No function_call item found in assistant response",
        ),
        (
            calls(("save", json.dumps({"person": ADA})), error={"code": "server_error", "message": "boom"}),
            "api_error",
            "ResponseError(code='server_error', message='boom')",
        ),
    ],
)
def test_tool_call_mode(response: Response, expected: str | None, message: str | None) -> None:
    reward, error, text = tool_call_outcome(TOOL_ROW, response)
    assert reward == (1.0 if expected is None else 0.0)
    assert error == expected
    assert (text or "").startswith(message or "")


def test_tool_call_without_name_or_payload_key() -> None:
    row = {**TOOL_ROW, "tool_name": None, "tool_payload_key": None}
    assert tool_call_outcome(row, calls(("anything", json.dumps(ADA))))[0] == 1.0
    assert tool_call_outcome(row, calls(("anything", "[1]")))[1] == "validation_error"


async def test_verify_grades_tool_calls_in_a_worker_process() -> None:
    v = await verify_once(StructuredOutputs, TOOL_ROW, calls(("save", json.dumps({"person": ADA}))))
    assert (v.reward, v.fields) == (1.0, {"error_type": None, "error_message": None})
    v = await verify_once(StructuredOutputs, TOOL_ROW, calls(("save", json.dumps({"person": {**ADA, "age": 1.5}}))))
    assert (v.reward, v.fields["error_type"]) == (0.0, "validation_error")
    v = await verify_once(StructuredOutputs, TOOL_ROW, calls())
    assert (v.reward, v.fields["error_type"]) == (0.0, "missing_tool_call")


async def test_options_turn_xml_coercion_off() -> None:
    row = {"schema_str": json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}}), "schema_type": "xml"}
    assert (
        await verify_once(
            StructuredOutputs, row, Response(id="r", created_at=0.0, output=[assistant_message("<n>1</n>")])
        )
    ).reward == 1.0
    inner = {"type": "object", "properties": {"n": {"type": "integer"}}}
    wrapped = json.dumps({"type": "object", "properties": {"r": inner}})
    row = {**row, "schema_str": wrapped}
    response = Response(id="r", created_at=0.0, output=[assistant_message("<r><n>1</n></r>")])
    assert (await verify_once(StructuredOutputs, row, response)).reward == 1.0
    assert (await verify_once(StructuredOutputs, row, response, {"xml_coerce_types": False})).reward == 0.0


@pytest.mark.parametrize(
    ("row", "message"), [({}, "schema_str"), ({"schema_str": "{}", "schema_type": "JSON"}, "schema_type")]
)
async def test_invalid_rows_are_refused(row: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        await verify_once(StructuredOutputs, row, calls())


def test_config_options() -> None:
    cfg = load_config(ENV_DIR / "config.yaml")
    assert cfg.agents["structured_outputs_v4_simple_agent"].max_steps == 1
    assert StructuredOutputs.tool_definitions() == []
