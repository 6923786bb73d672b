"""multi_step: look up synonym values one by one, then extract the relevant ones in order.

Matches NeMo Gym's ``example_multi_step`` resources server. The system prompt lists
terms and their synonyms; the model must find the term the user query is about,
call ``get_synonym_value`` for each of its synonyms (the value is the sum of the
synonym's character codes) and report them, in list order, with one
``extract_synonym_values`` call. No session state: the tools are pure functions.

``verify`` reads the arguments of the *last* ``extract_synonym_values`` call as
NeMo Gym's does (``json.loads(arguments)["synonym_values"]``, no coercion; no call
counts as ``[]``; arguments that are not JSON or lack the key are a verify error,
as they are there) and compares them with the task's ``expected_synonym_values``:

- ``reward`` = 1.0 iff the lists are equal (same values, same order);
- ``accuracy``: that same equality, as a bool;
- ``set_overlap``: |set(extracted) & set(expected)| / len(expected);
- ``original_term_minefield_hit``: the minefield term's own value or its label
  (the term, not a synonym, e.g. 299 or "Hot") was extracted;
- ``order_instruction_following_failure``: not accurate although every expected
  value was extracted (wrong order or extra values);
- ``parsed_synonym_values``: the extracted list as ``List[int]`` (711.0 and "711"
  become 711, as pydantic reports them; anything else is a verify error).
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec

from gym_runtime.messages import FunctionCall, Response
from gym_runtime.resource import Resource, Verdict, tool

_EXTRACT = "extract_synonym_values"


class _Task(msgspec.Struct):
    """The task fields verify needs; other row fields are ignored."""

    expected_synonym_values: list[int]
    minefield_label: str
    minefield_label_value: int


def _task(row: dict[str, Any]) -> _Task:
    try:
        task = msgspec.convert(row, _Task)
    except msgspec.ValidationError as e:
        raise ValueError(f"task row: {e}") from None
    if not task.expected_synonym_values:
        raise ValueError("task row: expected_synonym_values is empty")
    return task


class MultiStep(Resource):
    """Stateless; every instance answers the same way."""

    task_fields = _Task
    check_task = staticmethod(_task)
    tool_arguments = "nemo_gym"  # NeMo Gym's pydantic argument semantics (runtime/resource.py)

    @tool
    async def get_synonym_value(self, synonym: str) -> dict[str, int]:
        """Get the synonym value for a synonym."""
        return {"synonym_value": sum(map(ord, synonym))}

    @tool
    async def extract_synonym_values(self, synonym_values: list[int]) -> dict[str, bool]:
        """Extract the synonym values you retrieved for the term that is relevant to the user query."""
        return {"success": True}

    async def verify(self, task: dict[str, Any], response: Response) -> Verdict:
        t = _task(task)
        expected = t.expected_synonym_values
        actual = self._extracted(response)
        accuracy = actual == expected  # Python equality, as NeMo Gym's: 711.0 == 711, "711" != 711
        try:
            set_overlap = len(set(actual) & set(expected)) / len(expected)
        except TypeError as e:  # unhashable values ([[711]], [{}]): NeMo Gym's verify fails here too
            raise ValueError(f"{_EXTRACT}: synonym_values cannot be compared: {e}") from None
        return Verdict(
            reward=float(accuracy),
            fields={
                "parsed_synonym_values": _as_int_list(actual),
                "accuracy": accuracy,
                "set_overlap": set_overlap,
                # the label (a string) can be hit too when the model extracts strings
                "original_term_minefield_hit": t.minefield_label in actual or t.minefield_label_value in actual,
                "order_instruction_following_failure": not accuracy and set_overlap == 1.0,
            },
        )

    @staticmethod
    def _extracted(response: Response) -> Any:
        """The ``synonym_values`` of the last extract call, read as NeMo Gym's verify reads them: the arguments
        are JSON-decoded and the key taken as it is (no coercion, no schema); no extract call is ``[]``.
        Arguments that are not JSON, or lack the key, end verify with an error, as they end NeMo Gym's."""
        for item in reversed(response.output):
            if isinstance(item, FunctionCall) and item.name == _EXTRACT:
                try:
                    arguments = json.loads(item.arguments)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise ValueError(f"{_EXTRACT}: arguments are not JSON ({e})") from None
                if not isinstance(arguments, dict) or "synonym_values" not in arguments:
                    raise ValueError(f"{_EXTRACT}: arguments have no 'synonym_values'")
                values = arguments["synonym_values"]
                if not isinstance(values, (list, str, dict)):  # set(values) is what NeMo Gym's verify needs
                    raise ValueError(f"{_EXTRACT}: synonym_values is a {type(values).__name__}, not a list")
                return values
        return []


def _as_int_list(values: Any) -> list[int]:
    """``parsed_synonym_values`` as NeMo Gym's response model (``List[int]``, pydantic's lax mode) reports it:
    integral floats and numeric strings become ints; anything else makes its verify fail, so ours too."""
    if not isinstance(values, list):
        raise ValueError(f"{_EXTRACT}: synonym_values is not a list of integers")
    out = []
    for v in values:
        if isinstance(v, bool):
            out.append(int(v))
        elif isinstance(v, int):
            out.append(v)
        elif isinstance(v, float) and v.is_integer():
            out.append(int(v))
        elif isinstance(v, str) and re.fullmatch(r"\s*[+-]?\d+(_\d+)*\s*", v):
            out.append(int(v))
        else:
            raise ValueError(f"{_EXTRACT}: synonym value {v!r} is not an integer")
    return out
