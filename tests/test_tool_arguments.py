"""Tool-argument semantics: strict by default, NeMo Gym's (pydantic) as an opt-in.

The parity reference is a pydantic model written the way a NeMo Gym resources
server writes its request bodies (``class Req(BaseModel): ...``): our
``nemo_gym`` mode must accept, refuse and coerce exactly as it does.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import msgspec
import pydantic
import pytest

from gym_runtime.errors import UserError
from gym_runtime.resource import Resource, ToolArgumentsError, decode_arguments, encode_tool_output, tool
from gym_runtime.resources.math_advanced_calculations import MathAdvancedCalculations
from gym_runtime.resources.workplace_assistant import WorkplaceAssistant


class NemoGymRequest(pydantic.BaseModel):  # how NeMo Gym declares a tool's body
    city: str
    days: int = 1
    metric: bool = False
    scale: float = 1.0
    tags: list[str] = []
    note: str | None = None


class Lenient(Resource):
    tool_arguments = "nemo_gym"

    @tool
    async def forecast(
        self,
        city: str,
        days: int = 1,
        metric: bool = False,
        scale: float = 1.0,
        tags: list[str] = [],  # noqa: B006 - a default the schema shows
        note: str | None = None,
    ) -> dict[str, Any]:
        return {"city": city, "days": days, "metric": metric, "scale": scale, "tags": tags, "note": note}


class Strict(Resource):
    @tool
    async def forecast(
        self,
        city: str,
        days: int = 1,
        metric: bool = False,
        scale: float = 1.0,
        tags: list[str] = [],  # noqa: B006 - a default the schema shows
        note: str | None = None,
    ) -> dict[str, Any]:
        return {"city": city, "days": days, "metric": metric, "scale": scale, "tags": tags, "note": note}


class Mixed(Resource):
    @tool(arguments="nemo_gym")
    async def loose(self, n: int) -> int:
        return n

    @tool
    async def tight(self, n: int) -> int:
        return n


CASES = [
    {"city": "Paris"},
    {"city": "Paris", "units": "C"},  # unknown key: ignored
    {"city": "Paris", "days": "3"},  # numeric string -> int
    {"city": "Paris", "days": 3.0},  # integral float -> int
    {"city": "Paris", "days": 3.5},  # fractional float: refused
    {"city": "Paris", "days": " 4 "},  # whitespace around digits
    {"city": "Paris", "days": True},  # bool -> int
    {"city": "Paris", "days": "three"},
    {"city": "Paris", "metric": "yes"},
    {"city": "Paris", "metric": "off"},
    {"city": "Paris", "metric": 1},
    {"city": "Paris", "metric": 2},
    {"city": "Paris", "scale": 2},
    {"city": "Paris", "scale": "2.5"},
    {"city": "Paris", "tags": ["a", "b"]},
    {"city": "Paris", "tags": "a"},
    {"city": "Paris", "tags": [1]},  # int -> str is not coerced
    {"city": 42},
    {"city": None},
    {"city": "Paris", "note": None},
    {"days": 2},  # missing required
    {},
]


def reference(args: dict[str, Any]) -> dict[str, Any] | None:
    try:
        return NemoGymRequest.model_validate(args).model_dump()
    except pydantic.ValidationError:
        return None


@pytest.mark.parametrize("args", CASES, ids=[json.dumps(c) for c in CASES])
async def test_nemo_gym_mode_accepts_refuses_and_coerces_like_pydantic(args: dict[str, Any]) -> None:
    expected = reference(args)
    try:
        got = json.loads(await Lenient().call_tool("forecast", json.dumps(args)))
    except ToolArgumentsError as e:
        assert expected is None, f"refused but NeMo Gym accepts: {e}"
        assert "do not match the schema of 'forecast'" in str(e)
        return
    assert got == expected


def test_the_cases_exercise_both_outcomes() -> None:
    outcomes = [reference(c) is None for c in CASES]
    assert 5 <= sum(outcomes) <= len(CASES) - 10


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ('{"city": "Paris", "units": "C"}', "unknown field `units`"),
        ('{"city": "Paris", "days": "3"}', "Expected `int`, got `str`"),
        ('{"days": 2}', "missing required field `city`"),
    ],
)
async def test_strict_stays_the_default(arguments: str, message: str) -> None:
    assert Strict.tool_arguments == "strict"
    with pytest.raises(ToolArgumentsError, match=message):
        await Strict().call_tool("forecast", arguments)


@pytest.mark.parametrize(("arguments", "message"), [("[1]", "must be a JSON object"), ('{"city": ', "not valid JSON")])
async def test_nemo_gym_mode_refuses_non_objects_and_bad_json(arguments: str, message: str) -> None:
    with pytest.raises(ToolArgumentsError, match=message):
        await Lenient().call_tool("forecast", arguments)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ("[1]", "arguments of 'add' must be a JSON object, not list"),
        ('{"a": ', "arguments for 'add' are not valid JSON"),
    ],
)
async def test_hand_written_call_tools_refuse_as_the_nemo_gym_mode_does(arguments: str, message: str) -> None:
    """Environments that read their arguments themselves (``decode_arguments``) say what ``@tool``'s
    ``nemo_gym`` mode says, in the same words; blank arguments are ``{}`` in all of them."""
    assert decode_arguments("add", " ") == {} and decode_arguments("add", b'{"a": 1}') == {"a": 1}
    for call in (MathAdvancedCalculations().call_tool, WorkplaceAssistant().call_tool):
        with pytest.raises(ToolArgumentsError, match=message):
            await call("add", arguments)
    with pytest.raises(ToolArgumentsError, match=message.replace("'add'", "'forecast'")):
        await Lenient().call_tool("forecast", arguments)


def test_schema_offered_to_the_model_is_the_same_in_both_modes() -> None:
    assert Lenient.tool_definitions() == Strict.tool_definitions()
    params = Lenient.tool_definitions()[0]["parameters"]
    assert params["required"] == ["city"] and params["additionalProperties"] is False


async def test_per_tool_override() -> None:
    assert await Mixed().call_tool("loose", '{"n": "7", "x": 1}') == "7"
    with pytest.raises(ToolArgumentsError):
        await Mixed().call_tool("tight", '{"n": "7"}')


def test_unknown_mode_is_refused_at_definition() -> None:
    with pytest.raises(ValueError, match="arguments mode"):
        tool(arguments="loose")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="tool_arguments"):

        class Bad(Resource):
            tool_arguments = "lax"  # type: ignore[assignment]

            @tool
            async def f(self, n: int) -> int:
                return n


def test_environments_mirroring_nemo_gym_servers_use_its_semantics() -> None:
    from gym_runtime.resources.counter import Counter
    from gym_runtime.resources.math_advanced_calculations import MathAdvancedCalculations
    from gym_runtime.resources.multi_step import MultiStep
    from gym_runtime.resources.weather import Weather

    for cls in (Weather, Counter, MultiStep, MathAdvancedCalculations):
        assert {s.mode for s in cls.tools.values()} == {"nemo_gym"}, cls.__name__


class Opaque:
    """A type pydantic has no schema for."""


class OpaqueArguments(Resource):
    tool_arguments = "nemo_gym"

    @tool
    async def poke(self, thing: Opaque) -> str:
        return "poked"


def test_a_type_pydantic_cannot_validate_is_one_line_when_the_tools_are_made_ready() -> None:
    """The class loads (``publish`` reads its tools without pydantic); its worker builds the validators at
    start (``build_validators``), and that is where the author reads this."""
    assert set(OpaqueArguments.tools) == {"poke"}
    with pytest.raises(UserError) as e:
        OpaqueArguments.build_validators()
    assert str(e.value).startswith("OpaqueArguments.poke: a nemo_gym tool's arguments must be types pydantic")
    assert "\n" not in str(e.value)


def test_validators_built_once_serve_every_call() -> None:
    Lenient.build_validators()
    spec = Lenient.tools["forecast"]
    assert spec.lenient is not None and spec.lenient() is spec.lenient()


@pytest.mark.parametrize(
    "text",
    [
        '{"city": "SF", "days": 2}',
        b'{"a": 1, "a": 2}',  # the last of a repeated key
        '{"a": 123456789012345678901234567890}',
        '{"a": 1e400, "b": NaN, "c": -Infinity}',  # Python's json only
        '{"a": "\\ud800"}',  # a lone surrogate, escaped
        '{"a": "\ud800"}',  # and raw in a str
        b'\xef\xbb\xbf{"a": 1}',  # a UTF-8 BOM (json.loads takes bytes with one)
        '{"a": 1e5, "b": 1e-400, "c": -0.0, "d": "\\u0000"}',
        '\r\n {"a":\r\n[1, {"b": null}]} ',
        '{"\\u00e9": "\x7f"}',
        '{"city": "SF"} x',  # refused alike
        '{"a": "x\ny"}',
        "{'city': 'SF'}",
        '{"a": 01}',
    ],
)
def test_arguments_decode_as_json_loads_does(text: str | bytes) -> None:
    """msgspec reads the arguments where it can; what it refuses, ``json.loads`` answers: the same value (its
    type too) or the same refusal, for NeMo Gym's servers read them with ``json.loads``."""
    try:
        want: Any = json.loads(text)
    except ValueError as e:
        with pytest.raises(ToolArgumentsError, match=re.escape(f"not valid JSON: {e}")):
            decode_arguments("t", text)
        return
    got = decode_arguments("t", text)
    assert repr(got) == repr(want)  # nan != nan: compared as written
    assert [type(v) for v in got.values()] == [type(v) for v in want.values()]


def test_a_tool_output_is_json_dumps_of_its_builtins_byte_for_byte() -> None:
    """``encode_tool_output`` writes with json's C encoder built once: the text ``json.dumps`` writes (ASCII
    escapes, ", " and ": ", NaN and Infinity, non-string keys)."""
    values = [
        {"city": "SF", "weather_description": "The weather in SF is cold."},
        {"é": "ü\u2028\ud800", "n": [1, 2.5, 1e16, -0.0, math.nan, math.inf, None, True, False, 10**30]},
        [],
        {},
        7,
        1.5,
        None,
        [{"a": {"b": [[]]}}],
        {1: "int key", 2.5: "float key", False: "bool key", None: "null key"},
    ]
    for value in values:
        assert encode_tool_output(value) == json.dumps(msgspec.to_builtins(value))
    assert encode_tool_output("as it is") == "as it is"
