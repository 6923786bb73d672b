"""math_advanced_calculations: arithmetic in an alternate universe, graded on the tool outputs.

Matches NeMo Gym's ``math_advanced_calculations`` resources server (the "multiverse
math" tools of LangChain's tool-use benchmark). The calculator tools are altered on
purpose, so a model only gets the right values by calling them instead of doing
the arithmetic itself:

==================  ===========================  =========================
tool                claims                        computes
==================  ===========================  =========================
``add(a, b)``       a + b                         a + b + 1.2
``subtract(a, b)``  a - b                         a - b - 3
``multiply(a, b)``  a * b                         1.1 * a * b
``divide(a, b)``    a / b                         0.5 * a / b
``power(a, b)``     a ** b                        a ** (b + 2)
``log(a, base)``    log(a, base)                  log(a, abs(base + 1.5))
``sin(radians)``    sine                          cosine
``cos(radians)``    cosine                        sine
``pi()``            pi                            e
``negate(a)``       -a                            a
``return_constant`` a                             a
==================  ===========================  =========================

Each tool answers ``{"solution": <float>}``; a failing computation (division by
zero, a math domain error, a complex result) answers ``{"detail": "<reason>"}``
as NeMo Gym's HTTP 500 body does. Arguments are read leniently, like NeMo Gym's
pydantic request model: numbers, numeric strings and booleans become floats,
unknown keys and nulls are ignored, a missing argument is the function's error.

``verify`` is stateless and reads only the ``function_call_output`` items of the
response: each is parsed as JSON and its ``solution`` converted with ``float``
(anything unparsable counts as ``None``). The task's ``ground_truth`` is a JSON
string holding a list of numbers; the reward is 1.0 iff every ground-truth value
is among those outputs (Python ``in``: exact float equality, no tolerance;
order, duplicates and extra outputs do not matter). No extra fields.
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Callable
from typing import Any

import msgspec

from gym_runtime.messages import FunctionCallOutput, Response
from gym_runtime.resource import Resource, ToolArgumentsError, decode_arguments, tool


# The altered calculators. Plain functions with NeMo Gym's parameter names, so a call
# with a missing or unexpected argument fails with the same TypeError text.
def multiply(a, b):
    return 1.1 * a * b


def divide(a, b):
    return 0.5 * a / b


def add(a, b):
    return a + b + 1.2


def sin(radians):
    return math.cos(radians)


def cos(radians):
    return math.sin(radians)


def subtract(a, b):
    return a - b - 3


def power(a, b):
    return a ** (b + 2)


def log(a, base):
    return math.log(a, abs(base + 1.5))


def pi():
    return math.e


def negate(a):
    return a


def return_constant(a):
    return a


_CALCULATORS: dict[str, Callable[..., Any]] = {
    f.__name__: f for f in (multiply, divide, add, sin, cos, subtract, power, log, pi, negate, return_constant)
}
# The argument names NeMo Gym's request model knows; other keys are dropped unseen.
_REQUEST_FIELDS = ("a", "b", "radians", "base")


# What a model is told of each calculator (NeMo Gym's tool descriptions). Its parameters are the calculator's,
# each a number.
_DESCRIPTIONS = {
    "multiply": "Multiply two numbers; a * b.",
    "divide": "Divide two numbers; a / b. Division is neither commutative nor associative.",
    "add": "Add two numbers; a + b.",
    "sin": "The sine of an angle in radians.",
    "cos": "The cosine of an angle in radians.",
    "subtract": "Subtract two numbers; a - b.",
    "power": "Raise a number to a power; a ** b.",
    "log": "Take the log of a number; log(a, base). The base is always positive in this alternate universe.",
    "pi": "Returns a precise value of PI for this alternate universe.",
    "negate": "Negate a number; -a.",
    "return_constant": "Return a constant number: a with no modifications",
}


def _calculator_tool(name: str) -> Callable[..., Any]:
    """The tool method offering calculator ``name``: its parameters as numbers, its description."""
    calculate = _CALCULATORS[name]
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    numbers = [inspect.Parameter(p, kind, annotation=float) for p in inspect.signature(calculate).parameters]

    async def run(self: Any, *args: Any, **kwargs: Any) -> float:
        return calculate(*args, **kwargs)

    run.__name__ = run.__qualname__ = name
    run.__annotations__ = {p.name: float for p in numbers} | {"return": float}
    self_ = inspect.Parameter("self", kind)
    run.__signature__ = inspect.Signature([self_, *numbers], return_annotation=float)  # type: ignore[attr-defined]
    return tool(run, description=_DESCRIPTIONS[name])


class _CalculatorTools:
    """The calculators as tool methods, one for each (a Resource finds its tools among its classes' attributes)."""


for _name in _CALCULATORS:
    setattr(_CalculatorTools, _name, _calculator_tool(_name))


def _lax_float(name: str, value: Any) -> float:
    """A float the way pydantic's lax mode makes one, or a refusal naming the argument."""
    if isinstance(value, (bool, int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            pass
    raise ToolArgumentsError(f"argument {name!r} must be a number, got {value!r}")


def _number_json(x: float) -> Any:
    """Non-finite floats serialize as null (pydantic's JSON mode); others as Python floats."""
    return x if math.isfinite(x) else None


def solution_of(output: str) -> float | None:
    """The number a ``function_call_output`` reports, or None if it reports none."""
    try:
        return float(json.loads(output)["solution"])
    except Exception:  # noqa: BLE001 - any malformed output counts as no value, as in NeMo Gym
        return None


class MathAdvancedTask(msgspec.Struct, kw_only=True):
    """The task fields verify reads: ``ground_truth`` is a JSON string."""

    ground_truth: str


class MathAdvancedCalculations(_CalculatorTools, Resource):
    """Stateless: tools are pure functions and verify reads only the response."""

    task_fields = MathAdvancedTask
    tool_arguments = "nemo_gym"  # NeMo Gym's pydantic argument semantics (runtime/resource.py)

    async def call_tool(self, name: str, arguments: str | bytes) -> str:
        """Run a calculator with NeMo Gym's lenient argument handling and output shape."""
        fn = _CALCULATORS.get(name)
        if fn is None:
            return json.dumps({"detail": "Function not found"})
        raw = decode_arguments(name, arguments)
        kwargs = {k: _lax_float(k, raw[k]) for k in _REQUEST_FIELDS if raw.get(k) is not None}
        try:
            result = fn(**kwargs)
            if isinstance(result, complex):
                raise ValueError(f"{name} gives a complex number, {result}")  # noqa: TRY004 - reported as a detail
            solution = float(result)
        except Exception as e:  # noqa: BLE001 - shown to the model, as NeMo Gym's 500 body is
            return json.dumps({"detail": str(e)})
        return json.dumps({"solution": _number_json(solution)})

    async def verify(self, task: dict[str, Any], response: Response) -> float:
        ground_truth = task.get("ground_truth")
        if not isinstance(ground_truth, str):
            raise ValueError(  # noqa: TRY004 - an invalid task row
                f"task row needs 'ground_truth' as a JSON string, got {type(ground_truth).__name__}"
            )
        expected = json.loads(ground_truth)
        produced = [solution_of(i.output) for i in response.output if isinstance(i, FunctionCallOutput)]
        return 1.0 if all(gt in produced for gt in expected) else 0.0
